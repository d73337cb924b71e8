"""Sharded data parallelism (engine/36_fsdp) on 2 and 4 CPU processes (gloo) against one process: two AdamW steps
of the tiny Qwen3-MoE and DeepSeek-V2 in float64, every gradient, the clipped norm and every parameter compared
(`python -m pith_lit.testing fsdp`)."""
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

LAYOUTS = [  # (processes, pp, dp_replicate, dp, ep, overlap)
    (2, 1, 1, 2, 1, False),   # FSDP over two ranks
    (2, 1, 1, 1, 2, False),   # experts divided over ep, non-expert weights sharded over ep
    (2, 2, 1, 1, 1, False),   # DualPipeV: deferred weight gradients, one reduction per step
    (2, 1, 1, 2, 1, True),    # DualPipeV's overlapped schedule at pp 1 with FSDP dp 2
    (4, 1, 1, 2, 2, False),   # ep 2 × dp 2: experts on a sub-mesh, (Shard(1), Shard(0)) placements
    (4, 1, 2, 2, 1, False),   # HSDP: replicate across 2 groups, shard within
    (4, 2, 1, 2, 1, False),   # DualPipeV × FSDP
    (4, 2, 1, 1, 2, False),   # DualPipeV × expert parallelism
]


@pytest.mark.parametrize("n,pp,dpr,dp,ep,overlap", LAYOUTS)
def test_fsdp_against_one_process(n, pp, dpr, dp, ep, overlap):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m",
           "pith_lit.testing", "fsdp", "--layout", str(pp), str(dpr), str(dp), str(ep)] + (["--overlap"] if overlap else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("rank")]
    assert len(lines) == 2 * n and all("2 steps OK" in l for l in lines), proc.stdout
