"""Hidden and exposed communication in torch.profiler Chrome traces (the GPU timeline of a step): per rank and per
stage, how much NCCL time compute kernels covered, how much was exposed, and the GPU's idle time; with --peers, each
rank's NCCL time split into waiting for the other rank and transfer. nbs/engine/34_overlap explains the definitions
and checks them on traces written by hand. From the repository root:

    python benchmarks/overlap.py RUN_DIR/trace-rank*.json --top 15
"""
import argparse
import gzip
import json
from collections import defaultdict

def union(spans) -> list[tuple[float, float]]:
    "Merge (start, end) spans into disjoint, sorted ones."
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def length(spans) -> float:
    "Total length of disjoint spans."
    return sum(e - s for s, e in spans)


def intersect(a, b) -> list[tuple[float, float]]:
    "Intersection of two disjoint, sorted span lists."
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    "Parts of the disjoint spans `a` not covered by the disjoint spans `b`."
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out

def _kernels(trace: dict):
    "(name, start µs, end µs) of every GPU kernel in a Chrome trace."
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            yield ev["name"], float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))


def overlap_report(trace: dict) -> dict:
    """Communication, hidden and exposed time (ms) of one rank's trace, in total and per annotated stage."""
    comm = union((s, e) for n, s, e in _kernels(trace) if "nccl" in n.lower())
    compute = union((s, e) for n, s, e in _kernels(trace) if "nccl" not in n.lower())
    exposed = subtract(comm, compute)

    def row(window):
        c = intersect(comm, window)
        x = intersect(exposed, window)
        total = length(c)
        return {"comm_ms": total / 1e3, "exposed_ms": length(x) / 1e3, "hidden_ms": (total - length(x)) / 1e3,
                "hidden_frac": (total - length(x)) / total if total else 1.0}

    stages = defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "gpu_user_annotation":
            stages[ev["name"]].append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))))
    everything = [(min([s for s, _ in comm + compute], default=0.0), max([e for _, e in comm + compute], default=0.0))]
    total = row(everything)
    busy = length(union(comm + compute))
    total.update(span_ms=length(everything) / 1e3, compute_ms=length(compute) / 1e3,
                 idle_ms=(length(everything) - busy) / 1e3)
    return {"total": total, "stages": {k: row(union(v)) for k, v in sorted(stages.items())}}


def top_kernels(trace: dict, n: int = 10) -> list[tuple[str, int, float]]:
    "The `n` kernel names with the most GPU time: (name, launches, total ms), largest first."
    calls, time = defaultdict(int), defaultdict(float)
    for name, s, e in _kernels(trace):
        calls[name] += 1
        time[name] += (e - s) / 1e3
    return [(k, calls[k], time[k]) for k in sorted(time, key=time.get, reverse=True)[:n]]

def _nccl_streams(trace: dict) -> list[list[tuple[float, float]]]:
    "Per stream with NCCL kernels, in the order of each stream's first one: the (start, end) of its NCCL kernels."
    by = defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel" and "nccl" in ev["name"].lower():
            by[ev.get("tid")].append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))))
    return [sorted(v) for v in sorted(by.values(), key=min)]


def peer_report(trace: dict, peer: dict) -> dict:
    """Rank `trace`'s NCCL time (ms) split into waiting for `peer` (the other rank of a two-rank group) and
    transfer with both present, each with its exposed part (no compute kernel beside it)."""
    mine, theirs = _nccl_streams(trace), _nccl_streams(peer)
    if [len(s) for s in mine] != [len(s) for s in theirs]:
        raise ValueError(f"the traces' NCCL kernels per stream differ ({[len(s) for s in mine]} against "
                         f"{[len(s) for s in theirs]}): record the same step of the same run on both ranks")
    ends = sorted(a[1] - b[1] for s, t in zip(mine, theirs) for a, b in zip(s, t))
    offset = ends[len(ends) // 2] if ends else 0.0            # peer time + offset = this trace's time
    wait, transfer = [], []
    for s, t in zip(mine, theirs):
        for (a0, a1), (b0, _) in zip(s, t):
            both = min(max(a0, b0 + offset), a1)
            wait += [(a0, both)] if both > a0 else []
            transfer += [(both, a1)] if a1 > both else []
    compute = union((s, e) for n, s, e in _kernels(trace) if "nccl" not in n.lower())
    wait, transfer = union(wait), union(transfer)
    w, x = length(subtract(wait, compute)), length(subtract(transfer, compute))
    return {"wait_ms": length(wait) / 1e3, "wait_exposed_ms": w / 1e3, "transfer_ms": length(transfer) / 1e3,
            "transfer_exposed_ms": x / 1e3, "offset_us": offset,
            "transfer_hidden_frac": 1 - x / length(transfer) if transfer else 1.0}

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Hidden and exposed communication in torch.profiler Chrome traces")
    ap.add_argument("traces", nargs="+", help="trace JSON files (or .json.gz), e.g. one per rank")
    ap.add_argument("--top", type=int, default=10, help="list this many kernels by GPU time (0: none)")
    ap.add_argument("--peers", action="store_true", help="the traces are the two ranks of one group: split each "
                    "rank's NCCL time into waiting for the other rank and transfer (see peer_report)")
    args = ap.parse_args(argv)
    traces = []
    for path in args.traces:
        try:
            with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
                traces.append(json.load(f))
        except (OSError, ValueError) as e:
            ap.error(f"cannot read the trace {path}: {e}; pass a Chrome trace that torch.profiler wrote "
                     "(log.profile_step), whole, as .json or .json.gz")
    if args.peers:
        if len(traces) != 2:
            ap.error(f"--peers needs the traces of the two ranks of a group, got {len(traces)}")
        for path, trace, other in zip(args.traces, traces, traces[::-1]):
            p = peer_report(trace, other)
            print(f"{path}\n  waiting for the peer {p['wait_ms']:.3f} ms ({p['wait_exposed_ms']:.3f} exposed); "
                  f"transfer {p['transfer_ms']:.3f} ms ({p['transfer_exposed_ms']:.3f} exposed, "
                  f"{p['transfer_hidden_frac']:.1%} hidden); clock offset {p['offset_us']:.1f} µs")
        return
    for path, trace in zip(args.traces, traces):
        r = overlap_report(trace)
        t = r["total"]
        print(f"{path}\n  GPU span {t['span_ms']:.3f} ms: compute {t['compute_ms']:.3f} ms, communication "
              f"{t['comm_ms']:.3f} ms, idle {t['idle_ms']:.3f} ms")
        print(f"  {'stage':24} {'comm ms':>9} {'exposed ms':>11} {'hidden':>7}")
        for name, row in [("(whole trace)", t), *r["stages"].items()]:
            print(f"  {name:24} {row['comm_ms']:9.3f} {row['exposed_ms']:11.3f} {row['hidden_frac']:7.1%}")
        for name, calls, ms in top_kernels(trace, args.top):
            print(f"  {ms:9.3f} ms {calls:6d}x  {name[:100]}")


if __name__ == "__main__":
    main()
