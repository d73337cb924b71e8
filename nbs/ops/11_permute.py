# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Token permutation
#
# The router gives every token `k` experts. The experts want their rows *grouped*: all rows of expert 0,
# then all rows of expert 1, ..., so that one grouped GEMM (ops/grouped_linear) runs every expert at once.
# This notebook is the bookkeeping between the two orders and the two memory-bound copies that cross it:
#
# 1. `sort_by_expert(ids, num_experts, pad_to)`: where each (token, expert) pair goes in the grouped order.
# 2. `gather_rows(x, src_token)`: the **permute**, token order → grouped order (T rows in, N = T·k rows out).
# 3. `weighted_gather(y, row_index, weights)`: the **un-permute** fused with the router-weighted sum,
#    grouped order → token order (N rows in, T rows out). Stage 3 calls it on the experts' outputs: each
#    received token row becomes the weighted sum of its experts' outputs before the combine sends it back
#    (engine/31_ep; under expert parallelism the combine adds the rows from different ranks with the same
#    kernel and unit weights).
#
# At Qwen3-30B-A3B's shape (16K tokens, hidden 2048, top-8 of 128 experts, bf16) the permuted activation
# is 131072 × 2048 × 2 B = 512 MiB, so each copy moves about 1 GiB of memory. The copies are worth a kernel
# because of what eager PyTorch does around them (below).

# %%
#| default_exp ops.permute

# %%
#| export
import torch
from torch import Tensor
import triton
import triton.language as tl

from pith_lit.ops.swiglu import choose_impl

# %%
#| hide
import os

torch.manual_seed(0)
if torch.cuda.is_available():      # on the GPU machine the checks below run the compiled kernels on CUDA tensors
    torch.set_default_device("cuda")
else:
    assert os.environ.get("TRITON_INTERPRET") == "1", \
        "on a CPU, run this notebook with TRITON_INTERPRET=1 in the environment (set before triton is imported)"

# %% [markdown]
# ## 1. The grouped order
#
# Flatten the (T, k) expert ids into T·k pairs, pair p = t·k + j. A **stable** sort by expert id gives the
# grouped order, and stability keeps the pairs of one expert in token order (reads of `x` then sweep forward
# through memory, and the order is deterministic). Three outputs describe the permutation both ways:
#
# - `src_token (N,)`: the token each grouped row is copied from (-1 for a padding row);
# - `row_index (T, k)`: the grouped row of each pair, for the way back;
# - `counts (E,)`: rows per expert group, **including padding** — exactly the group sizes the GEMM sees.
#
# `counts` comes from `searchsorted` on the sorted ids, not `torch.bincount`: bincount sizes its output from
# the largest id, which is a host sync on CUDA. Without padding N = T·k is known on the host, and nothing
# here waits for the GPU.
#
# **Padding.** Some grouped GEMMs (FP8 ones in particular) want every group to start at a multiple of 16 or
# 32 rows. With `pad_to > 1` each group is rounded up; the padding rows have `src_token = -1` and are zero
# after the gather, so they contribute nothing and receive no gradient. The number of rows N then depends
# on the counts, and a tensor's size must be known on the host to allocate it: **the one host sync** is
# `int(padded.sum())` below, which waits for the sort to finish. Nothing else in this module syncs.
#
# Ids outside `[0, num_experts)` would silently corrupt the order; `torch._assert_async` checks them without
# a host sync (on CPU it raises at once, on CUDA it is a device-side assert).

# %%
#| export
def sort_by_expert(ids: Tensor, num_experts: int, pad_to: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """Grouped order of the (token, expert) pairs in `ids (T, k)`.

    Returns `src_token (N,)` (token of each grouped row, -1 for padding), `row_index (T, k)` (grouped row of each
    pair) and `counts (E,)` (rows per expert group, padding included). Stable: one expert's pairs stay in token
    order. With `pad_to > 1` each group is padded to a multiple of `pad_to` rows (one host sync, to size N)."""
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be a (T, k) int64 tensor of expert ids, got shape {tuple(ids.shape)} "
                         f"dtype {ids.dtype}; pass the router's top-k indices")
    if num_experts < 1 or pad_to < 1:
        raise ValueError(f"num_experts and pad_to must be >= 1, got num_experts={num_experts} pad_to={pad_to}")
    T, k = ids.shape
    flat = ids.reshape(-1)
    torch._assert_async(((flat >= 0) & (flat < num_experts)).all(),
                        f"sort_by_expert: expert ids must lie in [0, {num_experts}); check the router's top-k")
    # int32 keys: the radix sort makes half the passes of int64 (measured ~0.06 vs ~0.11 ms for 131K ids)
    sorted_ids, order = torch.sort(flat.to(torch.int32), stable=True)   # order[j] = pair at grouped position j
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, dtype=torch.int32, device=ids.device))
    counts = bounds.diff()
    rows = torch.arange(flat.numel(), device=ids.device)        # grouped row of position j (no padding)
    if pad_to == 1:
        src_token = order // k
    else:
        padded = (counts + pad_to - 1) // pad_to * pad_to
        pad_start = padded.cumsum(0) - padded
        rows = rows - bounds[sorted_ids] + pad_start[sorted_ids]
        n_rows = int(padded.sum())                              # the one host sync: N sizes src_token
        src_token = torch.full((n_rows,), -1, dtype=torch.int64, device=ids.device).scatter_(0, rows, order // k)
        counts = padded
    row_index = torch.empty_like(flat).scatter_(0, order, rows)
    return src_token, row_index.view(T, k), counts

# %% [markdown]
# Check against a hand-written loop: walk the experts in order, and within an expert the pairs in token order;
# pad each group; the result must match exactly. Awkward cases: an expert nobody chose, a single token, no
# tokens at all.

# %%
def sort_by_expert_loop(ids, num_experts, pad_to=1):
    "The definition, one pair at a time, in plain Python."
    T, k = ids.shape
    chosen, src, row_index, counts = ids.tolist(), [], [[0] * k for _ in range(T)], []
    for e in range(num_experts):
        pairs = [(t, j) for t in range(T) for j in range(k) if chosen[t][j] == e]
        for t, j in pairs:
            row_index[t][j] = len(src)
            src.append(t)
        pad = -len(pairs) % pad_to
        src += [-1] * pad
        counts.append(len(pairs) + pad)
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=ids.device)
    return as_tensor(src), as_tensor(row_index).view(T, k), as_tensor(counts)

for T, k, E, pad_to in [(7, 2, 5, 1), (7, 2, 5, 4), (1, 1, 3, 1), (1, 3, 4, 8), (0, 2, 4, 1), (0, 2, 4, 16),
                        (33, 4, 9, 3)]:
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    ids[ids == 1] = 0                                  # top-k never repeats an expert, but expert 1 gets no pairs
    got, want = sort_by_expert(ids, E, pad_to), sort_by_expert_loop(ids, E, pad_to)
    for g, w in zip(got, want):
        assert g.dtype == torch.int64 and torch.equal(g, w), (T, k, E, pad_to, g, w)
    assert int(got[2][1]) == 0 and int(got[2].sum()) == got[0].numel()
print("sort_by_expert matches the loop")

# %% [markdown]
# Bad input says what to change. (On CUDA, an id out of range fails as a device-side assert with the same
# message, which ends the process; so this check uses CPU tensors.)

# %%
cpu = lambda v: torch.tensor(v, device="cpu")   # on CUDA the range check is a device assert, fatal to the process
for bad, msg in [(lambda: sort_by_expert(torch.zeros(4, 2, dtype=torch.int32), 4), "int64"),
                 (lambda: sort_by_expert(cpu([[0, 4]]), 4), "[0, 4)"),
                 (lambda: sort_by_expert(cpu([[0, 1]]), 4, pad_to=0), "pad_to")]:
    try:
        bad()
    except (ValueError, RuntimeError) as e:
        assert msg in str(e), e
    else:
        raise AssertionError(f"no error for {msg}")

# %% [markdown]
# ## 2. Permute: `gather_rows`
#
# Eager PyTorch writes it as `torch.where(valid, x[src.clamp(min=0)], 0)`: an index_select pass (read N rows,
# write N rows) then a `where` pass (read N rows and write them again), ~2× the bytes, and its backward is
# autograd's `index_put_(accumulate=True)` **in the activation dtype**: in bf16 the k contributions to a token
# are rounded after each add. Without padding the `where` disappears, but the backward stays.
#
# The Triton forward is a pure copy: program (row, column block) loads its source row (masked to zero when
# `src = -1`) and stores it. No arithmetic, so bf16 passes through bit-exact.
#
# **Backward** is a scatter-add: `grad_x[src[n]] += grad_out[n]`. Which rows collide is only known from the
# data, so the obvious choices are `index_add_` or an atomic-add kernel. On CUDA both add in an order that is
# not fixed (not bitwise reproducible), and both are slow here: `index_add_` in bf16 rounds after every add, and
# a first version of this kernel with fp32 atomics into a zeroed (T, H) buffer, then a cast, ran at only 26%
# of the copy ceiling on the H200 (268M atomics, plus the zeroing and the cast pass). So we turn the scatter
# into a **gather**: sort `src_token` once (N integers, ~0.1% of the N × H values moved) and find each
# token's range of rows with `searchsorted`; then one program per (token, column block) sums its rows in fp32,
# in row order, and stores the token's gradient once in its dtype. No atomics, no fp32 buffer, no cast pass,
# deterministic; it moves N + T rows. Padding rows (`src = -1`) sort first and belong to no token's range.
#
# Where the caller has the inverse, `row_index (T, k)` (each token's grouped rows, from `sort_by_expert`, -1 for a
# choice with no row here), the sort is not needed at all: one program per (token, column block) sums the rows
# `row_index[t, :]` names, k of them known at compile time, in choice order. This is the un-permute's kernel of
# section 3 with every weight 1 (`_sum_pairs_kernel`, defined here for both). The dispatchers (models/20 and
# engine/31) pass it; the sort remains for a permute whose rows no (T, k) index describes, such as expert
# parallelism's send buffer, where a token's row goes to each rank that holds one of its experts.

# %%
#| export
def gather_rows_torch(x: Tensor, src_token: Tensor) -> Tensor:
    "Reference: `out[n] = x[src_token[n]]`, zero where `src_token[n] = -1`. Differentiable by autograd."
    valid = (src_token >= 0).unsqueeze(1)
    return torch.where(valid, x[src_token.clamp(min=0)], torch.zeros((), dtype=x.dtype, device=x.device))

# %%
#| export
_BLOCK_H = 1024   # columns per program in the copy kernels: 2 KiB of bf16 per load, enough to keep HBM busy


@triton.jit
def _gather_rows_kernel(x_ptr, src_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    src = tl.load(src_ptr + row)
    n_read = tl.where(src >= 0, H, 0)           # a padding row reads nothing and stores zeros
    vals = tl.load(x_ptr + tl.maximum(src, 0) * H + cols, mask=cols < n_read, other=0.0)
    tl.store(out_ptr + row * H + cols, vals, mask=cols < H)


@triton.jit
def _sum_rows_kernel(g_ptr, order_ptr, start_ptr, out_ptr, H, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i in range(tl.load(start_ptr + t), tl.load(start_ptr + t + 1)):   # this token's rows, in row order
        r = tl.load(order_ptr + i)
        acc += tl.load(g_ptr + r * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_pairs_kernel(y_ptr, idx_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr,
                      WEIGHTED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(idx_ptr + t * K + j)
        n = tl.where(r >= 0, H, 0)             # -1: no row, reads nothing
        v = tl.load(y_ptr + tl.maximum(r, 0) * H + cols, mask=cols < n, other=0.0).to(tl.float32)
        if WEIGHTED:
            v *= tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_token, row_index):
        x, src_token = x.contiguous(), src_token.contiguous()
        (N,), (T, H) = src_token.shape, x.shape
        out = torch.empty(N, H, dtype=x.dtype, device=x.device)
        if N and H:
            _gather_rows_kernel[(N, triton.cdiv(H, _BLOCK_H))](x, src_token, out, H, BLOCK_H=_BLOCK_H)
        ctx.save_for_backward(src_token if row_index is None else row_index.contiguous())
        ctx.x_shape, ctx.x_dtype = (T, H), x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (index,), (T, H) = ctx.saved_tensors, ctx.x_shape
        grad_out = grad_out.contiguous()
        grad_x = torch.empty(T, H, dtype=ctx.x_dtype, device=grad_out.device)
        if not (T and H):
            return grad_x, None, None
        grid = (T, triton.cdiv(H, _BLOCK_H))
        if index.dim() == 2:    # row_index (T, k): each token's rows, no sort
            _sum_pairs_kernel[grid](grad_out, index, index, grad_x, H, K=index.shape[1], BLOCK_H=_BLOCK_H,
                                    WEIGHTED=False)
            return grad_x, None, None
        # rows grouped by token, padding (-1) first; int32 keys halve the radix sort's passes
        sorted_src, order = torch.sort(index.to(torch.int32), stable=True)
        start = torch.searchsorted(sorted_src, torch.arange(T + 1, dtype=torch.int32, device=index.device))
        _sum_rows_kernel[grid](grad_out, order, start, grad_x, H, BLOCK_H=_BLOCK_H)
        return grad_x, None, None

# %% [markdown]
# Which implementation runs is decided here, in sight (ops/10's `choose_impl`): Triton on CUDA, the reference
# elsewhere. `impl=` overrides it, so this notebook runs the Triton kernels on CPU tensors under the interpreter.

# %%
#| export
def gather_rows(x: Tensor, src_token: Tensor, row_index: Tensor | None = None, impl: str | None = None) -> Tensor:
    """Permute: `out[n] = x[src_token[n]]` for `x (T, H)`, `src_token (N,)`; rows with `src_token = -1` are zero.
    Backward sums each token's rows in fp32: through `row_index (T, k)` where given (the grouped row of each of a
    token's choices, -1 for none; it must name exactly the rows `src_token` gives that token), else by sorting
    `src_token`. `impl`: "triton", "torch", or None (Triton on CUDA)."""
    if x.dim() != 2 or src_token.dim() != 1 or src_token.dtype != torch.int64:
        raise ValueError(f"gather_rows wants x (T, H) and src_token (N,) int64, got x {tuple(x.shape)}, "
                         f"src_token {tuple(src_token.shape)} {src_token.dtype}")
    if row_index is not None and (row_index.dim() != 2 or row_index.shape[0] != x.shape[0]
                                  or row_index.dtype != torch.int64):
        raise ValueError(f"gather_rows wants row_index (T, k) int64 with T = {x.shape[0]}, got "
                         f"{tuple(row_index.shape)} {row_index.dtype}")
    if choose_impl(impl, x) == "triton":
        return _GatherRows.apply(x, src_token, row_index)
    return gather_rows_torch(x, src_token)

# %% [markdown]
# Check: Triton (under the interpreter on CPU) against the float64 reference, forward and backward, with
# padding rows, an expert with no rows, a width that is not a multiple of the block, one token, zero tokens.
# The float64 reference gradient is exact; the kernels accumulate in fp32. bf16 must pass through the
# forward bit-exact, and the backward must be deterministic (bitwise equal on a second run).

# %%
def check_gather(T, k, E, H, pad_to, dtype=torch.float32):
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    src, row_index, counts = sort_by_expert(ids, E, pad_to)
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    g = torch.randn(src.numel(), H, dtype=dtype)
    x64 = x.detach().double().requires_grad_()
    want = gather_rows(x64, src, impl="torch")
    want.backward(g.double())
    for impl, index in [("triton", None), ("triton", row_index), ("torch", None)]:
        x.grad = None
        out = gather_rows(x, src, index, impl=impl)
        out.backward(g)
        assert out.dtype == dtype and torch.equal(out.double(), want.detach().to(dtype).double()), impl
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol, atol=tol)
        assert (out[src < 0] == 0).all()
        if impl == "triton":
            assert torch.equal(torch.autograd.grad(gather_rows(x, src, index, impl="triton"), x, g)[0], x.grad)

for T, k, E, H, pad_to in [(13, 3, 6, 1500, 4), (13, 3, 6, 7, 1), (1, 1, 2, 5, 1), (1, 2, 4, 33, 8), (0, 2, 4, 9, 1)]:
    check_gather(T, k, E, H, pad_to)
check_gather(9, 2, 5, 1030, 4, torch.bfloat16)
print("gather_rows: triton (backward by sort and by row_index) == torch == float64 reference")

# %% [markdown]
# ## 3. Un-permute fused with the weighted sum: `weighted_gather`
#
# Stage 3 ends with `out[t] = Σ_j weights[t, j] · y[row_index[t, j]]`. Eager PyTorch gathers `y[row_index]` into a
# (T, k, H) tensor (read N rows, write N rows), multiplies by the weights (read and write them again) and sums
# over k (read once more): about 5 × N × H × 2 B and 3 launches, plus a (T, k, H) fp32 intermediate if it
# accumulates in fp32. The fused kernel (section 2's `_sum_pairs_kernel`, weighted) reads each grouped row once and
# writes each token row once:
# (N + T) × H × 2 B, accumulating in fp32 in registers and rounding once to `y`'s dtype.
#
# **Backward.** `grad_y[row_index[t, j]] = weights[t, j] · grad_out[t]` and
# `grad_weights[t, j] = ⟨grad_out[t], y[row_index[t, j]]⟩`. Every grouped row belongs to at most one pair
# (the permutation is one-to-one, padding rows belong to none), so each row of `grad_y` is written by exactly
# one program: a plain store, no atomics, deterministic. One program per pair reads `grad_out[t]` (k programs
# share it, through L2) and its row of `y`, writes its `grad_y` row and its weight's gradient, the dot product
# accumulated in fp32. Padding rows of `grad_y` must be zero: the buffer is zeroed only when there is
# padding (N ≠ T·k, known on the host). So the contract is: each row belongs to at most one pair; a row that
# belongs to none gets a zero gradient when N ≠ T·k and an unspecified one when N = T·k. (engine/31_ep's
# sync-free buffer has N = T·k with rows that no pair reads; nothing reads their gradient either.)
#
# **No row.** An index of -1 (as in `gather_rows`) means the pair has no row: it adds nothing, its weight gets a
# zero gradient and no row of `grad_y` is written for it. The expert-parallel combine (engine/31_ep) uses this: a
# received token row sums only those of its k choices whose expert lives on the receiving rank.

# %%
#| export
def weighted_gather_torch(y: Tensor, row_index: Tensor, weights: Tensor) -> Tensor:
    "Reference: `out[t] = Σ_j weights[t, j] · y[row_index[t, j]]` over j with row_index ≥ 0, in fp32 or wider."
    acc = torch.promote_types(y.dtype, torch.float32)
    valid = (row_index >= 0).unsqueeze(-1)
    rows = torch.where(valid, y[row_index.clamp(min=0)].to(acc), torch.zeros((), dtype=acc, device=y.device))
    return (rows * weights.to(acc).unsqueeze(-1)).sum(1).to(y.dtype)

# %%
#| export
@triton.jit
def _weighted_gather_bwd_kernel(go_ptr, y_ptr, idx_ptr, w_ptr, gy_ptr, gw_ptr, H, K: tl.constexpr,
                                BLOCK_H: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)          # one (token, j) pair
    t = p // K
    r = tl.load(idx_ptr + p)
    w = tl.load(w_ptr + p).to(tl.float32)
    n = tl.where(r >= 0, H, 0)                 # a pair without a row reads and writes nothing
    r = tl.maximum(r, 0)
    dot = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = cols < n
        g = tl.load(go_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
        dot += g * tl.load(y_ptr + r * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(gy_ptr + r * H + cols, (w * g).to(gy_ptr.dtype.element_ty), mask=mask)
    tl.store(gw_ptr + p, tl.sum(dot, axis=0).to(gw_ptr.dtype.element_ty))


class _WeightedGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_index, weights):
        y, row_index, weights = y.contiguous(), row_index.contiguous(), weights.contiguous()
        (T, K), H = row_index.shape, y.shape[1]
        out = torch.empty(T, H, dtype=y.dtype, device=y.device)
        if T and H:
            _sum_pairs_kernel[(T, triton.cdiv(H, _BLOCK_H))](y, row_index, weights, out, H, K=K, BLOCK_H=_BLOCK_H,
                                                               WEIGHTED=True)
        ctx.save_for_backward(y, row_index, weights)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        y, row_index, weights = ctx.saved_tensors
        (T, K), (N, H) = row_index.shape, y.shape
        grad_out = grad_out.contiguous()
        grad_y = (torch.empty_like if N == T * K else torch.zeros_like)(y)   # padding rows get no store
        grad_w = torch.empty_like(weights)
        if T * K and H:
            _weighted_gather_bwd_kernel[(T * K,)](grad_out, y, row_index, weights, grad_y, grad_w, H, K=K,
                                                  BLOCK_H=_BLOCK_H)
        elif T * K:
            grad_w.zero_()
        return grad_y, None, grad_w

# %%
#| export
def weighted_gather(y: Tensor, row_index: Tensor, weights: Tensor, impl: str | None = None) -> Tensor:
    """Un-permute and weight: `out[t] = Σ_j weights[t, j] · y[row_index[t, j]]` for `y (N, H)`,
    `row_index (T, k)` int64 (-1: no row, adds nothing), `weights (T, k)`; fp32 accumulation, output in `y`'s
    dtype. Differentiable in `y` and `weights`. `impl`: "triton", "torch", or None (Triton on CUDA)."""
    if y.dim() != 2 or row_index.dim() != 2 or row_index.dtype != torch.int64 or weights.shape != row_index.shape:
        raise ValueError(f"weighted_gather wants y (N, H), row_index (T, k) int64 and weights (T, k), got y "
                         f"{tuple(y.shape)}, row_index {tuple(row_index.shape)} {row_index.dtype}, weights "
                         f"{tuple(weights.shape)}")
    if choose_impl(impl, y) == "triton":
        return _WeightedGather.apply(y, row_index, weights)
    return weighted_gather_torch(y, row_index, weights)

# %% [markdown]
# Check against float64, forward and both gradients, on the same awkward cases. The round trip
# `weighted_gather(gather_rows(x), row_index, w)` must give `x · Σ_j w[t, j]`, which ties the two directions
# together.

# %%
def check_weighted(T, k, E, H, pad_to, dtype=torch.float32):
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    src, row_index, counts = sort_by_expert(ids, E, pad_to)
    y = torch.randn(src.numel(), H, dtype=dtype)
    w = torch.rand(T, k, dtype=torch.float32)
    g = torch.randn(T, H, dtype=dtype)
    y64, w64 = y.double().requires_grad_(), w.double().requires_grad_()
    want = weighted_gather(y64, row_index, w64, impl="torch")
    want.backward(g.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for impl in ("triton", "torch"):
        yy, ww = y.clone().requires_grad_(), w.clone().requires_grad_()
        out = weighted_gather(yy, row_index, ww, impl=impl)
        out.backward(g)
        assert out.dtype == dtype and out.shape == (T, H)
        torch.testing.assert_close(out.double(), want.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(yy.grad.double(), y64.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(ww.grad.double(), w64.grad, rtol=tol, atol=tol * H ** 0.5)
        assert (yy.grad[src < 0] == 0).all()
    x = torch.randn(T, H, dtype=dtype)
    back = weighted_gather(gather_rows(x, src, impl="triton"), row_index, w, impl="triton")
    torch.testing.assert_close(back.double(), x.double() * w.double().sum(1, keepdim=True), rtol=tol, atol=tol)

for T, k, E, H, pad_to in [(13, 3, 6, 1500, 4), (13, 3, 6, 7, 1), (1, 1, 2, 5, 1), (1, 2, 4, 33, 8), (0, 2, 4, 9, 1)]:
    check_weighted(T, k, E, H, pad_to)
check_weighted(9, 2, 5, 1030, 4, torch.bfloat16)
print("weighted_gather: triton and torch match float64, forward and backward")

# %% [markdown]
# Pairs without a row (index -1): every other pair points at its own row, some rows belong to no pair, and the
# result must equal a plain loop over the pairs that have one.

# %%
def check_no_row(T, k, H, keep=0.6):
    valid = torch.rand(T, k) < keep
    M = int(valid.sum())
    row_index = torch.full((T, k), -1, dtype=torch.int64)
    N = T * k + 1                                           # more rows than pairs: some rows are nobody's
    row_index[valid] = torch.randperm(N)[:M]
    y, w, g = torch.randn(N, H), torch.rand(T, k), torch.randn(T, H)
    want, want_gy = torch.zeros(T, H, dtype=torch.float64), torch.zeros(N, H, dtype=torch.float64)
    want_gw = torch.zeros(T, k, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            if row_index[t, j] >= 0:
                r = row_index[t, j]
                want[t] += w[t, j].double() * y[r].double()
                want_gy[r] = w[t, j].double() * g[t].double()
                want_gw[t, j] = (g[t].double() * y[r].double()).sum()
    for impl in ("triton", "torch"):
        yy, ww = y.clone().requires_grad_(), w.clone().requires_grad_()
        out = weighted_gather(yy, row_index, ww, impl=impl)
        out.backward(g)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(yy.grad.double(), want_gy, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ww.grad.double(), want_gw, rtol=1e-5, atol=1e-4)

for T, k, H in [(11, 3, 1100), (5, 2, 7), (4, 1, 3)]:
    check_no_row(T, k, H)
check_no_row(3, 2, 5, keep=0.0)                              # no pair has a row: zeros, zero gradients
print("weighted_gather: pairs without a row add nothing and get no gradient")

# %% [markdown]
# ## 4. On the GPU: bf16 at the real size, and speed
#
# The GPU cell checks the permute and un-permute in bf16 at Qwen3-30B-A3B's shape against the eager reference,
# then prints `permute_bench` from `benchmarks/ops.py`: forward and backward of both copies, Triton against eager,
# in bytes moved against the device-copy ceiling (`python benchmarks/ops.py` prints every kernel's table).

# %%
#| cuda
T, H, E, k = 16384, 2048, 128, 8
ids = torch.randn(T, E, device="cuda").topk(k, dim=1).indices
src, row_index, counts = sort_by_expert(ids, E)
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.rand(T, k, device="cuda", requires_grad=True)
xp = gather_rows(x, src, row_index)
assert torch.equal(xp, x.detach()[src])
out = weighted_gather(xp, row_index, w)
want = weighted_gather_torch(xp.detach().double(), row_index, w.detach().double())
torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
out.backward(torch.ones_like(out))
torch.testing.assert_close(x.grad.double(), w.detach().double().sum(1, keepdim=True).expand(T, H),
                           rtol=1e-2, atol=1e-2)
src_p, row_index_p, counts_p = sort_by_expert(ids, E, pad_to=16)
assert (counts_p % 16 == 0).all() and torch.equal(gather_rows(x.detach(), src_p)[row_index_p], x.detach()[:, None]
                                                   .expand(T, k, H))
from benchmarks.ops import permute_bench
for name, value in permute_bench().items():
    print(f"{name:36s} {value:10.3f}")
