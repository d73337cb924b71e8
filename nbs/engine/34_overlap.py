# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # How much communication is hidden
#
# The point of the five-stage split and of DualPipeV is that all-to-alls and pipeline sends run *while* the GPU
# computes. Whether they do is a question for a profiler trace, not for the schedule's intentions: this notebook
# reads a `torch.profiler` trace (the Chrome-trace JSON that `prof.export_chrome_trace` writes) and reports, per
# rank and per stage, how much communication time was covered by compute kernels running at the same moment, and
# how much was *exposed* (the GPU did nothing but communicate).
#
# Definitions, on the GPU timeline of one trace:
# - **communication** = kernels whose name contains `nccl` (all-to-all, send/recv, all-reduce), on any stream;
# - **compute** = every other kernel;
# - **exposed** = the time covered by communication and by no compute kernel; **hidden** = communication time minus
#   exposed; the hidden fraction is hidden / communication. Times are measures of unions of intervals, so two
#   overlapping communication kernels are not counted twice.
# - **per stage**, the trace's `gpu_user_annotation` ranges (the GPU-side spans of `torch.profiler.record_function`
#   labels, such as the F, B and W slots of a DualPipeV step) cut the timeline; each label's row sums its windows;
# - **idle** = the time inside the trace's GPU span when no kernel at all runs: the GPU waits for the host
#   (launch overhead, a host synchronisation) rather than for the network.
#
# One caution when reading the numbers: an NCCL kernel starts when its stream reaches it and ends when the
# transfer is done, so its duration includes **waiting for the peer** to arrive at the same collective. When one
# rank has more work (more tokens routed to its experts, or a pipeline bubble), the other's communication kernels
# stretch by that difference. Exposed communication is therefore "the GPU waited on communication", for either
# reason; the byte volume alone would give much smaller times.
#
# `python -m pith_lit.engine.overlap TRACE.json [TRACE.json ...]` prints one table per trace (one per rank), then
# the kernels that took the most GPU time (`--top N`); with `--peers` and the two traces of a two-rank group it
# splits each rank's communication into waiting for the other rank and transfer (below).

# %%
#| default_exp engine.overlap

# %%
#| export
import argparse
import gzip
import json
from collections import defaultdict

# %% [markdown]
# ## Intervals
#
# Everything reduces to three operations on sorted, disjoint interval lists: the union (merge what overlaps),
# the intersection and the difference.

# %%
#| export
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

# %%
assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)] and length([(2, 3), (5, 6)]) == 2
assert subtract([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]

# %% [markdown]
# ## The report

# %%
#| export
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


# %% [markdown]
# Check on a trace written by hand: an all-to-all of 100 µs of which a matmul covers the first 60, a send of
# 50 µs with nothing beside it, and two stage annotations. Half of the exposed time is the send.

# %%
def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def stage(name, ts, dur):
    return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur}


demo = {"traceEvents": [kernel("sm90_xmma_gemm_bf16", 0, 60), kernel("ncclDevKernel_AllToAll_RING", 0, 100),
                        kernel("ncclDevKernel_SendRecv", 200, 50), kernel("triton_gather_rows", 90, 20),
                        stage("F0+B1", 0, 150), stage("W1", 150, 120)]}
r = overlap_report(demo)
print(json.dumps(r, indent=1))
assert abs(r["total"]["comm_ms"] - 0.150) < 1e-9 and abs(r["total"]["exposed_ms"] - 0.080) < 1e-9
assert abs(r["stages"]["F0+B1"]["hidden_frac"] - 0.7) < 1e-9 and r["stages"]["W1"]["hidden_frac"] == 0.0
# the span is 0..250 µs; kernels cover 0..110 and 200..250, so the GPU idled for 90 µs
assert abs(r["total"]["span_ms"] - 0.250) < 1e-9 and abs(r["total"]["idle_ms"] - 0.090) < 1e-9
assert abs(r["total"]["compute_ms"] - 0.080) < 1e-9   # the matmul 0..60 and the gather 90..110
assert top_kernels(demo, 2) == [("ncclDevKernel_AllToAll_RING", 1, 0.1), ("sm90_xmma_gemm_bf16", 1, 0.06)]

# %% [markdown]
# ## Waiting for the peer, and moving bytes
#
# With the traces of both ranks of a two-rank group the two parts can be told apart. Every rank issues the same
# collectives in the same order on each of its NCCL streams, so the i-th NCCL kernel of a stream on one rank and
# the i-th of the matching stream on the other are the same collective (streams are matched by the order of their
# first NCCL kernel). A collective finishes at about the same moment on both ranks; the rank that started it
# earlier **waited for its peer** until the later one started, and from then on both were present: that part is
# the **transfer**. `peer_report(a, b)` splits rank a's NCCL time this way and says how much of each part compute
# covered. The two traces' clocks are aligned by the median difference of the collectives' end times (on one host
# they share a clock and the offset is near zero).
#
# Waiting exposed is a rank that had nothing to compute while the other rank was late (load imbalance, a slower
# host); transfer exposed is bytes moving with nothing beside them, the part the schedule is meant to hide.

# %%
#| export
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

# %% [markdown]
# Check by hand: rank a starts an all-to-all at 0 and rank b at 40 (µs), both finish at 100; a computes from 0 to
# 30 and from 70 to 90. Rank a waited 40 µs (10 of them exposed) and was present with b for 60 µs, of which 20
# had compute beside them. Rank b waited for nothing. Then b's clock is shifted by 1000 µs: the offset absorbs it.

# %%
a = {"traceEvents": [kernel("ncclDevKernel_SendRecv", 0, 100), kernel("gemm", 0, 30), kernel("gemm", 70, 20)]}
b = {"traceEvents": [kernel("ncclDevKernel_SendRecv", 40, 60)]}
ra, rb = peer_report(a, b), peer_report(b, a)
print(ra, rb, sep="\n")
assert abs(ra["wait_ms"] - 0.040) < 1e-9 and abs(ra["wait_exposed_ms"] - 0.010) < 1e-9
assert abs(ra["transfer_ms"] - 0.060) < 1e-9 and abs(ra["transfer_exposed_ms"] - 0.040) < 1e-9
assert rb["wait_ms"] == 0 and abs(rb["transfer_ms"] - 0.060) < 1e-9 and rb["transfer_hidden_frac"] == 0
late = {"traceEvents": [dict(e, ts=e["ts"] + 1000) for e in b["traceEvents"]]}
assert peer_report(a, late) == dict(ra, offset_us=-1000.0)

# %% [markdown]
# ## Command line

# %%
#| export
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


if __name__ == "__main__" and __spec__ is not None:
    main()

# %% [markdown]
# On a GPU machine, record a step with `torch.profiler.profile(activities=[CPU, CUDA])` around
# `DualPipeV.step` (its slots are `record_function` ranges named as in its timeline: `F0`, `B1`, `F0&B1`, `W`,
# `comm`), export one trace per rank with `prof.export_chrome_trace(f"trace_rank{rank}.json")`, and run the
# command above on them.
