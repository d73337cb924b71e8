"""Load-balance loss and the optimizer pieces at other seeds and sizes than their notebooks
(nbs/train/42_load_balance.py, nbs/train/43_optim.py), plus the two-process all-reduce of the global balance."""
import copy
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ROOT, subprocess_env
from pith_lit.train.load_balance import LoadBalance
from pith_lit.train.optim import build_optimizer, count_tokens, lr_at
from references import token_loss_sum


# ---------------------------------------------------------------- load balance

def routed(seed, T, E, k, dtype=torch.float64, skew=1.5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, dtype=dtype, generator=g)
    logits[:, : E // 3] += skew
    probs = logits.softmax(-1)
    return probs.requires_grad_(), probs.detach().topk(k, -1).indices


def reference(probs, ids, E):
    "E · Σ f_i P_i and f, straight from the definition with bincount."
    f = torch.bincount(ids.flatten(), minlength=E).double() / ids.numel()
    return E * (f * probs.detach().double().mean(0)).sum(), f


@pytest.mark.parametrize("E,k", [(4, 1), (16, 4)])
def test_uniform_routing_is_one(E, k):
    T = 3 * E
    ids = (torch.arange(T)[:, None] + torch.arange(k)[None] * (E // k)) % E   # every expert gets 3k assignments
    assert torch.bincount(ids.flatten(), minlength=E).unique().tolist() == [3 * k]
    lb = LoadBalance(E, 1.0, "global")
    assert abs(lb.loss(0, torch.full((T, E), 1 / E, requires_grad=True), ids).item() - 1.0) < 1e-6
    assert abs(lb.stats()["lb/mean"] - 1.0) < 1e-12


@pytest.mark.parametrize("seed", [1, 2])
def test_value_and_gradient_match_formula(seed):
    T, E, k, coef = 10, 7, 3, 0.03
    probs, ids = routed(seed, T, E, k)
    out = LoadBalance(E, coef, "micro").loss(0, probs, ids)
    out.backward()
    value, f = reference(probs, ids, E)
    assert torch.allclose(out, coef * value, rtol=1e-12)
    assert torch.allclose(probs.grad, (coef * E * f / T).expand(T, E), rtol=1e-12)
    assert torch.autograd.gradcheck(lambda p: LoadBalance(E, coef, "micro").loss(1, p, ids),
                                    (probs.detach().clone().requires_grad_(),))


def test_global_is_running_accumulation_and_stats_cover_the_step():
    E, k, coef, T = 6, 2, 0.5, 5
    mbs = [routed(10 + m, T, E, k) for m in range(3)]
    lb = LoadBalance(E, coef, "global")
    for m, (probs, ids) in enumerate(mbs):
        lb.loss("L", probs, ids).backward()
        _, f_sofar = reference(torch.zeros(1, E), torch.cat([i for _, i in mbs[: m + 1]]), E)
        assert torch.allclose(probs.grad[0] * T / (coef * E), f_sofar, rtol=1e-12), m
    step_value, _ = reference(torch.cat([p for p, _ in mbs]), torch.cat([i for _, i in mbs]), E)
    stats = lb.stats()
    assert stats.keys() == {"lb/layerL", "lb/mean"}
    assert abs(stats["lb/layerL"] - step_value.item()) < 1e-12 and stats["lb/mean"] == stats["lb/layerL"]
    assert step_value.item() > 1.05   # the skewed router is measurably unbalanced
    # micro uses only its own micro-batch, and start_step forgets the previous step
    last_p, last_ids = mbs[-1]
    own, _ = reference(last_p, last_ids, E)
    assert torch.allclose(LoadBalance(E, coef, "micro").loss(0, last_p, last_ids), coef * own, rtol=1e-12)
    lb.start_step()
    assert torch.allclose(lb.loss("L", last_p, last_ids), coef * own, rtol=1e-12)


def test_stats_mean_over_layers_and_coef_zero():
    E, k = 5, 2
    lb = LoadBalance(E, 0.0, "micro")
    expect = {}
    for layer, seed in ((1, 20), (7, 21)):
        probs, ids = routed(seed, 9, E, k, dtype=torch.float32)
        z = lb.loss(layer, probs, ids)
        assert z.item() == 0.0 and z.grad_fn is None
        expect[f"lb/layer{layer}"] = reference(probs, ids, E)[0].item()
    stats = lb.stats()
    assert all(abs(stats[key] - v) < 1e-6 for key, v in expect.items())
    assert abs(stats["lb/mean"] - sum(expect.values()) / 2) < 1e-6


def test_load_balance_errors():
    with pytest.raises(ValueError, match="must be 'micro', 'global' or 'sequence', got 'step'"):
        LoadBalance(4, 1.0, "step")
    with pytest.raises(ValueError, match="must be >= 0"):
        LoadBalance(4, -0.1, "micro")
    with pytest.raises(ValueError, match=r"expected probs \(T, 4\)"):
        LoadBalance(4, 1.0, "micro").loss(0, torch.rand(3, 5), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="found no routing this step"):
        LoadBalance(4, 1.0, "micro").stats()


def test_global_all_reduce_two_gloo_processes(tmp_path):
    "Two ranks' running-global f, loss and stats equal one process that sees both ranks' shares (gloo)."
    code = ("import sys, torch.multiprocessing as mp\n"
            "sys.path.insert(0, 'tests')\n"
            "from references import check_across_ranks\n"
            "mp.spawn(check_across_ranks, args=(2, sys.argv[1], 3), nprocs=2)\n")
    proc = subprocess.run([sys.executable, "-c", code, f"file://{tmp_path}/init"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# ---------------------------------------------------------------- optimizer

REGROUP = """
import os, torch, torch.distributed as dist
from pith_lit.train.optim import _regroup
dist.init_process_group("gloo")
r, n = dist.get_rank(), dist.get_world_size()
for E, shape, dim in ((5, (7, 3), 1), (3, (4, 6), 2), (2, (5, 2), 1)):   # uneven rows, uneven and empty shares
    x = torch.arange(E * shape[0] * shape[1], dtype=torch.float64).view(E, *shape)
    part = x.chunk(n, dim)[r] if r < len(x.chunk(n, dim)) else x.narrow(dim, 0, 0)
    whole, back = _regroup(part.contiguous(), dim, x.shape[dim], dist.group.WORLD)
    assert torch.equal(whole, x.tensor_split(n)[r]), (r, E, whole.shape)
    assert torch.equal(back(whole * 2), part * 2), (r, E)
print("ok", r, flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)   # past the interpreter's teardown, where gloo's threads can abort the process
"""


@pytest.mark.parametrize("n", [2, 3])
def test_muon_regroups_experts_across_ranks(n):
    """Muon's regrouping of a stack split along a matrix dim (FSDP's rows of the experts) into whole matrices of each
    rank's share of the experts, and back: against slicing the whole stack, on n gloo processes."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           "--no-python", sys.executable, "-c", REGROUP],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.count("ok") == n, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_decay_groups_by_dimension():
    model = nn.Sequential(nn.Embedding(7, 6), nn.Linear(6, 6), nn.RMSNorm(6), nn.Linear(6, 3, bias=False))
    model[2].weight.requires_grad_(False)   # frozen parameters stay out of the optimizer
    opt = build_optimizer(model, 3e-4, 0.05, (0.9, 0.99), 1e-9)
    decayed, plain = ({id(p) for p in g["params"]} for g in opt.param_groups)
    assert decayed == {id(model[0].weight), id(model[1].weight), id(model[3].weight)}
    assert plain == {id(model[1].bias)}
    assert opt.param_groups[0]["weight_decay"] == 0.05 and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.defaults["lr"] == 3e-4 and opt.defaults["betas"] == (0.9, 0.99)


def test_lr_schedules_at_key_steps():
    kw = dict(lr=2.0, steps=50, warmup=5, decay_frac=0.4, min_lr_ratio=0.0)
    # warmup: 2·(s+1)/5; wsd decays over the last 20 steps (30..49): 2·(1 - (s-29)/20); cosine over 45 steps
    cases = {"constant": {0: 0.4, 4: 2.0, 5: 2.0, 49: 2.0},
             "wsd": {0: 0.4, 4: 2.0, 29: 2.0, 30: 1.9, 39: 1.0, 49: 0.0},
             "cosine": {4: 2.0, 5: 1.0 + math.cos(math.pi / 45), 49: 0.0}}
    for schedule, points in cases.items():
        for step, value in points.items():
            assert lr_at(step, schedule=schedule, **kw) == pytest.approx(value, abs=1e-12), (schedule, step)
    # no warmup, nonzero floor: cosine half way between lr and min at progress 1/2
    assert lr_at(9, lr=1.0, steps=20, warmup=0, schedule="cosine", decay_frac=0.0,
                 min_lr_ratio=0.2) == pytest.approx(0.6, abs=1e-12)
    assert lr_at(19, lr=1.0, steps=20, warmup=0, schedule="wsd", decay_frac=0.0, min_lr_ratio=0.2) == 1.0


def test_lr_schedule_errors():
    kw = dict(lr=1.0, steps=10, warmup=2, decay_frac=0.5, min_lr_ratio=0.1)
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        lr_at(0, schedule="step", **kw)
    with pytest.raises(ValueError, match=r"step 10 is outside the run's steps 0..9"):
        lr_at(10, schedule="cosine", **kw)
    with pytest.raises(ValueError, match="overlap"):
        lr_at(0, schedule="wsd", **dict(kw, warmup=6))
    with pytest.raises(ValueError, match=r"must both be in \[0, 1\]"):
        lr_at(0, schedule="cosine", **dict(kw, min_lr_ratio=1.5))


@pytest.mark.parametrize("seed", [5, 6])
def test_token_weighted_accumulation_is_exact(seed):
    V, d, B, L = 20, 6, 4, 10
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(V, d), nn.Linear(d, V))
    nn.init.normal_(model[0].weight, std=2.0)
    x = torch.randint(0, V, (B, L))
    y = torch.randint(0, V, (B, L))
    y[torch.rand(B, L) < torch.tensor([0.0, 0.2, 0.5, 0.7])[:, None]] = -7   # unequal counts per sequence
    counts = [count_tokens(y[b], ignore_index=-7).item() for b in range(B)]
    assert len(set(counts)) > 1
    n = sum(counts)

    def run(split, denominators):
        m = copy.deepcopy(model)
        total = 0.0
        for xs, ys, den in zip(split(x), split(y), denominators):
            loss = token_loss_sum(m(xs).flatten(0, 1), ys.flatten(), ignore_index=-7) / den
            loss.backward()
            total += loss.item()
        return total, [p.grad for p in m.parameters()]

    full_loss, full_grads = run(lambda t: [t], [n])
    acc_loss, acc_grads = run(lambda t: t.split(1), [n] * B)
    naive_loss, naive_grads = run(lambda t: t.split(1), [c * B for c in counts])
    # the reference: mean cross-entropy over the non-ignored tokens, computed in float64
    keep = y != -7
    ref = F.cross_entropy(model(x)[keep].double(), y[keep])
    assert full_loss == pytest.approx(ref.item(), abs=1e-6) and acc_loss == pytest.approx(full_loss, abs=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(acc_grads, full_grads))
    assert abs(naive_loss - full_loss) > 1e-2
    assert max((a - b).abs().max().item() for a, b in zip(naive_grads, full_grads)) > 1e-3


def test_token_loss_sum_is_fp32_for_bf16_logits():
    logits = torch.randn(6, 9).bfloat16()
    labels = torch.tensor([1, 2, -100, 4, -100, 8])
    s = token_loss_sum(logits, labels)
    assert s.dtype == torch.float32 and count_tokens(labels).item() == 4
    assert s.item() == pytest.approx(F.cross_entropy(logits.double()[labels != -100], labels[labels != -100],
                                                     reduction="sum").item(), rel=1e-6)
