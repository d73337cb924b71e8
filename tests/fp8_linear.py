"""`fp8_linear`: a dense `x @ wᵀ` in FP8 with DeepSeek-V3's block scales, through cuBLAS's block-scaled GEMM
(`F.scaled_mm`) on CUDA and the reference elsewhere. Nothing in the package runs it; the tests check it
(test_ops_fp8's group_dense) and benchmarks/fp8_bench.py times it against bf16.

On CUDA: `F.scaled_mm` with 1×128 tiles for the activation and 128×128 blocks for the weight, quantized by
ops/15's kernels. The three products:
- forward: `scaled_mm(X̂, Ŵᵀ, s_x, BlockWise1x128, s_w, BlockWise128x128)`;
- input gradient: the same with dY and Wᵀ's quantization (`quantize_weight(w, transposed=True)`);
- weight gradient: `scaled_mm(dŶᵀ, X̂ (column-major), s_dy, BlockWise1x128, s_x, BlockWise1x128)` with both
  quantized along tokens (`quantize_act(..., cols=True)` with one group, zero-padded to a multiple of 128 tokens).
cuBLAS's layout rules, which torch checks: the second operand column-major; the 1×128 scales M-major, strides
`(1, M)` (what `quantize_act` returns); the 128×128 scales of the second operand as a `(L4, N/128)` view with strides
`(1, L4)`, where `L4` is `K/128` rounded up to a multiple of 4 (padded with zeros). The scaled_mm path needs `in` and
`out` to be multiples of 128; the reference (fake-quantize, multiply in fp32) takes any size."""
import torch
import torch.nn.functional as F
from torch import Tensor

from pith_lit.ops.fp8 import Fp8Act, fake_quant, quantize_act, quantize_weight


def scaled_mm_blockwise(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor) -> Tensor:
    "`(qa·sa) @ (qb·sb)ᵀ` in bf16 via F.scaled_mm: qa (M, K) 1x128 tiles, qb (N, K) with (N/128, K/128) block scales."
    nb, kb = sb.shape
    sb_pad = sb.new_zeros(nb, -(-kb // 4) * 4)
    sb_pad[:, :kb] = sb
    return F.scaled_mm(qa, qb.t(), sa, F.ScalingType.BlockWise1x128, sb_pad.t(), F.ScalingType.BlockWise128x128,
                       output_dtype=torch.bfloat16)


def scaled_mm_wgrad(g: Fp8Act, a: Fp8Act) -> Tensor:
    "`dYᵀ X` in bf16 via F.scaled_mm from both operands' column quantizations (1x128 along tokens)."
    return F.scaled_mm(g.qt, a.qt.t(), g.st.t(), F.ScalingType.BlockWise1x128, a.st.t(),
                       F.ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)


class Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, use_scaled_mm):
        keep = ctx.needs_input_grad[1]
        if use_scaled_mm:
            a = quantize_act(x, rows=True, cols=keep)
            y = scaled_mm_blockwise(a.q, a.s, *quantize_weight(w)).to(x.dtype)
            saved = (a.qt, a.st) if keep else ()
        else:
            y = (fake_quant(x, (1, 128), torch.float32) @ fake_quant(w, (128, 128), torch.float32).T).to(x.dtype)
            saved = (x,) if keep else ()
        ctx.use_scaled_mm = use_scaled_mm
        ctx.save_for_backward(w, *saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        w, *saved = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dy = dy.contiguous()
        dx = dw = None
        if ctx.use_scaled_mm:
            g = quantize_act(dy, rows=need_dx, cols=need_dw)
            if need_dx:
                dx = scaled_mm_blockwise(g.q, g.s, *quantize_weight(w, transposed=True)).to(dy.dtype)
            if need_dw:
                dw = scaled_mm_wgrad(g, Fp8Act(None, None, *saved)).to(w.dtype)
        else:
            if need_dx:
                dx = (fake_quant(dy, (1, 128), torch.float32) @ fake_quant(w, (128, 128), torch.float32)).to(dy.dtype)
            if need_dw:
                (x,) = saved
                dw = (fake_quant(dy, (128, 1), torch.float32).T @ fake_quant(x, (128, 1), torch.float32)).to(w.dtype)
        return dx, dw, None


def fp8_linear(x: Tensor, w: Tensor, impl: str | None = None) -> Tensor:
    """`x @ wᵀ` in FP8 for `x (..., in)`, `w (out, in)`, in x's dtype: 1x128 activation tiles, 128x128 weight blocks.
    `impl`: "scaled_mm" (CUDA; in and out multiples of 128), "torch" (the reference), or None (by device)."""
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_linear wants x (..., in) and w (out, in), got x {tuple(x.shape)}, w {tuple(w.shape)}")
    if impl not in (None, "scaled_mm", "torch"):
        raise ValueError(f"impl must be 'scaled_mm', 'torch' or None (choose by device), got {impl!r}")
    use_scaled_mm = x.is_cuda if impl is None else impl == "scaled_mm"
    if use_scaled_mm and (w.shape[0] % 128 or w.shape[1] % 128):
        raise ValueError(f"fp8_linear through F.scaled_mm needs in and out features that are multiples of 128, got "
                         f"w {tuple(w.shape)}; use impl='torch' for other sizes")
    lead = x.shape[:-1]
    y = Fp8Linear.apply(x.reshape(-1, x.shape[-1]), w, use_scaled_mm)
    return y.reshape(*lead, w.shape[0])
