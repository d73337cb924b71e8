"""Summarise benchmark runs: `python benchmarks/summarise.py RUNS_DIR [OUT.json]`.

RUNS_DIR holds one run directory per configuration (as `python -m pith_lit.train` leaves them: config.toml,
metrics.jsonl and, when `log.profile_step` was set, trace-rank<R>.json). For each run it prints the mean
tokens/s of the steps after warm-up (the profiled step left out), per GPU and for the whole job, MFU, peak
memory, the loss at the first and last step, the largest relative loss difference from the single-GPU run of
the same model (the run whose name ends in `_1gpu` and starts with the same word), the share of
communication hidden under compute, for a two-GPU run the share of the transfer proper (both ranks inside the
collective, `peer_report`) hidden ("xfer"), and the share of the GPU span with no kernel running, from the
traces; then the peak memory the CUDA allocator reserved and how many times it ran out of cached blocks and had to
free its cache (all ranks, all steps)."""
import json
import sys
import tomllib
from pathlib import Path

from overlap import overlap_report, peer_report


def summarise(run: Path) -> dict:
    cfg = tomllib.loads((run / "config.toml").read_text())
    p = cfg["parallel"]
    world = p["pp"] * p["dp"] * p["cp"] * p["ep"]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skip = {cfg["log"].get("profile_step", 0)}
    steady = [r for r in recs if r["step"] > cfg["train"]["warmup"] and r["step"] not in skip]
    mean = lambda k: sum(r[k] for r in steady) / len(steady) if steady and k in steady[0] else None
    out = {"run": run.name, "gpus": world, "pp": p["pp"], "ep": p["ep"], "overlap": p["overlap"],
           "ep_sync_free": p.get("ep_sync_free", False), "profile_host": cfg["log"].get("profile_host", True),
           "steps": len(recs), "tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"),
           "peak_mem_gb": max(r["peak_mem_gb"] for r in recs), "loss_first": recs[0]["loss"],
           "loss_last": recs[-1]["loss"], "balance_last": recs[-1]["balance"], "losses": [r["loss"] for r in recs],
           "peak_reserved_gb": max(r.get("peak_reserved_gb", 0.0) for r in recs),
           "alloc_retries": sum(r.get("alloc_retries", 0) for r in recs)}
    out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / world if out["tokens_per_s"] else None
    paths = sorted(run.glob("trace-rank*.json"))
    comm, traces = [], [json.loads(t.read_text()) for t in paths]
    for path, trace in zip(paths, traces):
        rep = overlap_report(trace)
        comm.append({"trace": path.name, **rep["total"],
                     "stages": {k: v for k, v in rep["stages"].items() if v["comm_ms"] > 0}})
    if len(traces) == 2 and world == 2 and comm[0]["comm_ms"] > 0:   # the two ranks of one group: see peer_report
        peers = [peer_report(traces[0], traces[1]), peer_report(traces[1], traces[0])]
        out["peers"] = peers
        moved = sum(p["transfer_ms"] for p in peers)
        out["transfer_hidden_frac"] = 1 - sum(p["transfer_exposed_ms"] for p in peers) / moved if moved else None
    if comm:
        out["comm"] = comm
        total = sum(c["comm_ms"] for c in comm)
        out["hidden_frac"] = sum(c["hidden_ms"] for c in comm) / total if total else None
        span = sum(c["span_ms"] for c in comm)          # 0 on the CPU: no kernels in the trace
        out["idle_frac"] = sum(c["idle_ms"] for c in comm) / span if span else None
    return out


def main(runs_dir: str, out_json: str | None = None) -> list[dict]:
    rows = [summarise(d) for d in sorted(Path(runs_dir).iterdir()) if (d / "metrics.jsonl").exists()]
    base = {r["run"].split("_")[0]: r for r in rows if r["run"].endswith("_1gpu")}
    for r in rows:
        b = base.get(r["run"].split("_")[0])
        if b is not None and b is not r:
            n = min(len(b["losses"]), len(r["losses"]))
            r["max_rel_loss_diff_vs_1gpu"] = max(abs(x - y) / abs(y) for x, y in zip(r["losses"][:n], b["losses"][:n]))
            if r["tokens_per_s_per_gpu"] and b["tokens_per_s_per_gpu"]:   # None: a run that stopped in warm-up
                r["per_gpu_vs_1gpu"] = r["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
    if out_json:
        Path(out_json).write_text(json.dumps(rows, indent=1))
    fmt = lambda v, f: "-" if v is None else format(v, f)
    print(f"{'run':20} {'gpus':>4} {'tok/s':>9} {'tok/s/gpu':>9} {'vs 1gpu':>7} {'mfu':>6} {'peak GiB':>8} "
          f"{'loss':>13} {'max dloss':>9} {'balance':>7} {'hidden':>6} {'xfer':>6} {'idle':>6} {'resv GiB':>8} "
          f"{'retries':>7}")
    for r in rows:
        print(f"{r['run']:20} {r['gpus']:>4} {fmt(r['tokens_per_s'], ',.0f'):>9} "
              f"{fmt(r['tokens_per_s_per_gpu'], ',.0f'):>9} {fmt(r.get('per_gpu_vs_1gpu'), '.3f'):>7} "
              f"{fmt(r['mfu'], '.1%'):>6} {r['peak_mem_gb']:8.1f} {r['loss_first']:6.3f}>{r['loss_last']:6.3f} "
              f"{fmt(r.get('max_rel_loss_diff_vs_1gpu'), '.2e'):>9} {r['balance_last']:7.2f} "
              f"{fmt(r.get('hidden_frac'), '.1%'):>6} {fmt(r.get('transfer_hidden_frac'), '.1%'):>6} "
              f"{fmt(r.get('idle_frac'), '.1%'):>6} {r['peak_reserved_gb']:8.1f} {r['alloc_retries']:>7}")
    return rows


if __name__ == "__main__":
    main(*sys.argv[1:])
