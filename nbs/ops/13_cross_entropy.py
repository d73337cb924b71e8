# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fused linear cross-entropy
#
# The loss head multiplies the final hidden states `h (T, H)` by the output embedding `W (V, H)` and takes the
# cross-entropy of the logits against the next tokens. With Qwen3's vocabulary of 151936 and 16K tokens, the
# logits alone are 16384 × 151936 = 2.5 G elements: 5 GB in bf16. Eager PyTorch (`logits.float()` then
# `F.cross_entropy`) adds a 10 GB fp32 copy, saves a 10 GB fp32 log-softmax for backward, and in backward
# materialises two more fp32 tensors of that size before casting back: tens of GB for one scalar.
#
# None of that needs to exist at once. The gradient of the summed loss with respect to the logits is
# `softmax − onehot(label)`, known as soon as the forward has seen a row. So the logits are produced a chunk of
# tokens at a time, and each chunk is consumed on the spot:
#
# 1. `logits = h_c @ W^T` in the input dtype;
# 2. one Triton kernel computes each row's loss (an online logsumexp in fp32) and overwrites the logits with
#    their gradient `softmax − onehot` (zero for ignored rows), in place;
# 3. `grad_h_c = dlogits @ W` and `grad_W += dlogits^T @ h_c`.
#
# Forward thus already holds both input gradients for a loss scaled by 1; backward only multiplies them by the
# incoming gradient. Peak memory is one chunk of logits plus the weight gradient, instead of several full-size
# fp32 copies of the logits.
#
# The result is the SUM of token losses over the labels that are not `ignore_index`; the trainer divides by the
# global token count.

# %%
#| default_exp ops.cross_entropy

# %%
#| export
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pith_lit.ops.swiglu import choose_impl


# %% [markdown]
# The checks below run on the GPU when there is one (compiled kernels), otherwise on the CPU under the Triton
# interpreter, which must be switched on in the environment before Triton is imported.

# %%
import os

# %%
if torch.cuda.is_available():
    torch.set_default_device("cuda")
else:
    assert os.environ.get("TRITON_INTERPRET") == "1", "on a CPU, run this notebook with TRITON_INTERPRET=1 set"

# %% [markdown]
# ## The reference
#
# Eager and obvious: `cross_entropy_ref` (in `tests/references.py`, shared with the tests and the benchmark)
# computes the full logits `h @ weightᵀ` in fp32, or fp64 for fp64 inputs, and sums `F.cross_entropy` over the
# tokens. The checks compare against it in float64, and the GPU benchmark measures what the fused version saves
# against it.

# %%
from tests.references import cross_entropy_ref

# %% [markdown]
# ## The per-row step: loss, and the logits' gradient in place
#
# For a row `x` with label `y`: `loss = logsumexp(x) − x[y]` and `∂loss/∂x = softmax(x) − onehot(y)`.
# In plain PyTorch (the CPU path, and the reference for the kernel), computed in fp32 or wider:

# %%
#| export
def ce_rows_torch(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    "Per-row losses of `logits (c, V)`; overwrite `logits` with d(sum of losses)/d(logits). Plain PyTorch."
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = labels != ignore_index
    target = labels.where(valid, 0)
    lse = x.logsumexp(-1)
    loss = (lse - x.gather(1, target[:, None])[:, 0]).where(valid, 0)
    grad = (x - lse[:, None]).exp()
    grad[torch.arange(len(x), device=x.device), target] -= 1
    logits.copy_(grad * valid[:, None])
    return loss


# %% [markdown]
# The kernel runs one program per row and makes two passes over it, `BLOCK` columns at a time. The first keeps a
# running maximum `m` and a running sum `s = Σ exp(x − m)`, rescaling `s` by `exp(m_old − m_new)` whenever the
# maximum grows, so a row of any width needs one read and no fp32 copy. The second pass re-reads the row
# (much of it still in L2) and writes `exp(x − lse) − [col = y]`. A row whose label is `ignore_index` skips the
# first pass (its loop bound is 0) and writes zeros. A label outside `[0, V)` that is not `ignore_index` gives a
# NaN loss instead of a silent wrong value; checking it on the host would cost a device synchronisation.

# %%
#| export
@triton.jit
def _ce_rows_kernel(logits_ptr, labels_ptr, loss_ptr, n_cols, stride, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_ptr = logits_ptr + row.to(tl.int64) * stride
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    for start in range(0, tl.where(valid, n_cols, 0), BLOCK):
        x = tl.load(x_ptr + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(tl.where(valid, s, 1.0))  # an ignored row never summed: keep log(0) out
    in_range = (label >= 0) & (label < n_cols)
    x_label = tl.load(x_ptr + label, mask=valid & in_range, other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_label, 0.0))
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        x = tl.load(x_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        grad = tl.where(valid, tl.where(c == label, p - 1, p), 0.0)
        tl.store(x_ptr + c, grad.to(logits_ptr.dtype.element_ty), mask=c < n_cols)


def ce_rows_triton(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    "Same contract as `ce_rows_torch`, in one Triton launch (one program per row)."
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        block = min(triton.next_power_of_2(logits.shape[1]), 4096)
        _ce_rows_kernel[(logits.shape[0],)](logits, labels, loss, logits.shape[1], logits.stride(0), ignore_index,
                                            BLOCK=block, num_warps=8)
    return loss


# %% [markdown]
# Check the kernel against the PyTorch rows on logits wide enough for several blocks (V = 5000 > 4096, not a
# multiple of it), with ignored rows and labels at both ends of the vocabulary:

# %%
def rel_err(a, b):
    "‖a − b‖ / ‖b‖ in float64 (0 when both are empty)."
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

torch.manual_seed(0)
logits = torch.randn(13, 5000) * 4
labels = torch.randint(0, 5000, (13,))
labels[[2, 7]] = -100
labels[3], labels[4] = 0, 4999
fast, ref = logits.clone(), logits.double()
loss_fast, loss_ref = ce_rows_triton(fast, labels, -100), ce_rows_torch(ref, labels, -100)
errs = rel_err(loss_fast, loss_ref), rel_err(fast, ref)
print(f"loss rows rel err {errs[0]:.1e}, gradient rel err {errs[1]:.1e}")
assert max(errs) < 1e-6, errs
assert (loss_fast[[2, 7]] == 0).all() and (fast[[2, 7]] == 0).all()
assert torch.allclose(ref.sum(1), torch.zeros(13, dtype=torch.float64), atol=1e-12)  # softmax − onehot sums to 0
bad = torch.tensor([5000, -1, -100])  # out of range, negative, ignored
print("loss rows for bad labels:", ce_rows_triton(torch.randn(3, 5000), bad, -100))
assert ce_rows_triton(torch.randn(3, 5000), bad, -100).isnan().tolist() == [True, True, False]


# %% [markdown]
# ## The chunked autograd function
#
# Forward walks the tokens `chunk_size` at a time. `grad_h` is written chunk by chunk; `grad_W` accumulates over
# chunks in fp32 (on CUDA through `addmm` with `out_dtype`, bf16 operands with an fp32 result), so summing many
# chunks does not round to bf16 at every step, and is cast to the weight's dtype once at the end.
#
# The default chunk is 4096 tokens. The weight-gradient update reads and writes the fp32 `(V, H)` accumulator
# (8 bytes per element) for `2·chunk` flops per element, so at 4096 it does 1024 flops per byte, far above the
# H200's ridge of about 180 (789 TFLOP/s over 4.3 TB/s); chunks below about 700 tokens would make that update
# memory-bound. The chunk's logits then take 4096 × 151936 × 2 B = 1.2 GB, a quarter of the bf16 logits. On the
# H200 at 16K tokens, chunks of 2048, 4096 and 8192 took 50.6, 51.2 and 51.7 ms for fwd+bwd (within run-to-run
# noise) with peaks of 2.6, 3.8 and 6.3 GB.
#
# Gradients are computed only for inputs that need them, and not at all under `torch.no_grad()` (evaluation).

# %%
#| export
DEFAULT_CHUNK = 4096


class LinearCrossEntropyFunction(torch.autograd.Function):
    "Summed cross-entropy of `h @ weight^T`, token chunk by chunk; both gradients are computed in forward."

    @staticmethod
    def forward(ctx, h, weight, labels, ignore_index, chunk_size, impl, need_grad_h, need_grad_w):
        T = h.shape[0]
        acc_dtype = torch.promote_types(h.dtype, torch.float32)
        loss = torch.zeros((), dtype=acc_dtype, device=h.device)
        grad_h = torch.empty_like(h) if need_grad_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=h.device) if need_grad_w else None
        for start in range(0, T, chunk_size):
            h_c, labels_c = h[start:start + chunk_size], labels[start:start + chunk_size]
            logits = h_c @ weight.t()
            loss += (ce_rows_triton if impl == "triton" else ce_rows_torch)(logits, labels_c, ignore_index).sum()
            # logits now holds d(loss)/d(logits)
            if need_grad_h:
                torch.mm(logits, weight, out=grad_h[start:start + chunk_size])
            if need_grad_w and h.is_cuda and acc_dtype != h.dtype:  # bf16 inputs, fp32 accumulator
                torch.addmm(grad_w, logits.t(), h_c, out_dtype=acc_dtype, out=grad_w)
            elif need_grad_w:  # the CPU has no mixed-dtype addmm; .to is a no-op for fp32 and fp64
                grad_w.addmm_(logits.t().to(acc_dtype), h_c.to(acc_dtype))
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if need_grad_w else None)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * dloss if grad_h is not None else None, grad_w * dloss if grad_w is not None else None,
                None, None, None, None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         chunk_size: int | None = None, impl: str | None = None) -> torch.Tensor:
    """SUM over labels ≠ ignore_index of cross-entropy(h @ weight^T, labels), never holding all the logits.

    h (T, H), weight (V, H) of one dtype; labels (T,) integers in [0, V) or ignore_index. Returns an fp32 scalar
    (fp64 for fp64 inputs). chunk_size: tokens per chunk (default 4096). impl: the per-row kernel, 'triton',
    'torch', or None = Triton on CUDA."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"h must be (T, H) and weight (V, H) with the same H; got h {tuple(h.shape)}, "
                         f"weight {tuple(weight.shape)} (flatten batch and sequence into T first)")
    if labels.shape != (h.shape[0],) or labels.is_floating_point():
        raise ValueError(f"labels must be an integer tensor of shape ({h.shape[0]},), one per row of h; "
                         f"got {labels.dtype} of shape {tuple(labels.shape)}")
    if h.dtype != weight.dtype:
        raise ValueError(f"h and weight must have one dtype; got {h.dtype} and {weight.dtype}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens (or None for {DEFAULT_CHUNK}); "
                         f"got {chunk_size}")
    impl = choose_impl(impl, h)
    grad_on = torch.is_grad_enabled()
    return LinearCrossEntropyFunction.apply(h.contiguous(), weight.contiguous(), labels.contiguous(), ignore_index,
                                            chunk_size or DEFAULT_CHUNK, impl, grad_on and h.requires_grad,
                                            grad_on and weight.requires_grad)


# %% [markdown]
# Check loss and both gradients against the eager reference in float64: the Triton kernel on float32 inputs
# (error at float32 rounding), and the PyTorch rows in float64 (the chunking itself is exact, so the error is
# at float64 rounding). T is not a multiple of the chunk, some labels are ignored, one chunk is ignored entirely,
# and single-token and zero-token batches are included.

# %%
def check_lce(T, H, V, chunk_size, seed, ignore_rows=()):
    "Run linear_cross_entropy both ways against cross_entropy_ref in float64; return the three errors."
    torch.manual_seed(seed)
    h, w = torch.randn(T, H), torch.randn(V, H) / H ** 0.5 * 3
    labels = torch.randint(0, V, (T,))
    labels[list(ignore_rows)] = -100
    dloss = torch.rand(()) + 0.5  # backward scales by the incoming gradient
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    (cross_entropy_ref(h64, w64, labels) * dloss).backward()
    out = {}
    for impl, dtype, tol in [("triton", torch.float32, 1e-5), ("torch", torch.float64, 1e-12)]:
        hh, ww = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
        loss = linear_cross_entropy(hh, ww, labels, chunk_size=chunk_size, impl=impl)
        (loss * dloss).backward()
        errs = (rel_err(loss, cross_entropy_ref(h64, w64, labels)), rel_err(hh.grad, h64.grad),
                rel_err(ww.grad, w64.grad))
        assert max(errs) < tol and loss.dtype == torch.promote_types(dtype, torch.float32), (impl, errs)
        out[impl] = errs
        print(f"T={T:3d} H={H:3d} V={V:5d} chunk={chunk_size} {impl:6s} loss {errs[0]:.1e}  "
              f"grad_h {errs[1]:.1e}  grad_W {errs[2]:.1e}")
    return out

check_lce(T=45, H=24, V=5000, chunk_size=16, seed=0, ignore_rows=[0, 5, *range(16, 32)])
check_lce(T=1, H=8, V=300, chunk_size=None, seed=1)
check_lce(T=30, H=16, V=77, chunk_size=7, seed=2, ignore_rows=[29]);

# %% [markdown]
# Zero tokens give a zero loss and zero gradients; under `torch.no_grad()` no gradient is computed at all; the
# CPU default (`impl=None`) runs the PyTorch rows.

# %%
h, w = torch.randn(0, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
loss = linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.long))
loss.backward()
assert loss.item() == 0 and h.grad.shape == (0, 8) and (w.grad == 0).all()
h, w, labels = torch.randn(20, 8), torch.randn(50, 8, requires_grad=True), torch.randint(0, 50, (20,))
with torch.no_grad():
    loss = linear_cross_entropy(h, w, labels, chunk_size=6)
assert not loss.requires_grad and abs(loss.item() - cross_entropy_ref(h, w, labels).item()) < 1e-3


# %% [markdown]
# Bad input says what to change:

# %%
h, w, labels = torch.randn(6, 8), torch.randn(50, 8), torch.randint(0, 50, (6,))
for msg, call in [("with the same H", lambda: linear_cross_entropy(h, w[:, :4], labels)),
                  ("one per row of h", lambda: linear_cross_entropy(h, w, labels[:5])),
                  ("integer tensor", lambda: linear_cross_entropy(h, w, labels.float())),
                  ("one dtype", lambda: linear_cross_entropy(h, w.double(), labels)),
                  ("chunk_size must be", lambda: linear_cross_entropy(h, w, labels, chunk_size=0)),
                  ("impl must be", lambda: linear_cross_entropy(h, w, labels, impl="cuda"))]:
    try:
        call()
        raise AssertionError("no error")
    except ValueError as e:
        assert msg in str(e), e
        print("ValueError:", e)


# %% [markdown]
# ## On the GPU: bf16 at real sizes, memory and speed
#
# The fused version does the same three matmuls as eager (6·T·H·V flops), so its floor is matmul time; what it
# removes is the fp32 logits' traffic and memory. The GPU cell checks bf16 at the real vocabulary against an fp32
# reference on the same bf16 inputs, then runs `cross_entropy_bench` from `benchmarks/ops.py` (forward+backward
# time and peak memory above the inputs, fused and eager). Targets: peak memory ≤ 1/4 of eager's, and no slower
# (the figures: benchmarks/RESULTS.md).

# %%
#| cuda
torch.manual_seed(0)
h = torch.randn(2000, 2048, device="cuda").bfloat16().requires_grad_()
w = (torch.randn(151936, 2048, device="cuda") / 2048 ** 0.5).bfloat16().requires_grad_()
labels = torch.randint(0, 151936, (2000,), device="cuda")
labels[::7] = -100
loss = linear_cross_entropy(h, w, labels, chunk_size=768)
loss.backward()
hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
loss_ref = cross_entropy_ref(hf, wf, labels)
loss_ref.backward()
errs = rel_err(loss, loss_ref), rel_err(h.grad, hf.grad), rel_err(w.grad, wf.grad)
print(f"bf16 vs fp32: loss {errs[0]:.1e}, grad_h {errs[1]:.1e}, grad_W {errs[2]:.1e}")
assert max(errs) < 1e-2, errs
from benchmarks.ops import cross_entropy_bench
results = cross_entropy_bench()
for k, v in results.items():
    print(f"{k:45s} {v:10.3f}")
key = "linear_cross_entropy fwd+bwd"
assert results[f"{key} peak / eager peak"] <= 0.25 and results[f"{key} speed-up"] >= 1.0, results
