"""Sharded data parallelism (engine/36_fsdp) on 2 and 4 CPU processes (gloo) against one process: two AdamW steps
of the tiny Qwen3-MoE, DeepSeek-V2 and Qwen3.5-MoE in float64, every gradient, the clipped norm and every parameter compared
(`python -m pith_lit.testing fsdp`)."""
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

BOTH = "qwen3_moe deepseek_v2"
LAYOUTS = [  # (processes, pp, dp_replicate, dp, ep, overlap, families, checked one after the other in one launch)
    (2, 1, 1, 2, 1, False, BOTH + " qwen3_5_moe"),  # FSDP over two ranks
    (2, 1, 1, 1, 2, False, "qwen3_moe"),   # experts divided over ep, non-expert weights sharded over ep
    (2, 2, 1, 1, 1, False, "qwen3_moe"),   # DualPipeV: deferred weight gradients, one reduction per step
    (2, 1, 1, 2, 1, True, "qwen3_moe"),    # DualPipeV's overlapped schedule at pp 1 with FSDP dp 2
    (4, 1, 1, 2, 2, False, BOTH),          # ep 2 × dp 2: experts on a sub-mesh, (Shard(1), Shard(0)) placements
    (4, 1, 2, 2, 1, False, "qwen3_moe"),   # HSDP: replicate across 2 groups, shard within
    (4, 2, 1, 2, 1, False, "deepseek_v2"), # DualPipeV × FSDP
    (4, 2, 1, 1, 2, False, "qwen3_moe"),   # DualPipeV × expert parallelism
]


def fsdp_check(n, layout, *extra, families=BOTH):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m",
           "pith_lit.testing", "fsdp", "--layout", *map(str, layout), *extra, "--model", *families.split()]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith("rank")]
    assert len(lines) == len(families.split()) * n and all("2 steps OK" in l for l in lines), proc.stdout
    assert {l.split()[2] for l in lines} == set(families.split()), proc.stdout
    return lines


@pytest.mark.parametrize("n,pp,dpr,dp,ep,overlap,families", LAYOUTS)
def test_fsdp_against_one_process(n, pp, dpr, dp, ep, overlap, families):
    fsdp_check(n, (pp, dpr, dp, ep), *(["--overlap"] if overlap else []), families=families)


def test_grad_norm_and_clip_factor_one_process():
    "Plain tensors in one process (no group): the norm by hand in float64, the factor to the limit, 1 below it."
    import math
    import torch
    from pith_lit.engine.fsdp import clip_factor, grad_norm
    torch.manual_seed(3)
    ps = [torch.zeros(s, requires_grad=True) for s in ((4,), (3, 3), (1, 2, 5))] + [torch.zeros(2, requires_grad=True)]
    for p in ps[:3]:
        p.grad = 3 * torch.randn(p.shape)   # the last parameter has no gradient and is skipped
    orig = [p.grad.clone() for p in ps[:3]]
    total = math.sqrt(sum((g.double() ** 2).sum().item() for g in orig))
    norm = grad_norm(ps)
    assert norm.item() == pytest.approx(total, rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, orig))   # the gradients are left as they are
    assert clip_factor(norm, 0.25).item() == pytest.approx(0.25 / total, rel=1e-6)
    assert clip_factor(norm, 100.0).item() == 1.0 and clip_factor(norm, 0.0) is None


@pytest.mark.parametrize("n,pp,dpr,dp,ep", [(2, 1, 1, 2, 1), (2, 1, 1, 1, 2), (2, 2, 1, 1, 1), (4, 1, 1, 2, 2)])
def test_muon_against_one_process(n, pp, dpr, dp, ep):
    "Muon gathers each sharded matrix's momentum, orthogonalises it whole and keeps its rows: as one process would."
    lines = fsdp_check(n, (pp, dpr, dp, ep), "--optimizer", "muon", families="qwen3_moe")
    assert all("muon" in l for l in lines)


def test_fp8_against_one_process():
    """FP8 with row scales (the experts and every dense projection) under FSDP dp 2: each use quantizes the gathered
    weight and each micro-batch's passes see the rows one process sees, so two steps equal one process in FP8 to
    float64's rounding (at ep > 1 an expert's columns are quantized over both ranks' rows: the pipeline check at ep 2,
    engine/39, holds that case to float32's bound)."""
    lines = fsdp_check(2, (1, 1, 2, 1), "--fp8", "rows", families=BOTH)
    assert all("fp8 rows" in l for l in lines)
