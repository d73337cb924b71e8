"""Experiment: ops/14's forward kernel with Q, K, V tiles loaded by TMA (tensor descriptors: 4-D over (B, H, S, D), or
2-D over (B·S, H·D) when the heads are packed) instead of pointer arithmetic, causal, no window/documents/sinks,
against the kernel as it is, at the Qwen3 and MLA shapes over several tiles; and the backward's three kernels timed
one by one (torch.profiler). `FMA` computes the row maximum on the raw scores and folds the scale into the
exponent's argument. Results: benchmarks/RESULTS.md, "Attention and FP8 experiments". Run on a GPU from the
repository root:
    PYTHONPATH=. OUT=/tmp python3 benchmarks/attention_tma.py
With TRITON_INTERPRET=1 on the CPU it checks the variants against ops/14's kernel at small awkward shapes."""
import json, os
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
import pith_lit.ops.attention as A

INTERP = A.INTERPRET


@triton.jit
def _ld(desc, b, h, r0, c0, S, D: tl.constexpr, R: tl.constexpr, C: tl.constexpr, FOUR: tl.constexpr):
    "An (R, C) tile at rows r0.., columns c0.. of head (b, h), by a 4-D (B, H, S, D) or 2-D (B·S, H·D) descriptor."
    if FOUR:
        x = desc.load([b, h, r0, c0]).reshape(R, C)
    else:
        x = desc.load([b * S + r0, h * D + c0])
    return x


@triton.jit
def _fwd_step(acc, m_i, l_i, qa, qb, rows, KA, KB, VD, b, hk, n0, Sk, delta, qk_scale, DQK: tl.constexpr,
              DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BDV: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr, FOUR: tl.constexpr, FMA: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    ka = _ld(KA, b, hk, n0, 0, Sk, DQK, BLOCK_N, DA, FOUR).to(DOT)
    s = tl.dot(qa, tl.trans(ka), input_precision=PREC)
    if DB > 0:
        kb = _ld(KB, b, hk, n0, DA, Sk, DQK, BLOCK_N, DB, FOUR).to(DOT)
        s = tl.dot(qb, tl.trans(kb), s, input_precision=PREC)
    if MASK:   # ops/14's causal mask (a positive scale keeps -inf where it is, before or after scaling)
        keep = A._visible((cols < Sk)[None, :], rows[:, None], cols[None, :], rows[:, None], cols[None, :], delta, 0,
                          True, False, False)
        s = tl.where(keep, s, float("-inf"))
    if FMA:  # max of the raw scores, then one FMA per element
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * qk_scale - shift[:, None])
    else:    # ops/14's form: scale, then max and subtract
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
    alpha = tl.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _ld(VD, b, hk, n0, 0, Sk, DV, BLOCK_N, BDV, FOUR).to(DOT)
    acc = tl.dot(p.to(DOT), v, acc * alpha[:, None], input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _fwd_tma_kernel(QA, QB, KA, KB, VD, O, LSE, stride_ob, stride_oh, stride_om, stride_od, Sq, Sk, H, GROUP, delta,
                    qk_scale, DQK: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                    BDV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOUR: tl.constexpr,
                    FMA: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    qa = _ld(QA, b, h, m0, 0, Sq, DQK, BLOCK_M, DA, FOUR).to(DOT)
    qb = qa
    if DB > 0:
        qb = _ld(QB, b, h, m0, DA, Sq, DQK, BLOCK_M, DB, FOUR).to(DOT)
    start, int_lo, int_hi, hi = A._block_range(m0, Sq, Sk, delta, 0, LSE, BLOCK_M, BLOCK_N, True, True, False, False)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], tl.float32)
    for n0 in range(int_lo, int_hi, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, qa, qb, rows, KA, KB, VD, b, hk, n0, Sk, delta, qk_scale, DQK, DV,
                                  DA, DB, BDV, BLOCK_N, False, FOUR, FMA, DOT, PREC)
    for n0 in range(int_hi, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, qa, qb, rows, KA, KB, VD, b, hk, n0, Sk, delta, qk_scale, DQK, DV,
                                  DA, DB, BDV, BLOCK_N, True, FOUR, FMA, DOT, PREC)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * A._LN2, float("-inf"))
    Oh = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    A._store_tile(Oh, rows, stride_om, stride_od, Sq, out.to(O.dtype.element_ty), 0, DV, BDV)
    tl.store(LSE + bh.to(tl.int64) * Sq + rows, lse, mask=rows < Sq)


def _descs(t, rows, cols, four):
    "Descriptor of a (B, H, S, D) tensor laid out (B, S, H, D) with (rows, cols) blocks."
    B, H, S, D = t.shape
    if four:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])
    assert t.stride() == (S * H * D, D, H * D, 1), t.stride()
    flat = t.transpose(1, 2).reshape(B * S, H * D)
    return TensorDescriptor(flat, [B * S, H * D], [H * D, 1], [rows, cols])


def fwd_tma(q, k, v, cfg, four=True, fma=False):
    (B, Hq, Sq, Dqk), (Hkv, Sk, Dv) = q.shape, (k.shape[1], k.shape[2], v.shape[3])
    c = A._head_consts(Dqk, Dv)
    out = torch.empty(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    da, db = c["DA"], c["DB"]
    qa, qb = _descs(q, cfg.block_m, da, four), _descs(q, cfg.block_m, max(db, 16), four)
    ka, kb = _descs(k, cfg.block_n, da, four), _descs(k, cfg.block_n, max(db, 16), four)
    vd = _descs(v, cfg.block_n, c["BDV"], four)
    dot, prec = A._dot_dtype(q.dtype)
    _fwd_tma_kernel[(triton.cdiv(Sq, cfg.block_m), B * Hq)](
        qa, qb, ka, kb, vd, out, lse, *out.stride(), Sq, Sk, Hq, Hq // Hkv, 0, q.shape[-1] ** -0.5 * A.LOG2E,
        **c, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, FOUR=four, FMA=fma, DOT=dot, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse


def _inputs(B, S, Hq, Hkv, dqk, dv, dev, dtype):
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda H, D: torch.randn(B, S, H, D, device=dev, generator=g).to(dtype).transpose(1, 2)
    return mk(Hq, dqk), mk(Hkv, dqk), mk(Hkv, dv)


def check_cpu():
    C = A._Config
    for shape in ((1, 100, 4, 2, 24, 16), (2, 64, 2, 1, 48, 32)):
        q, k, v = _inputs(*shape, "cpu", torch.float32)
        ref, lse_r = A.flash_attention(q, k, v)
        c = A._head_consts(shape[4], shape[5])
        for four in (True, False) if c["DA"] + c["DB"] == shape[4] and c["BDV"] == shape[5] else (True,):
            for fma in (False, True):
                out, lse = fwd_tma(q, k, v, C(32, 16, 4, 1), four, fma)
                e = (out - ref).abs().max().item()
                el = (lse - lse_r).abs().max().item()
                print(shape, "four" if four else "flat", "fma" if fma else "mul", f"{e:.2e} {el:.2e}")
                assert e < 1e-4 and el < 1e-4


def bench():
    from triton.testing import do_bench
    C = A._Config
    out_dir = os.environ.get("OUT", "/tmp")
    res = {}
    shapes = {"qwen3": (2, 4096, 32, 4, 128, 128), "mla": (4, 2048, 16, 16, 192, 128)}
    for name, shape in shapes.items():
        q, k, v = _inputs(*shape, "cuda", torch.bfloat16)
        ref, _ = A.flash_attention(q, k, v)
        res[f"{name} fwd ops14"] = do_bench(lambda: A.flash_attention(q, k, v), return_mode="median")
        print(name, "ops14", f"{res[f'{name} fwd ops14']:.3f}", flush=True)
        for cfg in (C(128, 64, 8, 3), C(128, 64, 8, 2), C(128, 128, 8, 2), C(128, 128, 8, 3), C(128, 64, 4, 3),
                    C(64, 64, 4, 3)):
            for four in (True, False):
                for fma in (False, True):
                    key = f"{name} fwd tma {tuple(cfg)} {'4d' if four else '2d'} {'fma' if fma else 'mul'}"
                    try:
                        out, _ = fwd_tma(q, k, v, cfg, four, fma)
                        err = (out.float() - ref.float()).abs().max().item()
                        ms = do_bench(lambda: fwd_tma(q, k, v, cfg, four, fma), return_mode="median")
                    except Exception as e:
                        print(key, "ERR", str(e)[:300], flush=True)
                        continue
                    res[key] = ms
                    res[key + " err"] = err
                    print(key, f"{ms:.3f} ms err {err:.2e}", flush=True)
        # the backward's kernels one by one (profiler)
        q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
        out, lse = A.flash_attention(q, k, v)
        dout = torch.randn_like(out)
        for _ in range(3):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_time_total > 0:
                res[f"{name} bwd kernel {e.key}"] = e.device_time_total / e.count / 1e3
                print(name, "bwd kernel", e.key[:60], f"{e.device_time_total / e.count / 1e3:.3f} ms x{e.count}")
        del q, k, v, out, lse, dout
        torch.cuda.empty_cache()
    json.dump(res, open(f"{out_dir}/attention_tma.json", "w"), indent=1)


if __name__ == "__main__":
    if INTERP:
        check_cpu()
    else:
        bench()
