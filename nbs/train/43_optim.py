# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Optimizer, schedule, clipping and the loss
#
# Everything one optimizer step needs besides the model: AdamW with the right parameters decayed, fp32 master
# weights for a model stored in bf16, the learning-rate schedule, gradient clipping, and a cross-entropy whose
# gradient accumulation is exact. Each function takes plain arguments (the trainer passes `cfg.train.*`), so
# this notebook does not depend on the config.

# %%
#| default_exp train.optim

# %%
#| export
import math

import torch
import torch.nn.functional as F
from torch import nn

# %%
import copy

import matplotlib.pyplot as plt

# %% [markdown]
# ## AdamW and what it decays
#
# Weight decay pulls weights towards zero, which is a useful regulariser for the matrices that mix features
# (attention and expert projections, the router, the embedding and the head). It is wrong for normalisation
# gains, whose natural value is 1 and which only scale, and pointless for biases. The rule here is by shape,
# not by name: **parameters with two or more dimensions decay, one-dimensional ones (norm weights, biases)
# do not**. Embeddings are 2-D and decay, as in nanoGPT; a name-based exception would be a string lookup that
# has to be kept in step with every model's parameter names.
#
# The fused AdamW kernel (one launch for all parameters) exists for CUDA and CPU tensors, FSDP2's DTensors
# included; for any other device type the default (foreach where supported) is used. The `lr` given here is the
# peak; the trainer writes `lr_at(step)` into every param group before each step.

# %%
#| export
def build_optimizer(model, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float) -> torch.optim.AdamW:
    """AdamW over `model.named_parameters()` (an `nn.Module` or a `MasterWeights`): weight decay on parameters
    with ≥ 2 dimensions, none on 1-D ones (norm gains, biases). Fused on CUDA and CPU."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    fused = {p.device.type for p in decay + no_decay} <= {"cuda", "cpu"}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)

# %% [markdown]
# Check: a module with an embedding, a linear layer with bias and a norm; the matrices land in the decayed
# group and the vectors in the other, with nothing left out or counted twice.

# %%
toy = nn.ModuleDict(dict(emb=nn.Embedding(10, 4), proj=nn.Linear(4, 4), norm=nn.LayerNorm(4)))
opt = build_optimizer(toy, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
dec, nodec = ({id(p) for p in g["params"]} for g in opt.param_groups)
assert dec == {id(toy.emb.weight), id(toy.proj.weight)}
assert nodec == {id(toy.proj.bias), id(toy.norm.weight), id(toy.norm.bias)}
assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.defaults["fused"]

# %% [markdown]
# ## fp32 master weights for a bf16 model
#
# bf16 keeps 8 significant bits: next to a weight of magnitude $w$ the closest other bf16 number is about
# $w/128$ away. An Adam update is about `lr` in size, so with `lr = 1e-4` on weights of size 0.1 most updates
# round back to the old value, and training quietly stalls. The standard cure is to keep an fp32 *master* copy
# of each low-precision parameter: the optimizer (and its moment estimates) works on the fp32 copies, the bf16
# gradients are widened into them before the step, and the updated fp32 values are rounded into the bf16
# parameters after it. The model still computes in bf16.
#
# `MasterWeights` does exactly that and nothing for parameters already in fp32 (the master *is* the
# parameter, no copy). It is a module whose parameters carry the model's names, so `build_optimizer` and DCP's
# optimizer state dict treat it like the model itself, and the trainer
# code is the same for fp32 and bf16 models. Sharded runs get the same effect from FSDP2's
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16)`, which keeps fp32 shards; this wrapper is for parameters
# that are *stored* in bf16. One step reads:
#
# ```
# master.grads_to_master(); clip_grad_norm(master.parameters(), clip); opt.step(); opt.zero_grad(); master.master_to_model()
# ```

# %%
#| export
class MasterWeights(nn.Module):
    """fp32 master copies of a model's bf16/fp16 parameters; fp32 parameters are used as they are.

    Give the optimizer `MasterWeights(model)`, then per step: `grads_to_master()` → clip → `optimizer.step()` →
    `optimizer.zero_grad()` → `master_to_model()`. It is a module whose parameters carry the model's names, so
    anything that maps optimizer state to parameter names (DCP's `get_optimizer_state_dict`) works on it.
    `state_dict()` holds the fp32 copies (checkpoint it beside the model and the optimizer).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        for n, p in named:  # mirror the model's module tree so each master has the parameter's own name
            *path, leaf = n.split(".")
            owner = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            low = p.dtype in (torch.bfloat16, torch.float16)
            owner.register_parameter(leaf, nn.Parameter(p.detach().float()) if low else p)
        self.master = [self.get_parameter(n) for n in self.names]

    def named_parameters(self, *args, **kwargs):
        "The masters under the model's parameter names, in the model's order."
        return zip(self.names, self.master)

    def parameters(self, *args, **kwargs):
        return iter(self.master)

    @torch.no_grad()
    def model_to_master(self):
        "Copy the model's current weights into the masters (after loading weights into the model alone)."
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.copy_(p)

    def grads_to_master(self):
        "Widen each low-precision gradient into its master's fp32 `.grad` and free the low-precision one."
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None

    @torch.no_grad()
    def master_to_model(self):
        "Round the updated fp32 masters into the model's low-precision parameters."
        for p, m in zip(self.params, self.master):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict:
        "The fp32 masters of the low-precision parameters, by parameter name (empty for an fp32 model)."
        return {n: m for n, p, m in zip(self.names, self.params, self.master) if m is not p}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        "Restore the fp32 masters and round them into the model."
        mine = self.state_dict()
        if state.keys() != mine.keys():
            raise ValueError(f"master-weight checkpoint does not match the model: missing "
                             f"{sorted(mine.keys() - state.keys())}, unexpected {sorted(state.keys() - mine.keys())}; "
                             "load a checkpoint saved from the same model and parameter dtype")
        for n, m in mine.items():
            m.copy_(state[n])
        self.master_to_model()

# %% [markdown]
# Check: the same small regression trained three ways from the same start, all with AdamW at `lr = 1e-4`
# for 30 steps: an fp32 model (the reference), a bf16 model with plain AdamW on its bf16 parameters, and a bf16
# model with fp32 master weights. We measure how far each one's weights are from the fp32 reference, relative
# to how far the reference moved. Master weights track it closely (the rest is the bf16 forward pass); plain
# bf16 loses most of its updates to rounding.

# %%
def train_three(seed, steps=30, lr=1e-4):
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    plain, mixed = copy.deepcopy(ref).bfloat16(), copy.deepcopy(ref).bfloat16()
    ref.load_state_dict({n: v.bfloat16().float() for n, v in ref.state_dict().items()})  # same start as bf16
    start = [p.detach().clone() for p in ref.parameters()]
    master = MasterWeights(mixed)
    opts = [build_optimizer(m, lr, 0.0, (0.9, 0.95), 1e-8) for m in (ref, plain, master)]
    for _ in range(steps):
        for model, opt in zip((ref, plain, mixed), opts):
            dt = next(model.parameters()).dtype
            F.mse_loss(model(x.to(dt)).float(), y).backward()
            if model is mixed:
                master.grads_to_master()
            opt.step(); opt.zero_grad()
            if model is mixed:
                master.master_to_model()
    moved = sum((p.detach() - s).pow(2).sum() for p, s in zip(ref.parameters(), start)).sqrt()
    def err(m): return (sum((p.detach().float() - r.detach()).pow(2).sum()
                            for p, r in zip(m.parameters(), ref.parameters())).sqrt() / moved).item()
    return err(plain), err(mixed), master

plain_err, master_err, master = train_three(0)
print(f"distance from fp32 / distance fp32 moved: plain bf16 {plain_err:.3f}, bf16 + fp32 masters {master_err:.3f}")
assert master_err < 0.1 and plain_err > 0.5 and plain_err > 10 * master_err

# %% [markdown]
# The masters and the optimizer state are fp32, and the state dict round-trips: a fresh bf16 model loaded
# from it continues exactly like the original. An fp32 model gets no copies and an empty state dict.

# %%
assert all(m.dtype == torch.float32 for m in master.parameters())
assert all(p.dtype == torch.bfloat16 for p in master.params)
fp32_model = nn.Linear(3, 3)
assert all(m is p for m, p in zip(MasterWeights(fp32_model).parameters(), fp32_model.parameters()))
assert MasterWeights(fp32_model).state_dict() == {}

def continue_steps(model, master, opt, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(8, 4, generator=g).bfloat16()).float().pow(2).mean().backward()
        master.grads_to_master(); opt.step(); opt.zero_grad(); master.master_to_model()

torch.manual_seed(0)
a = nn.Linear(4, 4).bfloat16()
ma = MasterWeights(a)
oa = build_optimizer(ma, 1e-3, 0.1, (0.9, 0.95), 1e-8)
continue_steps(a, ma, oa, seed=0)
saved = copy.deepcopy({"model": a.state_dict(), "master": ma.state_dict(), "opt": oa.state_dict()})
b = nn.Linear(4, 4).bfloat16()
b.load_state_dict(saved["model"])
mb = MasterWeights(b)
ob = build_optimizer(mb, 1e-3, 0.1, (0.9, 0.95), 1e-8)
mb.load_state_dict(saved["master"]); ob.load_state_dict(saved["opt"])
continue_steps(a, ma, oa); continue_steps(b, mb, ob)
assert all(torch.equal(x, y) for x, y in zip(ma.parameters(), mb.parameters()))
assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
assert all(v.dtype == torch.float32 for s in ob.state.values() for v in s.values() if v.dim() > 0)

# %% [markdown]
# ## Learning-rate schedule
#
# `lr_at(step)` gives the learning rate of step `step` (counted from 0) of a run of `steps` steps. All
# schedules start with a linear warmup over `warmup` steps: step $s$ gets $\text{lr}\,(s+1)/\text{warmup}$,
# so the first step already learns and step `warmup-1` reaches the peak. Then:
# - **constant**: the peak to the end.
# - **cosine**: half a cosine from the peak to `min_lr = min_lr_ratio · lr`, reached on the last step.
# - **wsd** (warmup-stable-decay): the peak until the last `round(decay_frac · steps)` steps, then a **linear**
#   decay to `min_lr`, reached on the last step. A stable phase means a run can be extended, or branched into a
#   short decay from any checkpoint, without knowing its length in advance. We chose linear because it is the
#   simplest; a 1-sqrt shape is the common alternative and would be one changed line.
#
# Each phase uses the same "(position + 1) / length" count, so a phase's final value lands on its last step.

# %%
#| export
def lr_at(step: int, *, lr: float, steps: int, warmup: int, schedule: str, decay_frac: float,
          min_lr_ratio: float) -> float:
    "Learning rate of step `step` (0-based) of `steps`: linear warmup, then 'constant', 'cosine' or 'wsd'."
    if schedule not in ("constant", "cosine", "wsd"):
        raise ValueError(f"unknown schedule {schedule!r}: use 'wsd', 'cosine' or 'constant' (train.schedule)")
    if not 0 <= warmup <= steps:
        raise ValueError(f"warmup={warmup} must be between 0 and steps={steps} (train.warmup)")
    if not (0 <= decay_frac <= 1 and 0 <= min_lr_ratio <= 1):
        raise ValueError(f"decay_frac={decay_frac} and min_lr_ratio={min_lr_ratio} must both be in [0, 1]")
    if not 0 <= step < steps:
        raise ValueError(f"step {step} is outside the run's steps 0..{steps - 1}")
    decay = round(decay_frac * steps)
    if schedule == "wsd" and warmup + decay > steps:
        raise ValueError(f"warmup ({warmup}) and the wsd decay ({decay} = decay_frac {decay_frac} × {steps} steps) "
                         f"overlap: lower train.warmup or train.decay_frac")
    min_lr = lr * min_lr_ratio
    if step < warmup:
        return lr * (step + 1) / warmup
    match schedule:
        case "constant":
            return lr
        case "cosine":
            progress = (step - warmup + 1) / (steps - warmup)
            return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        case "wsd":
            start = steps - decay
            if step < start:
                return lr
            return lr + (min_lr - lr) * (step - start + 1) / decay

# %% [markdown]
# Check at the steps where something happens, with values worked out by hand: peak 1.0, 100 steps, 10 warmup,
# decay over the last 20, floor 0.1. Cosine halfway between the peak and the floor (0.55) is where
# progress = 1/2, that is step 54; wsd is halfway at the 10th of its 20 decay steps, step 89.

# %%
kw = dict(lr=1.0, steps=100, warmup=10, decay_frac=0.2, min_lr_ratio=0.1)
expected = {
    "constant": {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 99: 1.0},
    "cosine":   {0: 0.1, 9: 1.0, 54: 0.55, 99: 0.1},
    "wsd":      {0: 0.1, 9: 1.0, 50: 1.0, 79: 1.0, 80: 1 - 0.9 / 20, 89: 0.55, 99: 0.1},
}
for sched, points in expected.items():
    for s, v in points.items():
        assert abs(lr_at(s, schedule=sched, **kw) - v) < 1e-12, (sched, s, lr_at(s, schedule=sched, **kw), v)
cos = [lr_at(s, schedule="cosine", **kw) for s in range(100)]
assert all(a >= b for a, b in zip(cos[9:], cos[10:]))   # monotone after warmup

# %%
fig, ax = plt.subplots(figsize=(6, 3))
for sched in ("constant", "cosine", "wsd"):
    ax.plot([lr_at(s, schedule=sched, **kw) for s in range(100)], label=sched)
ax.set(xlabel="step", ylabel="lr / peak", title="warmup 10, decay_frac 0.2, min_lr_ratio 0.1"); ax.legend()
plt.show()

# %% [markdown]
# Settings that cannot work are refused with the field to change.

# %%
for bad, msg in [(dict(kw, schedule="linear"), "unknown schedule"),
                 (dict(kw, schedule="wsd", warmup=90), "overlap"),
                 (dict(kw, schedule="cosine", warmup=101), "warmup=101")]:
    try:
        lr_at(0, **bad)
        raise AssertionError("no error")
    except ValueError as e:
        assert msg in str(e), e

# %% [markdown]
# ## Gradient clipping
#
# One global norm over all gradients, $\sqrt{\sum_p \lVert g_p \rVert^2}$; if it exceeds `max_norm` every gradient
# is scaled by `max_norm / norm`. `max_norm = 0` switches clipping off, but the norm is still returned because
# it is one of the most useful numbers to log. With master weights, clip the fp32 master gradients (after
# `grads_to_master`). PyTorch's own functions do the work; for FSDP2's DTensor gradients they already reduce
# over the sharding mesh. **Distributed note:** when parameters are split across pipeline stages (or expert
# parameters live outside the FSDP mesh), each rank's norm covers only its own parameters. `clip_grad_norm`
# takes those as `sharded` with the `group` they are split over: their squared norms are summed over the group
# and added to the squared norm of the replicated `params`, so every rank computes the same global norm and the
# same scale.

# %%
#| export
def clip_grad_norm(params, max_norm: float, sharded=(), group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (a float tensor); if `max_norm > 0`, scale them so it is at most `max_norm`.

    `params` are replicated on every rank; `sharded` (e.g. expert parameters under expert parallelism) differ
    between the ranks of `group`, and their squared norms are summed over it."""
    if max_norm < 0:
        raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {max_norm} (train.grad_clip)")
    params = [p for p in params if p.grad is not None]
    sharded = [p for p in sharded if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if group is not None:
        part = torch.nn.utils.get_total_norm([p.grad for p in sharded]).to(norm.device) if sharded else norm * 0
        sq = part.float() ** 2
        torch.distributed.all_reduce(sq, group=group)
        norm = (norm.float() ** 2 + sq).sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params + sharded, max_norm, norm)
    return norm

# %% [markdown]
# Check against the norm computed by hand in float64, with and without clipping.

# %%
torch.manual_seed(0)
ps = [torch.zeros(s, requires_grad=True) for s in ((3, 4), (5,), (2, 2, 2))]
for p in ps:
    p.grad = torch.randn(p.shape)
orig = [p.grad.clone() for p in ps]
by_hand = math.sqrt(sum((g.double() ** 2).sum().item() for g in orig))
n0 = clip_grad_norm(ps, 0.0)
assert abs(n0.item() - by_hand) < 1e-5 and all(torch.equal(p.grad, g) for p, g in zip(ps, orig))
n1 = clip_grad_norm(ps, 1.0)
assert abs(n1.item() - by_hand) < 1e-5
assert abs(math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in ps)) - 1.0) < 1e-5
assert all(torch.allclose(p.grad, g / by_hand, rtol=1e-5) for p, g in zip(ps, orig))
clip_grad_norm(ps, 10.0)   # below the limit: unchanged
assert all(torch.allclose(p.grad, g / by_hand, rtol=1e-6) for p, g in zip(ps, orig))

# %% [markdown]
# ## Token-weighted cross-entropy
#
# The loss of a step is the mean cross-entropy over every predicted token of the global batch: all
# micro-batches, all data-parallel ranks, minus ignored positions (padding, document boundaries). Averaging
# each micro-batch's own mean instead weights a token by one over its micro-batch's token count, so a short
# micro-batch counts more per token than a long one and the accumulated gradient is not the full-batch
# gradient.
#
# The rule: **each micro-batch's loss is the *sum* of its token losses divided by the number of non-ignored
# tokens in the whole global batch**, counted before the step (sum `count_tokens` over the step's micro-batches,
# all-reduce over the data-parallel ranks). The micro-batch losses then add up to the global mean, and the
# gradients accumulate to the full-batch gradient exactly — which requires the gradient reduction over ranks
# to be a *sum*, not a mean. The sum is formed in fp32 whatever the logits' dtype.

# %%
#| export
def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    "Sum of cross-entropy over the non-ignored tokens, in fp32: `logits (T, V)`, `labels (T,)`."
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def count_tokens(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    "Number of labels that are not `ignore_index` (an int64 tensor, ready to sum and all-reduce)."
    return (labels != ignore_index).sum()

# %% [markdown]
# Check: a tiny language model (embedding, then a linear head) and 4 sequences whose labels have 0, 3, 6 and 9
# of their 12 positions ignored. Four micro-batches of one sequence, each divided by the global count,
# accumulate to the same gradients and loss as one micro-batch of all four; the per-micro-batch mean does not.

# %%
def lm(seed, V=16, d=8):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Embedding(V, d), nn.Linear(d, V))
    nn.init.normal_(m[0].weight, std=2.0)   # spread-out logits, so sequences' mean losses differ
    return m

def batch(seed, V=16, B=4, L=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, L), generator=g)
    y = torch.randint(0, V, (B, L), generator=g)
    for b in range(B):
        y[b, L - 3 * b:] = -100
    return x, y

def grads_of(model):
    return [p.grad.clone() for p in model.parameters()]

x, y = batch(0)
one = lm(0)
n_tokens = count_tokens(y)
full = token_loss_sum(one(x).flatten(0, 1), y.flatten()) / n_tokens
full.backward()

four = lm(0)
accumulated = sum(count_tokens(y[b]) for b in range(4))   # counted before the step
assert accumulated == n_tokens == 4 * 12 - (0 + 3 + 6 + 9)
loss = 0.0
for b in range(4):
    mb = token_loss_sum(four(x[b]), y[b]) / accumulated
    mb.backward()
    loss += mb.item()
assert abs(loss - full.item()) < 1e-6
assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(grads_of(one), grads_of(four)))

naive, naive_loss = lm(0), 0.0
for b in range(4):
    mb = token_loss_sum(naive(x[b]), y[b]) / count_tokens(y[b]) / 4
    mb.backward()
    naive_loss += mb.item()
print(f"global mean {full.item():.4f}, token-weighted accumulation {loss:.4f}, mean of micro-batch means {naive_loss:.4f}")
assert abs(naive_loss - full.item()) > 1e-2
assert max((a - b).abs().max() for a, b in zip(grads_of(one), grads_of(naive))) > 1e-3
