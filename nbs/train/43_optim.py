# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Optimizer, schedule and the loss
#
# Everything one optimizer step needs besides the model: AdamW with the right parameters decayed, Muon, why the master
# weights are fp32, the learning-rate schedule, and a cross-entropy whose gradient accumulation is exact (gradient
# clipping of sharded gradients is in engine/36_fsdp). Each function takes plain arguments (the trainer passes
# `cfg.train.*`), so this notebook does not depend on the config.

# %%
#| default_exp train.optim

# %%
#| export
import math

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from pith_lit.engine.ep import all_to_all
from pith_lit.ops.adamw import AdamW, decay_add, local, muon_momentum, ns_poly

# %%
import copy

import torch.nn.functional as F

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
# The optimizer is ops/19's `AdamW`: one pass over memory per parameter on CUDA (a Triton kernel), the clipping
# factor applied inside that pass (`step(grad_scale=c)`), FSDP2's DTensors stepped shard by shard. The `lr` given
# here is the peak; the trainer writes `lr_at(step)` into every param group before each step.

# %%
#| export
def build_optimizer(model, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, kind: str = "adamw", momentum: float = 0.95) -> torch.optim.Optimizer:
    """AdamW (ops/19) over `model.named_parameters()`: weight decay on parameters with ≥ 2 dimensions, none on 1-D
    ones (norm gains, biases). `kind="muon"`: `Muon` (below) for the matrices `muon_param` selects, AdamW for the
    rest, with the same decay rule."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "muon":
        mats = [p for n, p in named if muon_param(n, p)]
        rest = [(n, p) for n, p in named if not muon_param(n, p)]
        groups = [{"params": mats, "weight_decay": weight_decay, "muon": True},
                  {"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}]
        parts = {getattr(m, n): spec for m in model.modules() for n, spec in getattr(m, "MUON_PARTS", {}).items()}
        return Muon([g for g in groups if g["params"]], lr=lr, momentum=momentum, betas=betas, eps=eps, parts=parts)
    if kind != "adamw":
        raise ValueError(f"optimizer kind {kind!r}: expected 'adamw' or 'muon' (train.optimizer)")
    decay, no_decay = [], []
    for _, p in named:
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return AdamW(groups, lr=lr, betas=betas, eps=eps)

# %% [markdown]
# Check: a module with an embedding, a linear layer with bias and a norm; the matrices land in the decayed
# group and the vectors in the other, with nothing left out or counted twice.

# %%
toy = nn.ModuleDict(dict(emb=nn.Embedding(10, 4), proj=nn.Linear(4, 4), norm=nn.LayerNorm(4)))
opt = build_optimizer(toy, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
dec, nodec = ({id(p) for p in g["params"]} for g in opt.param_groups)
assert dec == {id(toy.emb.weight), id(toy.proj.weight)}
assert nodec == {id(toy.proj.bias), id(toy.norm.weight), id(toy.norm.bias)}
assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]

# %% [markdown]
# ## fp32 master weights for a bf16 model
#
# bf16 keeps 8 significant bits: next to a weight of magnitude $w$ the closest other bf16 number is about
# $w/128$ away. An Adam update is about `lr` in size, so with `lr = 1e-4` on weights of size 0.1 most updates
# round back to the old value, and training quietly stalls. The standard cure is to keep an fp32 *master* copy
# of each weight: the optimizer (and its moment estimates) works on the fp32 values, and the model computes with
# bf16 copies of them.
#
# In pith_lit the master weights are the parameters themselves. The trainer keeps every parameter in fp32
# (`train.optim_dtype = "float32"`) and FSDP2 (engine/36) casts each unit's weights to bf16 when it gathers them
# for compute and reduces the gradients in fp32 (`MixedPrecisionPolicy`), on one rank as on many; the optimizer
# steps the fp32 shards. `train.optim_dtype = "bfloat16"` stores the parameters and the AdamW states in bf16
# instead: half the memory, at the cost measured here.
#
# Check: the same small regression trained three ways from the same start, all with AdamW at `lr = 1e-4` for 30
# steps: an fp32 model (the reference), a bf16 model with AdamW on its bf16 parameters, and fp32 parameters
# computing in bf16 through FSDP2's mixed precision on a one-rank mesh. We measure how far each one's weights are
# from the fp32 reference, relative to how far the reference moved. The fp32 masters track it closely (the rest is
# the bf16 forward pass); plain bf16 loses most of its updates to rounding.

# %%
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from pith_lit.engine.fsdp import whole
from pith_lit.engine.mesh import init_distributed

# %%
def train_three(seed, steps=30, lr=1e-4):
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    ref.load_state_dict({n: v.bfloat16().float() for n, v in ref.state_dict().items()})  # same start as bf16
    plain, mixed = copy.deepcopy(ref).bfloat16(), copy.deepcopy(ref)
    fully_shard(mixed, mesh=init_device_mesh("cpu", (1,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    start = [p.detach().clone() for p in ref.parameters()]
    opts = [build_optimizer(m, lr, 0.0, (0.9, 0.95), 1e-8) for m in (ref, plain, mixed)]
    for _ in range(steps):
        for model, opt, dt in zip((ref, plain, mixed), opts, (torch.float32, torch.bfloat16, torch.bfloat16)):
            F.mse_loss(model(x.to(dt)).float(), y).backward()
            opt.step(); opt.zero_grad()
    moved = sum((p.detach() - s).pow(2).sum() for p, s in zip(ref.parameters(), start)).sqrt()
    def err(m): return (sum((whole(p.detach()).float() - r.detach()).pow(2).sum()
                            for p, r in zip(m.parameters(), ref.parameters())).sqrt() / moved).item()
    return err(plain), err(mixed), mixed

if not dist.is_initialized():
    init_distributed(60, "cpu")
plain_err, master_err, mixed = train_three(0)
print(f"distance from fp32 / distance fp32 moved: plain bf16 {plain_err:.3f}, fp32 masters computing in bf16 "
      f"{master_err:.3f}")
assert master_err < 0.1 and plain_err > 0.5 and plain_err > 10 * master_err
assert all(p.dtype == torch.float32 for p in mixed.parameters())          # the masters are the parameters

# %% [markdown]
# ## Muon: orthogonalised momentum for the matrices
#
# Muon updates a weight matrix with its momentum *orthogonalised*: the momentum `M = U Σ Vᵀ` is replaced by
# `U Vᵀ`, every singular value set to one, so that no direction of the update dominates the others. The exact
# `U Vᵀ` needs an SVD; Muon approximates it with five steps of a quintic Newton–Schulz iteration on `X = M/‖M‖`,
# `X ← a X + (b A + c A²) X` with `A = X Xᵀ` and `(a, b, c) = (3.4445, −4.7750, 2.0315)`, which pushes every singular
# value into roughly [0.7, 1.2] using matmuls only. A tall matrix takes the same iteration on its transpose, written
# as `A = XᵀX` and `X ← a X + X (b A + c A²)` so that the result keeps the matrix's layout. Each step is three
# products, `A`, `A²` and `B X`, with the small matrix `B = a I + b A + c A²` made in one pass (ops/19 `ns_poly`).
# `M/‖M‖` is never written: `‖M‖² = trace(M Mᵀ)`, so the first step forms `M Mᵀ`, scales it by `1/‖M‖²` and its `B`
# by `1/‖M‖`, which gives the same `B X` for one more pass over a small matrix instead of a norm and a divide over
# `M`. It applies to the 2-D
# weights inside the layers (attention projections, dense MLPs, shared experts) and to each routed expert's matrix
# (a stacked `(E, out, in)` tensor is E matrices); the embedding, the head, the router, norms and biases keep AdamW,
# as in the published Muon setups (the router's rows are per-expert scores, not a feature map). The momentum with
# its Nesterov form, and the update with its decay, are one pass over memory each (ops/19 `muon_momentum`,
# `decay_add`).
#
# **Learning-rate matching.** An orthogonal `out × in` update has RMS `1/√max(out, in)`; AdamW's updates have an
# RMS of about 0.2. Scaling the Muon update by `0.2·√max(out, in)` makes the two alike, so one `train.lr` (and the
# same warmup and decay) serves both groups. Weight decay is decoupled, `p ← p·(1 − lr·wd)`, for both.
#
# **Sharded matrices.** Orthogonalisation needs whole matrices, and under FSDP2 a rank holds some rows of them. A
# stack of matrices (the routed experts, `(E, out, in)`) needs no rank to hold all of it: each rank needs whole
# experts. So a split of its rows (FSDP's `Shard(1)` beside `ep`'s `Shard(0)`) moves to the expert dimension by an
# all-to-all over the shard group, each rank orthogonalises the whole matrices of its share of the experts, and a
# second all-to-all gives every rank its rows back; a split already along the experts (FSDP's `Shard(0)` without
# `ep`) stays, with no exchange at all. The Newton–Schulz work of the experts is thus divided among the ranks, as
# the optimizer's elementwise work is, and each exchange moves a 1/ranks share of what an all-gather would. A single
# matrix (attention, dense MLP, shared experts) is gathered whole on every rank of its shard group (the size of one
# FSDP gather of it) and orthogonalised there, each rank keeping its rows: that work repeats on every rank of the
# group, a small share next to the experts'.
#
# **Fused pairs.** The routed experts keep gate and up in one tensor (`gate_up_proj`: gate's rows then up's in
# models/20, their columns interleaved in GPT-OSS), but the model has two matrices there, as two linear layers would
# hold them. Muon orthogonalises the two apart: a module names its fused parameters and their layout in
# `MUON_PARTS`, and the step views each as a stack of pairs. That is also cheaper: an iteration on an `m × n` matrix
# (`m ≤ n`) costs `4m²n + 2m³` FLOPs, so at Qwen3's expert width (768 of hidden 2048) the two `768 × 2048` halves
# cost 2.3× less than one `1536 × 2048`.

# %%
#| export
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(m: Tensor, steps: int = 5) -> Tensor:
    """The quintic Newton–Schulz approximation of `U Vᵀ` for each matrix in the last two dims of `m` (bf16 on CUDA,
    fp32 or wider elsewhere)."""
    if steps < 1:   # the first step is also where the matrix is normalised
        raise ValueError(f"orthogonalize needs at least one Newton–Schulz step, got steps={steps}")
    x = m.to(torch.bfloat16 if m.is_cuda else torch.promote_types(m.dtype, torch.float32))
    tall = x.shape[-2] > x.shape[-1]   # then the Gram matrix of the columns, applied from the right
    lead, x = x.shape[:-2], x.reshape(-1, *x.shape[-2:])           # one batch of matrices: three GEMMs a step
    a, b, c = NS_COEFFS
    for i in range(steps):   # a·x + (b·A + c·A²)·x as one product: (a·I + b·A + c·A²)·x, A = x xᵀ (tall: the mirror)
        A = x.mT @ x if tall else x @ x.mT
        s = None
        if i == 0:           # ‖x‖² = trace(A): x/‖x‖ never written, its 1/‖x‖² scales A and its 1/‖x‖ scales B
            s = A.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.promote_types(A.dtype, torch.float32))
            s = s.sqrt_().add_(1e-7)
            ns_poly(A, None, a=0.0, b=1.0, c=0.0, scale=s.pow(-2))
        B = ns_poly(A, A @ A, a=a, b=b, c=c, scale=None if s is None else s.reciprocal())   # into A²'s storage
        x = x @ B if tall else B.mT @ x   # B is symmetric; Bᵀ's layout runs faster on the H200 (RESULTS, "Muon")
    return x.view(*lead, *x.shape[-2:]).to(m.dtype)


def _split(x: Tensor, spec) -> tuple[Tensor, callable]:
    """`x`'s fused pairs of matrices (`spec` = (the dim that holds both, whether they interleave), a module's
    `MUON_PARTS`) as a stack with a new dim of 2 before the matrix dims, and how to fuse a result of that shape."""
    dim, interleaved = spec
    dim %= x.dim()
    pair = dim + 1 if interleaved else dim     # where the new dim of 2 lands after unflatten
    y = x.unflatten(dim, (-1, 2) if interleaved else (2, -1)).movedim(pair, -3)
    return y, lambda out: out.movedim(-3, pair).flatten(dim, dim + 1)


def _regroup(x: Tensor, dim: int, size: int, group):
    """`x`, this rank's part of a stack of matrices whose matrix dim `dim` (of `size` in all) is split over `group` as
    FSDP splits (`torch.chunk`) -> (whole matrices of this rank's share of the stack's first dim, how to give back
    this rank's part of a result of that shape): one all-to-all each way."""
    n, r = group.size(), group.rank()
    rows = [len(c) for c in torch.arange(size).chunk(n)]
    rows += [0] * (n - len(rows))
    if x.shape[dim] != rows[r]:
        raise ValueError(f"Muon: rank {r} holds {x.shape[dim]} of {size} along dim {dim}, expected {rows[r]}")
    share = [len(c) for c in torch.arange(x.shape[0]).tensor_split(n)]
    slab = lambda e, k: math.prod(x.shape[1:dim]) * rows[k] * math.prod(x.shape[dim + 1:]) * e   # elements
    shape = lambda e, k: (e, *x.shape[1:dim], rows[k], *x.shape[dim + 1:])

    mine = [slab(share[r], k) for k in range(n)]   # from each rank: its rows of this rank's share
    got = all_to_all(x.reshape(-1), [slab(share[j], r) for j in range(n)], mine, group)   # engine/31
    whole = torch.cat([p.view(shape(share[r], k)) for k, p in enumerate(got.split(mine))], dim)

    def back(out: Tensor) -> Tensor:
        flat = torch.cat([p.reshape(-1) for p in out.split(rows, dim)])
        return all_to_all(flat, mine, [slab(share[j], r) for j in range(n)], group).view(x.shape)

    return whole, back


def _whole_matrices(t: Tensor):
    """(a local tensor of whole matrices of `t`, how to give back this rank's part of a result of that shape). A
    stack of matrices (`t.dim() > 2`) keeps its split along the leading dims; one of its rows or columns is
    regrouped by experts (`_regroup`). A single matrix is gathered whole."""
    if not isinstance(t, DTensor):
        return t, lambda full: full
    mesh, lead = t.device_mesh, t.dim() - 2
    split = [i for i, pl in enumerate(t.placements) if isinstance(pl, Shard) and pl.dim >= lead]
    if lead and len(split) == 1:
        dim = t.placements[split[0]].dim
        return _regroup(t.to_local(), dim, t.shape[dim], mesh.get_group(split[0]))
    keep = [pl if not isinstance(pl, Shard) or pl.dim < lead else Replicate() for pl in t.placements]
    full = t.redistribute(mesh, keep).to_local()
    return full, lambda out: DTensor.from_local(out, mesh, keep, run_check=False).redistribute(
        mesh, t.placements).to_local()


class Muon(AdamW):
    """Muon for the groups marked `muon=True` (matrices: momentum, Nesterov, Newton–Schulz, update scaled by
    0.2·√max(out, in)), AdamW (ops/19) for the others; decoupled weight decay for both. State per parameter:
    `momentum_buffer`, or AdamW's `step`, `exp_avg`, `exp_avg_sq`."""

    def __init__(self, groups, lr: float, momentum: float = 0.95, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, ns_steps: int = 5, parts: dict | None = None):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                         ns_steps=ns_steps, muon=False)
        self.parts = parts or {}   # parameter -> how it fuses two matrices (`_split`)

    def update(self, p, g: dict, grad_scale: Tensor | None) -> None:
        if not g["muon"]:
            return super().update(p, g, grad_scale)
        buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        update = torch.empty_like(p.grad)   # Nesterov's, of the gradient times the clipping factor (ops/19)
        muon_momentum(local(buf), local(p.grad), local(update), momentum=g["momentum"], grad_scale=grad_scale)
        full, mine = _whole_matrices(update)
        mats, fuse = _split(full, self.parts[p]) if p in self.parts else (full, lambda out: out)
        out = mine(fuse(orthogonalize(mats, g["ns_steps"]))).contiguous()
        decay_add(local(p), out, decay=1 - g["lr"] * g["weight_decay"],
                  alpha=-g["lr"] * 0.2 * max(mats.shape[-2:]) ** 0.5)


def muon_param(name: str, p: Tensor) -> bool:
    """Whether Muon updates parameter `name`: matrices inside the decoder layers except the router (`mlp.gate` in
    Qwen3-MoE, DeepSeek-V2 and Qwen3.5-MoE, `mlp.router` in GPT-OSS) and Qwen3.5-MoE's shared-expert gate (one row
    of per-token scores) and depthwise convolution (one short kernel per channel, not a matrix); not the embedding,
    the head, norms or biases."""
    return p.dim() >= 2 and ".layers." in f".{name}" and not name.endswith(
        ("mlp.gate.weight", "mlp.router.weight", "mlp.shared_expert_gate.weight", "linear_attn.conv1d.weight",
         "bias"))   # GPT-OSS's experts stack their biases, (E, out): rows of biases, not a matrix


def optimizer_states(kind: str):
    """States per parameter element that optimizer `kind` keeps, as a function `states(name, param)` (what the
    planner counts, engine/37): AdamW's two moments; Muon's momentum for the matrices it updates, AdamW's two for the
    rest."""
    if kind == "muon":
        return lambda name, p: 1 if muon_param(name, p) else 2
    return lambda name, p: 2

# %% [markdown]
# Check: Newton–Schulz against the SVD. For random matrices of several shapes (wide, tall, square, a stack of
# experts) the iteration's result has the same singular vectors as `U Vᵀ` (its projection on them is diagonal) and
# singular values within [0.6, 1.25]: an approximation of the orthogonal factor, not the factor itself.

# %%
g = torch.Generator().manual_seed(0)
for shape in [(16, 48), (48, 16), (32, 32), (3, 24, 40)]:
    m = torch.randn(*shape, generator=g, dtype=torch.float64)
    o = orthogonalize(m)
    u, sv, vh = torch.linalg.svd(m, full_matrices=False)
    proj = u.mT @ o @ vh.mT                                      # diagonal when the singular vectors agree
    off = (proj - torch.diag_embed(torch.diagonal(proj, dim1=-2, dim2=-1))).abs().max().item()
    s_o = torch.linalg.svdvals(o)
    assert off < 1e-8 and 0.6 < s_o.min() and s_o.max() < 1.25, (shape, off, s_o.min(), s_o.max())
    print(shape, f"singular values of the result in [{s_o.min():.3f}, {s_o.max():.3f}], off-diagonal {off:.1e}")

# %% [markdown]
# Check: the iteration as written above, `X = M/‖M‖` divided out and `a X + (b A + c A²) X` on the transpose of a tall
# matrix, in float64, gives `orthogonalize`'s result (its `1/‖M‖` folded into the first step's `A` and `B`, the tall
# case from the right, `a I` inside `B`) to float64's rounding; a zero matrix stays zero.

# %%
def textbook_orthogonalize(m, steps=5):
    x = m.mT if m.shape[-2] > m.shape[-1] else m
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)         # the same guard against a zero matrix
    a, b, c = NS_COEFFS
    for _ in range(steps):
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    return x.mT if m.shape[-2] > m.shape[-1] else x

for shape in [(16, 48), (48, 16), (3, 24, 40), (2, 2, 40, 24)]:
    m = 5 * torch.randn(*shape, generator=g, dtype=torch.float64)
    want = textbook_orthogonalize(m)
    err = ((orthogonalize(m) - want).norm() / want.norm()).item()
    assert err < 1e-12, (shape, err)
assert orthogonalize(torch.zeros(2, 8, 12, dtype=torch.float64)).abs().max() == 0
try:
    orthogonalize(torch.ones(4, 6), steps=0)
    raise AssertionError("expected a ValueError")
except ValueError as err:
    print(err)

# %% [markdown]
# Check: one Muon step on a toy model against the update written out by hand (momentum, Nesterov, the iteration,
# the scale, decoupled decay) for the matrix, and against `torch.optim.AdamW` for the rest.

# %%
toy = nn.ModuleDict(dict(layers=nn.ModuleDict({"0": nn.Linear(6, 10)}), norm=nn.LayerNorm(10)))
ref = copy.deepcopy(toy)
opt = build_optimizer(toy, lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, kind="muon")
ref_adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if not muon_param(n, p)], lr=0.02,
                              betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)   # all 1-D here: no decay
w, buf = ref.layers["0"].weight, torch.zeros(10, 6)
for step in range(3):
    x = torch.randn(5, 6, generator=g)
    for m in (toy, ref):
        m.zero_grad()
        m.norm(m.layers["0"](x)).pow(2).sum().backward()
    opt.step()
    with torch.no_grad():
        buf = 0.95 * buf + w.grad
        nesterov = w.grad + 0.95 * buf
        w.mul_(1 - 0.02 * 0.1).sub_(0.02 * 0.2 * 10 ** 0.5 * orthogonalize(nesterov))
    ref_adamw.step()
worst = max((a - b).abs().max().item() for a, b in zip(toy.parameters(), ref.parameters()))
assert worst < 1e-6, worst
print("Muon groups:", [(len(g["params"]), g["muon"]) for g in opt.param_groups], f"worst difference {worst:.1e}")

# %% [markdown]
# Check: a module's fused pair is orthogonalised as its two matrices. For both layouts (halves along the rows,
# interleaved columns), one step with momentum 0 and lr 1 moves the pair by the iteration of each matrix taken
# apart, scaled by its own shape.

# %%
class Pair(nn.Module):
    def __init__(self, shape, spec):
        super().__init__()
        self.w, self.MUON_PARTS = nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64)), {"w": spec}


for shape, spec, halves in [((3, 10, 7), (-2, False), lambda t: t.chunk(2, -2)),
                            ((3, 7, 10), (-1, True), lambda t: (t[..., 0::2], t[..., 1::2]))]:
    toy = nn.ModuleDict(dict(layers=nn.ModuleDict({"0": Pair(shape, spec)})))
    w0 = toy.layers["0"].w.detach().clone()
    toy.layers["0"].w.grad = torch.randn(shape, generator=g, dtype=torch.float64)
    opt = build_optimizer(toy, lr=1.0, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, kind="muon", momentum=0.0)
    opt.step()
    for moved, grad in zip(halves(w0 - toy.layers["0"].w.detach()), halves(toy.layers["0"].w.grad)):
        want = 0.2 * max(grad.shape[-2:]) ** 0.5 * orthogonalize(grad)
        assert (moved - want).abs().max() < 1e-12, (spec, (moved - want).abs().max())
print("fused pairs: each matrix orthogonalised apart, both layouts")

# %% [markdown]
# Check: in every family Muon chooses matrices only: no norm gain, no bias (GPT-OSS stacks its experts' biases into
# 2-D tensors), no router; and the routed experts' weights.

# %%
from pith_lit.models.family import MODEL_TYPES, family

for t in MODEL_TYPES:
    names = [n for n, p in family(t).Model(family(t).tiny_config(layers=2)).named_parameters() if muon_param(n, p)]
    assert not [n for n in names if "bias" in n or "norm" in n or n.endswith(("gate.weight", "router.weight"))], names
    assert sum(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names) >= 2, (t, names)
    print(t, len(names), "matrices")

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
# to be a *sum*, not a mean. The check sums token losses in fp32 with `token_loss_sum` (in `tests/references.py`,
# shared with the tests).

# %%
#| export
def count_tokens(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    "Number of labels that are not `ignore_index` (an int64 tensor, ready to sum and all-reduce)."
    return (labels != ignore_index).sum()

# %% [markdown]
# Check: a tiny language model (embedding, then a linear head) and 4 sequences whose labels have 0, 3, 6 and 9
# of their 12 positions ignored. Four micro-batches of one sequence, each divided by the global count,
# accumulate to the same gradients and loss as one micro-batch of all four; the per-micro-batch mean does not.

# %%
from tests.references import token_loss_sum

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
