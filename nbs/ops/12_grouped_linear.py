# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Grouped expert linear
#
# After the permute (ops/permute) the rows for expert 0 come first, then expert 1, and so on, `counts[e]` rows
# each. Every expert multiplies its own rows by its own weight: `y[rows of e] = x[rows of e] @ w[e]ᵀ`. One
# grouped GEMM does all experts in one launch; a loop over experts would launch 128 small GEMMs per
# projection and need the counts on the host.
#
# Its backward has two halves with different urgency. The **input gradient** `dX_e = dY_e w_e` is on the
# critical path: the previous layer (and, in a pipeline, the previous stage) waits for it. The **weight
# gradient** `dW_e = dY_eᵀ X_e` is needed only by the optimizer step. DualPipeV's zero-bubble schedule
# exploits that: it runs the input gradients first and fills pipeline bubbles with deferred weight
# gradients. `grouped_linear` therefore computes `dX` at once and either computes `dW` at once too, or
# pushes it to a `WeightGradQueue` that the scheduler drains later.

# %%
#| default_exp ops.grouped_linear

# %%
#| export
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from pith_lit.ops.swiglu import choose_impl

# %%
#| hide
torch.manual_seed(0)
if torch.cuda.is_available():      # on the GPU machine the checks below run on CUDA tensors
    torch.set_default_device("cuda")

# %% [markdown]
# ## The deferred weight-gradient queue
#
# A queue of closures. Each closure computes one weight gradient and accumulates it into its parameter's
# `.grad`, exactly as autograd would have. The scheduler calls `drain()` in a bubble; everything must be
# drained before the optimizer step (and before gradients are reduced across ranks), or those gradients are
# missing. A closure keeps its layer's `x` and `dY` alive until it runs: that is the memory price of deferring.

# %%
#| export
class WeightGradQueue:
    "Deferred weight-gradient work: `push(fn)` during backward, `drain()` runs and forgets it, in push order."
    def __init__(self):
        self._pending: list[Callable[[], None]] = []

    def push(self, fn: Callable[[], None]) -> None:
        self._pending.append(fn)

    def drain(self) -> None:
        pending, self._pending = self._pending, []
        for fn in pending:
            fn()

    def __len__(self) -> int:
        return len(self._pending)

# %% [markdown]
# ## Three grouped products
#
# With `offs = cumsum(counts)` as int32 (computed on the device, no host sync), `F.grouped_mm` (PyTorch ≥ 2.11,
# bf16 on sm ≥ 80) covers all three products:
#
# | product | `F.grouped_mm` call | shapes |
# |---|---|---|
# | forward `Y_e = X_e W_eᵀ` | `grouped_mm(x, w.transpose(-2, -1), offs=offs)` | (N, in) · (E, in, out) → (N, out) |
# | input grad `dX_e = dY_e W_e` | `grouped_mm(dy, w, offs=offs)` | (N, out) · (E, out, in) → (N, in) |
# | weight grad `dW_e = dY_eᵀ X_e` | `grouped_mm(dy.t(), x, offs=offs)` | (out, N) · (N, in) → (E, out, in) |
#
# In the last one both operands are 2D and `offs` slices the shared (reduction) dimension. A weight stored as
# `(E, in, out)` and passed as its `.mT` view (GPT-OSS keeps transformers' layout) gets its gradient as
# `grouped_mm(x.t(), dy)ᵀ`, a view of a tensor laid out like the parameter: computed as `(E, out, in)` it would be
# copied into the parameter's layout, a strided copy of every expert weight on each backward. `offs[-1]` must
# equal N: rows after it are ignored in the products and left unwritten in the output, so the counts are
# checked against N with a device-side assert (no host sync). Its layout rules: strides a multiple of
# 16 bytes (so `in` and `out` a multiple of 8 in bf16).
#
# The portable path loops over the expert row ranges with plain matmuls. It needs the range bounds as
# Python ints: **one host sync** (`counts.tolist()`) in the forward, kept for the backward. It is the
# reference, and what runs on CPU. `impl=` picks a path explicitly ("grouped_mm" | "loop"; None = grouped_mm
# on CUDA, loop elsewhere), so on CPU the notebook can also run the `F.grouped_mm` calls (PyTorch has a CPU
# implementation) and check their argument conventions against the loop.

# %%
#| export
def _products_grouped_mm(offs: Tensor, w_t: bool = False):
    "The three products; `w_t`: the weight is the `.mT` view of an `(E, in, out)` tensor (its gradient is made so)."
    fwd = lambda x, w: F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
    dgrad = lambda dy, w: F.grouped_mm(dy, w, offs=offs)
    if w_t:
        wgrad = lambda dy, x: F.grouped_mm(x.t(), dy, offs=offs).mT
    else:
        wgrad = lambda dy, x: F.grouped_mm(dy.t(), x, offs=offs)
    return fwd, dgrad, wgrad


def _products_loop(bounds: list[int], w_t: bool = False):
    ranges = list(zip(bounds[:-1], bounds[1:]))
    def fwd(x, w):
        y = x.new_empty(x.shape[0], w.shape[1])
        for e, (a, b) in enumerate(ranges):
            torch.matmul(x[a:b], w[e].t(), out=y[a:b])
        return y
    def dgrad(dy, w):
        dx = dy.new_empty(dy.shape[0], w.shape[2])
        for e, (a, b) in enumerate(ranges):
            torch.matmul(dy[a:b], w[e], out=dx[a:b])
        return dx
    def wgrad(dy, x):   # an empty range gives zeros
        if w_t:
            return torch.stack([x[a:b].t() @ dy[a:b] for a, b in ranges]).mT
        return torch.stack([dy[a:b].t() @ x[a:b] for a, b in ranges])
    return fwd, dgrad, wgrad

# %% [markdown]
# ## The autograd function
#
# Backward returns `dX` now. For `dW` it either returns it (autograd accumulates it into the parameter) or
# pushes a closure that computes the same product later and hands it to autograd then, with
# `torch.autograd.backward(w, dW)`. Autograd carries it through whatever `w` is — the parameter itself, or a
# view or cast of it, such as GPT-OSS's `(E, in, out)` weights passed as `.mT` — and accumulates it into the
# leaf exactly as an immediate backward would, firing the same gradient hooks (which FSDP2 relies on).
# `deliver_wgrad` makes that choice for this layer and for ops/15's FP8 layers.

# %%
#| export
def deliver_wgrad(queue: WeightGradQueue | None, param: Tensor | None, wgrad):
    """A weight gradient for autograd to return: `wgrad()` now, or None when there is none (`wgrad` None) or it waits
    in `queue`, as a closure that back-propagates it into `param` (the weight tensor the forward was given)."""
    if wgrad is None:
        return None
    if queue is None:
        return wgrad()
    queue.push(lambda: torch.autograd.backward(param, wgrad()))
    return None


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, wgrad_queue, use_grouped_mm):
        w_t = not w.is_contiguous() and w.mT.is_contiguous()   # an (E, in, out) weight passed as .mT
        if use_grouped_mm:
            products = _products_grouped_mm(counts.cumsum(0).to(torch.int32), w_t)
        else:
            products = _products_loop([0] + counts.cumsum(0).tolist(), w_t)   # the loop's one host sync
        ctx.products, ctx.queue = products, wgrad_queue
        ctx.param = w if wgrad_queue is not None else None   # the tensor a deferred closure back-propagates into
        ctx.save_for_backward(x, w)
        return products[0](x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        _, dgrad, wgrad = ctx.products
        dx = dgrad(dy, w) if ctx.needs_input_grad[0] else None
        dw = deliver_wgrad(ctx.queue, ctx.param, (lambda: wgrad(dy, x)) if ctx.needs_input_grad[1] else None)
        return dx, dw, None, None, None

# %%
#| export
def check_grouped(name: str, x: Tensor, w: Tensor, counts: Tensor, impl: str | None, impls: tuple[str, str]) -> str:
    "Refuse what an expert layer (this one, or ops/15's FP8 ones) cannot take, in one line; return the impl to run."
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or counts.shape != (w.shape[0],):
        raise ValueError(f"{name} wants x (N, in), w (E, out, in), counts (E,), got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, counts {tuple(counts.shape)}")
    if counts.dtype != torch.int64:
        raise ValueError(f"counts must be int64 (rows per expert, from sort_by_expert), got {counts.dtype}")
    impl = choose_impl(impl, x, impls)
    torch._assert_async(counts.sum() <= x.shape[0], f"{name}: counts must sum to at most the {x.shape[0]} rows of x")
    return impl


def grouped_linear(x: Tensor, w: Tensor, counts: Tensor, wgrad_queue: WeightGradQueue | None = None,
                   impl: str | None = None) -> Tensor:
    """Per-expert linear on grouped rows: `y[rows of e] = x[rows of e] @ w[e]ᵀ` for `x (N, in)`, `w (E, out, in)`,
    `counts (E,)` int64 with sum at most N: rows after the last group (a buffer sized by a bound) are neither
    read nor written, and their outputs and input gradients are left unspecified. With `wgrad_queue`, the weight
    gradient is deferred to `wgrad_queue.drain()` (accumulated into `w.grad`). `impl`: "grouped_mm", "loop", or
    None (grouped_mm on CUDA, loop elsewhere)."""
    use_grouped_mm = check_grouped("grouped_linear", x, w, counts, impl, ("grouped_mm", "loop")) == "grouped_mm"
    return _GroupedLinear.apply(x, w, counts, wgrad_queue, use_grouped_mm)

# %% [markdown]
# ## Checks
#
# Against a float64 reference (a per-row matmul with each row's own expert weight, no ranges involved): the
# output and both gradients, for both paths, with an expert that has no rows (its weight gradient must be
# exactly zero), a single-row group, and sizes that are no multiple of anything. `F.grouped_mm` on CPU runs
# in bf16 and fp32; the loop in fp32 here.

# %%
def reference(x, w, counts):
    "Each row times its own expert's weight, in float64."
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    return torch.einsum("ni,noi->no", x.double(), w.double()[expert])

def check(counts, n_in, n_out, impl, dtype=torch.float32, tol=1e-5):
    counts = torch.tensor(counts, dtype=torch.int64)
    N, E = int(counts.sum()), len(counts)
    x = torch.randn(N, n_in, dtype=dtype, requires_grad=True)
    w = (torch.randn(E, n_out, n_in) / n_in ** 0.5).to(dtype).requires_grad_()
    g = torch.randn(N, n_out, dtype=dtype)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = reference(x64, w64, counts)
    want.backward(g.double())
    y = grouped_linear(x, w, counts, impl=impl)
    y.backward(g)
    assert y.dtype == dtype and y.shape == (N, n_out)
    for got, ref in [(y, want), (x.grad, x64.grad), (w.grad, w64.grad)]:
        torch.testing.assert_close(got.double(), ref.detach(), rtol=tol, atol=tol)
    assert (w.grad[counts == 0] == 0).all(), "an expert with no rows got a nonzero weight gradient"

cases = [[5, 0, 1, 17, 3], [0, 0, 9], [1], [0, 4]]
for c in cases:
    check(c, 24, 40, "loop")
    check(c, 24, 40, "grouped_mm")
    check(c, 24, 40, "grouped_mm", torch.bfloat16, tol=5e-2)
print("loop and F.grouped_mm (CPU) match the float64 reference; empty experts get zero gradient")

# %% [markdown]
# **A weight stored `(E, in, out)`, passed as `.mT`.** Its gradient equals the reference's, immediate or deferred,
# and arrives in the parameter's own layout: no operator of the backward copies a weight-sized tensor (a
# `TorchDispatchMode` lists the copies).

# %%
from torch.utils._python_dispatch import TorchDispatchMode

class WeightCopies(TorchDispatchMode):
    "Records the copying operators whose result has `n` elements."
    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("clone", "copy_", "_to_copy") and getattr(out, "numel", lambda: 0)() == self.n:
            self.seen.append(func.__name__)
        return out

for impl in ("loop", "grouped_mm"):
    counts = torch.tensor([5, 0, 1, 17, 3], dtype=torch.int64)
    x = torch.randn(26, 24)
    w_io = (torch.randn(5, 24, 40) / 24 ** 0.5).requires_grad_()   # (E, in, out), as GPT-OSS stores it
    g = torch.randn(26, 40)
    for queue in (None, WeightGradQueue()):
        w_io.grad = None
        y = grouped_linear(x, w_io.mT, counts, queue, impl)
        with WeightCopies(w_io.numel()) as copies:
            y.backward(g)
            if queue is not None:
                queue.drain()
        assert not copies.seen, f"{impl}: the weight gradient was copied ({copies.seen})"
        w64 = w_io.detach().double().mT.requires_grad_()
        reference(x, w64, counts).backward(g.double())
        torch.testing.assert_close(w_io.grad.double(), w64.grad.mT, rtol=1e-5, atol=1e-5)
        assert w_io.grad.stride() == w_io.stride(), (w_io.grad.stride(), w_io.stride())
print("a transposed weight's gradient is right and laid out like the parameter")

# %% [markdown]
# **Rows after the last group.** A buffer sized by a bound (engine/31_ep's sync-free dispatch) has more rows than
# the counts cover. Those rows must change nothing: the first N outputs, their input gradients and the weight
# gradient equal the run on the first N rows alone, whatever the extra rows and their output gradients hold.

# %%
def check_trailing(counts, extra, impl):
    counts = torch.tensor(counts, dtype=torch.int64)
    N, E = int(counts.sum()), len(counts)
    x = torch.randn(N + extra, 24)
    w = torch.randn(E, 40, 24) / 24 ** 0.5
    g = torch.randn(N + extra, 40)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ya = grouped_linear(xa, wa, counts, impl=impl)
    ya.backward(g)
    xb, wb = x[:N].clone().requires_grad_(), w.clone().requires_grad_()
    yb = grouped_linear(xb, wb, counts, impl=impl)
    yb.backward(g[:N])
    assert ya.shape == (N + extra, 40)
    for got, want in [(ya[:N], yb), (xa.grad[:N], xb.grad), (wa.grad, wb.grad)]:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

for impl in ("loop", "grouped_mm"):
    check_trailing([5, 0, 1, 17, 3], 7, impl)
    check_trailing([0, 0, 0], 4, impl)
print("rows after the last group change nothing")

# %% [markdown]
# Zero rows in total, and input errors that say what to change. (The counts-sum check is a device-side assert
# on CUDA, which ends the process; so these checks use CPU tensors.)

# %%
cpu = dict(device="cpu")
y = grouped_linear(torch.zeros(0, 8), torch.zeros(3, 16, 8, requires_grad=True), torch.zeros(3, dtype=torch.int64))
assert y.shape == (0, 16)
for bad, msg in [
        (lambda: grouped_linear(torch.zeros(4, 8, **cpu), torch.zeros(2, 16, 8, **cpu), torch.tensor([3, 2], **cpu)),
         "at most the 4"),
        (lambda: grouped_linear(torch.zeros(4, 8), torch.zeros(2, 16, 8), torch.tensor([1, 3], dtype=torch.int32)),
         "int64"),
        (lambda: grouped_linear(torch.zeros(4, 7), torch.zeros(2, 16, 8), torch.tensor([1, 3])), "w (E, out, in)")]:
    try:
        bad()
    except (ValueError, RuntimeError) as e:
        assert msg in str(e), e
    else:
        raise AssertionError(f"no error for {msg}")

# %% [markdown]
# **Deferred equals immediate, bitwise.** Two layers in a row, two backward passes accumulating into the same
# `.grad` (as gradient accumulation over micro-batches does): with the queue, after backward the input
# gradient is already there and the weight gradients are not; after `drain()` every gradient equals the
# immediate run's bit for bit.

# %%
def two_layers(x, w1, w2, counts, queue, impl):
    return grouped_linear(torch.relu(grouped_linear(x, w1, counts, queue, impl)), w2, counts, queue, impl)

for impl in ("loop", "grouped_mm"):
    counts = torch.tensor([3, 0, 6, 1], dtype=torch.int64)
    x = torch.randn(10, 16, requires_grad=True)
    w1, w2 = torch.randn(4, 24, 16, requires_grad=True), torch.randn(4, 8, 24, requires_grad=True)
    grads = {}
    for queue in (None, WeightGradQueue()):
        for p in (x, w1, w2):
            p.grad = None
        for _ in range(2):
            two_layers(x, w1, w2, counts, queue, impl).square().sum().backward()
        if queue is not None:
            assert len(queue) == 4 and w1.grad is None and w2.grad is None and x.grad is not None
            queue.drain()
            assert len(queue) == 0
        grads[queue is None] = [p.grad.clone() for p in (x, w1, w2)]
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False])), impl
    assert (grads[True][1][1] == 0).all() and (grads[True][2][1] == 0).all()
print("deferred == immediate, bitwise; the empty expert's weight gradients are zero")

# %% [markdown]
# ## On the GPU
#
# The GPU cell checks both implementations in bf16 against each other, then prints `grouped_linear_bench` from
# `benchmarks/ops.py`: forward + backward against raw `F.grouped_mm` (autograd's own backward) at Qwen3-30B-A3B's
# expert shapes (131072 routed rows over 128 experts), against the bf16 matmul ceiling.

# %%
#| cuda
counts = torch.tensor([37, 0, 1, 250, 0, 96], device="cuda")
x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(6, 512, 256, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
g = torch.randn(x.shape[0], 512, device="cuda", dtype=torch.bfloat16)
grads = []
for impl in ("grouped_mm", "loop"):
    x.grad = w.grad = None
    y = grouped_linear(x, w, counts, impl=impl)
    y.backward(g)
    grads.append((y.detach(), x.grad, w.grad))
for a, b in zip(*grads):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
assert (grads[0][2][counts == 0] == 0).all(), "grouped_mm gave a nonzero weight gradient to an empty expert"
queue = WeightGradQueue()
x.grad = w.grad = None
grouped_linear(x, w, counts, queue).backward(g)
queue.drain()
assert torch.equal(w.grad, grads[0][2]) and torch.equal(x.grad, grads[0][1])
from benchmarks.ops import grouped_linear_bench
for name, value in grouped_linear_bench().items():
    print(f"{name:44s} {value:10.3f}")
