"""FP8 quantization, grouped GEMMs and linear layers (pith_lit.ops.fp8) against float64 references, under the Triton
interpreter.

Each group runs in its own process (`python tests/test_ops_fp8.py <group>`) with TRITON_INTERPRET=1 set before
Triton is imported. Sizes stay within a few 128-row tiles so each group takes seconds on two CPU cores. The
references quantize with `quantize_ref` (plain torch) and multiply in float64, one row or one expert at a time.
"""
import pytest

from conftest import group_main, run_group

GROUPS = ["quantize", "gemm", "layer", "swiglu", "dense", "rows"]


@pytest.mark.parametrize("group", GROUPS)
def test_fp8(group):
    run_group(__file__, group)


# ---- helpers (run in the child process) ----

def _rel(a, b):
    "‖a − b‖ / ‖b‖ in float64."
    a, b = a.double(), b.double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _randn(seed, *shapes, scale=1.0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * scale for s in shapes]


def _blocky(t, seed):
    """t times powers of two that vary by 1x128 tile, by 32-row group per column, and by 128x128 block, so that
    neighbouring scale blocks in every direction get different scales (a misplaced scale then shows)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    R, C = t.shape[-2:]
    def spread(rows, cols, br, bc):
        e = torch.randint(-4, 5, (*t.shape[:-2], rows, cols), generator=g).float()
        return e.repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., :R, :C]
    n = lambda size, b: -(-size // b)
    return t * torch.exp2(spread(R, n(C, 128), 1, 128) + spread(n(R, 32), C, 32, 1) + spread(n(R, 128), n(C, 128), 128, 128))


def _fq(x, block):
    from pith_lit.ops.fp8 import dequantize_ref, quantize_ref
    return dequantize_ref(*quantize_ref(x, block), block)


def _bounds(counts):
    b = [0] + counts.cumsum(0).tolist()
    return list(zip(b[:-1], b[1:]))


def _tile_starts(counts):
    "The first 128-token tile of each expert in the column layout, and the end: `[0, ...]` of length E + 1."
    return [0] + ((counts + 127) // 128).cumsum(0).tolist()


def _ref_layer(x, w, counts, dy):
    """y, dx, dw of the FP8 expert layer in float64, one expert at a time: 1x128 tiles of x and dy, 128x128 blocks of
    w, tiles of 128 tokens from each expert's first row for the weight gradient. Rows past the experts: zero."""
    import torch
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    for e, (a, b) in enumerate(_bounds(counts)):
        wq = _fq(w[e], (128, 128))
        y[a:b] = _fq(x[a:b], (1, 128)) @ wq.T
        dx[a:b] = _fq(dy[a:b], (1, 128)) @ wq
        dw[e] = _fq(dy[a:b], (128, 1)).T @ _fq(x[a:b], (128, 1))
    return y, dx, dw


def _gemm_cases(K0, seed, K4=160):
    """(i, counts, rows, x, w, dy) for the GEMM groups: an empty expert, a one-row expert, experts spanning several
    tiles, rows past the last expert, K and N below, at and off multiples of 128 (`K0`, `K4`: K of cases 1 and 4);
    values spread over scale blocks in every direction (`_blocky`)."""
    import torch
    cases = [([70, 0, 1, 131], 4, 256, 192), ([1], 0, K0, 16), ([0, 0, 0], 3, 128, 128), ([33, 200], 0, 96, 130),
             ([5, 9, 0, 17, 2, 0, 1, 40], 2, K4, 48)]
    for i, (counts, extra, K, N) in enumerate(cases):
        counts = torch.tensor(counts, dtype=torch.int64)
        n = int(counts.sum())
        x, w, dy = (_blocky(t, seed + 50 + i + j) for j, t in
                    enumerate(_randn(seed + i, (n + extra, K), (len(counts), N, K), (n + extra, N))))
        yield i, counts, n, x, w, dy


# ---- groups ----

def group_quantize():
    """Triton quantizers equal the torch reference value for value; scales are the smallest powers of two that fit."""
    import torch
    from pith_lit.ops.fp8 import FP8, pow2_scale, quantize_act, quantize_ref, quantize_weight
    # the scale rule, at the boundaries: amax = 448·2^k exactly, just above, zero, tiny, huge
    amax = torch.tensor([448.0, 448.0 * 2 ** -20, 448.00003, 1.0, 0.0, 1e-42, 3e38])
    s = pow2_scale(amax)
    assert s.tolist() == [1.0, 2.0 ** -20, 2.0, 2.0 ** -8, 2.0 ** -126, 2.0 ** -126, 2.0 ** 120], s.tolist()
    assert (amax / s <= 448).all() and ((amax / (s / 2) > 448) | (s == 2.0 ** -126)).all()
    # every E4M3 value and every midpoint between neighbours (ties to even), with scale 1
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids + 1e-7 * mids.abs(), mids - 1e-7 * mids.abs()])
    vals = torch.cat([vals, torch.zeros(-len(vals) % 127)]).view(-1, 127).clamp(-448, 448)
    vals = torch.cat([torch.full((len(vals), 1), 448.0), vals], 1)
    got = quantize_act(vals).q.float()
    assert torch.equal(got, vals.to(FP8).float()), (got != vals.to(FP8).float()).sum()
    # random activations: rows and per-expert columns, many expert patterns, K below, at and above 128
    for seed, (counts, extra, K) in enumerate([([1], 0, 16), ([0, 128, 129], 3, 128), ([257, 0, 0, 2], 1, 300),
                                               ([0, 0], 5, 64), ([3], 0, 130)]):
        counts = torch.tensor(counts, dtype=torch.int64)
        M = int(counts.sum()) + extra
        (x,) = _randn(100 + seed, (M, K))
        x = x * torch.logspace(-30, 30, M)[:, None]
        a = quantize_act(x, counts, rows=True, cols=True)
        n = int(counts.sum())
        q, s = quantize_ref(x[:n], (1, 128))
        assert torch.equal(a.q[:n].float(), q.float()) and torch.equal(a.s[:n], s)
        tile = _tile_starts(counts)
        assert a.qt.shape == (K, 128 * (-(-M // 128) + len(counts) - 1)) and a.st.shape == (a.qt.shape[1] // 128, K)
        for e, (lo, hi) in enumerate(_bounds(counts)):
            q, s = quantize_ref(x[lo:hi], (128, 1))
            t0, t1 = tile[e], tile[e + 1]
            assert torch.equal(a.qt[:, 128 * t0:128 * t0 + hi - lo].float(), q.float().T)
            assert torch.equal(a.st[t0:t1], s) and (a.qt[:, 128 * t0 + hi - lo:128 * t1].float() == 0).all()
        only_cols = quantize_act(x, counts, rows=False, cols=True)
        assert only_cols.q is None and torch.equal(only_cols.qt[:, :128 * tile[-1]].float(),
                                                   a.qt[:, :128 * tile[-1]].float())
    # bf16 input quantizes like its fp32 value
    (x,) = _randn(110, (40, 200))
    xb = x.bfloat16()
    assert torch.equal(quantize_act(xb).q.float(), quantize_act(xb.float()).q.float())
    # weights: 2-D and 3-D, partial blocks, both layouts
    for seed, shape in enumerate([(1, 16, 16), (2, 129, 257), (300, 40)]):
        (w,) = _randn(120 + seed, shape, scale=3.0)
        q, s = quantize_weight(w)
        qr, sr = quantize_ref(w, (128, 128))
        assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr)
        qt, st = quantize_weight(w, transposed=True)
        assert torch.equal(qt.float(), q.float().transpose(-2, -1)) and torch.equal(st, s.transpose(-2, -1))
        for src in (w, w.mT.contiguous().mT):                # both layouts from one pass, also from a stored transpose
            (q2, s2), (qt2, st2) = quantize_weight(src, "both")
            assert all(torch.equal(a.float(), b.float()) for a, b in [(q2, q), (s2, s), (qt2, qt), (st2, st)])
    with pytest.raises(ValueError, match="'both'"):
        quantize_weight(w, transposed="t")


def group_gemm():
    """The grouped GEMM and the weight-gradient GEMM against float64, over tile configurations and expert patterns."""
    import torch
    from pith_lit.ops.fp8 import GemmConfig, fp8_grouped_mm, fp8_grouped_wgrad, quantize_act, quantize_weight
    configs = [GemmConfig(), GemmConfig(64, 128, 64), GemmConfig(128, 64, 32), GemmConfig(16, 32, 128)]
    for i, counts, n, x, w, dy in _gemm_cases(K0=128, seed=200):
        cfg = configs[i % len(configs)]
        a = quantize_act(x, counts, cols=True)
        y = fp8_grouped_mm(a.q, a.s, *quantize_weight(w), counts, torch.float32, cfg)
        g = quantize_act(dy, counts, cols=True)
        dx = fp8_grouped_mm(g.q, g.s, *quantize_weight(w, transposed=True), counts, torch.float32, cfg)
        dw = fp8_grouped_wgrad(g.qt, g.st, a.qt, a.st, counts, torch.float32, cfg)
        y_r, dx_r, dw_r = _ref_layer(x, w, counts, dy)
        for name, got, want in [("y", y[:n], y_r[:n]), ("dx", dx[:n], dx_r[:n]), ("dw", dw, dw_r)]:
            assert _rel(got, want) < 1e-5 or (want == 0).all() and (got == 0).all(), (i, name, _rel(got, want))
        assert (dw[counts == 0] == 0).all()
    # bf16 output: rounded (truncated by the interpreter) to bf16 only
    counts = torch.tensor([50, 80])
    x, w = _randn(210, (130, 256), (2, 64, 256))
    a = quantize_act(x)
    y = fp8_grouped_mm(a.q, a.s, *quantize_weight(w), counts, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and _rel(y, _ref_layer(x, w, counts, torch.zeros(130, 64))[0]) < 1e-2
    # K = 0 gives zeros; no rows gives an empty result
    z = fp8_grouped_mm(*quantize_act(torch.zeros(3, 0))[:2], *quantize_weight(torch.zeros(2, 8, 0)),
                       torch.tensor([1, 2]), torch.float32)
    assert z.shape == (3, 8) and (z == 0).all()
    e = fp8_grouped_mm(*quantize_act(torch.zeros(0, 64))[:2], *quantize_weight(torch.zeros(2, 8, 64)),
                       torch.tensor([0, 0]), torch.float32)
    assert e.shape == (0, 8)


def group_layer():
    """fp8_grouped_linear through autograd: Triton and torch paths against float64; deferred weight gradients."""
    import torch
    from pith_lit.ops.fp8 import fp8_grouped_linear
    from pith_lit.ops.grouped_linear import WeightGradQueue, grouped_linear
    for i, (counts, extra, n_in, n_out) in enumerate([([70, 0, 1, 131], 3, 256, 192), ([0, 140], 0, 200, 72)]):
        counts = torch.tensor(counts)
        n = int(counts.sum())
        x, w, dy = _randn(300 + i, (n + extra, n_in), (len(counts), n_out, n_in), (n + extra, n_out))
        w = w / n_in ** 0.5
        y_r, dx_r, dw_r = _ref_layer(x, w, counts, dy)
        for impl in ("triton", "torch"):
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fp8_grouped_linear(xl, wl, counts, impl=impl)
            y.backward(dy)
            errs = [_rel(y[:n], y_r[:n]), _rel(xl.grad[:n], dx_r[:n]), _rel(wl.grad, dw_r)]
            assert max(errs) < 1e-5, (impl, errs)
            assert (wl.grad[counts == 0] == 0).all()
        # the FP8 layer is within quantization error of the bf16-free grouped_linear
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y_exact = grouped_linear(xl, wl, counts, impl="loop")
        y_exact.backward(dy)
        assert _rel(y[:n], y_exact[:n]) < 0.05 and _rel(wl.grad, dw_r) < 0.05
    # bf16 in, bf16 out; only one of the gradients asked for
    counts = torch.tensor([30, 0, 100])
    x, w, dy = _randn(310, (130, 128), (3, 256, 128), (130, 256))
    xb, wb = x.bfloat16().requires_grad_(), (w / 11).bfloat16()
    y = fp8_grouped_linear(xb, wb, counts, impl="triton")
    (dx,) = torch.autograd.grad(y, xb, dy.bfloat16())
    y_r, dx_r, _ = _ref_layer(xb.detach().float(), wb.float(), counts, dy.bfloat16().float())
    assert y.dtype == dx.dtype == torch.bfloat16 and _rel(y, y_r) < 1e-2 and _rel(dx, dx_r) < 1e-2
    wl = (w / 11).requires_grad_()
    (dw,) = torch.autograd.grad(fp8_grouped_linear(x, wl, counts, impl="triton"), wl, dy)
    assert _rel(dw, _ref_layer(x, w / 11, counts, dy)[2]) < 1e-5
    # deferred == immediate, bitwise, over two micro-batches; x without requires_grad
    counts = torch.tensor([64, 1, 0, 70])
    x, w = _randn(320, (135, 256), (4, 128, 256))
    out = {}
    for queue in (None, WeightGradQueue()):
        wl = w.clone().requires_grad_()
        for mb in range(2):
            fp8_grouped_linear(x * (mb + 1), wl, counts, queue, "triton").sin().sum().backward()
        if queue is not None:
            assert wl.grad is None and len(queue) == 2
            queue.drain()
        out[queue is None] = wl.grad
    assert torch.equal(out[True], out[False]) and (out[True][2] == 0).all()
    # a weight passed as a view: the deferred gradient reaches the parameter through it
    base = w.transpose(1, 2).contiguous().requires_grad_()          # (E, in, out), as GPT-OSS stores experts
    queue = WeightGradQueue()
    fp8_grouped_linear(x, base.mT, counts, queue, "triton").sum().backward()
    queue.drain()
    wl = w.clone().requires_grad_()
    fp8_grouped_linear(x, wl, counts, impl="triton").sum().backward()
    assert torch.equal(base.grad, wl.grad.transpose(1, 2))
    # every row past the experts, and no rows at all
    y = fp8_grouped_linear(torch.randn(5, 256, requires_grad=True), w, torch.zeros(4, dtype=torch.int64),
                           impl="triton")
    y.sum().backward()
    assert y.shape == (5, 128)
    # bad input
    ok = dict(x=torch.zeros(4, 128), w=torch.zeros(2, 64, 128), counts=torch.tensor([1, 3]))
    for msg, kw in [("w \\(E, out, in\\)", dict(ok, w=torch.zeros(2, 64, 64))),
                    ("counts \\(E,\\)", dict(ok, counts=torch.tensor([1, 1, 2]))),
                    ("int64", dict(ok, counts=torch.tensor([1, 3], dtype=torch.int32))),
                    ("impl must be", dict(ok, impl="fp8")),
                    ("impl must be", dict(ok, impl="rowwise"))]:
        with pytest.raises(ValueError, match=msg):
            fp8_grouped_linear(**kw)
    with pytest.raises(RuntimeError, match="at most the 4"):
        fp8_grouped_linear(ok["x"], ok["w"], torch.tensor([4, 1]), impl="triton")


def _row_recipe():
    """The row-scaled recipe's three products for one expert, from its definition: forward rows of x times rows of w;
    input gradient rows of (dy times w's row scales) times w's FP8 values; weight gradient columns (over the expert's
    rows) of (dy times x's row scales) times x's FP8 values. Returns (fwd, dgrad, wgrad) functions in float64."""
    from pith_lit.ops.fp8 import quantize_ref
    rows = lambda t: _fq(t, (1, max(t.shape[-1], 1)))
    cols = lambda t: _fq(t, (max(t.shape[0], 1), 1))
    def dgrad(g, w):
        q, s = quantize_ref(w, (1, w.shape[-1]))
        return rows(g * s[:, 0].double()) @ q.double()
    def wgrad(g, x):
        q, s = quantize_ref(x, (1, max(x.shape[-1], 1)))
        return cols(g * s.double()).T @ q.double()
    return (lambda x, w: rows(x) @ rows(w).T), dgrad, wgrad


def _block_recipe():
    "The block-scaled recipe's three products for one expert, as _row_recipe."
    return ((lambda x, w: _fq(x, (1, 128)) @ _fq(w, (128, 128)).T), (lambda g, w: _fq(g, (1, 128)) @ _fq(w, (128, 128))),
            (lambda g, x: _fq(g, (128, 1)).T @ _fq(x, (128, 1))))


def _ref_swiglu_experts(x, w1, w2, counts, dy, recipe=None):
    """y, dx, dw1, dw2 of down(swiglu(gate_up(x))) in FP8, float64, one expert at a time: each product from its
    operands' quantization (`recipe`, block scales by default), SwiGLU and its gradient exact between them."""
    import torch
    fwd, dgrad, wgrad = recipe or _block_recipe()
    x, w1, w2, dy = (t.double() for t in (x, w1, w2, dy))
    y, dx = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64), torch.zeros_like(x)
    dw1, dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
    for e, (a, b) in enumerate(_bounds(counts)):
        g, u = fwd(x[a:b], w1[e]).chunk(2, -1)
        s = torch.sigmoid(g)
        h = g * s * u
        y[a:b] = fwd(h, w2[e])
        dh = dgrad(dy[a:b], w2[e])
        dw2[e] = wgrad(dy[a:b], h)
        dgu = torch.cat([dh * u * s * (1 + g * (1 - s)), dh * g * s], -1)
        dx[a:b] = dgrad(dgu, w1[e])
        dw1[e] = wgrad(dgu, x[a:b])
    return y, dx, dw1, dw2


def _swiglu_cases(seed):
    """(i, counts, x, w_gate_up, w_down, dy) for the SwiGLU expert checks: an empty expert, a one-row expert, rows past
    the last expert, widths off multiples of 128."""
    import torch
    for i, (counts, extra, hidden, inter) in enumerate([([70, 0, 1, 131], 3, 256, 72), ([0, 140], 0, 130, 128)]):
        counts = torch.tensor(counts)
        n = int(counts.sum())
        x, w1, w2, dy = _randn(seed + i, (n + extra, hidden), (len(counts), 2 * inter, hidden),
                               (len(counts), hidden, inter), (n + extra, hidden))
        yield i, counts, x, w1 / hidden ** 0.5, w2 / inter ** 0.5, dy


def _check_swiglu_experts(i, x, w1, w2, counts, dy, want, scaling):
    """fp8_swiglu_experts under `scaling` against float64 `want` (y, dx, dw1, dw2): Triton immediate and deferred
    (bitwise equal), and torch; zero weight gradients for experts without rows."""
    import torch
    from pith_lit.ops.fp8 import fp8_swiglu_experts
    from pith_lit.ops.grouped_linear import WeightGradQueue
    n = int(counts.sum())
    got = {}
    for impl, queue in [("triton", None), ("triton", WeightGradQueue()), ("torch", None)]:
        xl, w1l, w2l = (t.clone().requires_grad_() for t in (x, w1, w2))
        y = fp8_swiglu_experts(xl, w1l, w2l, counts, queue, impl, scaling=scaling)
        y.backward(dy)
        if queue is not None:
            assert w1l.grad is None and w2l.grad is None and len(queue) == 2
            queue.drain()
        out = [y[:n], xl.grad[:n], w1l.grad, w2l.grad]
        errs = [_rel(a, b) for a, b in zip(out, [want[0][:n], want[1][:n], *want[2:]])]
        assert max(errs) < 1e-4, (i, scaling, impl, errs)
        assert (w1l.grad[counts == 0] == 0).all() and (w2l.grad[counts == 0] == 0).all()
        got[impl, queue is None] = out
    assert all(torch.equal(a, b) for a, b in zip(got["triton", True], got["triton", False]))


def group_swiglu():
    """fp8_swiglu_experts (SwiGLU inside the quantization passes) against float64; deferred == immediate."""
    import torch
    from pith_lit.ops.fp8 import fp8_swiglu_experts
    for i, counts, x, w1, w2, dy in _swiglu_cases(seed=500):
        want = _ref_swiglu_experts(x, w1, w2, counts, dy)
        _check_swiglu_experts(i, x, w1, w2, counts, dy, want, "block")
    with pytest.raises(ValueError, match="w_down"):
        fp8_swiglu_experts(torch.zeros(4, 8), torch.zeros(2, 16, 8), torch.zeros(2, 8, 4), torch.tensor([1, 3]))


def group_dense():
    """fp8_linear (tests/fp8_linear.py)'s reference path against float64; the CUDA-only calls' layouts through torch's
    meta checks."""
    import torch
    from fp8_linear import fp8_linear, scaled_mm_blockwise, scaled_mm_wgrad
    from pith_lit.ops import fp8
    for seed, (lead, n_in, n_out), scale in [(400, ((3, 50), 300, 200), 17), (7, ((2, 75), 200, 136), 14)]:
        x, w, dy = _randn(seed, (*lead, n_in), (n_out, n_in), (*lead, n_out))
        w = w / scale
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xl, wl)                                     # CPU: the reference path
        y.backward(dy)
        assert y.shape == (*lead, n_out)
        M = lead[0] * lead[1]
        x2, dy2 = x.reshape(M, n_in), dy.reshape(M, n_out)
        y_r, dx_r, dw_r = _ref_layer(x2, w[None], torch.tensor([M]), dy2)
        assert _rel(y.reshape(M, n_out), y_r) < 1e-5 and _rel(xl.grad.reshape(M, n_in), dx_r) < 1e-5
        assert _rel(wl.grad, dw_r[0]) < 1e-5 and _rel(y, x.double() @ w.double().T) < 0.05
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_linear(x, w, impl="scaled_mm")
    with pytest.raises(ValueError, match="impl must be"):
        fp8_linear(x, w, impl="cublas")
    with pytest.raises(ValueError, match="w \\(out, in\\)"):
        fp8_linear(x, w.T)
    # the F.scaled_mm calls at the real models' widths, on meta tensors (K/128 = 6: the weight scales need padding)
    meta = lambda *s: torch.empty(*s, device="meta")
    for M, n_in, n_out in [(256, 2048, 1536), (1000, 768, 2048), (130, 1408, 2048), (64, 2048, 2816), (200, 384, 256)]:
        T = -(-M // 128)
        a = fp8.Fp8Act(meta(M, n_in).to(fp8.FP8), meta(n_in // 128, M).t(), meta(n_in, 128 * T).to(fp8.FP8),
                       meta(T, n_in))
        g = fp8.Fp8Act(meta(M, n_out).to(fp8.FP8), meta(n_out // 128, M).t(), meta(n_out, 128 * T).to(fp8.FP8),
                       meta(T, n_out))
        assert scaled_mm_blockwise(a.q, a.s, meta(n_out, n_in).to(fp8.FP8),
                                   meta(n_out // 128, n_in // 128)).shape == (M, n_out)
        assert scaled_mm_blockwise(g.q, g.s, meta(n_in, n_out).to(fp8.FP8),
                                   meta(n_in // 128, n_out // 128)).shape == (M, n_in)
        assert scaled_mm_wgrad(g, a).shape == (n_out, n_in)


def test_dense_on_gpu():
    """fp8_linear's F.scaled_mm path against its reference on the GPU, in bf16: within 1e-2 (the tensor cores'
    accumulation and the bf16 outputs)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with FP8 tensor cores")
    from fp8_linear import fp8_linear
    torch.manual_seed(0)
    x = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(768, 1024, device="cuda") / 32).bfloat16().requires_grad_()
    dy = torch.randn(1000, 768, device="cuda", dtype=torch.bfloat16)
    got = []
    for impl in ("scaled_mm", "torch"):
        x.grad = w.grad = None
        y = fp8_linear(x, w, impl=impl)
        y.backward(dy)
        got.append((y.detach(), x.grad, w.grad))
    errs = [_rel(a, b) for a, b in zip(*got)]
    assert max(errs) < 1e-2, errs


def group_rows():
    """One scale per row (`scaling="rows"`): the row quantizer (and its transpose) and the per-expert column
    quantizer equal the torch reference value for value; the GEMMs at several tiles and the layers through autograd
    against float64 from the recipe's definition; bad input."""
    import torch
    from pith_lit.ops.fp8 import (GemmConfig, fp8_grouped_linear, fp8_grouped_mm, fp8_grouped_wgrad,
                                  pow2_scale, quantize_act, quantize_ref, quantize_rows, quantize_weight_rows)
    fwd, dgrad, wgrad = _row_recipe()
    configs = [GemmConfig(), GemmConfig(128, 256, 128, 8, 3), GemmConfig(64, 64, 256, 4, 2, promote=128),
               GemmConfig(16, 32, 64, 4, 2, promote=64)]
    for i, counts, n, x, w, dy in _gemm_cases(K0=16, K4=300, seed=600):
        cfg = configs[i % len(configs)]
        K = x.shape[1]
        r, (qw, sw) = quantize_rows(x, counts, trans=True), quantize_weight_rows(w)
        q, s = quantize_ref(x[:n], (1, K))
        assert torch.equal(r.q[:n].float(), q.float()) and torch.equal(r.s[:n], s[:, 0])
        qr, sr = quantize_ref(w, (1, K))
        assert torch.equal(qw.float(), qr.float()) and torch.equal(sw, sr[..., 0])
        (qw2, sw2), (qwt2, swt2) = quantize_weight_rows(w, "both")
        assert torch.equal(qw2.float(), qr.float()) and torch.equal(qwt2.float(), qr.float().mT)
        assert torch.equal(sw2, sw) and torch.equal(swt2, sw)
        g = quantize_rows(dy, counts, mult=sw, col_amax=True, row_mult=r.s)
        tiles = _tile_starts(counts)
        for e, (lo, hi) in enumerate(_bounds(counts)):
            want = (dy[lo:hi] * r.s[lo:hi, None]).abs().amax(0) if hi > lo else torch.zeros(dy.shape[1])
            assert torch.equal(g.col_amax[e], want), (i, e)
            qt = r.qt[:, 128 * tiles[e]:128 * tiles[e + 1]].float()
            assert torch.equal(qt[:, :hi - lo], q[lo:hi].float().T) and (qt[:, hi - lo:] == 0).all(), (i, e)
        y = fp8_grouped_mm(r.q, r.s, qw, sw, counts, torch.float32, cfg)
        dx = fp8_grouped_mm(g.q, g.s, quantize_weight_rows(w, transposed=True)[0], None, counts, torch.float32, cfg)
        gt = quantize_act(dy, counts, rows=False, cols=True, col_amax=g.col_amax, row_mult=r.s).qt
        dw = fp8_grouped_wgrad(gt, pow2_scale(g.col_amax), r.qt, None, counts, torch.float32,
                               cfg._replace(block_k=min(cfg.block_k, 128), promote=None), group_scales=True)
        for e, (lo, hi) in enumerate(_bounds(counts)):
            xd, wd, gd = x[lo:hi].double(), w[e].double(), dy[lo:hi].double()
            for name, got, want in [("y", y[lo:hi], fwd(xd, wd)), ("dx", dx[lo:hi], dgrad(gd, wd)),
                                    ("dw", dw[e], wgrad(gd, xd))]:
                assert _rel(got, want) < 1e-5 or (want == 0).all() and (got == 0).all(), (i, e, name)
    # the layers through autograd: both implementations, immediate and deferred, against float64
    for i, counts, x, w1, w2, dy in _swiglu_cases(seed=700):
        n, extra, inter = int(counts.sum()), x.shape[0] - int(counts.sum()), w2.shape[2]
        want = _ref_swiglu_experts(x, w1, w2, counts, dy, _row_recipe())
        _check_swiglu_experts(i, x, w1, w2, counts, dy, want, "rows")
        # one layer with its weight stored transposed (GPT-OSS's (E, in, out)), against a contiguous copy
        stored, w1l = w1.mT.contiguous().requires_grad_(), w1.clone().requires_grad_()
        d1 = torch.randn(n + extra, 2 * inter)
        y1 = fp8_grouped_linear(x, stored.mT, counts, impl="triton", scaling="rows")
        y1.backward(d1)
        y2 = fp8_grouped_linear(x, w1l, counts, impl="triton", scaling="rows")
        y2.backward(d1)
        want_y = torch.cat([fwd(x[lo:hi].double(), w1[e].double()) for e, (lo, hi) in enumerate(_bounds(counts))])
        assert torch.equal(y1[:n], y2[:n]) and torch.equal(stored.grad, w1l.grad.mT) and _rel(y1[:n], want_y) < 1e-5
    # what the deferred weight gradients hold until W: the planner's count per routed row, the spare rows of the FP8
    # column layouts (sized for the most 128-row tiles M rows can need over E experts: (E - 1) * 128 beyond the rows,
    # the planner's `spare_deferred`), and the gradients' scales per expert column
    from pith_lit.engine.planner import deferred_per_row
    from pith_lit.ops.fp8 import fp8_swiglu_experts
    from pith_lit.ops.grouped_linear import WeightGradQueue
    counts, H, inter = torch.tensor([128, 0, 256]), 256, 128
    x, w1, w2 = _randn(710, (384, H), (3, 2 * inter, H), (3, H, inter))
    w1, w2, queue = w1.requires_grad_(), w2.requires_grad_(), WeightGradQueue()
    fp8_swiglu_experts(x, w1, w2, counts, queue, "triton", scaling="rows").sum().backward()
    assert len(queue) == 2
    held, stack, skip = {}, list(queue._pending), {w1.data_ptr(), w2.data_ptr(), counts.data_ptr()}
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.data_ptr() not in skip:
                held[o.data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, (tuple, list)):
            stack.extend(o)
        elif callable(o) and getattr(o, "__closure__", None):
            stack.extend(c.cell_contents for c in o.__closure__)
    tile_rows = 128 * (384 // 128 + 3 - 1)
    assert sum(held.values()) == (384 * deferred_per_row(H, inter, 2, fp8=True) + (tile_rows - 384) *
                                  (2 * H + 3 * inter) + 4 * 3 * (H + 2 * inter)), held
    with pytest.raises(ValueError, match="scaling must be"):
        fp8_grouped_linear(torch.zeros(4, 128), torch.zeros(2, 64, 128), torch.tensor([1, 3]), scaling="row")
    with pytest.raises(ValueError, match="row scales"):
        qw, sw = quantize_weight_rows(torch.ones(2, 64, 128))
        fp8_grouped_mm(*quantize_rows(torch.ones(4, 128))[:2], qw, sw[:, :32], torch.tensor([1, 3]), torch.float32)
    with pytest.raises(ValueError, match="mult must be"):
        quantize_rows(torch.ones(4, 128), torch.tensor([1, 3]), mult=torch.ones(2, 64))
    with pytest.raises(ValueError, match="row_mult must be"):
        quantize_rows(torch.ones(4, 128), torch.tensor([1, 3]), row_mult=torch.ones(4))     # without col_amax
    with pytest.raises(ValueError, match="sbt"):
        qt = torch.zeros(64, 128).to(torch.float8_e4m3fn)
        fp8_grouped_wgrad(qt, torch.ones(1, 64), qt, None, torch.tensor([1, 3]), torch.float32)   # tile scales


if __name__ == "__main__":
    group_main(globals(), GROUPS)
