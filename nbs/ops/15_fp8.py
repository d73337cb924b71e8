# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # FP8 linear layers
#
# The expert projections are most of a MoE layer's FLOPs, and an H200's tensor cores multiply FP8 at twice their
# bf16 rate. This notebook is the FP8 path for them. Values are **E4M3** (`torch.float8_e4m3fn`: 4 exponent bits,
# 3 mantissa bits, largest finite value 448), each group of values with an fp32 scale that is a **power of two**,
# `s = 2^ceil(log2(amax/448))`, so that `x/s` fits in ±448 and dividing by `s` changes no mantissa bit. Two recipes
# choose the groups (`train.fp8_scaling`):
#
# - **one scale per row** over the whole reduction (`"rows"`, the default): the scales factor out of each product's
#   sum, so the GEMMs chain their FP8 products inside `tl.dot` and scale once, at the end;
# - **block scales**, DeepSeek-V3's recipe (`"block"`), the alternative: one scale per **1×128 tile** of an
#   activation (a row piece along the reduction dimension K) and per **128×128 block** of a weight, with the partial
#   sums **promoted** to fp32 every 128 of K, where the scales are applied: `acc += dot(a, b) * (s_a · s_b)`. A
#   block confines an outlier to its 128 values, where a row's scale is set by its largest element over all of K.
#
# The notebook builds the block-scaled pieces first, since the row recipe reuses their parts (the activation inside
# the quantization pass, the grouped GEMMs, which take either recipe's scales). A linear layer needs three
# products, and each quantizes its operands along its own reduction dimension; under block scales:
#
# | product | A (rows × K) | B (cols × K) | K is |
# |---|---|---|---|
# | forward `Y = X Wᵀ` | X, 1×128 tiles | W, 128×128 blocks | in features |
# | input gradient `dX = dY W` | dY, 1×128 tiles | Wᵀ, 128×128 blocks | out features |
# | weight gradient `dW = dYᵀ X` | dYᵀ, tiles of 128 tokens | Xᵀ, tiles of 128 tokens | tokens |
#
# A weight block is square, so Wᵀ's blocks are W's blocks transposed, with the same scales and values. The weight
# gradient reduces over tokens: X and dY are quantized a second time, along the other dimension (the *transposed*
# quantization), in tiles of 128 tokens that start at each expert's first row. The section "One scale per row" says
# what the row recipe changes, and the section on speed what each recipe costs.
#
# What is here: the torch reference (quantize, dequantize, multiply in float64); Triton kernels that quantize
# (activations both ways in one pass, weights in either layout; and by rows); a grouped FP8 GEMM over rows grouped
# by expert and a grouped weight-gradient GEMM over tokens grouped by expert, both without a host sync and both
# taking either recipe's scales; `fp8_grouped_linear`, the
# autograd function for the experts, whose weight gradient can wait in ops/grouped_linear's `WeightGradQueue`;
# `fp8_swiglu_experts`, both projections of a SwiGLU expert with the activation and its gradient computed inside
# the quantization passes, which the models' experts run under `train.fp8` with one copy of each weight per step
# (ops/18_experts). On a CPU the kernels run under the Triton interpreter, which is how the checks run in CI.

# %%
#| default_exp ops.fp8

# %%
#| export
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from pith_lit.ops.grouped_linear import WeightGradQueue, check_grouped, deliver_wgrad
from pith_lit.ops.swiglu import swiglu, swiglu_grad_tiles, swiglu_tile

# %% [markdown]
# The checks below run on the GPU when there is one (compiled kernels), otherwise on the CPU under the Triton
# interpreter, which must be switched on in the environment before Triton is imported. The interpreter multiplies
# FP8 exactly and accumulates in fp32, so a kernel agrees with the float64 reference of the same quantization to
# about 1e-6 there (`EXACT`, 1e-5); the H200's tensor cores accumulate each 128-deep FP8 product with fewer bits
# than fp32, about 1e-4 relative (`EXACT` 1e-3 there).

# %%
import gc
import os
import time
from contextlib import contextmanager

from torch.multiprocessing.reductions import StorageWeakRef

# %%
if torch.cuda.is_available():
    torch.set_default_device("cuda")
else:
    assert os.environ.get("TRITON_INTERPRET") == "1", "on a CPU, run this notebook with TRITON_INTERPRET=1 set"
EXACT = 1e-3 if torch.cuda.is_available() else 1e-5
T0 = time.time()

# %% [markdown]
# ## The reference: scales, quantization, dequantization
#
# For a block with largest magnitude `amax`, the scale is the smallest power of two `s` with `amax / s ≤ 448`. The
# exponent is clamped to [−126, 126], so both `s` and `1/s` are normal fp32 numbers; an all-zero block gets
# `s = 2⁻¹²⁶` and quantizes to zeros. Dequantization is `q · s`. `pow2_scale` here and `_pow2_scale` in the
# kernels take the exponent from amax's bits, never from a `log2`, which on CUDA is not exact at every power of
# two: an amax of exactly `448·2^k` (bf16's coarse grid makes such maxima common) must get `2^k` on both sides,
# because some scales are computed here for values a kernel quantized (the row recipe's weight gradient).
#
# `quantize_ref` quantizes the last two dimensions of a tensor in blocks of any shape: `(1, 128)` for activation
# tiles, `(128, 128)` for weight blocks, `(128, 1)` for the token tiles of the weight gradient. Edge blocks are
# partial: padding counts as zero and is cut off again. It clamps to ±448 before the cast (torch 2.11's CUDA cast
# turns values beyond it into NaN), which changes nothing here since `|x/s| ≤ 448` by construction.

# %%
#| export
E4M3_MAX = 448.0            # largest finite torch.float8_e4m3fn
FP8 = torch.float8_e4m3fn


def pow2_scale(amax: Tensor) -> Tensor:
    """fp32 scales `2^ceil(log2(amax/448))`, exponent clamped to [-126, 126] (so an all-zero block gets 2^-126),
    from amax's binary exponent and mantissa: `amax = m·2^e` with `m` in [0.5, 1) and `448 = 0.875·2^9`."""
    m, e = torch.frexp(amax)
    k = torch.where(amax > 0, e - 9 + (m > 0.875).int(), -126).clamp(-126, 126)
    return ((k + 127).int() << 23).view(torch.float32)


def quantize_ref(x: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """E4M3 values (x's shape) and fp32 scales, one per `block` (rows, cols) of the last two dimensions:
    scale shape `(..., ceil(R/rows), ceil(C/cols))`. Plain torch, the definition the kernels are checked against."""
    br, bc = block
    R, C = x.shape[-2:]
    padded = F.pad(x.float(), (0, -C % bc, 0, -R % br))
    blocks = padded.unflatten(-1, (-1, bc)).unflatten(-3, (-1, br))        # (..., R/br, br, C/bc, bc)
    s = pow2_scale(blocks.abs().amax(dim=(-3, -1)))                        # (..., R/br, C/bc)
    q = (blocks / s[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.flatten(-2).flatten(-3, -2)[..., :R, :C], s


def dequantize_ref(q: Tensor, s: Tensor, block: tuple[int, int], dtype=torch.float64) -> Tensor:
    "`q · s` with each scale spread over its block, in `dtype`."
    R, C = q.shape[-2:]
    full = s.to(dtype).repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return q.to(dtype) * full[..., :R, :C]


def fake_quant(x: Tensor, block: tuple[int, int], dtype=torch.float64) -> Tensor:
    "What the FP8 matmuls see of `x`: quantized in `block`s, then dequantized."
    return dequantize_ref(*quantize_ref(x, block), block, dtype)


def fake_quant_rows(x: Tensor, dtype=torch.float64) -> Tensor:
    "What the FP8 matmuls see of `x` quantized one scale per row (over its last dimension)."
    return fake_quant(x, (1, max(x.shape[-1], 1)), dtype)

# %% [markdown]
# Known values first. With a row maximum of 448 the scale is 1 and E4M3 rounding shows directly: 3 mantissa bits,
# ties to even, subnormals in steps of 2⁻⁹ below 2⁻⁶. A row maximum just above 448 doubles the scale; an all-zero
# row gets the smallest scale; a row maximum of 1 gets 2⁻⁸ (1/2⁻⁸ = 256 ≤ 448 < 512).

# %%
def quantized_values(row):
    "Quantize one row (1x128 tiles) and return (q as floats, scales)."
    q, s = quantize_ref(torch.tensor([row], device="cpu"), (1, 128))
    return q.float()[0].tolist(), s[0].tolist()

vals, s = quantized_values([448.0, 31.5, 17.0, 19.0, -400.0, 0.0013, -0.0013, 2.0 ** -10])
assert s == [1.0] and vals == [448.0, 32.0, 16.0, 20.0, -384.0, 2.0 ** -9, -(2.0 ** -9), 0.0], vals
assert quantized_values([449.0, 1.0])[1] == [2.0]
assert quantized_values([0.0] * 5) == ([0.0] * 5, [2.0 ** -126])
assert quantized_values([1.0, -0.5])[1] == [2.0 ** -8]
assert quantized_values([1.0] * 130)[1] == [2.0 ** -8, 2.0 ** -8]          # two tiles, the second partial

# %% [markdown]
# How far is the quantized product from the exact one? A normal E4M3 value is off by at most 2⁻⁴ of itself
# (half a step of 3 mantissa bits), about 2.5% root-mean-square for Gaussian data. Errors of independent
# elements add in quadrature along K, and both operands contribute, so the product of two quantized Gaussian
# matrices is off by about √2 · 2.5% ≈ 3.5–4% in relative Frobenius norm. The checks below assert **under 5%**
# against the unquantized float64 product, and that the kernels match the quantized reference to fp32 rounding.

# %%
def rel_err(a, b):
    "‖a − b‖ / ‖b‖ in float64 (0 when both are zero)."
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

def randn(seed, *shapes):
    "Standard normal tensors of the given shapes from one seeded CPU generator, on the default device."
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(*s, generator=g, device="cpu").to(torch.get_default_device()) for s in shapes]

x, w = randn(0, (200, 384), (160, 384))
err = rel_err(fake_quant(x, (1, 128)) @ fake_quant(w, (128, 128)).T, x.double() @ w.double().T)
print(f"quantized vs exact product: relative error {err:.4f}")
assert 0.01 < err < 0.05, err

# %% [markdown]
# ## Rounding onto E4M3 in Triton
#
# The interpreter's fp32→E4M3 cast is wrong for about 8% of values (ties away from zero, a lost carry that turns
# 31.5 into 16, truncated subnormals). A value already on the E4M3 grid casts correctly, so `_to_e4m3` rounds in fp32
# first: clamp to ±448; for normal values round the fp32 bit pattern to 3 mantissa bits, ties to even (add
# `0x7FFFF` plus the lowest kept bit, clear the 20 dropped bits); below 2⁻⁶ round to a multiple of 2⁻⁹ by adding
# and subtracting 1.5·2¹⁴, where fp32's step is exactly 2⁻⁹. The GPU's saturating cast gives the same values for
# finite input, so the same code runs on both.
#
# `_pow2_scale` computes the scale from fp32 bits instead of `log2` and a division (both approximate on the GPU):
# with `amax = m · 2^e`, `1 ≤ m < 2`, the smallest `s = 2^k` with `amax ≤ 448 · 2^k = 1.75 · 2^(k+8)` is
# `k = e − 8`, plus one when the mantissa exceeds 1.75's (`0x600000`). It returns `s` and `1/s`, both built from
# their exponent bits, so `x · (1/s)` is exact.

# %%
#| export
@triton.jit
def _to_e4m3(x):
    "fp32 → E4M3, round to nearest even, saturating at ±448 (exact under the interpreter too)."
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal).to(tl.float8e4nv)


@triton.jit
def _pow2_scale(amax):
    "(s, 1/s) for s = 2^ceil(log2(amax/448)), exponent clamped to [-126, 126], from the bits of amax >= 0."
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.minimum(tl.maximum(k, -126), 126)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)

# %% [markdown]
# ## Quantizing activations: the tile schedule
#
# Rows arrive grouped by expert, `counts[e]` rows each (ops/permute), and the counts live on the device. A kernel
# that works on 128-row tiles of one expert at a time finds its tile without asking the host: with
# `tile_offs = [0, cumsum(ceil(counts / BM))]` (computed by torch on the device), program `t` belongs to expert
# `e = #{j : tile_offs[j+1] ≤ t}`, one vector compare over the experts, and covers rows
# `row_offs[e] + (t − tile_offs[e])·BM + [0, BM)`, masked to the expert's end. The grid is an upper bound,
# `ceil(M / BM) + E − 1` tiles (each expert wastes at most one partial tile); programs past the last tile return.
#
# `_quant_act_kernel` reads a 128×128 tile once and writes what is asked:
#
# - **rows** (`ROWS`): 1×128 tiles along K, values in x's layout `(M, K)`, scales `(ceil(K/128), M)` in memory,
#   handed out as an `(M, ceil(K/128))` view with strides `(1, M)` (M-major, the layout `F.scaled_mm` wants);
# - **columns** (`COLS`): tiles of 128 tokens per expert, for the weight gradient. These are written transposed,
#   `(K, 128·T)` with tile `t` in columns `[128t, 128t + 128)`, zero past the expert's last row, and scales
#   `(T, K)`. Both operands of the weight-gradient GEMM then read whole, aligned, K-contiguous tiles with no mask.
#   The padding costs at most one tile per expert.
#
# Rows past the last expert (a buffer sized by a bound) belong to no tile and are not quantized. With no counts the
# whole tensor is one group.

# %%
#| export
@triton.jit
def _expert_of_tile(t, tile_offs_ptr, E, E_P2: tl.constexpr):
    "The expert that tile t belongs to (E when t is past the last tile): #{e : tile_offs[e+1] <= t}."
    lanes = tl.arange(0, E_P2)
    ends = tl.load(tile_offs_ptr + 1 + lanes, mask=lanes < E, other=2147483647)
    return tl.sum((ends <= t).to(tl.int32), axis=0)


@triton.jit
def _act_tile(x_ptr, dh_ptr, rows, cols, mask, K, ACT: tl.constexpr):
    "The fp32 tile [rows, cols] of what is quantized: x (ACT 0), swiglu(x) (1) or swiglu's input gradient (2)."
    r64 = rows.to(tl.int64)[:, None]
    if ACT == 0:                                              # x is (M, K)
        return tl.load(x_ptr + r64 * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:                                              # x = [gate | up] is (M, 2K)
        gate = tl.load(x_ptr + r64 * (2 * K) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + r64 * (2 * K) + K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return swiglu_tile(gate, up)
    I = K // 2                                                # x = [gate | up] is (M, K), dh is (M, K/2)
    is_gate = cols < I
    j = tl.where(is_gate, cols, cols - I)[None, :]
    gate = tl.load(x_ptr + r64 * K + j, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + r64 * K + I + j, mask=mask & is_gate[None, :], other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + r64 * I + j, mask=mask, other=0.0).to(tl.float32)
    dgate, dup = swiglu_grad_tiles(gate, up, dh)
    return tl.where(is_gate[None, :], dgate, dup)


@triton.jit
def _quant_act_kernel(x_ptr, dh_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, amax_ptr, rmult_ptr, row_offs_ptr, tile_offs_ptr,
                      M, K, E, LDT, ROWS: tl.constexpr, COLS: tl.constexpr, E_P2: tl.constexpr, ACT: tl.constexpr,
                      GROUP: tl.constexpr, RMULT: tl.constexpr):
    t = tl.program_id(0)
    kb = tl.program_id(1)
    e = _expert_of_tile(t, tile_offs_ptr, E, E_P2)
    if e >= E:
        return
    r = tl.arange(0, 128)
    rows = tl.load(row_offs_ptr + e) + (t - tl.load(tile_offs_ptr + e)) * 128 + r
    row_ok = rows < tl.load(row_offs_ptr + e + 1)
    cols = kb * 128 + r
    col_ok = cols < K
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x = _act_tile(x_ptr, dh_ptr, rows, cols, row_ok[:, None] & col_ok[None, :], K, ACT)
    if ROWS:
        s, inv = _pow2_scale(tl.max(tl.abs(x), axis=1))
        tl.store(q_ptr + offs, _to_e4m3(x * inv[:, None]), mask=row_ok[:, None] & col_ok[None, :])
        tl.store(s_ptr + kb * M + rows, s, mask=row_ok)
    if COLS:
        if RMULT:                                                 # the columns of x[m, k] · rmult[m]
            x *= tl.load(rmult_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if GROUP:                                                 # one scale per column of the expert's rows
            s, inv = _pow2_scale(tl.load(amax_ptr + e * K + cols, mask=col_ok, other=0.0))
        else:
            s, inv = _pow2_scale(tl.max(tl.abs(x), axis=0))
        qt = _to_e4m3(x * inv[None, :])                           # rows past the expert's end are zero
        tl.store(qt_ptr + cols.to(tl.int64)[None, :] * LDT + (t * 128 + r)[:, None], qt, mask=col_ok[None, :])
        tl.store(st_ptr + t * K + cols, s, mask=col_ok)


def _schedule(counts: Tensor, bm: int) -> tuple[Tensor, Tensor]:
    "row_offs and tile_offs (both (E+1,) int32, on counts' device, no host sync) for tiles of `bm` rows."
    row_offs = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    tile_offs = F.pad(((counts + bm - 1) // bm).cumsum(0), (1, 0)).to(torch.int32)
    return row_offs, tile_offs


def _max_tiles(M: int, E: int, bm: int) -> int:
    "An upper bound on sum(ceil(counts / bm)) when sum(counts) <= M: each expert adds at most one partial tile."
    return triton.cdiv(M, bm) + E - 1


def _e_p2(E: int) -> int:
    return max(2, triton.next_power_of_2(E))


class Fp8Act(NamedTuple):
    "An activation quantized for the FP8 matmuls; the parts not asked for are None."
    q: Tensor | None     # (M, K) e4m3, 1x128 tiles along K
    s: Tensor | None     # (M, ceil(K/128)) fp32 view with strides (1, M)
    qt: Tensor | None    # (K, 128·T) e4m3: tiles of 128 tokens per expert, transposed, zero-padded
    st: Tensor | None    # (T, K) fp32, scale of column k in token tile t


_ACTS = {None: 0, "swiglu": 1, "swiglu_grad": 2}
QUANT_WARPS = 8   # warps per 128x128 tile of quantize_act (benchmarks/fp8_bench.py --quant-sweep times others)


def _act_input(x: Tensor, act: str | None, dh: Tensor | None) -> tuple[Tensor, Tensor | None, int, int]:
    "Check what a quantization pass reads for `act`; return x and dh contiguous and the quantized width (M, K)."
    if act not in _ACTS:
        raise ValueError(f"act must be None, 'swiglu' or 'swiglu_grad', got {act!r}")
    x = x.contiguous()
    M, K = x.shape[0], x.shape[1] // 2 if act == "swiglu" else x.shape[1]
    if act == "swiglu" and x.shape[1] % 2:
        raise ValueError(f"act='swiglu' wants x = [gate | up] with an even width, got {tuple(x.shape)}")
    if act == "swiglu_grad":
        if dh is None or dh.shape != (M, K // 2) or K % 2:
            raise ValueError(f"act='swiglu_grad' wants x (M, 2I) and dh (M, I), got x {tuple(x.shape)}, "
                             f"dh {None if dh is None else tuple(dh.shape)}")
        dh = dh.contiguous()
    return x, dh, M, K


def quantize_act(x: Tensor, counts: Tensor | None = None, rows: bool = True, cols: bool = False,
                 act: str | None = None, dh: Tensor | None = None, col_amax: Tensor | None = None,
                 row_mult: Tensor | None = None) -> Fp8Act:
    """Quantize `x (M, K)` in one pass: along K in 1x128 tiles (`rows`) and/or along tokens in tiles of 128 rows that
    start at each expert's first row (`cols`; `counts (E,)` int64 rows per expert, None = one group of all M rows).
    `act="swiglu"`: quantize `swiglu(x)` for `x = [gate | up] (M, 2K)`, computed in the pass; `act="swiglu_grad"`:
    quantize the gradient of `swiglu` at `x (M, K)` given the output's gradient `dh (M, K/2)`. `col_amax (E, K)`:
    the columns' scales come from these maxima over each expert's rows (`quantize_rows(..., col_amax=True)`), not
    from each tile's, so they are constant along an expert's tokens; with `row_mult (M,)` too, the columns quantized
    are those of `x[m, k] · row_mult[m]`."""
    x, dh, M, K = _act_input(x, act, dh)
    counts = x.new_full((1,), M, dtype=torch.int64) if counts is None else counts
    E, T, KB = counts.numel(), _max_tiles(M, counts.numel(), 128), triton.cdiv(K, 128)
    if col_amax is not None and (col_amax.shape != (E, K) or col_amax.dtype != torch.float32 or rows):
        raise ValueError(f"col_amax must be fp32 ({E}, {K}) and comes with cols only, got {tuple(col_amax.shape)} "
                         f"{col_amax.dtype}, rows={rows}")
    if row_mult is not None and (row_mult.shape != (M,) or row_mult.dtype != torch.float32 or col_amax is None):
        raise ValueError(f"row_mult must be fp32 ({M},) and comes with col_amax, got {tuple(row_mult.shape)} "
                         f"{row_mult.dtype}")
    row_offs, tile_offs = _schedule(counts, 128)
    q = torch.empty(M, K, dtype=FP8, device=x.device) if rows else None
    s = torch.empty(KB, M, dtype=torch.float32, device=x.device) if rows else None
    qt = torch.empty(K, 128 * T, dtype=FP8, device=x.device) if cols else None
    st = torch.empty(T, K, dtype=torch.float32, device=x.device) if cols else None
    if T * KB > 0 and (rows or cols):
        _quant_act_kernel[(T, KB)](x, x if dh is None else dh, q, s, qt, st, col_amax, row_mult, row_offs, tile_offs,
                                   M, K, E, 128 * T, ROWS=rows, COLS=cols, E_P2=_e_p2(E), ACT=_ACTS[act],
                                   GROUP=col_amax is not None, RMULT=row_mult is not None, num_warps=QUANT_WARPS)
    return Fp8Act(q, s.t() if rows else None, qt, st)

# %% [markdown]
# The row quantization must equal the reference exactly, at sizes that are no multiple of 128 (the last tile is
# partial in both directions). The column quantization must equal the reference applied to each expert's rows
# separately, laid out in the expert's tiles, and be zero in the padding. The counts have an empty expert, a
# one-row expert, and rows past the last expert. (Equality is compared on values: the rounding trick gives +0
# where torch gives −0 for tiny negatives.)

# %%
def check_quantize_act(counts, M, K, seed):
    (x,) = randn(seed, (M, K))
    x = x * torch.logspace(-3, 3, M)[:, None]                           # rows of very different sizes
    x[3, :] = 0                                                          # an all-zero row: smallest scale, zeros
    counts = torch.tensor(counts)
    a = quantize_act(x, counts, rows=True, cols=True)
    q, s = quantize_ref(x, (1, 128))
    bounds = [0] + counts.cumsum(0).tolist()
    n = bounds[-1]                                                       # rows past it are not quantized
    assert torch.equal(a.q[:n].float(), q[:n].float()) and torch.equal(a.s[:n], s[:n]), "row quantization"
    assert a.s.stride() == (1, M)
    whole = quantize_act(x)                                             # no counts: every row
    assert torch.equal(whole.q.float(), q.float()) and torch.equal(whole.s, s)
    tile = [0] + ((counts + 127) // 128).cumsum(0).tolist()
    for e in range(len(counts)):
        n, t0, t1 = bounds[e + 1] - bounds[e], tile[e], tile[e + 1]
        q, s = quantize_ref(x[bounds[e]:bounds[e + 1]], (128, 1))
        assert torch.equal(a.qt[:, 128 * t0:128 * t0 + n].float(), q.float().T), f"expert {e} column values"
        assert torch.equal(a.st[t0:t1], s), f"expert {e} column scales"
        assert (a.qt[:, 128 * t0 + n:128 * t1].float() == 0).all(), f"expert {e} padding"

check_quantize_act([70, 0, 1, 131], 212, 200, seed=1)     # 10 rows past the last expert; K = 128 + 72
check_quantize_act([5], 5, 130, seed=2)
a = quantize_act(torch.randn(0, 64), rows=True, cols=True)
assert a.q.shape == (0, 64) and a.qt.shape == (64, 0)
print("activation quantization (rows, and columns per expert) equals the reference")

# %% [markdown]
# Single values, as in the known-value check above (a 448 in the row sets the scale to 1): ties, the carry case
# 31.5, subnormals, and 8192 random values spread over every binade, all against torch's cast.

# %%
g = torch.Generator(device="cpu").manual_seed(3)
vals = torch.randn(64, 128, generator=g, device="cpu")
vals = (vals * torch.exp2(torch.randint(-12, 8, (64, 128), generator=g, device="cpu").float())).clamp(-448, 448)
vals[:, 0] = 448.0
vals[0, 1:8] = torch.tensor([31.5, -124.0, -400.0, 0.0013, 2.0 ** -10 * 3, 17.0, 19.0])
got = quantize_act(vals.to(torch.get_default_device())).q.float().cpu()
assert torch.equal(got, vals.to(FP8).float()), (got != vals.to(FP8).float()).sum()
assert got[0, 1:8].tolist() == [32.0, -128.0, -384.0, 2.0 ** -9, 2.0 ** -8, 16.0, 20.0]

# %% [markdown]
# ## Quantizing weights
#
# One program per 128×128 block of one expert's `(N, K)` weight: the block's maximum gives one scale. The kernel
# writes the block as it is (`FWD`), transposed (`TRANS`), or both from the one read: the transposed result is the
# quantization of `Wᵀ`, `(E, K, N)` with scales `(E, ceil(K/128), ceil(N/128))`, ready as the K-contiguous B operand
# of the input gradient. A training step needs both layouts of every expert weight, so the step's copies
# (`Fp8Weights`, ops/18) ask for both at once (`transposed="both"`) and W is read once instead of twice. A 2-D
# weight is one expert.

# %%
#| export
@triton.jit
def _quant_weight_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, N, K, FWD: tl.constexpr, TRANS: tl.constexpr):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    kb = tl.program_id(2)
    n = nb * 128 + tl.arange(0, 128)
    k = kb * 128 + tl.arange(0, 128)
    mask = (n < N)[:, None] & (k < K)[None, :]
    base = e.to(tl.int64) * N * K
    w = tl.load(w_ptr + base + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
    s, inv = _pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    q = _to_e4m3(w * inv)
    NB, KB = tl.cdiv(N, 128), tl.cdiv(K, 128)
    if FWD:
        tl.store(q_ptr + base + n[:, None] * K + k[None, :], q, mask=mask)
        tl.store(s_ptr + (e * NB + nb) * KB + kb, s)
    if TRANS:
        tl.store(qt_ptr + base + k[None, :] * N + n[:, None], q, mask=mask)
        tl.store(st_ptr + (e * KB + kb) * NB + nb, s)


def _layouts(transposed: bool | str) -> tuple[bool, ...]:
    "The layouts a weight quantizer writes: `(False,)`, `(True,)`, or for `'both'` `(False, True)`."
    if transposed == "both":
        return (False, True)
    if transposed in (False, True):
        return (bool(transposed),)
    raise ValueError(f"transposed must be False, True or 'both', got {transposed!r}")


def _weight_result(w: Tensor, outs: list, transposed: bool | str):
    "A weight quantizer's answer: `(q, s)`, or `((q, s), (qt, st))` for `'both'`; a 2-D weight's without the E axis."
    if w.dim() == 2:
        outs = [tuple(t[0] for t in o) for o in outs]
    return tuple(outs) if transposed == "both" else outs[0]


def quantize_weight(w: Tensor, transposed: bool | str = False):
    """128x128-block quantization of `w (E, N, K)` or `(N, K)`: e4m3 values of w's shape and scales
    `(E, ceil(N/128), ceil(K/128))` (no E for 2-D). With `transposed`, those of `wᵀ`: `(E, K, N)`, scales transposed;
    with `transposed="both"`, both pairs from one read of w, `((q, s), (qt, st))`.
    A `.mT` view of a contiguous weight (GPT-OSS stores its experts `(E, in, out)`) is read as it is stored: the
    blocks of `wᵀ` are those of `w` transposed, so no copy is made."""
    layouts = _layouts(transposed)
    if w.dim() == 3 and not w.is_contiguous() and w.mT.is_contiguous():
        flipped = quantize_weight(w.mT, "both" if len(layouts) == 2 else not layouts[0])
        return flipped[::-1] if len(layouts) == 2 else flipped
    w3 = w.contiguous() if w.dim() == 3 else w.contiguous()[None]
    E, N, K = w3.shape
    NB, KB = triton.cdiv(N, 128), triton.cdiv(K, 128)
    outs = [(torch.empty((E, K, N) if t else (E, N, K), dtype=FP8, device=w.device),
             torch.empty((E, KB, NB) if t else (E, NB, KB), dtype=torch.float32, device=w.device)) for t in layouts]
    if E * NB * KB > 0:
        (q, s), (qt, st) = outs[0], outs[-1]
        _quant_weight_kernel[(E, NB, KB)](w3, q, s, qt, st, N, K, FWD=False in layouts, TRANS=True in layouts,
                                          num_warps=8)
    return _weight_result(w, outs, transposed)

# %% [markdown]
# Against the reference, at sizes with partial blocks; the transposed layout must hold the same blocks.

# %%
(w,) = randn(4, (3, 200, 260))
w = w * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]                # experts of very different sizes
q, s = quantize_weight(w)
qr, sr = quantize_ref(w, (128, 128))
assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr) and s.shape == (3, 2, 3)
qt, st = quantize_weight(w, transposed=True)
assert torch.equal(qt.float(), q.float().transpose(1, 2)) and torch.equal(st, s.transpose(1, 2))
q2, s2 = quantize_weight(w[1])
assert torch.equal(q2.float(), q[1].float()) and torch.equal(s2, s[1])


def same(a, b):
    "Two quantizer answers (nested tuples of values and scales) hold equal numbers."
    if isinstance(a, Tensor):
        return torch.equal(a.float(), b.float())
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


stored = w.mT.contiguous()                                              # a weight stored (E, in, out), used as .mT
for src in (w, stored.mT, w[1]):
    assert same(quantize_weight(src, "both"), (quantize_weight(src), quantize_weight(src, True)))
for t in (False, True):
    assert same(quantize_weight(stored.mT, t), quantize_weight(w, t))
print("weight quantization equals the reference; the transposed layout holds the same blocks, also both from one read")

# %% [markdown]
# ## The grouped FP8 GEMM
#
# `C[rows of e] = A[rows of e] · B[e]ᵀ` for A `(M, K)` in 1×128 tiles and B `(E, N, K)` in 128×128 blocks: the
# forward with `A = X, B = W`, and the input gradient with `A = dY, B = Wᵀ`. Program `pid` takes output tile
# `(t, j)` with the N tile `j` varying fastest, so the programs that run together share one tile of A (read once
# from memory, then from L2) and one expert's B (a few MB, which stays in L2). Each step of the K loop loads a
# `BM × BK` tile of A and a `BN × BK` tile of B, both K-contiguous (the layout Hopper's FP8 tensor-core instruction
# takes), their scales, multiplies in FP8 and adds `dot · (s_a s_b)` to the fp32 accumulator. `BK` divides 128, so a
# step never straddles two scale blocks, and `BN` divides 128, so a tile's columns lie in one block of B: B's scale
# is one number per step and `s_a s_b` a column of `BM` numbers. Promotion is then one multiply-add per accumulator
# element; a scale per column would add a multiply per element, which `benchmarks/fp8_bound.py` measures slower
# (benchmarks/RESULTS.md, "Block scales: one scale per row in the promotion").
#
# Promotion matters on the GPU: the tensor cores accumulate FP8 products with fewer bits than fp32, and Triton's
# default on sm90 lets that accumulator run over the whole K. A fresh `tl.dot` per step bounds it to `BK`
# (DeepGEMM's scheme). K that is no multiple of `BK` is masked (`EVEN_K` drops the masks when it is).

# %%
#| export
@triton.jit
def _fp8_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, K, E,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_P2: tl.constexpr,
                     EVEN_K: tl.constexpr, ROW_SCALES: tl.constexpr = False, HAS_SB: tl.constexpr = True,
                     PROMOTE: tl.constexpr = None):
    n_tiles = tl.cdiv(N, BN)
    t = tl.program_id(0) // n_tiles
    j = tl.program_id(0) % n_tiles
    e = _expert_of_tile(t, tile_offs_ptr, E, E_P2)
    if e >= E:
        return
    rows = tl.load(row_offs_ptr + e) + (t - tl.load(tile_offs_ptr + e)) * BM + tl.arange(0, BM)
    row_ok = rows < tl.load(row_offs_ptr + e + 1)
    cols = j * BN + tl.arange(0, BN)
    col_ok = cols < N
    kk = tl.arange(0, BK)
    KB = tl.cdiv(K, 128)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * N * K + cols.to(tl.int64)[:, None] * K + kk[None, :]
    if not ROW_SCALES:
        sb_ptr += (e * tl.cdiv(N, 128) + j * BN // 128) * KB  # B's scales (E, ceil(N/128), KB): one per step
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + kk < K)[None, :]
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok, other=0.0)
        if ROW_SCALES:                                               # scales are constant along K: chain the dots
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)
        else:
            s = tl.load(sa_ptr + (k0 // 128) * M + rows, mask=row_ok, other=0.0) * tl.load(sb_ptr + k0 // 128)
            acc += tl.dot(a, tl.trans(b)) * s[:, None]               # A's scales (KB, M) times B's one
        a_ptrs += BK
        b_ptrs += BK
    if ROW_SCALES:                                                   # A's scale per row, B's per column of e
        acc *= tl.load(sa_ptr + rows, mask=row_ok, other=0.0)[:, None]
        if HAS_SB:
            acc *= tl.load(sb_ptr + e * N + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])

# %% [markdown]
# The tile shape is a launch parameter. The default is the best one measured for a dense block-scaled Triton GEMM
# on the H200 (128×128×128, 8 warps; 4 warps ran at a fraction of its speed, wider tiles spilled registers);
# `benchmarks/fp8_bench.py` sweeps a few for the grouped kernels. The interpreter ignores warps and stages,
# and large tiles keep it fast.

# %%
#| export
class GemmConfig(NamedTuple):
    """Tile shape and launch parameters of the FP8 GEMM kernels; `promote`: with row scales, add the tensor cores'
    partial sums into the fp32 accumulator every `promote` of K (at most `block_k`; None: never, Triton's default)."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    warps: int = 8
    stages: int = 4
    promote: int | None = None


def _check_config(cfg: GemmConfig, block_scales: bool = True) -> GemmConfig:
    "Refuse tiles the kernels cannot take: with block scales a K step must lie in one 128-wide scale block."
    if any(b < 16 or b & (b - 1) for b in cfg[:3]) or (block_scales and 128 % cfg.block_k):
        raise ValueError(f"GemmConfig blocks must be powers of two >= 16, with block_k dividing 128 under block "
                         f"scales; got {cfg}")
    if cfg.promote is not None and not 0 < cfg.promote <= cfg.block_k:
        raise ValueError(f"GemmConfig promote must be None or between 1 and block_k; got {cfg}")
    return cfg


def _check_fp8(name: str, t: Tensor, shape: tuple) -> None:
    if t.dtype != FP8 or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be float8_e4m3fn of shape {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")


def fp8_grouped_mm(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor | None, counts: Tensor, out_dtype: torch.dtype,
                   config: GemmConfig | None = None) -> Tensor:
    """`C[rows of e] = (qa·sa)[rows of e] @ (qb[e]·sb[e])ᵀ` for `qa (M, K)`, `qb (E, N, K)`, `counts (E,)` rows per
    expert (sum at most M; later rows of C are left unwritten). Block scales: `sa (M, ceil(K/128))` 1x128 as
    `quantize_act` gives them, `sb (E, ceil(N/128), ceil(K/128))` 128x128. Row scales (`sa` 1-D): `sa (M,)` one per
    row as `quantize_rows` gives them, `sb (E, N)` one per row of each `qb[e]`, or None (ones). Returns C `(M, N)` in
    `out_dtype`."""
    row_scales = sa.dim() == 1
    cfg = _check_config(config or (ROW_GEMM if row_scales else GemmConfig()), not row_scales)
    if 128 % cfg.block_n and not row_scales:
        raise ValueError(f"fp8_grouped_mm's block_n must divide 128 (B has one scale per 128 columns); got {cfg}")
    (M, K), (E, N) = qa.shape, qb.shape[:2]
    _check_fp8("qa", qa, (M, K))
    _check_fp8("qb", qb, (E, N, K))
    KB = triton.cdiv(K, 128)
    if row_scales:
        if sa.shape != (M,) or (sb is not None and sb.shape != (E, N)):
            raise ValueError(f"row scales: want sa ({M},) and sb ({E}, {N}) or None; got sa {tuple(sa.shape)}, "
                             f"sb {None if sb is None else tuple(sb.shape)}")
    elif sa.shape != (M, KB) or not sa.t().is_contiguous() or sb is None or sb.shape != (E, triton.cdiv(N, 128), KB):
        raise ValueError(f"scales: want sa ({M}, {KB}) with strides (1, {M}) and sb ({E}, {triton.cdiv(N, 128)}, "
                         f"{KB}); got sa {tuple(sa.shape)} strides {sa.stride()}, "
                         f"sb {None if sb is None else tuple(sb.shape)}")
    c = torch.empty(M, N, dtype=out_dtype, device=qa.device)
    grid = _max_tiles(M, E, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    if grid > 0 and K > 0:
        row_offs, tile_offs = _schedule(counts, cfg.block_m)
        _fp8_gemm_kernel[(grid,)](qa, sa if row_scales else sa.t(), qb, sa if sb is None else sb.contiguous(), c,
                                  row_offs, tile_offs, M, N, K, E, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                                  E_P2=_e_p2(E), EVEN_K=K % cfg.block_k == 0, ROW_SCALES=row_scales,
                                  HAS_SB=sb is not None, PROMOTE=cfg.promote, num_warps=cfg.warps,
                                  num_stages=cfg.stages)
    elif K == 0:
        c.zero_()
    return c

# %% [markdown]
# Check against the quantized reference in float64: each row times its own expert's dequantized weight, within
# `EXACT`. Cases: an empty expert, a one-row expert, experts spanning several 128-row tiles, rows past the last
# expert, K and N no multiple of 128 (masked K), and a smaller `BK` that promotes every 64.

# %%
def reference_rows(x, w, counts):
    "Float64 product of each row's 1x128-quantized x with its expert's 128x128-quantized weight."
    expert = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    n = len(expert)
    return torch.einsum("mk,mnk->mn", fake_quant(x[:n], (1, 128)), fake_quant(w, (128, 128))[expert])

def check_gemm(counts, extra, K, N, cfg=None, seed=0):
    counts = torch.tensor(counts)
    n = int(counts.sum())
    x, w = randn(seed, (n + extra, K), (len(counts), N, K))
    a = quantize_act(x)
    y = fp8_grouped_mm(a.q, a.s, *quantize_weight(w), counts, torch.float32, cfg)
    err = rel_err(y[:n], reference_rows(x, w, counts))
    assert err < EXACT, (counts, K, N, err)
    return err

t = time.time()
errs = [check_gemm([70, 0, 1, 131], 7, 256, 192),
        check_gemm([40, 3], 0, 200, 130),                                           # K, N partial
        check_gemm([0, 150], 5, 256, 64, GemmConfig(block_m=64, block_n=64, block_k=64))]
print(f"grouped FP8 GEMM vs quantized reference: max rel err {max(errs):.1e} ({time.time() - t:.1f} s)")

# %% [markdown]
# ## The weight-gradient GEMM
#
# `dW[e] = dY_eᵀ X_e`: the reduction runs over expert e's tokens, so this GEMM is grouped along K, not M. Its
# operands are the column quantizations of dY and X: `(out, 128·T)` and `(in, 128·T)`, each expert's tokens in its
# own zero-padded tiles `tile_offs[e] … tile_offs[e+1]`. Program `(e, i, j)` loops over exactly those tiles, every
# load a whole aligned K-contiguous tile with no K mask, every scale pair one per row of each operand per tile. An
# expert with no rows runs no iteration and stores zeros, which is its exact gradient. Programs are ordered expert
# first, so the programs that run together read the same expert's tokens.

# %%
#| export
@triton.jit
def _fp8_wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, tile_offs_ptr, M, N, LD,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_SCALES: tl.constexpr = False,
                      HAS_SB: tl.constexpr = True, PROMOTE: tl.constexpr = None):
    tm, tn = tl.cdiv(M, BM), tl.cdiv(N, BN)
    pid = tl.program_id(0)
    e = pid // (tm * tn)
    i = pid // tn % tm
    j = pid % tn
    rows = i * BM + tl.arange(0, BM)
    cols = j * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < M, cols < N
    kk = tl.arange(0, BK)
    k_start = tl.load(tile_offs_ptr + e) * 128
    k_end = tl.load(tile_offs_ptr + e + 1) * 128
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * LD + (k_start + kk)[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * LD + (k_start + kk)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        if GROUP_SCALES:                                             # one scale per row of the expert: chain
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)
        else:
            sa = tl.load(sa_ptr + (k0 // 128) * M + rows, mask=row_ok, other=0.0)     # (T, M)
            sb = tl.load(sb_ptr + (k0 // 128) * N + cols, mask=col_ok, other=0.0)     # (T, N)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        a_ptrs += BK
        b_ptrs += BK
    if GROUP_SCALES:                                                 # scales (E, M) and (E, N), or none for B
        acc *= tl.load(sa_ptr + e * M + rows, mask=row_ok, other=0.0)[:, None]
        if HAS_SB:
            acc *= tl.load(sb_ptr + e * N + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(c_ptr + e.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_grouped_wgrad(qat: Tensor, sat: Tensor, qbt: Tensor, sbt: Tensor | None, counts: Tensor, out_dtype: torch.dtype,
                      config: GemmConfig | None = None, group_scales: bool = False) -> Tensor:
    """`C[e] = A_eᵀ B_e` summed over expert e's tokens, from column quantizations (`quantize_act(..., cols=True)`
    with the same `counts`): `qat (Ma, 128·T)`, `qbt (Nb, 128·T)`, and their scales per token tile, `sat (T, Ma)`,
    `sbt (T, Nb)`, or with `group_scales` one per expert, `sat (E, Ma)`, `sbt (E, Nb)` or None (B's values are
    taken as they are: the row recipe's X, whose row scales are in A). Returns `(E, Ma, Nb)`."""
    cfg = _check_config(config or (ROW_WGRAD if group_scales else GemmConfig()))   # K steps within 128-token tiles
    (Ma, LD), Nb, E = qat.shape, qbt.shape[0], counts.numel()
    _check_fp8("qat", qat, (Ma, LD))
    _check_fp8("qbt", qbt, (Nb, LD))
    lead = E if group_scales else LD // 128
    sb_shape = None if sbt is None else tuple(sbt.shape)
    if LD % 128 or sat.shape != (lead, Ma) or sb_shape not in ((lead, Nb),) + ((None,) if group_scales else ()):
        raise ValueError(f"want qat (Ma, 128·T), qbt (Nb, 128·T), sat ({'E' if group_scales else 'T'}, Ma), sbt "
                         f"({'E' if group_scales else 'T'}, Nb){' or None' if group_scales else ''}; got qat "
                         f"{tuple(qat.shape)} sat {tuple(sat.shape)} qbt {tuple(qbt.shape)} sbt {sb_shape}")
    c = torch.empty(E, Ma, Nb, dtype=out_dtype, device=qat.device)
    grid = E * triton.cdiv(Ma, cfg.block_m) * triton.cdiv(Nb, cfg.block_n)
    if grid > 0:
        _, tile_offs = _schedule(counts, 128)
        sat = sat.contiguous()
        _fp8_wgrad_kernel[(grid,)](qat, sat, qbt, sat if sbt is None else sbt.contiguous(), c, tile_offs, Ma, Nb, LD,
                                   BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_SCALES=group_scales,
                                   HAS_SB=sbt is not None, PROMOTE=cfg.promote, num_warps=cfg.warps,
                                   num_stages=cfg.stages)
    return c

# %% [markdown]
# Check against the reference: per expert, both operands quantized in tiles of 128 of that expert's tokens, then
# multiplied in float64. Experts with 0, 1, 130 and 300 rows (one, two and three tiles, the last partial),
# rows past the last expert (which must not count), and a `BK` of 64.

# %%
def fake_quant_cols(x, counts):
    "Each expert's rows of x quantized in tiles of 128 tokens from its first row, dequantized (float64)."
    bounds = [0] + counts.cumsum(0).tolist()
    return [fake_quant(x[a:b], (128, 1)) for a, b in zip(bounds[:-1], bounds[1:])]

def check_wgrad(counts, extra, n_out, n_in, cfg=None, seed=0):
    counts = torch.tensor(counts)
    n = int(counts.sum())
    dy, x = randn(seed, (n + extra, n_out), (n + extra, n_in))
    ga, xa = quantize_act(dy, counts, rows=False, cols=True), quantize_act(x, counts, rows=False, cols=True)
    dw = fp8_grouped_wgrad(ga.qt, ga.st, xa.qt, xa.st, counts, torch.float32, cfg)
    want = torch.stack([a.T @ b for a, b in zip(fake_quant_cols(dy, counts), fake_quant_cols(x, counts))])
    err = rel_err(dw, want)
    assert err < EXACT, (counts, err)
    assert (dw[counts == 0] == 0).all()
    return err

t = time.time()
errs = [check_wgrad([0, 1, 130, 300], 9, 96, 136), check_wgrad([20, 0], 0, 64, 64, GemmConfig(64, 64, 64))]
print(f"grouped FP8 weight gradient vs quantized reference: max rel err {max(errs):.1e} ({time.time() - t:.1f} s)")

# %% [markdown]
# ## One scale per row
#
# Block scales change along K every 128 elements, so each 128-deep product must be finished and scaled before the
# next is added, and on the H200 that wait is what bounds the GEMM (the section on speed below). With **one scale
# per row over the whole reduction** (the row-wise recipe) the scales factor out of the sum,
# `C[m, n] = s_a[m] · s_b[n] · Σ_k q_a[m, k] q_b[n, k]`: the products chain inside `tl.dot` and the scales are
# applied once, to the finished tile. The three products then quantize:
#
# | product | A, one scale per | B, one scale per |
# |---|---|---|
# | forward `Y = X Wᵀ` | token (row of X, over the in features) | row of `W[e]` (output feature, over in) |
# | input gradient `dX = dY W` | token of `dY ⊙ s_W[e]` | none: `W[e]`'s values as they are, transposed |
# | weight gradient `dW = dYᵀ X` | column of `dY ⊙ s_X` over expert e's tokens | none: X's forward values, transposed |
#
# Each gradient reduces over a dimension along which one operand's scales vary, and the same move serves both: the
# scales go to the other side, into `dY` before it is quantized, which is exact in fp32 since a scale is a power of
# two. The input gradient reduces over W's rows, so `dY[m, n] · s_W[e, n]` is quantized by rows and the B operand is
# the forward's FP8 weight transposed, with no scale of its own. The weight gradient reduces over tokens, along
# which X's row scales vary, so `dY[m, n] · s_X[m]` is quantized by columns and the B operand is the forward's FP8
# X transposed: the weight gradient is the gradient of the product the forward computed, and X is quantized once.
# The forward's row pass writes X's FP8 values twice, as rows for the forward and transposed, in tiles of 128
# tokens from each expert's first row (`trans`), the layout the weight-gradient GEMM reads (on sm90 an FP8 operand
# must be contiguous along the reduction; the tensor cores cannot transpose 8-bit tiles on the way in).
#
# The columns of `dY ⊙ s_X` need each column's maximum over an expert's tokens before any of them can be
# quantized, so that takes two passes over dY: the row pass for the input gradient, which reads every element
# anyway, also writes each column's maximum over its tile of rows (of `dY ⊙ s_X`, `row_mult`), a small kernel
# (`_expert_max_kernel`) reduces those per expert, and the column pass (`quantize_act(..., cols=True,
# col_amax=..., row_mult=...)`) reads dY again and quantizes with them.
#
# A row's scale is set by its largest element over all of K, so an outlier costs the whole row precision, where a
# 1×128 tile confines it to 128 elements; how much that matters to training is measured (`nbs/validate/v05_fp8`).
#
# `_quant_rows_kernel` takes `BM` rows of one expert per program and reads them twice, 128 columns at a time: the first
# loop finds the row maxima (and, asked, the column maxima), the second quantizes and writes (and, asked, writes the
# values transposed). The second read comes from L2 only while the program's rows are still there, which at the wide
# widths, with every program in flight reading its own, they mostly may not be. So a pass that writes no transpose takes
# whole rows instead, one at a time, each loaded once: the row maxima, the scale, the values and, asked, the column
# maxima, kept over the program's rows, all come from that one tile. It does so where the row, padded to a power of two,
# holds at most `ROWS_WHOLE` elements: the passes over the gradients (dY with the column maxima, SwiGLU's gradient) then
# run faster at the 235B and V3 widths. A pass that writes the transpose keeps the two loops: with a few rows a program
# its transposed stores write a few bytes a line, and whole rows ran several times slower (benchmarks/RESULTS.md, "The
# weight and row passes at the 235B width"). Its programs cover each expert's rows rounded up to 128, so the transposed
# tiles' padding is written as zeros by the programs past the expert's end. It computes the same activations as
# `quantize_act` (`act`), and multiplies by a per-expert column factor (`mult`, the weight scales of the input gradient)
# before taking maxima.

# %%
#| export
@triton.jit
def _quant_rows_kernel(x_ptr, dh_ptr, mult_ptr, rmult_ptr, q_ptr, s_ptr, qt_ptr, amax_ptr, row_offs_ptr,
                       tile_offs_ptr, M, K, E, LDT, MULT: tl.constexpr, RMULT: tl.constexpr, AMAX: tl.constexpr,
                       ROWS: tl.constexpr, TRANS: tl.constexpr, E_P2: tl.constexpr, ACT: tl.constexpr,
                       BM: tl.constexpr, KP2: tl.constexpr):
    t = tl.program_id(0)
    e = _expert_of_tile(t, tile_offs_ptr, E, E_P2)
    if e >= E:
        return
    first, end = tl.load(row_offs_ptr + e) + (t - tl.load(tile_offs_ptr + e)) * BM, tl.load(row_offs_ptr + e + 1)
    if KP2 > 0:                                # whole rows, one at a time: each element read once
        tl.static_assert(ROWS and not TRANS, "whole rows write the rows alone; a transpose takes two loops over K")
        cols = tl.arange(0, KP2)
        col_ok = cols < K
        if MULT:
            mult = tl.load(mult_ptr + e * K + cols, mask=col_ok, other=0.0)
        c_max = tl.zeros((KP2,), dtype=tl.float32)
        for r in range(0, BM):
            rows = first + r + tl.arange(0, 1)
            row_ok = rows < end
            x = _act_tile(x_ptr, dh_ptr, rows, cols, row_ok[:, None] & col_ok[None, :], K, ACT)
            if AMAX:
                if RMULT:
                    rmult = tl.load(rmult_ptr + rows, mask=row_ok, other=0.0)
                    c_max = tl.maximum(c_max, tl.max(tl.abs(x * rmult[:, None]), axis=0))
                else:
                    c_max = tl.maximum(c_max, tl.max(tl.abs(x), axis=0))
            if MULT:
                x *= mult[None, :]
            s, inv = _pow2_scale(tl.max(tl.abs(x), axis=1))
            tl.store(s_ptr + rows, s, mask=row_ok)
            q = _to_e4m3(x * inv[:, None])
            tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q,
                     mask=row_ok[:, None] & col_ok[None, :])
        if AMAX:
            tl.store(amax_ptr + t * K + cols, c_max, mask=col_ok)
    else:                                      # two loops over K, 128 columns at a time
        rows = first + tl.arange(0, BM)
        row_ok = rows < end
        if AMAX and RMULT:
            rmult = tl.load(rmult_ptr + rows, mask=row_ok, other=0.0)
        r_max = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, K, 128):
            cols = k0 + tl.arange(0, 128)
            col_ok = cols < K
            x = _act_tile(x_ptr, dh_ptr, rows, cols, row_ok[:, None] & col_ok[None, :], K, ACT)
            if AMAX:                           # the columns' maxima over this tile's rows, times rmult
                if RMULT:
                    tl.store(amax_ptr + t * K + cols, tl.max(tl.abs(x * rmult[:, None]), axis=0), mask=col_ok)
                else:
                    tl.store(amax_ptr + t * K + cols, tl.max(tl.abs(x), axis=0), mask=col_ok)
            if MULT:
                x *= tl.load(mult_ptr + e * K + cols, mask=col_ok, other=0.0)[None, :]
            r_max = tl.maximum(r_max, tl.max(tl.abs(x), axis=1))
        s, inv = _pow2_scale(r_max)
        tl.store(s_ptr + rows, s, mask=row_ok)
        for k0 in range(0, K, 128):
            cols = k0 + tl.arange(0, 128)
            col_ok = cols < K
            mask = row_ok[:, None] & col_ok[None, :]
            x = _act_tile(x_ptr, dh_ptr, rows, cols, mask, K, ACT)
            if MULT:
                x *= tl.load(mult_ptr + e * K + cols, mask=col_ok, other=0.0)[None, :]
            q = _to_e4m3(x * inv[:, None])
            if ROWS:
                tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=mask)
            if TRANS:                          # rows past the expert's end are zeros: the tile's padding
                tl.store(qt_ptr + cols.to(tl.int64)[None, :] * LDT + (t * BM + tl.arange(0, BM))[:, None], q,
                         mask=col_ok[None, :])


@triton.jit
def _expert_max_kernel(tile_max_ptr, amax_ptr, tile_offs_ptr, K, TILES: tl.constexpr):
    "amax[e, cols] = the maximum of tile_max[t, cols] over expert e's tiles t (0 for an expert with none)."
    e = tl.program_id(0)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    t0, t1 = tl.load(tile_offs_ptr + e), tl.load(tile_offs_ptr + e + 1)
    acc = tl.zeros((128,), dtype=tl.float32)
    for t in range(t0, t1, TILES):
        tiles = t + tl.arange(0, TILES)
        m = tl.load(tile_max_ptr + tiles.to(tl.int64)[:, None] * K + cols[None, :],
                    mask=(tiles < t1)[:, None] & (cols < K)[None, :], other=0.0)
        acc = tl.maximum(acc, tl.max(m, axis=0))
    tl.store(amax_ptr + e * K + cols, acc, mask=cols < K)


class Fp8Rows(NamedTuple):
    "An activation quantized one scale per row; when asked, the same values transposed, and its columns' maxima."
    q: Tensor | None         # (M, K) e4m3
    s: Tensor                # (M,) fp32
    col_amax: Tensor | None  # (E, K) fp32: max |x · row_mult| of each column over each expert's rows (before `mult`)
    qt: Tensor | None        # (K, 128·T) e4m3: q transposed in tiles of 128 tokens per expert, zero-padded


ROWS_BM = 32      # rows per program of quantize_rows (its second loop reads them again); divides 128
ROWS_WARPS = 4    # warps per program (benchmarks/fp8_rows.py --parts rowsweep times others)
ROWS_WHOLE = 8192  # a pass with no transpose holds a row whole, one a time, up to this next_pow2(K) (0: two loops)


def _rows_kp2(K: int, trans: bool, whole: int) -> int:
    "The tile width `quantize_rows` holds a whole row in (`next_pow2(K)`), or 0 where it takes two loops over K."
    kp2 = triton.next_power_of_2(K)
    return kp2 if not trans and kp2 <= whole else 0


def quantize_rows(x: Tensor, counts: Tensor | None = None, act: str | None = None, dh: Tensor | None = None,
                  mult: Tensor | None = None, col_amax: bool = False, row_mult: Tensor | None = None,
                  trans: bool = False, rows: bool = True) -> Fp8Rows:
    """Quantize `x (M, K)` (or `act` of it, as in `quantize_act`) one power-of-two scale per row over all of K.
    `mult (E, K)`: quantize `x[m, k] · mult[e, k]` for the expert e of row m. `col_amax`: also return each column's
    max |x[m, k] · row_mult[m]| (`row_mult (M,)`, or 1) over each expert's rows. `trans`: also return the FP8 values
    transposed, in `quantize_act`'s column layout; `rows=False` (with `trans`): return only those and the scales,
    for a weight gradient that reads no rows. Rows past `counts`' sum are not quantized."""
    x, dh, M, K = _act_input(x, act, dh)
    counts = x.new_full((1,), M, dtype=torch.int64) if counts is None else counts
    E, T128 = counts.numel(), _max_tiles(M, counts.numel(), 128)
    T = T128 * (128 // ROWS_BM)
    if mult is not None and (mult.shape != (E, K) or mult.dtype != torch.float32):
        raise ValueError(f"mult must be fp32 ({E}, {K}), got {tuple(mult.shape)} {mult.dtype}")
    if row_mult is not None and (row_mult.shape != (M,) or row_mult.dtype != torch.float32 or not col_amax):
        raise ValueError(f"row_mult must be fp32 ({M},) and comes with col_amax, got {tuple(row_mult.shape)} "
                         f"{row_mult.dtype}, col_amax={col_amax}")
    if not (rows or trans):
        raise ValueError("quantize_rows writes its rows, their transpose (trans=True) or both; rows=False needs trans")
    q = torch.empty(M, K, dtype=FP8, device=x.device) if rows else None
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    qt = torch.empty(K, 128 * T128, dtype=FP8, device=x.device) if trans else None
    tile_max = torch.empty(T, K, dtype=torch.float32, device=x.device) if col_amax else None
    row_offs, tile_offs = _schedule(counts, 128)
    tile_offs = tile_offs * (128 // ROWS_BM)   # each expert's 128-row tiles, split: a tile never holds two experts
    if T > 0 and K > 0:
        _quant_rows_kernel[(T,)](x, x if dh is None else dh, s if mult is None else mult.contiguous(),
                                 s if row_mult is None else row_mult.contiguous(), qt if q is None else q, s,
                                 q if qt is None else qt, s if tile_max is None else tile_max, row_offs, tile_offs,
                                 M, K, E, 128 * T128, MULT=mult is not None, RMULT=row_mult is not None,
                                 AMAX=col_amax, ROWS=rows, TRANS=trans, E_P2=_e_p2(E), ACT=_ACTS[act], BM=ROWS_BM,
                                 KP2=_rows_kp2(K, trans, ROWS_WHOLE), num_warps=ROWS_WARPS)
    amax = None
    if col_amax:                               # each tile's column maxima, reduced per expert
        amax = torch.empty(E, K, dtype=torch.float32, device=x.device)
        if E * K > 0:
            _expert_max_kernel[(E, triton.cdiv(K, 128))](tile_max, amax, tile_offs, K, TILES=8, num_warps=4)
    return Fp8Rows(q, s, amax, qt)

# %% [markdown]
# Weights, one scale per row of each `W[e]`: `_quant_weight_rows_kernel` takes `WEIGHT_ROWS` rows per program, finds
# their maxima over K, then writes them in the layouts asked, `W`'s `(E, N, K)`, transposed `(E, K, N)` (the input
# gradient's B operand), or both. Finding the maxima is a read of its own: the second loop reads the rows again, from L2
# only where they are still there, which the block size alone does not decide (smaller blocks leave room for more
# programs in flight; the pass runs at one rate from 8 rows a block to 128: benchmarks/RESULTS.md, "The weight and row
# passes at the 235B width"). So the forward layout alone, the pass a layer runs first, can hold whole rows instead:
# with `WEIGHT_ROW_TILE` elements per program, `WEIGHT_ROW_TILE // next_pow2(K)` rows of all of K in one tile, which it
# loads once, reduces and writes, on `WEIGHT_ROW_TILE_WARPS` warps: 1.6–1.7× faster than the two loops at the experts'
# weights of the 235B and V3 widths (benchmarks/RESULTS.md, "The weight and row passes at the 235B width"). The
# transposed layout keeps the two loops over 64 rows: its stores run along N, and a handful of rows would write a few
# bytes per line; so would a weight read through `.mT`, whose rows are strided. A row's scale depends on nothing but the
# row, so a pass given the scales of an earlier pass over the same, unchanged W (`scales`) skips the first loop and
# reads W once, `WEIGHT_ROWS_GIVEN` rows per program (a setting of its own, chosen by timing it; the timings are in
# benchmarks/RESULTS.md, "The weight and row passes at the 235B width"): an expert layer that quantizes its weight at
# each use gives its backward's transposed pass the forward's scales (`weight_each_use`, below). `fp8_linear`'s forward
# and backward are operators of their own, so its backward finds them again. It reads W through strides, so GPT-OSS's
# experts stored `(E, in, out)` and used as `.mT` are read in place.

# %%
#| export
WEIGHT_ROWS = 64        # rows of W per program
WEIGHT_ROWS_GIVEN = 128 # rows of W per program of a pass given its scales (one loop; fp8_rows.py --parts weights)
WEIGHT_ROWS_WARPS = 8   # benchmarks/fp8_rows.py --parts rowsweep times others
WEIGHT_ROW_TILE = 16384 # elements of W a program holds with whole rows (forward layout alone; 0: two loops)
WEIGHT_ROW_TILE_WARPS = 4   # warps per program with whole rows (fp8_rows.py --parts weights)


@triton.jit
def _quant_weight_rows_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, N, K, s_e, s_n, s_k, FWD: tl.constexpr,
                              TRANS: tl.constexpr, BN: tl.constexpr, GIVEN: tl.constexpr, KP2: tl.constexpr):
    e = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < N
    base = w_ptr + e.to(tl.int64) * s_e + n.to(tl.int64)[:, None] * s_n
    if KP2 > 0:                                 # whole rows in one tile: one read (the forward layout alone)
        k = tl.arange(0, KP2)
        mask = n_ok[:, None] & (k < K)[None, :]
        w = tl.load(base + k[None, :] * s_k, mask=mask, other=0.0).to(tl.float32)
        s, inv = _pow2_scale(tl.max(tl.abs(w), axis=1))
        tl.store(s_ptr + e * N + n, s, mask=n_ok)
        tl.store(q_ptr + e.to(tl.int64) * N * K + n.to(tl.int64)[:, None] * K + k[None, :],
                 _to_e4m3(w * inv[:, None]), mask=mask)
    else:                                       # two loops over K, 128 columns at a time
        if GIVEN:                               # the scales s = 2^k of an earlier pass: 1/s = 2^-k from their bits
            s_bits = tl.load(s_ptr + e * N + n, mask=n_ok, other=1.0).to(tl.int32, bitcast=True)
            inv = ((254 - ((s_bits >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True)
        else:
            r_max = tl.zeros((BN,), dtype=tl.float32)
            for k0 in range(0, K, 128):
                k = k0 + tl.arange(0, 128)
                w = tl.load(base + k[None, :] * s_k, mask=n_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
                r_max = tl.maximum(r_max, tl.max(tl.abs(w), axis=1))
            s, inv = _pow2_scale(r_max)
            tl.store(s_ptr + e * N + n, s, mask=n_ok)
        off = e.to(tl.int64) * N * K
        for k0 in range(0, K, 128):
            k = k0 + tl.arange(0, 128)
            mask = n_ok[:, None] & (k < K)[None, :]
            q = _to_e4m3(tl.load(base + k[None, :] * s_k, mask=mask, other=0.0).to(tl.float32) * inv[:, None])
            if FWD:
                tl.store(q_ptr + off + n[:, None] * K + k[None, :], q, mask=mask)
            if TRANS:
                tl.store(qt_ptr + off + k[None, :] * N + n[:, None], q, mask=mask)


def quantize_weight_rows(w: Tensor, transposed: bool | str = False, scales: Tensor | None = None):
    """One power-of-two scale per row of `w (E, N, K)` or `(N, K)` over K: e4m3 values of w's shape (with
    `transposed`, of `wᵀ`: `(E, K, N)`) and scales `(E, N)` (no E for 2-D), the same either way; with
    `transposed="both"`, both from one pass, `((q, s), (qt, s))`. `scales`: the scales an earlier call returned for
    this w, unchanged since; they are used as given (and returned), and w is read once."""
    layouts = _layouts(transposed)
    w3 = w if w.dim() == 3 else w[None]
    E, N, K = w3.shape
    if scales is not None:
        if scales.shape != w.shape[:-1] or scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 of shape {tuple(w.shape[:-1])} (w's rows), got "
                             f"{scales.dtype} {tuple(scales.shape)}")
        s = scales.contiguous().view(E, N)
    else:
        s = torch.empty(E, N, dtype=torch.float32, device=w.device)
    outs = [(torch.empty((E, K, N) if t else (E, N, K), dtype=FP8, device=w.device), s) for t in layouts]
    kp2 = triton.next_power_of_2(K)
    whole = layouts == (False,) and scales is None and kp2 <= WEIGHT_ROW_TILE and w3.stride(2) == 1
    bn = WEIGHT_ROW_TILE // kp2 if whole else WEIGHT_ROWS if scales is None else WEIGHT_ROWS_GIVEN
    if E * N * K > 0:
        _quant_weight_rows_kernel[(E, triton.cdiv(N, bn))](
            w3, outs[0][0], outs[-1][0], s, N, K, *w3.stride(), FWD=False in layouts, TRANS=True in layouts,
            BN=bn, GIVEN=scales is not None, KP2=kp2 if whole else 0,
            num_warps=WEIGHT_ROW_TILE_WARPS if whole else WEIGHT_ROWS_WARPS)
    return _weight_result(w, outs, transposed)

# %% [markdown]
# The GEMMs take row scales as they are given (`fp8_grouped_mm` with 1-D `sa`, `fp8_grouped_wgrad` with
# `group_scales`), with their own default tiles, `ROW_GEMM` (`benchmarks/fp8_rows.py` sweeps others). On sm90
# Triton lets the tensor cores accumulate FP8 products over the whole K unless told (`max_num_imprecise_acc`, the
# config's `promote`); the H200's accumulator keeps fewer bits than fp32, and how far that moves a product at the
# expert shapes is measured alongside the speed.

# %%
#| export
ROW_GEMM = GemmConfig(128, 256, 128, 8, 3, promote=None)     # fp8_grouped_mm with row scales
ROW_WGRAD = GemmConfig(128, 256, 128, 8, 3, promote=None)    # fp8_grouped_wgrad with group scales (block_k <= 128)

# %% [markdown]
# Checks against plain torch in float64: the row quantization (`quantize_ref` with one block per row) bit for
# bit, with a multiplier and through both SwiGLU activations, and its transpose with the padding zero (alone too,
# without the rows); the column maxima per expert, with and without a row multiplier; the column pass with those
# maxima against each expert's rows quantized one block per column; the weights both ways, from a weight stored
# transposed too; then the two GEMMs against their float64 references, with an empty expert, a one-row expert and
# rows past the last expert.

# %%
def check_rows(counts, M, K, seed):
    counts = torch.tensor(counts)
    n, E = int(counts.sum()), len(counts)
    x, gu, dh, mult = randn(seed, (M, K), (M, 2 * K), (M, K), (E, K))
    x = x * torch.logspace(-3, 3, M)[:, None]
    mult = pow2_scale(mult.abs() * 100)                                  # powers of two, as weight scales are
    expert = torch.repeat_interleave(torch.arange(E), counts)
    bounds = [0] + counts.cumsum(0).tolist()
    tile = [0] + ((counts + 127) // 128).cumsum(0).tolist()
    row_mult = pow2_scale(torch.rand(M) * 1e3)
    for act, src, want in [(None, x, x), ("swiglu", gu, swiglu(gu, impl="triton"))]:
        for rm in (None, row_mult):
            r = quantize_rows(src, counts, act=act, col_amax=True, row_mult=rm, trans=True)
            q, s = quantize_ref(want[:n], (1, K))
            assert torch.equal(r.q[:n].float(), q.float()) and torch.equal(r.s[:n], s[:, 0]), act
            scaled = want if rm is None else want * rm[:, None]
            amax = torch.stack([scaled[a:b].abs().amax(0) if b > a else want.new_zeros(K)
                                for a, b in zip(bounds[:-1], bounds[1:])])
            assert torch.equal(r.col_amax, amax.float()), act
            c = quantize_act(src, counts, rows=False, cols=True, act=act, col_amax=r.col_amax, row_mult=rm)
            for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                cols = slice(128 * tile[e], 128 * tile[e + 1])
                assert (r.qt[:, cols].float()[:, b - a:] == 0).all(), (act, e)        # the padding
                assert torch.equal(r.qt[:, cols][:, :b - a].float(), r.q[a:b].float().T), (act, e)
                if b > a:
                    qe, _ = quantize_ref(scaled[a:b], (b - a, 1))
                    assert torch.equal(c.qt[:, cols][:, :b - a].float(), qe.float().T), (act, e)
    t = quantize_rows(x, counts, trans=True, rows=False)                 # the transpose alone: the same values
    r, used = quantize_rows(x, counts, trans=True), slice(0, 128 * tile[-1])
    assert t.q is None and torch.equal(t.qt[:, used].float(), r.qt[:, used].float()) and torch.equal(t.s[:n], r.s[:n])
    r = quantize_rows(x, counts, mult=mult)
    q, s = quantize_ref(x[:n] * mult[expert], (1, K))
    assert torch.equal(r.q[:n].float(), q.float()) and torch.equal(r.s[:n], s[:, 0])
    gu2 = gu[:, :K]
    r = quantize_rows(gu2, counts, act="swiglu_grad", dh=dh[:, :K // 2], mult=mult)
    gu_ = gu2.clone().requires_grad_()
    swiglu(gu_, impl="triton").backward(dh[:, :K // 2])
    q, s = quantize_ref(gu_.grad[:n] * mult[expert], (1, K))
    assert torch.equal(r.q[:n].float(), q.float()) and torch.equal(r.s[:n], s[:, 0])

t = time.time()
check_rows([70, 0, 1, 131], 212, 200, seed=12)
check_rows([5], 5, 130, seed=13)
whole, ROWS_WHOLE = ROWS_WHOLE, 0         # the two loops for every pass (the default takes whole rows where it can)
check_rows([70, 0, 1, 131], 212, 200, seed=12)
ROWS_WHOLE = whole
(w,) = randn(14, (3, 70, 260))
w = w * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
q, s = quantize_weight_rows(w)
qr, sr = quantize_ref(w, (1, 260))
assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr[..., 0])
for stored_t in (False, True):
    src = w.mT.contiguous().mT if stored_t else w
    qt, st = quantize_weight_rows(src, transposed=True)
    assert torch.equal(qt.float(), q.float().mT) and torch.equal(st, s)
    assert same(quantize_weight_rows(src, "both"), ((q, s), (qt, s)))
assert same(quantize_weight_rows(w[2], "both"), ((q[2], s[2]), (q[2].T, s[2])))
for src, sc, ref in ((w.mT.contiguous().mT, s, q), (w[2], s[2], q[2])):   # given scales: w read once, same values
    for layout in (False, True):
        qg, sg = quantize_weight_rows(src, layout, scales=sc)
        assert torch.equal(qg.float(), ref.float().mT if layout else ref.float()) and torch.equal(sg, sc)
qg, _ = quantize_weight_rows(w, True, scales=2 * s)                   # used as given, not found again
assert torch.equal(qg.float(), (w.double() / (2 * s.double())[..., None]).to(FP8).float().mT)
try:
    quantize_weight_rows(w, True, scales=s[0])
    raise AssertionError("scales of the wrong shape were taken")
except ValueError as e:
    assert "scales must be float32 of shape (3, 70)" in str(e), e
tile = WEIGHT_ROW_TILE
for WEIGHT_ROW_TILE in (0, 512):           # the forward layout by two loops, and by whole rows one to a program
    assert same(quantize_weight_rows(w), (q, s)) and same(quantize_weight_rows(w[2]), (q[2], s[2]))
    assert same(quantize_weight_rows(w.mT.contiguous().mT), (q, s))    # strided rows: the two loops still
WEIGHT_ROW_TILE = tile
print(f"row quantization (activations, weights, per-expert columns) equals the reference ({time.time() - t:.1f} s)")


def check_row_gemms(counts, extra, K, N, cfg=None, seed=0):
    counts = torch.tensor(counts)
    n, E = int(counts.sum()), len(counts)
    x, w, dy = randn(seed, (n + extra, K), (E, N, K), (n + extra, N))
    expert = torch.repeat_interleave(torch.arange(E), counts)
    a, (qw, sw) = quantize_rows(x, counts), quantize_weight_rows(w)
    y = fp8_grouped_mm(a.q, a.s, qw, sw, counts, torch.float32, cfg)
    want = torch.einsum("mk,mnk->mn", fake_quant_rows(x[:n]), fake_quant_rows(w)[expert])
    errs = [rel_err(y[:n], want)]
    g = quantize_rows(dy, counts, mult=sw, col_amax=True)                # the input gradient: dY ⊙ s_W, Wᵀ unscaled
    qwt, _ = quantize_weight_rows(w, transposed=True)
    dx = fp8_grouped_mm(g.q, g.s, qwt, None, counts, torch.float32, cfg)
    want = torch.einsum("mn,mnk->mk", fake_quant_rows(dy[:n] * sw[expert]), qw.double()[expert])
    errs.append(rel_err(dx[:n], want))
    xa = quantize_rows(x, counts, trans=True)                          # the weight gradient: dY ⊙ s_X, X's values
    g = quantize_rows(dy, counts, col_amax=True, row_mult=xa.s)
    gt = quantize_act(dy, counts, rows=False, cols=True, col_amax=g.col_amax, row_mult=xa.s)
    dw = fp8_grouped_wgrad(gt.qt, pow2_scale(g.col_amax), xa.qt, None, counts, torch.float32, cfg, group_scales=True)
    bounds = [0] + counts.cumsum(0).tolist()
    qx, sx = quantize_ref(x[:n], (1, K))
    want = torch.stack([fake_quant(dy[a:b] * sx[a:b], (max(b - a, 1), 1)).T @ qx[a:b].double()
                        for a, b in zip(bounds[:-1], bounds[1:])])
    errs.append(rel_err(dw, want))
    assert max(errs) < EXACT, (counts, K, N, errs)
    assert (dw[counts == 0] == 0).all()
    return max(errs)

t = time.time()
errs = [check_row_gemms([70, 0, 1, 131], 7, 256, 192),
        check_row_gemms([40, 3], 0, 200, 130),
        check_row_gemms([0, 150], 5, 256, 64, GemmConfig(64, 64, 64, 4, 2))]
print(f"row-scaled GEMMs (forward, input and weight gradients) vs reference: max rel err {max(errs):.1e} "
      f"({time.time() - t:.1f} s)")

# %% [markdown]
# ## The expert linear layer
#
# `fp8_grouped_linear(x, w, counts)` is `grouped_linear` (ops/grouped_linear) in FP8: bf16 (or fp32) in and out,
# quantizing inside. With block scales, forward quantizes X both ways in one pass when the weight needs a gradient
# and keeps only the FP8 column quantization for the weight gradient (about 1.1 bytes per element instead of
# bf16's 2), and W in blocks; backward quantizes dY both ways in one pass and quantizes W again, transposed. With
# row scales the forward's one pass writes X's rows and their transpose, the layer keeps the transpose and X's row
# scales, and backward quantizes dY by rows and by columns (above).
# W is a parameter that the backward holds anyway (FSDP2 gathers it again for the backward), so the layer keeps no
# FP8 copy alive between forward and backward (under `train.fp8` the step keeps one, ops/18). The weight gradient
# either runs at once or waits in a `WeightGradQueue`, exactly as in `grouped_linear`: the deferred closure holds
# the two FP8 column quantizations and hands its result to `torch.autograd.backward(w, dW)`, which accumulates it
# into the parameter and fires its hooks.
#
# Two implementations sit behind the one call, chosen by `impl`:
#
# - `"triton"`: the kernels above. The default on CUDA.
# - `"torch"`: the reference, the same quantization in plain torch, multiplied in fp32 one expert at a time
#   (one host sync for the expert bounds). The default elsewhere, so a CPU run needs no interpreter.
#
# Each runs either recipe (`scaling`): "block", DeepSeek-V3's, or "rows", one scale per row ("One scale per row"
# above). PyTorch's own row-scaled grouped GEMM, `torch._scaled_grouped_mm`, measured slower than these kernels at
# the Qwen3 and DeepSeek-V2-Lite expert shapes, forward and backward (`benchmarks/RESULTS.md`, "The three products:
# row scales against block scales"), so the row recipe runs on the kernels above too.

# %%
#| export
def _group_cols(g: Tensor, counts: Tensor, col_amax: Tensor, row_mult: Tensor | None, act: str | None = None,
                dh: Tensor | None = None):
    """The weight gradient's A operand from a row pass's column maxima (`Fp8Rows.col_amax`): the columns of
    `g ⊙ row_mult` (the other operand's row scales) quantized per expert, and their scales."""
    cols = quantize_act(g, counts, rows=False, cols=True, act=act, dh=dh, col_amax=col_amax, row_mult=row_mult)
    return cols.qt, pow2_scale(col_amax)


def _wgrad(g_cols, x_cols, counts, dtype, rows):
    """The weight gradient from the gradient's column quantization and the input's saved one (block: both per token
    tile; rows: the gradient's per expert, the input's the forward's FP8 rows transposed, `x_cols = (qt, s)`)."""
    if rows:
        return fp8_grouped_wgrad(*g_cols, x_cols[0], None, counts, dtype, group_scales=True)
    return fp8_grouped_wgrad(*g_cols, *x_cols, counts, dtype)


def _triton_forward(x, counts, keep_cols, weight, rows, act=None):
    """One layer's output from `x` (or `act` of it, as in `quantize_act`) and what its weight gradient keeps: the
    FP8 rows transposed (rows) or the column quantization (block)."""
    if rows:
        a = quantize_rows(x, counts, act=act, trans=keep_cols)
        y = fp8_grouped_mm(a.q, a.s, *weight(False, quantize_weight_rows), counts, x.dtype)
        return y, ((a.qt, a.s) if keep_cols else ())
    a = quantize_act(x, counts, rows=True, cols=keep_cols, act=act)
    y = fp8_grouped_mm(a.q, a.s, *weight(False, quantize_weight), counts, x.dtype)
    return y, ((a.qt, a.st) if keep_cols else ())


def _triton_backward(dy, w, counts, saved, need_dx, need_dw, weight, rows, act=None, dh=None):
    "One layer's dX and dW's closure (or None) given `dy` (or `act` of it and `dh`, as in `quantize_act`)."
    if rows:                                   # dY ⊙ s_W by rows for dX; dY ⊙ s_X's columns per expert for dW
        qwt, sw = weight(True, quantize_weight_rows)
        sx = saved[1] if need_dw else None
        g = quantize_rows(dy, counts, act=act, dh=dh, mult=sw, col_amax=need_dw, row_mult=sx)
        dx = fp8_grouped_mm(g.q, g.s, qwt, None, counts, dy.dtype) if need_dx else None
        col_amax = g.col_amax
        del qwt, g                             # the rows, and a weight copy made for this use, go before the columns
        g_cols = _group_cols(dy, counts, col_amax, sx, act, dh) if need_dw else None
    else:
        g = quantize_act(dy, counts, rows=need_dx, cols=need_dw, act=act, dh=dh)
        dx = fp8_grouped_mm(g.q, g.s, *weight(True, quantize_weight), counts, dy.dtype) if need_dx else None
        g_cols = (g.qt, g.st)
    wgrad = (lambda: _wgrad(g_cols, saved, counts, w.dtype, rows)) if need_dw else None
    return dx, wgrad


def _pick(fwd: tuple, trans: tuple, transposed: bool | str):
    "A reference weight quantizer's answer from both of its layouts: the one asked, or both for `'both'`."
    layouts = _layouts(transposed)
    return (fwd, trans) if len(layouts) == 2 else (trans if layouts[0] else fwd)


def quantize_weight_ref(w: Tensor, transposed: bool | str = False):
    "`quantize_weight` in plain torch (`quantize_ref` in 128x128 blocks): the weights of the torch implementation."
    q, s = quantize_ref(w, (128, 128))
    return _pick((q, s), (q.mT, s.mT), transposed)


def quantize_weight_rows_ref(w: Tensor, transposed: bool | str = False):
    "`quantize_weight_rows` in plain torch (`quantize_ref` one block per row)."
    q, s = quantize_ref(w, (1, max(w.shape[-1], 1)))
    return _pick((q, s[..., 0]), (q.mT, s[..., 0]), transposed)


def _torch_weight(weight, rows) -> Tensor:
    "The experts' weights as the FP8 layer sees them: their quantization (blocks or rows), dequantized to fp32."
    if rows:
        q, s = weight(False, quantize_weight_rows_ref)
        return q.float() * s[..., None]
    return dequantize_ref(*weight(False, quantize_weight_ref), (128, 128), torch.float32)


def _torch_forward(x, w, counts, keep_x, weight, rows):
    bounds = [0] + counts.cumsum(0).tolist()                  # the reference's one host sync
    xq = fake_quant_rows(x, torch.float32) if rows else fake_quant(x, (1, 128), torch.float32)   # row by row
    wq = _torch_weight(weight, rows)
    y = x.new_zeros(x.shape[0], w.shape[1])
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        y[a:b] = (xq[a:b] @ wq[e].T).to(y.dtype)
    return y, ((x,) if keep_x else ())


def _torch_backward(dy, w, counts, saved, need_dx, need_dw, weight, rows):
    bounds = [0] + counts.cumsum(0).tolist()
    ranges = list(zip(bounds[:-1], bounds[1:]))
    dx = None
    if need_dx:
        dx = dy.new_zeros(dy.shape[0], w.shape[2])
        if rows:                               # dY ⊙ s_W quantized by rows, times W's values
            qw, sw = weight(False, quantize_weight_rows_ref)
            mult = torch.repeat_interleave(sw, counts, dim=0, output_size=bounds[-1])
            gq, wq = dy.float().clone(), qw.float()
            gq[:bounds[-1]] *= mult
            gq = fake_quant_rows(gq, torch.float32)
        else:
            gq, wq = fake_quant(dy, (1, 128), torch.float32), _torch_weight(weight, rows)
        for e, (a, b) in enumerate(ranges):
            dx[a:b] = (gq[a:b] @ wq[e]).to(dx.dtype)
    def wgrad():
        (x,) = saved
        if rows:                               # columns of dY ⊙ s_X per expert, times X's FP8 row values
            q, s = quantize_ref(x[:bounds[-1]], (1, max(x.shape[1], 1)))
            cols = lambda t: fake_quant(t, (max(len(t), 1), 1), torch.float32)
            return torch.stack([cols(dy[a:b] * s[a:b]).T @ q[a:b].float() for a, b in ranges]).to(w.dtype)
        cols = lambda t: fake_quant(t, (128, 1), torch.float32)
        return torch.stack([cols(dy[a:b]).T @ cols(x[a:b]) for a, b in ranges]).to(w.dtype)
    return dx, (wgrad if need_dw else None)

# %% [markdown]
# The autograd function picks the implementation with a plain `if`, runs its forward, and in backward hands the
# weight-gradient closure either to autograd (immediately) or to the queue.

# %%
#| export
class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, wgrad_queue, impl, weight, rows):
        keep = ctx.needs_input_grad[1]
        weight = weight or weight_each_use(w)
        if impl == "triton":
            y, saved = _triton_forward(x, counts, keep, weight, rows)
        else:
            y, saved = _torch_forward(x, w, counts, keep, weight, rows)
        ctx.impl, ctx.queue, ctx.weight, ctx.rows = impl, wgrad_queue, weight, rows
        ctx.param = w if wgrad_queue is not None else None     # the tensor a deferred closure back-propagates into
        ctx.save_for_backward(w, counts, *saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        w, counts, *saved = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dy = dy.contiguous()
        if ctx.impl == "triton":
            dx, wgrad = _triton_backward(dy, w, counts, saved, need_dx, need_dw, ctx.weight, ctx.rows)
        else:
            dx, wgrad = _torch_backward(dy, w, counts, saved, need_dx, need_dw, ctx.weight, ctx.rows)
        return dx, deliver_wgrad(ctx.queue, ctx.param, wgrad), None, None, None, None, None


def weight_each_use(w: Tensor, kept: dict | None = None, key=None):
    """The `weight(transposed, quantize)` of a layer that keeps no copy: quantize w itself at each use, in the
    direction asked. With row scales (`quantize_weight_rows`) a use after the first passes the first's scales on, so
    it reads w once: w does not change between a layer's forward and its backward. `kept`: a dict holding those
    scales under `key` beyond this call, for the uses of later micro-batches while w stays unchanged (ops/18's
    `Fp8Weights` keeps them for the step); without it they last for this call's uses."""
    kept = {} if kept is None else kept
    def weight(transposed: bool, quantize):
        if quantize is not quantize_weight_rows:
            return quantize(w, transposed)
        q, kept[key] = quantize(w, transposed, scales=kept.get(key))
        return q, kept[key]
    return weight


def fp8_grouped_linear(x: Tensor, w: Tensor, counts: Tensor, wgrad_queue: WeightGradQueue | None = None,
                       impl: str | None = None, weight=None, scaling: str = "block") -> Tensor:
    """Per-expert linear in FP8 on grouped rows: `y[rows of e] ≈ x[rows of e] @ w[e]ᵀ` for `x (N, in)`,
    `w (E, out, in)`, `counts (E,)` int64 summing to at most N (later rows: outputs and gradients unspecified).
    Inputs and outputs in x's dtype; quantized inside, `scaling` "block" (1x128 activation tiles, 128x128 weight
    blocks) or "rows" (one scale per row; see "One scale per row"). With `wgrad_queue` the weight gradient waits for
    `wgrad_queue.drain()`. `impl`: "triton", "torch", or None (triton on CUDA, torch elsewhere).
    `weight(transposed, quantize)`: w's quantization, `quantize(w, transposed)` when None, or a copy kept for the
    step (ops/18 `Fp8Weights`)."""
    impl = _check_args("fp8_grouped_linear", x, w, counts, impl, scaling)
    return _Fp8GroupedLinear.apply(x, w, counts, wgrad_queue, impl, weight, scaling == "rows")


SCALINGS = ("block", "rows")


def _check_args(name: str, x: Tensor, w: Tensor, counts: Tensor, impl: str | None, scaling: str) -> str:
    "Refuse what an FP8 expert layer cannot take, in one line (ops/12's checks and the scaling); return the impl."
    impl = check_grouped(name, x, w, counts, impl, ("triton", "torch"))
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    return impl

# %% [markdown]
# ## Checks of the layer
#
# Output and both gradients, through autograd, against the quantized float64 reference (`reference_rows` above for
# the forward; the same quantization of dY, W, and per-expert token tiles for the gradients), for the Triton and the
# torch implementations: **relative error under `EXACT`** in fp32. Against the unquantized float64 product the error is
# the quantization's, **under 5%**. An expert without rows must get an exactly zero weight gradient. In bf16 the
# output and gradients are rounded to bf16 as well (the interpreter truncates: up to 2⁻⁷ relative per element), so
# the bound against the quantized reference is **1e-2**.

# %%
def reference_grads(x, w, counts, dy):
    "dx and dw of the FP8 layer in float64: each product from its operands' quantization (see the table at the top)."
    expert = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    n = len(expert)
    wq = fake_quant(w, (128, 128))
    dx = torch.einsum("mn,mnk->mk", fake_quant(dy[:n], (1, 128)), wq[expert])
    dw = torch.stack([a.T @ b for a, b in zip(fake_quant_cols(dy, counts), fake_quant_cols(x, counts))])
    return dx, dw

def check_layer(counts, n_in, n_out, impl, dtype=torch.float32, extra=0, seed=0, tol=None):
    counts = torch.tensor(counts)
    n = int(counts.sum())
    x, w, dy = randn(seed, (n + extra, n_in), (len(counts), n_out, n_in), (n + extra, n_out))
    x, w, dy = x.to(dtype).requires_grad_(), (w / n_in ** 0.5).to(dtype).requires_grad_(), dy.to(dtype)
    y = fp8_grouped_linear(x, w, counts, impl=impl)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
    xd, wd, dyd = x.detach().double(), w.detach().double(), dy.double()
    dx_ref, dw_ref = reference_grads(xd, wd, counts, dyd)
    errs = [rel_err(y[:n], reference_rows(xd, wd, counts)), rel_err(x.grad[:n], dx_ref), rel_err(w.grad, dw_ref)]
    exact = torch.repeat_interleave(torch.arange(len(counts)), counts)
    quant = rel_err(y[:n], torch.einsum("mk,mnk->mn", xd[:n], wd[exact]))
    assert max(errs) < (tol or (EXACT if dtype == torch.float32 else 1e-2)), (impl, dtype, errs)
    assert quant < 0.05, quant
    assert (w.grad[counts == 0] == 0).all(), "an expert with no rows got a nonzero weight gradient"
    return max(errs), quant

t = time.time()
for impl in ("triton", "torch"):
    for counts, n_in, n_out, extra in [([70, 0, 1, 131], 256, 192, 6), ([0, 0, 9], 130, 136, 0)]:
        err, quant = check_layer(counts, n_in, n_out, impl, extra=extra)
        print(f"{impl:6s} counts {counts}: {err:.1e} vs quantized reference, {quant:.3f} vs exact")
err, _ = check_layer([70, 0, 1, 131], 256, 192, "triton", torch.bfloat16)
print(f"bf16: {err:.1e} vs quantized reference ({time.time() - t:.1f} s)")


# %% [markdown]
# With one scale per row, the two implementations must agree within `EXACT` (the torch one is the definition: each
# operand quantized as the table of "One scale per row" says, multiplied in fp32), the output and gradients must be
# within 5% of the unquantized product, and an expert without rows must get a zero weight gradient.

# %%
def check_rows_layer(counts, n_in, n_out, extra=0, seed=0):
    counts = torch.tensor(counts)
    n = int(counts.sum())
    x, w, dy = randn(seed, (n + extra, n_in), (len(counts), n_out, n_in), (n + extra, n_out))
    w = w / n_in ** 0.5
    got = []
    for impl in ("triton", "torch"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_grouped_linear(xr, wr, counts, impl=impl, scaling="rows")
        y.backward(dy)
        got.append((y[:n].detach(), xr.grad[:n], wr.grad))
    errs = [rel_err(a, b) for a, b in zip(*got)]
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    exact = [torch.einsum("mk,mnk->mn", xd[:n], wd[expert]), torch.einsum("mn,mnk->mk", dyd[:n], wd[expert]),
             torch.stack([dyd[a:b].T @ xd[a:b] for a, b in zip([0] + counts.cumsum(0).tolist()[:-1],
                                                               counts.cumsum(0).tolist())])]
    quant = [rel_err(a, b) for a, b in zip(got[0], exact)]
    assert max(errs) < EXACT and max(quant) < 0.05, (errs, quant)
    assert (got[0][2][counts == 0] == 0).all()
    return max(errs), max(quant)

t = time.time()
for counts, n_in, n_out, extra in [([70, 0, 1, 131], 256, 192, 6), ([0, 0, 9], 130, 136, 0)]:
    err, quant = check_rows_layer(counts, n_in, n_out, extra)
    print(f"rows, counts {counts}: triton vs torch {err:.1e}, {quant:.3f} vs exact")
print(f"({time.time() - t:.1f} s)")

# The layer quantizes its weight at each use (`weight_each_use`): the backward's transposed pass gets the forward's
# row scales, the values the checks above compared. Seen here by standing in for the pass under its own name.
calls, real_pass = [], quantize_weight_rows
def quantize_weight_rows(w, transposed=False, scales=None):
    calls.append((transposed, scales is not None))
    return real_pass(w, transposed, scales)
try:
    x, w, dy = randn(3, (40, 128), (2, 64, 128), (40, 64))
    fp8_grouped_linear(x.requires_grad_(), w.requires_grad_(), torch.tensor([30, 10]), impl="triton",
                       scaling="rows").backward(dy)
finally:
    quantize_weight_rows = real_pass
assert calls == [(False, False), (True, True)], calls
kept, calls = {}, []                       # scales held beyond one call: a later use is given them from its start
quantize_weight_rows = lambda w, transposed=False, scales=None: (calls.append(scales is not None),
                                                                 real_pass(w, transposed, scales))[1]
try:
    for _ in range(2):
        weight_each_use(w, kept, "w")(False, quantize_weight_rows)
finally:
    quantize_weight_rows = real_pass
assert calls == [False, True] and torch.equal(kept["w"], real_pass(w)[1]), calls

# %% [markdown]
# **Deferred equals immediate, bitwise**, as in ops/grouped_linear: two layers, two backward passes accumulating
# into the same `.grad`. With the queue, the input gradient is there after backward and the weight gradients are
# not; after `drain()` all equal the immediate run's bit for bit. A weight without `requires_grad` keeps no column
# quantization and gets no closure.

# %%
t = time.time()
counts = torch.tensor([3, 0, 140, 1])
x, w1, w2 = randn(5, (144, 128), (4, 128, 128), (4, 64, 128))
x, w1, w2 = x.requires_grad_(), (w1 / 11).requires_grad_(), (w2 / 11).requires_grad_()
grads = {}
for queue in (None, WeightGradQueue()):
    for p in (x, w1, w2):
        p.grad = None
    for _ in range(2):
        h = torch.relu(fp8_grouped_linear(x, w1, counts, queue, "triton"))
        fp8_grouped_linear(h, w2, counts, queue, "triton").square().sum().backward()
    if queue is not None:
        assert len(queue) == 4 and w1.grad is None and w2.grad is None and x.grad is not None
        queue.drain()
        assert len(queue) == 0
    grads[queue is None] = [p.grad.clone() for p in (x, w1, w2)]
assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
assert (grads[True][1][1] == 0).all() and (grads[True][2][1] == 0).all()
frozen = w2.detach()
y = fp8_grouped_linear(x, frozen, counts, impl="triton")
assert len(y.grad_fn.saved_tensors) == 2                    # w and counts only: no column quantization kept
print(f"deferred == immediate, bitwise ({time.time() - t:.1f} s)")

# %% [markdown]
# Rows past the last expert change nothing, and bad input says what to change (CPU tensors: on CUDA the counts
# check is a device-side assert, fatal to the process).

# %%
counts = torch.tensor([5, 0, 20])
x, w, dy = randn(6, (32, 128), (3, 64, 128), (32, 64))
outs = []
for rows in (32, 25):
    xa, wa = x[:rows].clone().requires_grad_(), w.clone().requires_grad_()
    ya = fp8_grouped_linear(xa, wa, counts, impl="triton")
    ya.backward(dy[:rows])
    outs.append((ya[:25], xa.grad[:25], wa.grad))
assert all(torch.equal(a, b) for a, b in zip(*outs))

cpu = dict(device="cpu")
for bad, msg in [
        (lambda: fp8_grouped_linear(torch.zeros(4, 8, **cpu), torch.zeros(2, 16, 8, **cpu),
                                    torch.tensor([3, 2], **cpu), impl="torch"), "at most the 4"),
        (lambda: fp8_grouped_linear(torch.zeros(4, 8, **cpu), torch.zeros(2, 16, 8, **cpu),
                                    torch.tensor([1, 3], dtype=torch.int32, **cpu)), "int64"),
        (lambda: fp8_grouped_linear(torch.zeros(4, 7, **cpu), torch.zeros(2, 16, 8, **cpu),
                                    torch.tensor([1, 3], **cpu)), "w (E, out, in)"),
        (lambda: fp8_grouped_linear(torch.zeros(4, 8, **cpu), torch.zeros(2, 16, 8, **cpu),
                                    torch.tensor([1, 3], **cpu), impl="blockwise"), "impl must be"),
        (lambda: fp8_grouped_mm(torch.zeros(4, 8, **cpu), torch.zeros(4, 1, **cpu), torch.zeros(2, 16, 8, **cpu),
                                torch.zeros(2, 1, 1, **cpu), torch.tensor([1, 3], **cpu), torch.float32), "float8"),
        (lambda: fp8_grouped_mm(torch.zeros(4, 8, **cpu).to(FP8), torch.ones(1, 4, **cpu).t(),
                                torch.zeros(2, 16, 8, **cpu).to(FP8), torch.ones(2, 1, 1, **cpu),
                                torch.tensor([1, 3], **cpu), torch.float32, GemmConfig(block_k=256)), "block_k"),
        (lambda: fp8_grouped_mm(torch.zeros(4, 8, **cpu).to(FP8), torch.ones(1, 4, **cpu).t(),
                                torch.zeros(2, 16, 8, **cpu).to(FP8), torch.ones(2, 1, 1, **cpu),
                                torch.tensor([1, 3], **cpu), torch.float32, GemmConfig(block_n=256)), "divide 128")]:
    try:
        bad()
    except (ValueError, RuntimeError) as e:
        assert msg in str(e), e
    else:
        raise AssertionError(f"no error for {msg}")

# %% [markdown]
# ## SwiGLU experts: the activation inside the quantization passes
#
# Between its two projections a SwiGLU expert computes `h = silu(gate) · up` from `gate_up (M, 2I)`, and in FP8 the
# down projection's first act is to quantize `h`; in backward the gate-up projection's first act is to quantize
# the gradient SwiGLU's backward just wrote. Each time one kernel writes an activation in bf16 and the next reads
# it back to quantize it. `quantize_act` takes the activation's inputs instead (`act`): with `"swiglu"` it reads
# `gate_up` and quantizes `swiglu(gate_up)`, with `"swiglu_grad"` it reads `gate_up` and `dh` and quantizes the
# gradient `[dgate | dup]` (each 128-wide tile finds its columns' gate, up and dh; a tile may straddle the two
# halves). Neither `h` nor its gradient is ever written in bf16: per layer that saves a write and a read of
# `(M, I)` forward and of `(M, 2I)` backward. The gradient pass gives part of that back, since the tiles of both
# halves read gate and dh for their columns; on the H200 the fused experts run as fast as the layers apart at
# Qwen3's shape and slightly faster at DeepSeek-V2-Lite's (benchmarks/RESULTS.md, "The expert MLP and its
# quantization passes").
#
# `fp8_swiglu_experts(x, w_gate_up, w_down, counts)` is `down(swiglu(gate_up(x)))` in FP8. With the Triton kernels
# it is two autograd functions around the fused passes. The first computes `gate_up` and saves it with the input's
# quantization; the second quantizes `swiglu(gate_up)` as it reads it, runs the down projection and saves `h`'s
# quantization. Between them `h` exists only as a stand-in of its shape that holds no bytes (one zero, expanded), so
# the down half's backward hands `dh` to the gate/up half through autograd. Together they save what the two layers
# and SwiGLU saved apart, and defer both weight gradients to a queue the same way. The torch implementation is the
# two layers and SwiGLU apart.
#
# The split is where the memory goes. Autograd holds a node's incoming gradient and its saved tensors until its
# backward returns; as two nodes, the down half's `dY` (as wide as the model, one row per routed row) and its `h` rows
# are gone before the gate/up half starts, as bf16's separate nodes free them. Within each half the rows and a weight
# copy made for this use go once `dX` is computed, before the column pass. The gate/up half's incoming `dh` and its
# saved `gate_up` are read last by the two quantizations of the SwiGLU gradient, so the node empties both in place
# then (`_release`, the tensor left with no elements), before the gate/up weight gradient; a second backward through
# the same graph (`retain_graph=True`) then stops with an error instead of reading freed memory, already in the down
# half, before it adds a second weight gradient, since both halves share the flag. engine/37 counts the moments
# (`fp8_backward_bytes`).
#
# GPT-OSS's experts (biases, a clamped SwiGLU on interleaved columns) call the layers one by one.

# %%
#| export
_SECOND_BACKWARD = ("fp8_swiglu_experts frees what it saved as its backward goes: a second backward through the "
                    "same graph (retain_graph=True) is not supported; run the forward again")


def _keep_half(ctx, w, wgrad_queue, weight, keep, rows, released) -> None:
    "What either half's backward reads besides its saved tensors; `released` is the flag the two halves share."
    ctx.queue, ctx.weight, ctx.keep, ctx.rows, ctx.released = wgrad_queue, weight, keep, rows, released
    ctx.param = w if wgrad_queue is not None else None     # the tensor a deferred closure back-propagates into


class _Fp8GateUp(torch.autograd.Function):
    "The experts' first half: `x` to `gate_up`, saved for SwiGLU, and a stand-in for `h` that carries `dh` back."
    @staticmethod
    def forward(ctx, x, w1, counts, wgrad_queue, weight1, rows, released):
        keep = ctx.needs_input_grad[1]
        gate_up, xs = _triton_forward(x, counts, keep, weight1, rows)
        _keep_half(ctx, w1, wgrad_queue, weight1, keep, rows, released)
        ctx.save_for_backward(w1, counts, gate_up, *xs)
        ctx.mark_non_differentiable(gate_up)
        ctx.set_materialize_grads(False)
        return gate_up, gate_up.new_zeros(()).expand(gate_up.shape[0], gate_up.shape[1] // 2)   # h's shape, no bytes

    @staticmethod
    def backward(ctx, _, dh):
        if ctx.released[0]:
            raise RuntimeError(_SECOND_BACKWARD)
        w1, counts, gate_up, *xs = ctx.saved_tensors
        dx, wgrad1 = _triton_backward(gate_up, w1, counts, xs, ctx.needs_input_grad[0], ctx.keep, ctx.weight,
                                      ctx.rows, "swiglu_grad", dh)
        _release(dh, gate_up)        # both quantizations of the SwiGLU gradient are made: they were the last readers
        ctx.released[0] = True
        return dx, deliver_wgrad(ctx.queue, ctx.param, wgrad1), None, None, None, None, None


class _Fp8SwiGLUDown(torch.autograd.Function):
    "The second half: SwiGLU of `gate_up` quantized in one pass, then the down projection; `dh` goes to the stand-in."
    @staticmethod
    def forward(ctx, gate_up, h, w2, counts, wgrad_queue, weight2, rows, released):
        keep = ctx.needs_input_grad[2]
        y, hs = _triton_forward(gate_up, counts, keep, weight2, rows, act="swiglu")
        _keep_half(ctx, w2, wgrad_queue, weight2, keep, rows, released)
        ctx.save_for_backward(w2, counts, *hs)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.released[0]:          # refused before this half adds a second weight gradient the other half cannot
            raise RuntimeError(_SECOND_BACKWARD)
        w2, counts, *hs = ctx.saved_tensors
        dh, wgrad2 = _triton_backward(dy.contiguous(), w2, counts, hs, ctx.needs_input_grad[1], ctx.keep, ctx.weight,
                                      ctx.rows)
        return None, dh, deliver_wgrad(ctx.queue, ctx.param, wgrad2), None, None, None, None, None


def _release(*tensors: Tensor) -> None:
    """Free the memory of tensors a node saved or received, now: autograd holds them until the node's backward returns,
    so dropping the name is not enough. Each is left with no elements (both halves then refuse a second backward,
    `released`)."""
    for t in tensors:
        t.data = t.new_empty(0)


def fp8_swiglu_experts(x: Tensor, w_gate_up: Tensor, w_down: Tensor, counts: Tensor,
                       wgrad_queue: WeightGradQueue | None = None, impl: str | None = None,
                       weight_gate_up=None, weight_down=None, scaling: str = "block") -> Tensor:
    """`down(swiglu(gate_up(x)))` in FP8 for SwiGLU experts: `x (N, H)`, `w_gate_up (E, 2I, H)` (gate rows, then
    up), `w_down (E, H, I)`, `counts (E,)`; the arguments as `fp8_grouped_linear`'s, one weight copy for each
    projection. The Triton implementation computes SwiGLU and its gradient inside the quantization passes."""
    impl = _check_args("fp8_swiglu_experts", x, w_gate_up, counts, impl, scaling)
    if w_down.dim() != 3 or w_down.shape[0] != w_gate_up.shape[0] or 2 * w_down.shape[2] != w_gate_up.shape[1]:
        raise ValueError(f"fp8_swiglu_experts wants w_down (E, H, I) for w_gate_up (E, 2I, H), got "
                         f"{tuple(w_down.shape)} and {tuple(w_gate_up.shape)}")
    if impl == "torch":
        h = swiglu(fp8_grouped_linear(x, w_gate_up, counts, wgrad_queue, impl, weight_gate_up, scaling), impl="torch")
        return fp8_grouped_linear(h, w_down, counts, wgrad_queue, impl, weight_down, scaling)
    rows, released = scaling == "rows", [False]   # True once the gate/up half has emptied what it saved
    gate_up, h = _Fp8GateUp.apply(x, w_gate_up, counts, wgrad_queue, weight_gate_up or weight_each_use(w_gate_up), rows,
                                  released)
    return _Fp8SwiGLUDown.apply(gate_up, h, w_down, counts, wgrad_queue, weight_down or weight_each_use(w_down), rows,
                                released)

# %% [markdown]
# The fused passes quantize exactly what the unfused ones do: in fp32 (under the interpreter, or in fp32 on a GPU)
# `swiglu` in ops/swiglu and these passes compute each element with the same expression, so the quantizations
# must be **bitwise equal** — at a width `I` that is no multiple of 128 (tiles of the gradient straddle the gate and
# up halves), with an empty expert and rows past the last one. Then the whole function against the two layers and
# SwiGLU's Triton kernel apart: output and the three gradients bitwise equal, immediate and deferred to a queue.

# %%
def check_fused_act(counts, M, I, seed):
    gate_up, dh = randn(seed, (M, 2 * I), (M, I))
    counts = torch.tensor(counts)
    n = int(counts.sum())
    fwd = quantize_act(gate_up, counts, rows=True, cols=True, act="swiglu")
    ref = quantize_act(swiglu(gate_up, impl="triton"), counts, rows=True, cols=True)
    grad = quantize_act(gate_up, counts, rows=True, cols=True, act="swiglu_grad", dh=dh)
    gate_up_ = gate_up.clone().requires_grad_()
    swiglu(gate_up_, impl="triton").backward(dh)
    ref_grad = quantize_act(gate_up_.grad, counts, rows=True, cols=True)
    tiles = int(((counts + 127) // 128).sum())                # the column tiles in use (the rest is never written)
    for got, want in ((fwd, ref), (grad, ref_grad)):
        assert torch.equal(got.q[:n].float(), want.q[:n].float()) and torch.equal(got.s[:n], want.s[:n])
        assert torch.equal(got.qt[:, :128 * tiles].float(), want.qt[:, :128 * tiles].float())
        assert torch.equal(got.st[:tiles], want.st[:tiles])

t = time.time()
check_fused_act([70, 0, 1, 131], 205, 72, seed=8)        # 2I = 144: the gradient's second tile straddles
check_fused_act([5], 5, 128, seed=9)


def check_fused_experts(counts, n_in, inter, extra, seed, scaling="block"):
    counts = torch.tensor(counts)
    n = int(counts.sum())
    x, w1, w2, dy = randn(seed, (n + extra, n_in), (len(counts), 2 * inter, n_in), (len(counts), n_in, inter),
                          (n + extra, n_in))
    x, w1, w2 = x.requires_grad_(), (w1 / n_in ** 0.5).requires_grad_(), (w2 / inter ** 0.5).requires_grad_()
    runs = []
    for fused in (True, False):
        for queue in (None, WeightGradQueue()):
            for p in (x, w1, w2):
                p.grad = None
            if fused:
                y = fp8_swiglu_experts(x, w1, w2, counts, queue, impl="triton", scaling=scaling)
            else:
                h = swiglu(fp8_grouped_linear(x, w1, counts, queue, "triton", scaling=scaling), impl="triton")
                y = fp8_grouped_linear(h, w2, counts, queue, "triton", scaling=scaling)
            y.backward(dy)
            if queue is not None:
                assert w1.grad is None and w2.grad is None and len(queue) == 2
                queue.drain()
            runs.append([y[:n].detach(), x.grad[:n], w1.grad, w2.grad])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))
    assert (runs[0][2][counts == 0] == 0).all() and (runs[0][3][counts == 0] == 0).all()

check_fused_experts([70, 0, 1, 131], 160, 72, 3, seed=10)
check_fused_experts([70, 0, 1, 131], 160, 72, 3, seed=10, scaling="rows")

# The down half's incoming `dY` is freed before the gate/up half runs (a product's backward makes it, as the
# experts' reduce does in the model); the gate/up half empties its saved `gate_up`, a second backward says what to
# do, and a node with no rows at all runs.
for queue in (None, WeightGradQueue()):
    x, w1, w2, dy = randn(11, (40, 128), (2, 64, 128), (2, 128, 32), (40, 128))
    x, w1, w2 = x.requires_grad_(), w1.requires_grad_(), w2.requires_grad_()
    y = fp8_swiglu_experts(x, w1, w2, torch.tensor([30, 10]), queue, impl="triton", scaling="rows")
    up = y.grad_fn.next_functions[1][0]                   # the gate/up half, through the stand-in for h
    gate_up, seen = up.saved_tensors[2], {}
    y.register_hook(lambda g: seen.update(dy=StorageWeakRef(g.untyped_storage())))

    def before_up(grads):   # the interpreter leaves a launch's arguments in reference cycles: collect them first
        gc.collect()
        seen["freed"] = seen["dy"].expired()
    up.register_prehook(before_up)
    (2 * y).backward(dy, retain_graph=True)
    assert seen["freed"] and gate_up.numel() == 0 and x.grad.shape == x.shape
    before = (len(queue) if queue is not None else 0, None if w2.grad is None else w2.grad.clone())
    try:
        (2 * y).backward(dy)
    except RuntimeError as e:
        assert "retain_graph=True" in str(e), e
    else:
        raise AssertionError("a second backward through the released node ran")
    assert len(queue or ()) == before[0] and (before[1] is None or torch.equal(w2.grad, before[1]))   # nothing added
    if queue is not None:
        queue.drain()
        assert w2.grad is not None and w2.grad.abs().sum() > 0
x = torch.zeros(0, 128, requires_grad=True)
fp8_swiglu_experts(x, w1, w2, torch.tensor([0, 0]), impl="triton", scaling="rows").sum().backward()
assert x.grad.shape == (0, 128)
for bad, msg in [(lambda: quantize_act(torch.zeros(4, 9), act="swiglu"), "even width"),
                 (lambda: quantize_act(torch.zeros(4, 8), act="swiglu_grad"), "dh (M, I)"),
                 (lambda: quantize_act(torch.zeros(4, 8), act="gelu"), "act must be"),
                 (lambda: fp8_swiglu_experts(torch.zeros(4, 8), torch.zeros(2, 16, 8), torch.zeros(2, 8, 6),
                                             torch.tensor([1, 3])), "w_down (E, H, I)")]:
    try:
        bad()
    except ValueError as e:
        assert msg in str(e), e
    else:
        raise AssertionError(f"no error for {msg}")
print(f"fused SwiGLU passes equal the unfused ones, bitwise; the experts too ({time.time() - t:.1f} s)")

# %% [markdown]
# ## Dense projections
#
# The attention projections, MLA's down and up projections, shared experts and dense MLP layers are plain linear
# layers: one weight, every token. In FP8 they are the experts' layer with a single group of all `M` rows, so they
# take the same recipe, kernels and torch definition, with `counts = [M]`. Two things differ from the experts:
#
# - **Several projections read one input.** q, k and v read the same normed hidden state, as do a MLP's gate and
#   up, MLA's two down projections and Qwen3.5's input projections. `fp8_linear` takes their weights as a list and
#   runs them as one layer over the weights stacked along the output dimension: the input is quantized once for all
#   of them, and one GEMM computes them all. Under row scales each output row of a weight has its own scale, so
#   stacking the weights changes no value, only the number of passes and launches.
# - **They run inside the compiled stage.** Stage 1 compiles in one graph, which a Python-side dict of weight
#   copies would break; so the layer is one custom operator (`pith_lit::fp8_linear` with its backward) that
#   `torch.compile` keeps whole, and it quantizes its weights at each call, both layouts' worth over the step: the
#   forward layout in the forward, the transposed in the backward. The input's FP8 rows are made again in the
#   backward from the bf16 input it saves (the input the bf16 layer would save), so the FP8 path holds no more
#   memory between the forward and the backward than bf16's.
#
# Against bf16 the layer runs its GEMMs on FP8 operands and pays six passes over memory that bf16 does not: X by
# rows in the forward and again transposed in the backward, the weight in each layout, and dY twice (its rows with
# the weight's scales, then its columns with X's). Each pass costs in proportion to a width, the products in
# proportion to the product of two, and each call launches some twenty kernels, so the layer pays only where both
# its input and its output are wide (benchmarks/RESULTS.md, "FP8 dense projections", measures where). The models
# therefore put a projection in FP8 only where both widths reach `Options.fp8_dense_min` (models/20).
#
# The torch implementation is the definition, as for the experts; the check below compares both against the row
# recipe written out in float64 from `quantize_ref`: `Y = (q_X s_X)(q_W s_W)ᵀ`; `dX` from the rows of `dY ⊙ s_W`
# quantized, times `q_W`; `dW` from the columns of `dY ⊙ s_X` quantized over all tokens, times `q_X`.

# %%
#| export
def _single(x: Tensor) -> Tensor:
    "The `counts` of one group holding all of x's rows."
    return torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)


def _stacked(weights: list[Tensor]) -> Tensor:
    "The weights as one group `(1, Σ out_i, in)`: one weight is read in place, several are stacked into a copy."
    return (weights[0] if len(weights) == 1 else torch.cat(weights))[None]


def _input_cols(x: Tensor, counts: Tensor, rows: bool) -> tuple:
    "What the weight gradient reads of the layer's input, as `_triton_forward` keeps it."
    if rows:
        a = quantize_rows(x, counts, trans=True, rows=False)
        return a.qt, a.s
    a = quantize_act(x, counts, rows=False, cols=True)
    return a.qt, a.st


@torch.library.custom_op("pith_lit::fp8_linear", mutates_args=())
def _fp8_linear(x: Tensor, weights: list[Tensor], impl: str, rows: bool) -> Tensor:
    w = _stacked(weights)
    if impl == "triton":
        return _triton_forward(x, _single(x), False, weight_each_use(w), rows)[0]
    return _torch_forward(x, w, _single(x), False, weight_each_use(w), rows)[0]


@_fp8_linear.register_fake
def _(x, weights, impl, rows):
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))


@torch.library.custom_op("pith_lit::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward(dy: Tensor, x: Tensor, weights: list[Tensor], impl: str, rows: bool) -> list[Tensor]:
    "dx and the stacked weights' gradient."
    w, counts, dy = _stacked(weights), _single(x), dy.contiguous()
    if impl == "triton":
        dx, wgrad = _triton_backward(dy, w, counts, _input_cols(x, counts, rows), True, True, weight_each_use(w), rows)
    else:
        dx, wgrad = _torch_backward(dy, w, counts, (x,), True, True, weight_each_use(w), rows)
    return [dx, wgrad()[0]]


@_fp8_linear_backward.register_fake
def _(dy, x, weights, impl, rows):
    return [torch.empty_like(x), x.new_empty(sum(w.shape[0] for w in weights), x.shape[1])]


def _fp8_linear_setup(ctx, inputs, output):
    x, weights, ctx.impl, ctx.rows = inputs
    ctx.save_for_backward(x, *weights)


def _fp8_linear_grad(ctx, dy):
    x, *weights = ctx.saved_tensors
    dx, dw = _fp8_linear_backward(dy, x, weights, ctx.impl, ctx.rows)
    return dx, list(dw.split([w.shape[0] for w in weights])), None, None


_fp8_linear.register_autograd(_fp8_linear_grad, setup_context=_fp8_linear_setup)


def fp8_linear(x: Tensor, weights: list[Tensor], scaling: str = "rows", impl: str | None = None) -> Tensor:
    """`x @ cat(weights)ᵀ` in FP8 for `x (..., in)` and `weights`, a list of `(out_i, in)` matrices that read the
    same input: one layer over the stacked weights (the experts' recipe with one group of all rows, `scaling` as
    `fp8_grouped_linear`'s), one custom operator that `torch.compile` keeps whole. Returns `(..., Σ out_i)` in x's
    dtype. `impl`: "triton", "torch", or None (triton on CUDA, torch elsewhere)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if not weights or any(w.dim() != 2 or w.shape[1] != x.shape[-1] or w.dtype != x.dtype for w in weights):
        raise ValueError(f"fp8_linear wants weights (out, {x.shape[-1]}) in {x.dtype}, got "
                         f"{[(tuple(w.shape), w.dtype) for w in weights]}")
    impl = impl or ("triton" if x.is_cuda else "torch")
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton', 'torch' or None, got {impl!r}")
    y = _fp8_linear(x.reshape(-1, x.shape[-1]), list(weights), impl, scaling == "rows")
    return y.view(*x.shape[:-1], y.shape[-1])

# %%
def dense_rows_ref(x, w, dy):
    "y, dx, dw of the row recipe for one dense layer, written out in float64 from `quantize_ref`."
    (qx, sx), (qw, sw) = quantize_ref(x, (1, x.shape[1])), quantize_ref(w, (1, w.shape[1]))
    xq, wq = qx.double() * sx, qw.double() * sw
    qg, sg = quantize_ref(dy * sw[:, 0], (1, dy.shape[1]))
    qh, ch = quantize_ref(dy * sx, (dy.shape[0], 1))
    return xq @ wq.T, (qg.double() * sg) @ qw.double(), (qh.double() * ch).T @ qx.double()

def check_dense(M, n_in, outs, impl, dtype=torch.float32, seed=0, tol=EXACT):
    x, dy, *ws = randn(seed, (M, n_in), (M, sum(outs)), *[(o, n_in) for o in outs])
    x = x.to(dtype).requires_grad_()
    ws = [(w / n_in ** 0.5).to(dtype).requires_grad_() for w in ws]
    y = fp8_linear(x[None], ws, impl=impl)[0]          # a leading dim, as the models' (B, S, H)
    y.backward(dy.to(dtype))
    w_all = torch.cat([w.detach() for w in ws]).double()
    y_ref, dx_ref, dw_ref = dense_rows_ref(x.detach().double(), w_all, dy.to(dtype).double())
    errs = [rel_err(y, y_ref), rel_err(x.grad, dx_ref), rel_err(torch.cat([w.grad for w in ws]), dw_ref)]
    assert max(errs) < tol, (impl, dtype, errs)
    assert rel_err(y, x.detach().double() @ w_all.T) < 0.05
    return max(errs)

t = time.time()
for impl in ("triton", "torch"):
    err = max(check_dense(200, 256, [192, 64, 64], impl), check_dense(131, 130, [136], impl, seed=1))
    print(f"fp8_linear {impl}: {err:.1e} vs the row recipe in float64")
print(f"bf16: {check_dense(200, 256, [192, 64], 'triton', torch.bfloat16, tol=1e-2):.1e} ({time.time() - t:.1f} s)")

# %% [markdown]
# Compiled in one graph with its backward (`aot_eager`, the graph capture that inductor builds on), the operator
# must give what it gives eagerly, bit for bit; and a weight of another width than the input's is refused.

# %%
x, w1, w2, dy = randn(2, (64, 128), (96, 128), (32, 128), (64, 128))
runs = []
for compiled in (False, True):
    xs, ws = x.clone().requires_grad_(), [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
    f = lambda a, b, c: fp8_linear(a, [b, c]).sin()
    y = (torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f)(xs, *ws)
    y.backward(dy)
    runs.append([y.detach(), xs.grad, ws[0].grad, ws[1].grad])
assert all(torch.equal(a, b) for a, b in zip(*runs))
torch._dynamo.reset()   # drop the compiled function's cache now, not at interpreter exit
try:
    fp8_linear(x, [w1, torch.zeros(8, 64)])
except ValueError as e:
    assert "weights (out, 128)" in str(e), e
else:
    raise AssertionError("a weight of the wrong width was taken")
print("fp8_linear compiled in one graph equals eager, bitwise")

# %%
print(f"CPU checks done in {time.time() - T0:.1f} s")

# %% [markdown]
# ## Speed, and what bounds it
#
# `benchmarks/fp8_rows.py` times each product and the whole SwiGLU expert MLP under both scalings against bf16,
# `benchmarks/fp8_bench.py` and `benchmarks/fp8_bound.py` the block-scaled pieces and variants of its GEMM
# (benchmarks/RESULTS.md, "FP8", and "FP8 end to end" for the bench end to end). Three things bound the experts in
# FP8 on the H200:
#
# - **Promotion, under block scales.** A step's scales apply to a finished 128-deep product, so each step waits for
#   its tensor-core instruction to complete (`wgmma.wait_group 0` in the kernel's PTX) and then runs the
#   multiply-adds while the tensor cores idle. Issuing the next product before promoting the last changes nothing
#   (Triton still waits right after each product), and neither does Triton's warp specialisation of the loop; a
#   Gluon kernel with DeepGEMM's structure (a producer warp, two math partitions that promote in turn) gains a few
#   per cent (benchmarks/RESULTS.md). So the three block-scaled products together run at about bf16's speed.
#   Row scales take the promotion away: the products chain inside `tl.dot` and run well above bf16's speed at both
#   models' expert shapes. The tensor cores then accumulate the whole K (Triton's default on sm90; promoting into
#   fp32 every 128 of K costs much of the gain), which adds an error far below the quantization's own.
# - **Quantization.** Every FP8 operand is written by a pass of its own that reads the bf16 activation: the input
#   and `dY`, and SwiGLU's output and gradient (computed inside their passes, `fp8_swiglu_experts`). Under row
#   scales the forward's passes read their activation once and write it twice (rows, and the transpose the weight
#   gradient reads), and the backward's read each gradient twice, once for the rows and once more for the columns
#   the weight gradient needs, whose scales exist only after the row pass has seen all of an expert's rows. At
#   these widths (hidden 2048, experts 768 and 1408 wide) the passes take most of what the GEMMs save, so the whole
#   expert MLP in FP8 runs near bf16's speed with row scales (a little under it at Qwen3's width, a little over at
#   DeepSeek-V2-Lite's) and slower with block scales. The quantization of the experts' input stays a
#   pass of its own: the rows it reads are gathered by the dispatcher's `expand` (the engine's permutation, one per
#   dispatcher: one rank, or expert parallelism after the all-to-all) just before the model's `stage3` (models/20),
#   and folding that gather into the experts' first kernel would make the model's experts depend on each
#   dispatcher's row layout, which the layer protocol keeps on the engine's side. The weights' pass (both layouts
#   from one read) is paid once per step: with one micro-batch per step it costs the Qwen3 bench more than the
#   MLPs' own deficit; with several micro-batches per step it is shared among them.
# - **The experts' share of a step.** The expert MLPs are about a quarter of a bench step's time in bf16; attention,
#   the dense projections, the head and the optimizer take the rest. So even experts at twice bf16's speed, with
#   quantization free, leave the step well short of 1.25× faster. The dense projections in FP8 (above) gain only
#   where both their widths are large, and there less than the experts' products do.
#
# `train.fp8_scaling` chooses between the two recipes; benchmarks/RESULTS.md has the figures for all of the above,
# both recipes against bf16 end to end, and their loss curves (`nbs/validate/v05_fp8`).

# %% [markdown]
# ## Passes over memory, layer by layer
#
# What FP8 adds to a layer is the passes that read an operand in bf16 and write it in E4M3, and what fusion takes away
# is passes. The table below counts them for each FP8 layer, per row that runs through the layer (a routed row for the
# experts, a token for a dense projection), in bytes of values read and written: bf16 is 2 bytes, E4M3 1. Left out are
# the fp32 scales (one per row or column, 0.1% of the bytes or less) and the column maxima that the passes marked so
# write for each tile of 32 rows and then reduce per expert (an eighth of a byte per value, written once and read
# once: about 8% on top of those passes' bytes). The experts are shown three ways: in bf16, where the only passes are
# SwiGLU's and its gradient's (ops/14's kernels); in FP8 with SwiGLU computed apart (each FP8 projection fed by a bf16
# `h` or `dgate_up`, as the layers composed by hand run); and in FP8 as `fp8_swiglu_experts` runs, SwiGLU inside the
# quantization passes. The weights' passes are counted per weight element and step: with one micro-batch a step each
# weight is read twice (its forward layout made in the forward, its transposed one in the backward), with several it
# is read once for both layouts (ops/18's step copies).
#
# The cell after the table runs each FP8 layer under a counter that records every quantization pass it launches,
# in order, with the bytes of values passed in and out, and checks both against the table, at a shape where the
# column layouts need no padding tiles (one expert, rows a multiple of 128).

# %%
QUANT_PASSES = ("quantize_rows", "quantize_act", "quantize_weight_rows")


def _value_bytes(obj) -> int:
    "Bytes of the bf16 and E4M3 tensors in obj (a tensor, or a tuple or list of them); scales and counts excluded."
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size() if obj.element_size() <= 2 else 0
    return sum(_value_bytes(o) for o in obj) if isinstance(obj, (tuple, list)) else 0


@contextmanager
def counting_passes():
    "Within, every call of a quantization pass this notebook defines appends (name, act, bytes in, bytes out)."
    log, names, g = [], QUANT_PASSES, globals()
    saved = {n: g[n] for n in names}

    def counted(name, f):
        def run(*args, **kwargs):
            out = f(*args, **kwargs)
            log.append((name, kwargs.get("act"), _value_bytes(list(args) + list(kwargs.values())), _value_bytes(out)))
            return out
        return run

    g.update({n: counted(n, f) for n, f in saved.items()})
    try:
        yield log
    finally:
        g.update(saved)


# Each pass: (what it passes over, the function that runs it or None for ops/14's SwiGLU kernels, its act, bytes
# read and bytes written per row, each as (a, b) for a·H + b·I: the experts' hidden and expert widths, or a
# dense projection's input and output widths)
EXPERT_PASSES = {
    "bf16": [
        ("SwiGLU", None, None, (0, 4), (0, 2)),
        ("SwiGLU's gradient", None, None, (0, 6), (0, 4))],
    "FP8, SwiGLU apart": [
        ("x: rows and their transpose", "quantize_rows", None, (2, 0), (2, 0)),
        ("SwiGLU", None, None, (0, 4), (0, 2)),
        ("h: rows and their transpose", "quantize_rows", None, (0, 2), (0, 2)),
        ("dY ⊙ s_W2: rows, column maxima", "quantize_rows", None, (2, 0), (1, 0)),
        ("dY ⊙ s_h: columns", "quantize_act", None, (2, 0), (1, 0)),
        ("SwiGLU's gradient", None, None, (0, 6), (0, 4)),
        ("dgate_up ⊙ s_W1: rows, column maxima", "quantize_rows", None, (0, 4), (0, 2)),
        ("dgate_up ⊙ s_x: columns", "quantize_act", None, (0, 4), (0, 2))],
    "FP8, SwiGLU inside": [
        ("x: rows and their transpose", "quantize_rows", None, (2, 0), (2, 0)),
        ("SwiGLU: rows and their transpose", "quantize_rows", "swiglu", (0, 4), (0, 2)),
        ("dY ⊙ s_W2: rows, column maxima", "quantize_rows", None, (2, 0), (1, 0)),
        ("dY ⊙ s_h: columns", "quantize_act", None, (2, 0), (1, 0)),
        ("SwiGLU's gradient ⊙ s_W1: rows, column maxima", "quantize_rows", "swiglu_grad", (0, 6), (0, 2)),
        ("SwiGLU's gradient ⊙ s_x: columns", "quantize_act", "swiglu_grad", (0, 6), (0, 2))]}
DENSE_PASSES = [   # fp8_linear; bf16's F.linear has none
    ("x: rows (forward)", "quantize_rows", None, (2, 0), (1, 0)),
    ("x: the transpose alone, from the saved bf16 x (backward)", "quantize_rows", None, (2, 0), (1, 0)),
    ("dY ⊙ s_W: rows, column maxima", "quantize_rows", None, (0, 2), (0, 1)),
    ("dY ⊙ s_x: columns", "quantize_act", None, (0, 2), (0, 1))]
WEIGHT_PASSES = {1: (2, 6), 4: (1, 4)}   # micro-batches a step: passes over a weight, bytes per element a step


def row_bytes(coef, widths) -> int:
    return coef[0] * widths[0] + coef[1] * widths[1]


def per_row(passes, widths) -> tuple[int, int]:
    "Passes, and bytes read and written per row."
    return len(passes), sum(row_bytes(r, widths) + row_bytes(w, widths) for *_, r, w in passes)


WIDTHS = {"Qwen3-30B-A3B": (2048, 768), "Qwen3-235B-A22B": (4096, 1536), "DeepSeek-V3": (7168, 2048)}
print(f"{'the expert MLP, per routed row':30s}" + "".join(f"{m:>22s}" for m in WIDTHS))
for way, passes in EXPERT_PASSES.items():
    cells = ["%d passes, %s B" % (n, format(b, ",")) for n, b in (per_row(passes, w) for w in WIDTHS.values())]
    print(f"  {way:28s}" + "".join(f"{c:>22s}" for c in cells))
for m, (n, b) in WEIGHT_PASSES.items():
    print(f"  each expert weight, {m} micro-batch(es) a step: {n} pass(es), {b} B per element a step")
print("a dense projection in FP8, per token (bf16: no passes)")
for name, widths in {"235B's q, 4096 → 8192": (4096, 8192), "V3's o, 16384 → 7168": (16384, 7168)}.items():
    n, b = per_row(DENSE_PASSES, widths)
    print(f"  {name:28s}{n} passes, {b:,d} B; its weight: 2 passes, 6 B per element, each micro-batch")
fused, apart = (per_row(EXPERT_PASSES[k], WIDTHS["Qwen3-30B-A3B"]) for k in ("FP8, SwiGLU inside", "FP8, SwiGLU apart"))
assert fused[0] == apart[0] - 2 and fused[1] < apart[1]

# %%
def check_passes(expected, got, rows, widths):
    "The passes a layer ran over `rows` rows (`counting_passes`' log) against a table's quantization passes."
    want = [(f, act, rows * row_bytes(r, widths), rows * row_bytes(w, widths)) for _, f, act, r, w in expected
            if f is not None]
    assert [(n, a) for n, a, _, _ in got] == [(f, a) for f, a, _, _ in want], (got, want)
    assert [(i, o) for _, _, i, o in got] == [(r, w) for _, _, r, w in want], (got, want)


H, I, M = 128, 256, 256            # one expert, M a multiple of 128: the column layouts have no spare tiles
counts = torch.tensor([M])
x, w1, w2, dy = randn(14, (M, H), (1, 2 * I, H), (1, H, I), (M, H))
x, dy, w1, w2 = (t.bfloat16() for t in (x, dy, w1 / 16, w2 / 16))
for way, run in {"FP8, SwiGLU inside": lambda a, b, c: fp8_swiglu_experts(a, b, c, counts, impl="triton",
                                                                          scaling="rows"),
                 "FP8, SwiGLU apart": lambda a, b, c: fp8_grouped_linear(
                     swiglu(fp8_grouped_linear(a, b, counts, impl="triton", scaling="rows"), impl="torch"), c,
                     counts, impl="triton", scaling="rows")}.items():
    xl, w1l, w2l = (t.clone().requires_grad_() for t in (x, w1, w2))
    with counting_passes() as log:
        run(xl, w1l, w2l).backward(dy)
    weights = [p for p in log if p[0] == "quantize_weight_rows"]
    assert [(i, o) for _, _, i, o in weights] == [(2 * w.numel(), w.numel()) for w in (w1, w2, w2, w1)], weights
    check_passes(EXPERT_PASSES[way], [p for p in log if p[0] != "quantize_weight_rows"], M, (H, I))
    print(f"{way}: {len(log) - len(weights)} quantization passes over activations and {len(weights)} over weights,"
          " as the table has")

K, N = 128, 384
x, w, dy = (t.bfloat16() for t in randn(15, (M, K), (N, K), (M, N)))
xl, wl = x.clone().requires_grad_(), (w / 16).clone().requires_grad_()
with counting_passes() as log:
    fp8_linear(xl, [wl], impl="triton").backward(dy)
weights = [p for p in log if p[0] == "quantize_weight_rows"]
assert [(i, o) for _, _, i, o in weights] == [(2 * w.numel(), w.numel())] * 2, weights
check_passes(DENSE_PASSES, [p for p in log if p[0] != "quantize_weight_rows"], M, (K, N))
print(f"fp8_linear: {len(log) - len(weights)} quantization passes over activations and {len(weights)} over weights, "
      "as the table has")

# %% [markdown]
# With SwiGLU inside the quantization passes the experts make two passes fewer and write no bf16 `h` or
# `dgate_up`; what remains is one pass for each FP8 input and two for each gradient (its rows, then its columns). Two
# more could go into their producers, and are not done: an RMSNorm sees whole rows, so it could write the FP8 rows and
# scale of its output beside (or, where every reader is FP8, instead of) its bf16 output, taking the forward's `x`
# pass out of the projection after it; the attention kernel could do the same for the o projection's input. Neither
# helps the backward's `x` pass, whose transposed layout the weight gradient reads: its column scales need every
# token's value. A dense projection's gradient pass stays a pass of its own under row scales: a row's scale needs the
# maximum of the whole row of `dY ⊙ s_W`, and the kernel that produces `dY` (the next layer's input-gradient GEMM)
# writes each row in tiles from different programs. The experts' `dY` comes from the backward of the dispatcher's
# combine, which handles whole rows and could quantize them, but it runs on the engine's side of the layer protocol,
# for the same reason as the input's gather above.

# %% [markdown]
# ## On the GPU
#
# The compiled kernels against the quantized reference at a moderate size, in bf16: the FP8 tensor cores accumulate
# each 128-deep product with fewer bits than fp32 (about 2e-4 relative) and the output is rounded to bf16 (about
# 2⁻⁹), so the bound is 1e-2. `benchmarks/fp8_rows.py` and `benchmarks/fp8_bench.py` measure speed at the real
# expert shapes.

# %%
#| cuda
err, quant = check_layer([300, 0, 1, 1000, 517], 1024, 768, "triton", torch.bfloat16, extra=3)
print(f"triton bf16 on the GPU: {err:.1e} vs quantized reference, {quant:.3f} vs exact")

# %% [markdown]
# The fused SwiGLU experts against the layers apart, in bf16: apart, `h` and its gradient are rounded to bf16
# between the kernels, fused they go from fp32 straight to E4M3. A bf16 rounding moves about one value in 64 across
# an E4M3 rounding boundary (a step of 2⁻³ relative), so the two differ by 1–2% (1.7e-2 at the bench shapes in
# `benchmarks/fp8_bench.py`); a mistake in the fused passes would differ by order one.

# %%
#| cuda
counts = torch.tensor([300, 0, 1, 1000, 517], device="cuda")
x, w1, w2, dy = randn(11, (1818, 1024), (5, 1536, 1024), (5, 1024, 768), (1818, 1024))
x, dy = x.bfloat16().requires_grad_(), dy.bfloat16()
w1, w2 = (w1 / 32).bfloat16().requires_grad_(), (w2 / 28).bfloat16().requires_grad_()
got = []
for fused in (True, False):
    x.grad = w1.grad = w2.grad = None
    y = (fp8_swiglu_experts(x, w1, w2, counts) if fused else
         fp8_grouped_linear(swiglu(fp8_grouped_linear(x, w1, counts)), w2, counts))
    y.backward(dy)
    got.append((y.detach(), x.grad, w1.grad, w2.grad))
errs = [rel_err(a, b) for a, b in zip(*got)]
print(f"fused SwiGLU experts vs apart, bf16 on the GPU: {errs}")
assert max(errs) < 3e-2, errs

# %% [markdown]
# Scales computed in torch and in the kernels agree at every exact boundary `448·2^k` (where a `log2` on CUDA can
# be off by one); and the row-scaled layer on bf16-valued inputs, whose maxima often sit on those boundaries (the
# weight gradient takes scales computed in torch for values a kernel quantized), against the torch definition on
# the same GPU: within 1e-2 (the tensor cores' accumulation), where a mismatched scale moves some columns by 2×.

# %%
#| cuda
amax = 448 * torch.exp2(torch.arange(-126, 120, device="cuda", dtype=torch.float32))
edge = torch.zeros(len(amax), 128, device="cuda")
edge[:, 5] = -amax
want = torch.exp2(torch.arange(-126, 120, device="cpu", dtype=torch.float64)).float().cuda()      # 2^k, exactly
assert torch.equal(quantize_rows(edge).s, want) and torch.equal(pow2_scale(amax), want)
counts = torch.tensor([300, 0, 1, 1000, 517], device="cuda")
x, w, dy = (t.cuda().bfloat16().float() for t in randn(12, (1818, 1024), (5, 768, 1024), (1818, 768)))
got = []
for impl in ("triton", "torch"):
    xl, wl = x.clone().requires_grad_(), (w / 32).requires_grad_()
    y = fp8_grouped_linear(xl, wl, counts, impl=impl, scaling="rows")
    y.backward(dy)
    got.append((y.detach(), xl.grad, wl.grad))
errs = [rel_err(a, b) for a, b in zip(*got)]
print(f"row-scaled layer, triton vs torch on the GPU: {errs}")
assert max(errs) < 1e-2, errs

# %% [markdown]
# The dense layer on the GPU at the Qwen3 bench's attention width (q, k and v of hidden 2048 read together), in
# bf16: the Triton kernels against the torch definition on the same GPU, and both against the row recipe in float64,
# within the tensor cores' accumulation and the bf16 output's rounding (1e-2).

# %%
#| cuda
x, dy, wq, wk, wv = (t.cuda() for t in randn(13, (4096, 2048), (4096, 5120), (4096, 2048), (512, 2048), (512, 2048)))
x, dy = x.bfloat16(), dy.bfloat16()
ws = [(w / 2048 ** 0.5).bfloat16() for w in (wq, wk, wv)]
ref = dense_rows_ref(x.double(), torch.cat(ws).double(), dy.double())
got = []
for impl in ("triton", "torch"):
    xl, wl = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
    y = fp8_linear(xl, wl, impl=impl)
    y.backward(dy)
    got.append((y.detach(), xl.grad, torch.cat([w.grad for w in wl])))
    errs = [rel_err(a, b) for a, b in zip(got[-1], ref)]
    print(f"fp8_linear {impl} on the GPU vs the row recipe in float64: {errs}")
    assert max(errs) < 1e-2, (impl, errs)
errs = [rel_err(a, b) for a, b in zip(*got)]
print(f"fp8_linear triton vs torch on the GPU: {errs}")
assert max(errs) < 1e-2, errs
