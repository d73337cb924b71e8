# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # AdamW in one pass over memory, the clipping folded in
#
# The optimizer step touches every parameter and does almost no arithmetic per element, so its time is the bytes
# it moves divided by the memory bandwidth. For each element AdamW reads the gradient `g`, the parameter `p` and
# the two moments `m`, `v`, and writes `p`, `m`, `v`: with bf16 parameters, gradients and states, 8 bytes read
# and 6 written. Clipping the gradients to a global norm costs one more read of `g` for the norm, and if the
# clipped gradients are written back before the update (`g ← c·g`, then AdamW), a read and a write more:
#
# | per element, bf16 | norm | `g ← c·g` | update | total |
# | --- | --- | --- | --- | --- |
# | clip in place, then AdamW | 2 B | 4 B | 14 B | 20 B |
# | clip folded into the update | 2 B | — | 14 B | 16 B |
#
# The norm has to be known before any element is updated, so its read stays; the multiplication by
# `c = min(1, max_norm / (‖g‖ + 1e-6))` moves into the update, which reads `c` from device memory (no host
# synchronisation). `adamw_update` is that update: one Triton pass per parameter on CUDA, every element computed
# in fp32 from the stored dtypes and rounded once on the store; elsewhere the same formula in PyTorch (the CPU's
# path and the checks' reference). train/43_optim builds the optimizer on it and engine/36 computes the norm and
# `c`; RESULTS.md ("The optimizer step") has the measured bandwidth.

# %%
#| default_exp ops.adamw

# %%
#| export
import math

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor

from pith_lit.ops.swiglu import choose_impl

# %% [markdown]
# The checks run on the GPU when there is one, otherwise on the CPU under the Triton interpreter.

# %%
import copy
import os

# %%
if not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "on a CPU, run this notebook with TRITON_INTERPRET=1 set"
dev = "cuda" if torch.cuda.is_available() else "cpu"

# %% [markdown]
# ## The formula, in PyTorch
#
# AdamW with decoupled weight decay and bias correction at step `t` (counted from 1), on a gradient scaled by `c`:
#
# `p ← p·(1 − lr·wd)`, `m ← m + (1 − β₁)(c·g − m)`, `v ← β₂·v + (1 − β₂)(c·g)²`,
# `p ← p − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)`.
#
# `adamw_torch` computes it in fp32 (float64 for float64 tensors) whatever the stored dtypes and writes each tensor
# back once.

# %%
#| export
def adamw_torch(p, g, m, v, *, step: int, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                grad_scale: torch.Tensor | None = None) -> None:
    "One AdamW update of `p` and its moments `m`, `v` in place, from gradient `g` times `grad_scale` (fp32 math)."
    b1, b2 = betas
    wide = torch.promote_types(p.dtype, torch.float32)
    gf = g.to(wide) if grad_scale is None else g.to(wide) * grad_scale
    pf, mf, vf = p.to(wide), m.to(wide), v.to(wide)   # the tensors themselves when they are that wide already
    pf.mul_(1 - lr * weight_decay)
    mf.lerp_(gf, 1 - b1)
    vf.mul_(b2).addcmul_(gf, gf, value=1 - b2)
    denom = (vf.sqrt() / math.sqrt(1 - b2 ** step)).add_(eps)
    pf.addcdiv_(mf, denom, value=-lr / (1 - b1 ** step))
    for dst, src in ((p, pf), (m, mf), (v, vf)):
        dst.copy_(src)   # nothing to do where they are the same tensor

# %% [markdown]
# Against `torch.optim.AdamW` (its single-tensor form, an independent implementation), in fp32, over three steps of
# clipped gradients; `c` is applied to the reference's gradients beforehand, as clipping in place does.

# %%
def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def torch_reference(shape, steps, c, dtype=torch.float32, lr=1e-2, wd=0.1, betas=(0.9, 0.95), eps=1e-8):
    "(p, m, v) after `steps` updates of torch's AdamW on gradients times `c`, and the gradients it saw."
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(shape, generator=gen).to(dev, dtype).requires_grad_()
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, betas=betas, eps=eps, foreach=False)
    start, grads = p.detach().clone(), []
    for _ in range(steps):
        g = torch.randn(shape, generator=gen).to(dev, dtype)
        grads.append(g)
        p.grad = g * c
        opt.step()
    st = opt.state[p]
    return start, grads, (p.detach(), st["exp_avg"], st["exp_avg_sq"])


start, grads, want = torch_reference((37, 53), 3, 0.25)
p, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
c = torch.tensor(0.25, device=dev)
for t, g in enumerate(grads, 1):
    adamw_torch(p, g, m, v, step=t, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, grad_scale=c)
errs = [rel(a, b) for a, b in zip((p, m, v), want)]
print("adamw_torch against torch.optim.AdamW, fp32:", [f"{e:.1e}" for e in errs])
assert max(errs) < 1e-6, errs

# %% [markdown]
# ## The kernel
#
# One program updates `BLOCK` consecutive elements of one parameter: it loads `g`, `p`, `m`, `v` in their stored
# dtypes, computes in fp32 (square root and divisions rounded to nearest, as PyTorch's), and stores `p`, `m`, `v`.
# The step's scalars come from the host, computed there in double precision: the bias corrections `1 − β₂ᵗ` are
# differences of numbers close to 1, which fp32 would get wrong in the fourth digit for β₂ = 0.999 at `t = 1`.
# The optimizer keeps `t` on the host (a CPU tensor, as PyTorch's own AdamW does), so nothing synchronises.
#
# A launch per parameter keeps the indexing trivial: the largest tensors (a layer's stacked experts, 10⁸–10⁹
# elements) fill the GPU many times over, and the small ones (norm gains, biases) are a few hundred of the step's
# ~10¹⁰ elements.

# %%
#| export
@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, n, decay, one_minus_b1, b2, one_minus_b2, neg_step_size,
                  bc2_sqrt, eps, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    p = p * decay
    m = m + one_minus_b1 * (g - m)
    v = v * b2 + one_minus_b2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + neg_step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def _one_shape(name: str, *ts) -> None:
    if any(t.shape != ts[0].shape for t in ts):
        raise ValueError(f"{name}: shapes differ: {[tuple(t.shape) for t in ts]}")


def _contiguous(name: str, *ts) -> None:
    if not all(t.is_contiguous() for t in ts):
        raise ValueError(f"{name}: the Triton kernel needs contiguous tensors")


ADAMW_BLOCK, ADAMW_WARPS = 2048, 8   # the best of 1024-8192 × 4-16 warps on the H200 (RESULTS.md)


def adamw_update(p, g, m, v, *, step: int, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                 grad_scale: torch.Tensor | None = None, impl: str | None = None) -> None:
    """One AdamW update in place of parameter `p` (step `step`, from 1) and its moments `m`, `v`, from gradient `g`
    times `grad_scale` (a 0-d tensor on `p`'s device, or None): the Triton kernel on CUDA, `adamw_torch` elsewhere
    and for float64 parameters (`impl`: "triton" or "torch" to choose). Plain local tensors of one shape, contiguous
    for the kernel."""
    _one_shape("adamw_update", p, g, m, v)
    args = dict(step=step, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, grad_scale=grad_scale)
    if choose_impl(impl or ("torch" if p.dtype == torch.float64 else None), p) == "torch":
        return adamw_torch(p, g, m, v, **args)
    _contiguous("adamw_update", p, g, m, v)
    b1, b2 = betas
    if p.numel():
        _adamw_kernel[(triton.cdiv(p.numel(), ADAMW_BLOCK),)](
            p, g, m, v, grad_scale.float() if grad_scale is not None else p, p.numel(), 1 - lr * weight_decay, 1 - b1, b2,
            1 - b2, -lr / (1 - b1 ** step), math.sqrt(1 - b2 ** step), eps, HAS_SCALE=grad_scale is not None,
            BLOCK=ADAMW_BLOCK, num_warps=ADAMW_WARPS)

# %% [markdown]
# The kernel against `torch.optim.AdamW` in fp32, over three steps, with and without `c`, on a size that is not a
# multiple of the block; with β₂ = 0.999 at the first steps, where the bias correction is most delicate.

# %%
for shape, c, betas in (((3, 5001), 0.25, (0.9, 0.95)), ((4099,), 1.0, (0.9, 0.999))):
    start, grads, want = torch_reference(shape, 3, c, betas=betas)
    p, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    scale = torch.tensor(c, device=dev) if c != 1.0 else None
    for t, g in enumerate(grads, 1):
        adamw_update(p, g, m, v, step=t, lr=1e-2, weight_decay=0.1, betas=betas, eps=1e-8, grad_scale=scale,
                     impl="triton")
    errs = [rel(a, b) for a, b in zip((p, m, v), want)]
    print(f"kernel against torch.optim.AdamW, fp32 {shape}, c={c}, β₂={betas[1]}:", [f"{e:.1e}" for e in errs])
    assert max(errs) < 1e-6, errs

# %% [markdown]
# With bf16 parameters and states both paths round the same fp32 values once, so they differ by at most one bf16
# step. On the GPU both round to nearest and differ only where the fp32 results straddle a rounding boundary (the
# last cell); the Triton interpreter truncates on the store, so on the CPU about half the elements are one step
# apart.

# %%
gen = torch.Generator().manual_seed(1)
bf = [torch.randn(6007, generator=gen).to(dev, torch.bfloat16) for _ in range(4)]
bf[3] = bf[3].abs()   # v ≥ 0
out = {}
for impl in ("triton", "torch"):
    p, g, m, v = (t.clone() for t in bf)
    adamw_update(p, g, m, v, step=5, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                 grad_scale=torch.tensor(0.5, device=dev), impl=impl)
    out[impl] = (p, m, v)
for a, b in zip(out["triton"], out["torch"]):
    ulp = (a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30)
    assert ulp.max() <= 2 ** -7, ulp.max()
print("bf16: kernel and adamw_torch differ on",
      [f"{(a != b).float().mean().item():.2%}" for a, b in zip(out["triton"], out["torch"])], "of elements, by ≤ 1 step")

# %% [markdown]
# An empty parameter is left alone, and shapes that differ are refused by name.

# %%
e = torch.empty(0, device=dev)
adamw_update(e, e, e, e, step=1, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, impl="triton")
try:
    adamw_update(e, torch.empty(1, device=dev), e, e, step=1, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    raise AssertionError("expected a ValueError")
except ValueError as err:
    print(err)

# %% [markdown]
# ## The norm's pass
#
# The clipping norm reads every gradient once. PyTorch's `_foreach_norm` gives one norm per tensor in the tensors'
# dtype (a bf16 norm of a bf16 gradient) and reads bf16 at about half the bandwidth (RESULTS.md). `sum_squares` on
# CUDA is one Triton pass per tensor: each program squares and sums `SQ_BLOCK` elements in fp32 and writes its
# partial sum, and the partial sums are added in float64. Elsewhere it is the per-tensor norms, squared and summed in
# fp32 or wider (float64 for the float64 checks of engine/39).

# %%
#| export
@triton.jit
def _sum_squares_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x * x, 0))


SQ_BLOCK = 4096


def sum_squares(tensors: list[torch.Tensor], impl: str | None = None) -> torch.Tensor:
    """Σ x² over every element of `tensors` (plain tensors on one device, at least one), a 0-d tensor in fp32 or
    wider: the Triton pass on CUDA (contiguous tensors, float64 excepted), torch's norms elsewhere."""
    first = tensors[0]
    if choose_impl(impl or ("torch" if first.dtype == torch.float64 else None), first) == "torch":
        wide = torch.promote_types(first.dtype, torch.float32)
        return torch.stack(torch._foreach_norm(tensors)).to(wide).pow(2).sum()
    _contiguous("sum_squares", *tensors)
    blocks = [triton.cdiv(t.numel(), SQ_BLOCK) for t in tensors]
    partial = torch.empty(sum(blocks), device=first.device, dtype=torch.float32)
    start = 0
    for t, nb in zip(tensors, blocks):
        if nb:
            _sum_squares_kernel[(nb,)](t, partial[start:], t.numel(), BLOCK=SQ_BLOCK, num_warps=8)
        start += nb
    return partial.sum(dtype=torch.float64).float()

# %% [markdown]
# Against float64 by hand, over tensors of several sizes (one empty, one not a multiple of the block), in fp32 and bf16.

# %%
gen = torch.Generator().manual_seed(2)
for dtype in (torch.float32, torch.bfloat16):
    ts = [torch.randn(s, generator=gen).to(dev, dtype) for s in ((3, 5000), (0,), (4096,), (7,))]
    want = sum((t.double() ** 2).sum() for t in ts).item()
    got = {impl: sum_squares(ts, impl=impl) for impl in ("triton", "torch")}
    print(dtype, {k: f"{v.item() / want - 1:+.1e}" for k, v in got.items()}, "relative to float64")
    assert abs(got["triton"].item() / want - 1) < 1e-6 and got["triton"].dtype == torch.float32

# %% [markdown]
# ## Muon's passes
#
# Besides its Newton–Schulz iteration, train/43's Muon does two element-wise things to each matrix it updates. Before
# the iteration it keeps a momentum `b ← μ·b + c·g` of the gradient scaled by the clipping factor `c`, and hands the
# iteration its Nesterov form `u = c·g + μ·b`; after it, it applies the iteration's result `o` with the decoupled
# decay, `p ← (1 − lr·wd)·p − α·o` (`α` the learning rate times the update's scale). As PyTorch operations on bf16
# tensors that is seven passes: `g ← c·g`, `b ← μ·b`, `b ← b + g`, `u = g + μ·b`, `o ← α·o`, `p ← (1 − lr·wd)·p`,
# `p ← p − o`, 34 bytes per element. `muon_momentum` and `decay_add` are one pass each: the first reads `g`, `b` and
# writes `b`, `u` (8 bytes), the second reads `p`, `o` and writes `p` (6 bytes). Both compute in fp32 from the stored
# dtypes and round once on each store; the PyTorch forms are the CPU's path and the checks' reference.

# %%
#| export
@triton.jit
def _muon_momentum_kernel(b_ptr, g_ptr, u_ptr, scale_ptr, n, mu, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32) * mu + g
    tl.store(b_ptr + offs, b.to(b_ptr.dtype.element_ty), mask=mask)
    tl.store(u_ptr + offs, (g + mu * b).to(u_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decay_add_kernel(p_ptr, o_ptr, n, decay, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32) * decay
    p = p + alpha * tl.load(o_ptr + offs, mask=mask).to(tl.float32)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


def muon_momentum(b, g, u, *, momentum: float, grad_scale: torch.Tensor | None = None, impl: str | None = None):
    """Muon's momentum in place: `b ← μ·b + c·g`, and its Nesterov form `u ← c·g + μ·b` written into `u` (`c` =
    `grad_scale`, a 0-d tensor, or 1 when None), fp32 math rounded once per store: one Triton pass on CUDA, PyTorch
    elsewhere and for float64. Plain local tensors of one shape."""
    _one_shape("muon_momentum", b, g, u)
    if choose_impl(impl or ("torch" if b.dtype == torch.float64 else None), b) == "torch":
        wide = torch.promote_types(b.dtype, torch.float32)
        gf = g.to(wide) if grad_scale is None else g.to(wide) * grad_scale
        bf = b.to(wide) * momentum + gf
        u.copy_(gf + momentum * bf)
        b.copy_(bf)
        return
    _contiguous("muon_momentum", b, g, u)
    if b.numel():
        _muon_momentum_kernel[(triton.cdiv(b.numel(), ADAMW_BLOCK),)](
            b, g, u, grad_scale.float() if grad_scale is not None else b, b.numel(), momentum,
            HAS_SCALE=grad_scale is not None, BLOCK=ADAMW_BLOCK, num_warps=ADAMW_WARPS)


def decay_add(p, o, *, decay: float, alpha: float, impl: str | None = None) -> None:
    """`p ← decay·p + alpha·o` in place, fp32 math rounded once: one Triton pass on CUDA, PyTorch elsewhere and for
    float64. Plain local tensors of one shape."""
    _one_shape("decay_add", p, o)
    if choose_impl(impl or ("torch" if p.dtype == torch.float64 else None), p) == "torch":
        wide = torch.promote_types(p.dtype, torch.float32)
        p.copy_(p.to(wide) * decay + alpha * o.to(wide))
        return
    _contiguous("decay_add", p, o)
    if p.numel():
        _decay_add_kernel[(triton.cdiv(p.numel(), ADAMW_BLOCK),)](p, o, p.numel(), decay, alpha, BLOCK=ADAMW_BLOCK,
                                                                  num_warps=ADAMW_WARPS)

# %% [markdown]
# Check: both against the formulas in float64, in fp32 (to 1e-6 relative) and bf16 (within one rounding of the
# float64 result), each with 1e-6 absolute for fp32's own rounding where terms cancel; with and without `c`, on a
# size that is not a multiple of the block; then a non-contiguous tensor is refused by name.

# %%
gen = torch.Generator().manual_seed(3)
for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
    for c in (0.25, None):
        b, g, o, p = (torch.randn(3, 2051, generator=gen).to(dev, dtype) for _ in range(4))
        scale = torch.tensor(c, device=dev) if c is not None else None
        cg = g.double() * (c if c is not None else 1.0)
        want_b = 0.95 * b.double() + cg
        want = dict(b=want_b, u=cg + 0.95 * want_b, p=p.double() * 0.998 - 0.3 * o.double())
        for impl in ("triton", "torch"):
            bb, pp, u = b.clone(), p.clone(), torch.empty_like(b)
            muon_momentum(bb, g, u, momentum=0.95, grad_scale=scale, impl=impl)
            decay_add(pp, o, decay=0.998, alpha=-0.3, impl=impl)
            got = dict(b=bb, u=u, p=pp)
            errs = {k: ((got[k].double() - w).abs() - bound * w.abs()).max().item() for k, w in want.items()}
            assert max(errs.values()) <= 1e-6, (dtype, c, impl, errs)   # fp32's own rounding where terms cancel
    print(dtype, f"muon_momentum and decay_add, both paths, against float64: within {bound:.1e} relative")
try:
    decay_add(torch.zeros(4, 6, device=dev).mT, torch.zeros(6, 4, device=dev), decay=1.0, alpha=1.0, impl="triton")
    raise AssertionError("expected a ValueError")
except ValueError as err:
    print(err)

# %% [markdown]
# Newton–Schulz (train/43) builds, at each of its steps, the small matrix `B = a I + b A + c A²` from `A = X Xᵀ` and
# the plain product `A²`, and at its first step scales `A` and `B` by powers of `1/‖M‖`, one number per matrix of a
# stack. `ns_poly` is that combination, `f·(a I + b A + c A²)` with `f` per matrix, as one pass over the `n × n`
# matrices, written in place over `A²` (or over `A` when there is no `A²`).

# %%
#| export
NS_BLOCK = 2048   # elements of one matrix per program


@triton.jit
def _ns_poly_kernel(a_ptr, a2_ptr, out_ptr, f_ptr, nn, n, alpha, beta, gamma, HAS_A2: tl.constexpr,
                    HAS_F: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < nn
    y = beta * tl.load(a_ptr + m * nn + offs, mask=mask).to(tl.float32)
    if HAS_A2:
        y += gamma * tl.load(a2_ptr + m * nn + offs, mask=mask).to(tl.float32)
    y += tl.where(offs // n == offs % n, alpha, 0.0)
    if HAS_F:
        y *= tl.load(f_ptr + m)
    tl.store(out_ptr + m * nn + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def ns_poly(A: torch.Tensor, A2: torch.Tensor | None, *, a: float, b: float, c: float,
            scale: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """`f·(a·I + b·A + c·A2)` for a stack of square matrices `A (N, n, n)` (and `A2`, or none), `f = scale (N,)` per
    matrix or 1, fp32 math rounded once, written over `A2` (else over `A`) and returned. One Triton pass on CUDA,
    PyTorch elsewhere and for float64."""
    if A.dim() != 3 or A.shape[1] != A.shape[2] or (scale is not None and scale.shape != A.shape[:1]):
        raise ValueError(f"ns_poly wants a stack of square matrices (N, n, n) and a scale (N,), got "
                         f"{tuple(A.shape)} and {None if scale is None else tuple(scale.shape)}")
    out = A2 if A2 is not None else A
    _one_shape("ns_poly", A, out)
    if choose_impl(impl or ("torch" if A.dtype == torch.float64 else None), A) == "torch":
        wide = torch.promote_types(A.dtype, torch.float32)
        y = b * A.to(wide) + (c * A2.to(wide) if A2 is not None else 0)
        y = y + a * torch.eye(A.shape[1], dtype=wide, device=A.device)
        return out.copy_(y if scale is None else y * scale.to(wide)[:, None, None])
    _contiguous("ns_poly", A, out)
    N, n = A.shape[:2]
    if N and n:
        _ns_poly_kernel[(triton.cdiv(n * n, NS_BLOCK), N)](
            A, A2 if A2 is not None else A, out, scale.float().contiguous() if scale is not None else A, n * n, n,
            a, b, c, HAS_A2=A2 is not None, HAS_F=scale is not None, BLOCK=NS_BLOCK, num_warps=ADAMW_WARPS)
    return out

# %% [markdown]
# Check: `ns_poly` against the formula in float64, in fp32 and bf16 (within one rounding), with and without `A2` and
# `f`, written over `A2` or `A`; matrices whose `n²` is not a multiple of the block; a non-square stack is refused.

# %%
for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
    A, A2 = (torch.randn(3, 47, 47, generator=gen).to(dev, dtype) for _ in range(2))
    f = torch.rand(3, generator=gen).to(dev) + 0.5
    for has_a2, has_f in ((True, True), (True, False), (False, True), (False, False)):
        eye = torch.eye(47, dtype=torch.float64, device=dev)
        want = 0.7 * A.double() + (-1.3 * A2.double() if has_a2 else 0) + 2.5 * eye
        want = want * f.double()[:, None, None] if has_f else want
        for impl in ("triton", "torch"):
            a_, a2_ = A.clone(), A2.clone()
            got = ns_poly(a_, a2_ if has_a2 else None, a=2.5, b=0.7, c=-1.3, scale=f if has_f else None, impl=impl)
            assert got is (a2_ if has_a2 else a_)
            err = ((got.double() - want).abs() - bound * want.abs()).max().item()
            assert err <= 1e-6, (dtype, has_a2, has_f, impl, err)
    print(dtype, f"ns_poly, both paths, against float64: within {bound:.1e} relative")
try:
    ns_poly(torch.zeros(2, 4, 6, device=dev), None, a=1.0, b=1.0, c=0.0)
    raise AssertionError("expected a ValueError")
except ValueError as err:
    print(err)

# %% [markdown]
# ## The optimizer
#
# `AdamW` is a `torch.optim.Optimizer` whose step runs `adamw_update` on every parameter that has a gradient, with
# the group's learning rate, decay, betas and ε. Its `step(grad_scale=c)` is how clipping reaches the update. The
# state per parameter is `torch.optim.AdamW`'s, under the same names (`step`, `exp_avg`, `exp_avg_sq`), so a
# checkpoint of one loads into the other; `step` stays a CPU tensor, as in PyTorch's own non-fused AdamW, so that
# the bias corrections need no synchronisation. The parameters may be FSDP2's DTensors (engine/36): each rank
# updates its own shard, elementwise, which needs no communication. train/43's `Muon` is this class with the
# matrices' update replaced.

# %%
#| export
def local(t: torch.Tensor) -> torch.Tensor:
    "The tensor this rank holds: a DTensor's local shard (a view that writes through), else `t` itself."
    return t.to_local() if isinstance(t, DTensor) else t


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay: one `adamw_update` per parameter with a gradient. `step(grad_scale=c)`
    multiplies every gradient by the 0-d tensor `c` inside the update (clipping: engine/36 `clip_factor`). State as
    `torch.optim.AdamW`'s: `step` (a CPU tensor), `exp_avg`, `exp_avg_sq`. Defaults as `torch.optim.AdamW`'s."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **defaults):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **defaults))

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None):
        loss = None
        if closure is not None:   # torch's optimizer protocol (DCP calls step to create empty states)
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, group, grad_scale)
        return loss

    def update(self, p, group: dict, grad_scale: torch.Tensor | None) -> None:
        "Step parameter `p` of `group`, its gradient times `grad_scale`."
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                         exp_avg_sq=torch.zeros_like(p))
        state["step"] = state["step"].cpu() + 1   # PyTorch's fused AdamW saves it on the GPU
        adamw_update(local(p), local(p.grad), local(state["exp_avg"]), local(state["exp_avg_sq"]),
                     step=int(state["step"]), lr=float(group["lr"]), weight_decay=group["weight_decay"],
                     betas=group["betas"], eps=group["eps"], grad_scale=grad_scale)

# %% [markdown]
# Check: a model with two groups (decayed matrices, undecayed vectors) against `torch.optim.AdamW` over four steps,
# the reference's gradients clipped in place by `clip_grad_norm_` and ours scaled inside the update by the same
# factor; in the middle, the reference's state is loaded into a fresh `AdamW` (and the learning rate changed), which
# carries on the same.

# %%
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)).to(dev)
twin = copy.deepcopy(net)
groups = lambda m: [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
ref_opt = torch.optim.AdamW(groups(twin), lr=3e-3, betas=(0.9, 0.95), foreach=False)
opt = AdamW(groups(net), lr=3e-3, betas=(0.9, 0.95))
for step in range(4):
    if step == 2:
        opt = AdamW(groups(net), lr=3e-3, betas=(0.9, 0.95))
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))   # a copy: the state tensors are not shared
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = 1e-3
    x = torch.randn(64, 16, device=dev)
    for m in (net, twin):
        m.zero_grad()
        m(x).pow(2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    ref_opt.step()
    opt.step(grad_scale=(0.05 / (norm + 1e-6)).clamp(max=1.0))
errs = [rel(a, b) for a, b in zip(net.parameters(), twin.parameters())]
print(f"AdamW against torch.optim.AdamW with clipping, 4 steps: worst {max(errs):.1e}")
assert max(errs) < 1e-6 and norm > 0.05, (errs, norm)   # the clipping acted
assert sorted(opt.state_dict()["state"][0]) == sorted(ref_opt.state_dict()["state"][0])

# %% [markdown]
# ## On the GPU
#
# At a size of the bench's expert tensors' order, in fp32 against `torch.optim.AdamW` and in bf16 against
# `adamw_torch`.

# %%
#| cuda
start, grads, want = torch_reference((64, 1536, 512), 2, 0.3)
p, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
for t, g in enumerate(grads, 1):
    adamw_update(p, g, m, v, step=t, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                 grad_scale=torch.tensor(0.3, device="cuda"))
errs = [rel(a, b) for a, b in zip((p, m, v), want)]
print("H200, fp32:", [f"{e:.1e}" for e in errs])
assert max(errs) < 1e-6, errs
bf = [t.bfloat16() for t in (start, grads[0], want[1], want[2])]
out = {}
for impl in ("triton", "torch"):
    p, g, m, v = (t.clone() for t in bf)
    adamw_update(p, g, m, v, step=3, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, impl=impl)
    out[impl] = (p, m, v)
diff = [(a != b).float().mean().item() for a, b in zip(out["triton"], out["torch"])]
print("H200, bf16: elements that differ by one rounding:", [f"{d:.2%}" for d in diff])
assert max(diff) < 1e-2, diff
