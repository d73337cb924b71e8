"""DualPipeV and the five-stage engine beyond their notebooks: the schedule for many pipeline sizes, the model
split, bad input, one rank (overlap) in this process, and two CPU processes (gloo) against a single-process run."""
import copy
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, subprocess_env
from pith_lit.engine.dualpipev import DualPipeV, dualpipev_schedule, simulate, split_model
from references import unit_duration
from pith_lit.engine.mesh import stage_layers
from pith_lit.models.protocol import head_loss
from pith_lit.testing import aux_fn as _aux_fn, compare, micro_batches as _micro_batches, reference_step, tiny_model


def _tiny(dtype=torch.float32):
    return tiny_model(dtype=dtype)


def _loss_fn(model):
    return lambda h, labels: head_loss(model, h, labels)


def grads(model):
    return {n: p.grad for n, p in model.named_parameters()}
from pith_lit.engine.stages import LayerRun, Streams, backward_layers, forward_layers, run_steps
from pith_lit.models.protocol import LocalDispatcher


@pytest.mark.parametrize("P", range(1, 9))
def test_schedule_every_size(P):
    "Every message matched in order, no deadlock, every F/B of both phases once, each W after its B."
    for M in range(2 * P, 3 * P + 2):
        events = simulate(P, M, unit_duration)
        for r, ev in enumerate(events):
            zero_bubble = sum(a[0] == "B" and a[3] for a in dualpipev_schedule(r, P, M))
            assert sum(e[0] == "W" for e in ev) == zero_bubble


def test_schedule_needs_enough_micro_batches():
    with pytest.raises(ValueError, match=r"pp = 3 needs at least 2·pp = 6 micro-batches per step, got 5"):
        dualpipev_schedule(0, 3, 5)


def test_stage_layers_edges_get_fewer():
    assert stage_layers(10, 2) == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert stage_layers(9, 2) == [[0, 1], [2, 3, 4], [5, 6], [7, 8]]
    assert [len(s) for s in stage_layers(30, 4)] == [3, 4, 4, 4, 4, 4, 4, 3]
    assert stage_layers(6, 2, sizes=[0, 3, 2, 1]) == [[], [0, 1, 2], [3, 4], [5]]
    for bad in ([3, 4, 3], [3, 0, 3, 6], [4, 4, 4, 4]):
        with pytest.raises(ValueError, match=r"pp_stage_layers = .*: give 2·pp = 4 layer counts"):
            stage_layers(12, 2, sizes=bad)


def test_split_model_keeps_only_this_ranks_parameters():
    full = dict(_tiny().named_parameters())
    kept = []
    for rank in range(2):
        model = _tiny()
        parts = split_model(model, rank, 2)
        names = {n for n, _ in model.named_parameters()}
        assert [p.index for p in parts] == [rank, 3 - rank]
        assert ("lm_head.weight" in names) == (rank == 0) and ("model.embed_tokens.weight" in names) == (rank == 0)
        assert all(torch.equal(p, full[n]) for n, p in model.named_parameters())
        kept.append(names)
    assert kept[0] | kept[1] == full.keys() and not kept[0] & kept[1]
    with pytest.raises(ValueError, match="2·pp = 6 stages of at least one layer, but model.num_hidden_layers = 5"):
        split_model(_tiny(), 0, 3)


def test_step_rejects_bad_micro_batches():
    model = _tiny()
    pipe = DualPipeV(split_model(model, 0, 1), None, LocalDispatcher(4), _loss_fn(model))
    with pytest.raises(ValueError, match="at least 2·pp = 2 micro-batches"):
        pipe.step(_micro_batches(1, 64))
    uneven = _micro_batches(1, 64) + _micro_batches(1, 64, shape=(2, 6))
    with pytest.raises(ValueError, match=r"same \(batch, seq\) shape.*\(2, 6\), \(2, 8\)"):
        pipe.step(uneven)
    with pytest.raises(ValueError, match="runs stages 0 and 1, got parts of stages"):
        DualPipeV(split_model(_tiny(), 1, 2), None, LocalDispatcher(4), None)


@pytest.mark.parametrize("M", [2, 4])
def test_overlap_one_rank_matches_plain_autograd(M):
    """parallel.overlap: P = 1, everything but the first micro-batch's forward and the last one's backward in F&B
    pairs; float64 so only the order of sums differs."""
    ref, model = _tiny(dtype=torch.float64), _tiny(dtype=torch.float64)
    batches, scale, aux_fn = _micro_batches(M, 64, seed=7), 1 / (M * 16), _aux_fn(4, coef=0.3)
    ref_loss, ref_aux = reference_step(ref, batches, scale, aux_fn)
    pipe = DualPipeV(split_model(model, 0, 1), None, LocalDispatcher(4), _loss_fn(model), aux_fn)
    loss, aux = pipe.step(batches, scale)
    compare(model, grads(ref), loss, ref_loss, f"P=1 M={M}", grad_tol=1e-12, loss_tol=1e-12)
    assert abs(aux - ref_aux) <= 1e-12 * abs(ref_aux)
    events = pipe.timeline.events()
    kinds = [k for k, *_ in events]
    assert kinds.count("F1&B0") == M - 1 and kinds.count("F0&B1") == M - 1
    assert [k for k in kinds if "&" not in k and k != "W"] == ["F0", "F1", "B1", "B0"]


def test_run_steps_interleaves_at_communication_steps():
    "Two tasks alternate after each COMM step; results equal running them one after the other."
    model = _tiny()
    disp, cpu, pos = LocalDispatcher(4), Streams(torch.device("cpu")), torch.arange(8)
    ids_a, ids_b = torch.randint(0, 64, (2, 2, 8))
    def runs(m):
        return [LayerRun(layer, k, disp) for k, layer in m.model.layers.items()]
    outs = []
    for overlapped in (False, True):
        m = copy.deepcopy(model)
        rb = runs(m)
        run_steps(cpu, forward_layers(rb, m.prolog(ids_b), pos))
        grad = torch.linspace(-1, 1, rb[-1].h_out.numel()).view_as(rb[-1].h_out)
        ra, trace = runs(m), []
        fa, bb = forward_layers(ra, m.prolog(ids_a), pos), backward_layers(rb, grad)
        if overlapped:
            run_steps(cpu, bb, fa, trace=trace)
            # the first layer pair: b.stage5_backward b.combine_backward | a.stage1 a.dispatch | ...
            assert trace[:6] == [(0, "stage5_backward"), (0, "combine_backward"), (1, "stage1"), (1, "dispatch"),
                                 (0, "stage3_backward"), (0, "dispatch_backward")]
        else:
            run_steps(cpu, fa)
            run_steps(cpu, bb)
        outs.append((ra[-1].h_out, rb[0].grad_in, [p.grad.clone() for p in m.parameters() if p.grad is not None]))
    (h0, g0, p0), (h1, g1, p1) = outs
    assert torch.equal(h0, h1) and torch.equal(g0, g1) and len(p0) == len(p1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def torchrun(nproc: int, *args: str) -> list[str]:
    "Run the module's checks on `nproc` CPU processes; returns the lines that report a passed check."
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "-m", "pith_lit.testing", "pipeline", *args],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [line for line in proc.stdout.splitlines() if line.endswith(")") and " OK " in line]


def test_two_ranks_against_single_process():
    "pp = 2 over gloo with 2P, 2P+1 and 3P micro-batches: loss to 1e-6, gradients to 1e-5 relative (float32)."
    assert len(torchrun(2, "--micro", "4", "5", "6")) == 6


def test_overlap_with_expert_parallelism():
    """pp = 1 × ep = 2: the F&B pairs interleave the all-to-alls of two micro-batches; each ep rank has its own data.
    Qwen3-MoE and Qwen3.5-MoE (linear attention, shared expert): expert parallelism against one process."""
    lines = torchrun(2, "--micro", "2", "3", "--ep", "2", "--model", "qwen3_moe", "qwen3_5_moe")
    assert len(lines) == 8 and sum("qwen3_5_moe" in l for l in lines) == 4


def test_pipeline_with_expert_parallelism():
    "pp = 2 × ep = 2 on four processes: two pipeline groups."
    assert len(torchrun(4, "--micro", "4", "5", "--ep", "2")) == 8


def test_four_pipeline_ranks():
    "pp = 4 on four processes (9 layers in 8 stages), 2P micro-batches; the middle ranks have two neighbours each."
    assert len(torchrun(4, "--micro", "8")) == 4


def test_empty_edge_stages():
    "pp = 2 with rank 0 holding no layer at all (stage 0 only embeds, stage 3 only runs the head and the loss)."
    assert len(torchrun(2, "--micro", "4", "5", "--stage-layers", "0", "3", "2", "0")) == 4


def test_other_families_pipeline():
    """pp = 2 with DeepSeek-V2 (dense first layer on rank 0's first stage, shared experts, latent attention) and
    Qwen3.5-MoE (linear and full attention layers on different stages)."""
    lines = torchrun(2, "--micro", "4", "5", "--model", "deepseek_v2", "qwen3_5_moe")
    assert len(lines) == 8 and sum("qwen3_5_moe" in l for l in lines) == 4
