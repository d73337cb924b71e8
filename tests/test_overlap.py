"""The exposed-communication report: interval arithmetic against a brute-force count, and the command line."""
import json
import random
import subprocess
import sys

from conftest import ROOT, subprocess_env
from benchmarks.overlap import overlap_report


def test_report_matches_a_brute_force_count():
    "Random kernels on a 1-µs grid: exposed and hidden time equal counting grid points one by one."
    rng = random.Random(0)
    events, comm_at, compute_at = [], set(), set()
    for i in range(60):
        ts, dur = rng.randrange(0, 500), rng.randrange(1, 40)
        comm = rng.random() < 0.4
        events.append({"ph": "X", "cat": "kernel", "name": "ncclKernel_x" if comm else f"gemm{i}", "ts": ts,
                       "dur": dur})
        (comm_at if comm else compute_at).update(range(ts, ts + dur))
    r = overlap_report({"traceEvents": events})["total"]
    assert round(r["comm_ms"] * 1e3) == len(comm_at)
    assert round(r["exposed_ms"] * 1e3) == len(comm_at - compute_at)


def test_command_line(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 60},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllToAll", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "F0+B1", "ts": 0, "dur": 120}]}
    path = tmp_path / "trace_rank0.json"
    path.write_text(json.dumps(trace))
    proc = subprocess.run([sys.executable, "benchmarks/overlap.py", str(path)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "F0+B1" in proc.stdout and "60.0%" in proc.stdout


def test_dualpipev_slots_are_profiler_ranges():
    "The schedule's F/B/W slots appear as record_function ranges in a (CPU) profiler trace, which the report reads."
    import torch
    from pith_lit.engine.dualpipev import DualPipeV, split_model
    from pith_lit.models.protocol import LocalDispatcher, head_loss
    from pith_lit.testing import micro_batches, tiny_model
    model = tiny_model()
    pipe = DualPipeV(split_model(model, 0, 1), None, LocalDispatcher(4), lambda h, y: head_loss(model, h, y), None,
                     "cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(micro_batches(2, 64), 1.0)
    names = {e.name for e in prof.events()}
    assert {"F0", "B0", "W"} & names and any("&" in n for n in names), sorted(n for n in names if len(n) < 8)
