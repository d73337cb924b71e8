"""Experiment: ops/14's backward with dq accumulated inside the dk/dv pass (one kernel instead of two). Each dk/dv
program already holds dSᵀ for its key block against every query block it visits; `dS · K` for those query rows is one
more product, added into an fp32 dq buffer by atomic reductions, either element-wise (`tl.atomic_add`, REDUCE=0) or
by TMA tile reductions (a tensor descriptor's `atomic_add`, REDUCE=1). The dq kernel, which recomputes S and dP, is
gone; the price is the reduction traffic and a cast of the fp32 buffer. Masks, windows, documents, sinks, dlse and
GQA are ops/14's (its helpers are called). MODE=split times ops/14's dq kernel and the dk/dv kernel (with pointer
or TMA loads) apart; the pointer-load dq rows in RESULTS.md ran with this script at 0482fac, against the package at
b57213c, before ops/14 took TMA loads. Results: benchmarks/RESULTS.md. Run on a GPU from the repository root:
    PYTHONPATH=. OUT=/tmp python3 benchmarks/attention_fused_bwd.py
(with WARM=1 PART=i NPARTS=n it only compiles the i-th of n shares of the variants, to fill Triton's cache from
several processes before the timed run).
With TRITON_INTERPRET=1 on the CPU it checks every gradient against ops/14's backward at small awkward shapes."""
import json, os
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
import pith_lit.ops.attention as A

INTERP = A.INTERPRET


@triton.jit
def _reduce_dq(DQP, DQD, x, rows, bh, m0, Sq, stride_m, COL0: tl.constexpr, DQK: tl.constexpr, BD: tl.constexpr,
               BLOCK_M: tl.constexpr, REDUCE: tl.constexpr):
    "Add an fp32 (BLOCK_M, BD) tile at column COL0 into the buffer (B·Hq, Sq, DQK): element-wise or by TMA."
    if REDUCE == 1:
        DQD.atomic_add([bh, m0, COL0], x.reshape(1, BLOCK_M, BD))
    else:
        cols = COL0 + tl.arange(0, BD)
        ptrs = DQP + (bh.to(tl.int64) * Sq + rows.to(tl.int64))[:, None] * stride_m + cols[None, :]
        tl.atomic_add(ptrs, x, mask=(rows < Sq)[:, None] & (cols < DQK)[None, :], sem="relaxed")


@triton.jit
def _fused_block(dka, dkb, dv, ka, kb, v, cols, kdoc, Qh, DOh, LSEh, DDh, QDOC, DQP, DQA, DQB, QA, QB, DOD, b, h,
                 bh, m0, Sq,
                 stride_qm, stride_qd, stride_dm, stride_dd, delta, window, qk_scale, scale, DQK: tl.constexpr,
                 DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BDV: tl.constexpr, BLOCK_M: tl.constexpr,
                 MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOC: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr, REDUCE: tl.constexpr, TMA: tl.constexpr):
    "ops/14's _dkdv_block (Q and dO tiles by TMA when TMA), then dS·K for these query rows reduced into dq."
    rows = m0 + tl.arange(0, BLOCK_M)
    if TMA:
        qa = QA.load([b, h, m0, 0]).reshape(BLOCK_M, DA).to(DOT)
    else:
        qa = A._tile(Qh, rows, stride_qm, stride_qd, Sq, 0, DQK, DA, MASK).to(DOT)
    st = tl.dot(ka, tl.trans(qa), input_precision=PREC)
    qb = qa
    if DB > 0:
        if TMA:
            qb = QB.load([b, h, m0, DA]).reshape(BLOCK_M, DB).to(DOT)
        else:
            qb = A._tile(Qh, rows, stride_qm, stride_qd, Sq, DA, DQK, DB, MASK).to(DOT)
        st = tl.dot(kb, tl.trans(qb), st, input_precision=PREC)
    if MASK:
        lse = tl.load(LSEh + rows, mask=rows < Sq, other=float("inf"))
        dd = tl.load(DDh + rows, mask=rows < Sq, other=0.0)
    else:
        lse = tl.load(LSEh + rows)
        dd = tl.load(DDh + rows)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * A._LOG2E)
    pt = tl.exp2(st * qk_scale - lse2[None, :])
    if MASK:
        qdoc = rows
        if HAS_DOC:
            qdoc = tl.load(QDOC + rows, mask=rows < Sq, other=-2)
        keep = A._visible((rows < Sq)[None, :], rows[None, :], cols[:, None], qdoc[None, :], kdoc[:, None], delta,
                          window, CAUSAL, HAS_WINDOW, HAS_DOC)
        pt = tl.where(keep, pt, 0.0)
    if TMA:
        do = DOD.load([b, h, m0, 0]).reshape(BLOCK_M, BDV).to(DOT)
    else:
        do = A._tile(DOh, rows, stride_dm, stride_dd, Sq, 0, DV, BDV, MASK).to(DOT)
    dv = tl.dot(pt.to(DOT), do, dv, input_precision=PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = (pt * (dpt - dd[None, :])).to(DOT)
    dka = tl.dot(dst, qa, dka, input_precision=PREC)
    if DB > 0:
        dkb = tl.dot(dst, qb, dkb, input_precision=PREC)
    if REDUCE >= 0:  # REDUCE = -1: dk, dv only (ops/14's kernel, with TMA loads when TMA)
        ds = tl.trans(dst)
        _reduce_dq(DQP, DQA, tl.dot(ds, ka, input_precision=PREC) * scale, rows, bh, m0, Sq, DQK, 0, DQK, DA,
                   BLOCK_M, REDUCE)
        if DB > 0:
            _reduce_dq(DQP, DQB, tl.dot(ds, kb, input_precision=PREC) * scale, rows, bh, m0, Sq, DQK, DA, DQK, DB,
                       BLOCK_M, REDUCE)
    return dka, dkb, dv


@triton.jit
def _attn_bwd_fused_kernel(Q, K, V, DO, LSE, DELTA, DK, DVv, DQP, DQA, DQB, QA, QB, DOD, QDOC, KDOC, RANGES,
                           stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                           stride_vb, stride_vh, stride_vn, stride_vd, stride_db, stride_dh, stride_dm, stride_dd,
                           stride_gkb, stride_gkh, stride_gkn, stride_gkd, stride_gvb, stride_gvh, stride_gvn,
                           stride_gvd, Sq, Sk, HKV, GROUP, delta, window, qk_scale, scale,
                           DQK: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                           BDV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, HAS_DOC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                           REDUCE: tl.constexpr, TMA: tl.constexpr):
    "Program (key block, b·Hkv + g): ops/14's dk, dv of one key block, and its share of dq for every query block."
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hk = bh % HKV
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    Kh = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    ka = A._tile(Kh, cols, stride_kn, stride_kd, Sk, 0, DQK, DA, True).to(DOT)
    kb = ka
    if DB > 0:
        kb = A._tile(Kh, cols, stride_kn, stride_kd, Sk, DA, DQK, DB, True).to(DOT)
    v = A._tile(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh, cols, stride_vn, stride_vd, Sk, 0, DV,
                BDV, True).to(DOT)
    kdoc = cols
    QDOCb = QDOC
    if HAS_DOC:
        kdoc = tl.load(KDOC + b.to(tl.int64) * Sk + cols, mask=cols < Sk, other=-1)
        QDOCb = QDOC + b.to(tl.int64) * Sq
    start, int_lo, int_hi, hi = A._block_range(n0, Sk, Sq, delta, window,
                                               RANGES + (b * tl.num_programs(0) + pid_n) * 3, BLOCK_N, BLOCK_M,
                                               False, CAUSAL, HAS_WINDOW, HAS_DOC)
    dka = tl.zeros([BLOCK_N, DA], tl.float32)
    dkb = dka
    if DB > 0:
        dkb = tl.zeros([BLOCK_N, DB], tl.float32)
    dv = tl.zeros([BLOCK_N, BDV], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        bhq = b * HKV * GROUP + h
        Qh = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        DOh = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
        LSEh = LSE + bhq.to(tl.int64) * Sq
        DDh = DELTA + bhq.to(tl.int64) * Sq
        for m0 in range(start, int_lo, BLOCK_M):
            dka, dkb, dv = _fused_block(dka, dkb, dv, ka, kb, v, cols, kdoc, Qh, DOh, LSEh, DDh, QDOCb, DQP, DQA, DQB,
                                        QA, QB, DOD, b, h, bhq, m0, Sq, stride_qm, stride_qd, stride_dm, stride_dd,
                                        delta, window, qk_scale, scale, DQK, DV, DA, DB, BDV, BLOCK_M, True, CAUSAL,
                                        HAS_WINDOW, HAS_DOC, DOT, PREC, REDUCE, TMA)
        for m0 in range(int_lo, int_hi, BLOCK_M):
            dka, dkb, dv = _fused_block(dka, dkb, dv, ka, kb, v, cols, kdoc, Qh, DOh, LSEh, DDh, QDOCb, DQP, DQA, DQB,
                                        QA, QB, DOD, b, h, bhq, m0, Sq, stride_qm, stride_qd, stride_dm, stride_dd,
                                        delta, window, qk_scale, scale, DQK, DV, DA, DB, BDV, BLOCK_M, False, CAUSAL,
                                        HAS_WINDOW, HAS_DOC, DOT, PREC, REDUCE, TMA)
        for m0 in range(int_hi, hi, BLOCK_M):
            dka, dkb, dv = _fused_block(dka, dkb, dv, ka, kb, v, cols, kdoc, Qh, DOh, LSEh, DDh, QDOCb, DQP, DQA, DQB,
                                        QA, QB, DOD, b, h, bhq, m0, Sq, stride_qm, stride_qd, stride_dm, stride_dd,
                                        delta, window, qk_scale, scale, DQK, DV, DA, DB, BDV, BLOCK_M, True, CAUSAL,
                                        HAS_WINDOW, HAS_DOC, DOT, PREC, REDUCE, TMA)
    DKh = DK + b.to(tl.int64) * stride_gkb + hk.to(tl.int64) * stride_gkh
    A._store_tile(DKh, cols, stride_gkn, stride_gkd, Sk, (dka * scale).to(DK.dtype.element_ty), 0, DQK, DA)
    if DB > 0:
        A._store_tile(DKh, cols, stride_gkn, stride_gkd, Sk, (dkb * scale).to(DK.dtype.element_ty), DA, DQK, DB)
    A._store_tile(DVv + b.to(tl.int64) * stride_gvb + hk.to(tl.int64) * stride_gvh, cols, stride_gvn, stride_gvd, Sk,
                  dv.to(DVv.dtype.element_ty), 0, DV, BDV)


def _desc4(t, rows, cols):
    "A 4-D descriptor over (B, H, S, D) as laid out, (rows, cols) blocks: rows past S and columns past D read 0."
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])


def pre(q, out, dout, dlse):
    "ops/14's D' = rowsum(dO ⊙ O) − dlse."
    B, Hq, Sq, _ = q.shape
    Dv = out.shape[-1]
    bdv = A._head_consts(q.shape[-1], Dv)["BDV"]
    delta_ = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    pre_m = max(16, 4096 // bdv) if q.is_cuda else 64
    A._attn_bwd_pre_kernel[(triton.cdiv(Sq, pre_m), B * Hq)](
        out, dout, dlse.float().contiguous() if dlse is not None else delta_, delta_, *out.stride(),
        *dout.stride(), Sq, Hq, DV=Dv, BDV=bdv, BLOCK_M=pre_m, HAS_DLSE=dlse is not None)
    return delta_


def dq_only(q, k, v, sinks, out, lse, dout, dlse, m, scale, q_doc, k_doc, cfg, delta_):
    "ops/14's dq kernel alone (its key and value tiles by TMA) at the tiles of cfg."
    (B, Hq, Sq, Dqk), (Hkv, Sk, Dv) = q.shape, (k.shape[1], k.shape[2], v.shape[3])
    dq = torch.empty_like(q)
    consts, flags = A._head_consts(Dqk, Dv), A._kernel_flags(q, m, q_doc)
    docs = (q_doc, k_doc) if q_doc is not None else (lse, lse)
    ranges = A._doc_ranges(q_doc, k_doc, cfg.block_m) if q_doc is not None else lse
    A._attn_bwd_dq_kernel[(triton.cdiv(Sq, cfg.block_m), B * Hq)](
        q, *A._descs(k, cfg.block_n, (consts["DA"], consts["DB"])), *A._descs(v, cfg.block_n, (consts["BDV"],)), dout,
        lse, delta_, dq, *docs, ranges, *q.stride(), *dout.stride(), *dq.stride(), Sq, Sk, Hq, Hq // Hkv,
        m.q_offset - m.k_offset, m.window or 0, scale * A.LOG2E, scale, **consts, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, **flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dq


def bwd_fused(q, k, v, sinks, out, lse, dout, dlse, m, scale, q_doc, k_doc, cfg, reduce=0, tma=False,
              delta_=None):
    """ops/14's _bwd with dq from the dk/dv kernel: (dq, dk, dv, dsinks or None). reduce = -1: dk, dv only, from
    the given delta_ (dq and dsinks None)."""
    (B, Hq, Sq, Dqk), (Hkv, Sk, Dv) = q.shape, (k.shape[1], k.shape[2], v.shape[3])
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    acc = torch.zeros(B * Hq, Sq, Dqk, dtype=torch.float32, device=q.device) if reduce >= 0 else lse
    consts, flags = A._head_consts(Dqk, Dv), A._kernel_flags(q, m, q_doc)
    if delta_ is None:
        delta_ = pre(q, out, dout, dlse)
    docs = (q_doc, k_doc) if q_doc is not None else (lse, lse)
    da, db = consts["DA"], consts["DB"]
    if reduce == 1:
        dqa = TensorDescriptor(acc, list(acc.shape), list(acc.stride()), [1, cfg.block_m, da])
        dqb = TensorDescriptor(acc, list(acc.shape), list(acc.stride()), [1, cfg.block_m, max(db, 16)])
    else:
        dqa = dqb = acc
    if tma:
        qd = (_desc4(q, cfg.block_m, da), _desc4(q, cfg.block_m, max(db, 16)), _desc4(dout, cfg.block_m, consts["BDV"]))
    else:
        qd = (q, q, dout)
    ranges = A._doc_ranges(k_doc, q_doc, cfg.block_n) if q_doc is not None else lse
    _attn_bwd_fused_kernel[(triton.cdiv(Sk, cfg.block_n), B * Hkv)](
        q, k, v, dout, lse, delta_, dk, dv, acc, dqa, dqb, *qd, *docs, ranges, *q.stride(), *k.stride(), *v.stride(),
        *dout.stride(), *dk.stride(), *dv.stride(), Sq, Sk, Hkv, Hq // Hkv, m.q_offset - m.k_offset, m.window or 0,
        scale * A.LOG2E, scale, **consts, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags, REDUCE=reduce, TMA=tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if reduce < 0:
        return None, dk, dv, None
    dq = torch.empty_like(q)
    dq.copy_(acc.view(B, Hq, Sq, Dqk))
    dsinks = None
    if sinks is not None:
        dsinks = -(torch.exp(sinks.float().view(1, Hq, 1) - lse) * delta_).sum((0, 2)).to(sinks.dtype)
    return dq, dk, dv, dsinks


def _case(B, Hq, Hkv, Sq, Sk, dqk, dv, dev, dtype, sinks=False, window=None, docs=None, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    mk = lambda H, S, D: torch.randn(B, S, H, D, device=dev, generator=g).to(dtype).transpose(1, 2)
    q, k, v = mk(Hq, Sq, dqk), mk(Hkv, Sk, dqk), mk(Hkv, Sk, dv)
    s = torch.randn(Hq, device=dev, generator=g) if sinks else None
    q_doc = k_doc = None
    if docs is not None:
        q_doc = torch.repeat_interleave(torch.arange(len(docs), device=dev), torch.tensor(docs, device=dev))
        q_doc = k_doc = q_doc[None].expand(B, Sq).contiguous()
    scale, m, q_doc, k_doc = A._check_args(q, k, v, s, True, window, None, q_doc, k_doc, 0, 0)
    out, lse = A._fwd(q, k, v, s, m, scale, q_doc, k_doc)
    dout = torch.randn(out.shape, device=dev, generator=g).to(dtype)
    dlse = torch.randn(lse.shape, device=dev, generator=g)
    return (q, k, v, s, out, lse, dout, dlse, m, scale, q_doc, k_doc)


def check_cpu():
    C = A._Config
    cases = [dict(B=1, Hq=4, Hkv=2, Sq=100, Sk=100, dqk=24, dv=16),
             dict(B=2, Hq=2, Hkv=1, Sq=70, Sk=70, dqk=48, dv=32, sinks=True, window=20),
             dict(B=1, Hq=2, Hkv=2, Sq=64, Sk=64, dqk=16, dv=16, docs=[1, 30, 33], sinks=True)]
    rel = lambda a, b: (a - b).abs().max().item() / b.abs().max().item()
    for c in cases:
        args = _case(**c, dev="cpu", dtype=torch.float32)
        want = A._bwd(*args, blocks=(16, 16))
        delta_ = pre(args[0], args[4], args[6], args[7])
        for tma in (False, True):  # the interpreter has TMA loads but not TMA reductions
            got = bwd_fused(*args, C(16, 32, 4, 1), 0, tma)
            errs = [rel(a, b) for a, b in zip(got, want) if b is not None]
            dq = dq_only(*args, C(16, 32, 4, 1), delta_)
            _, dk, dv, _ = bwd_fused(*args, C(16, 32, 4, 1), -1, tma, delta_)
            errs += [rel(dq, want[0]), rel(dk, want[1]), rel(dv, want[2])]
            print(c, "tma" if tma else "ptr", " ".join(f"{e:.1e}" for e in errs))
            assert max(errs) < 1e-5


SHAPES = {"mla": dict(B=4, Hq=16, Hkv=16, Sq=2048, Sk=2048, dqk=192, dv=128),
          "qwen3": dict(B=2, Hq=32, Hkv=4, Sq=4096, Sk=4096, dqk=128, dv=128),
          "gptoss_win": dict(B=2, Hq=64, Hkv=8, Sq=4096, Sk=4096, dqk=64, dv=64, sinks=True, window=128)}


def _sdpa_times(res, name, q, k, v):
    "SDPA's forward and forward+backward (causal, as dispatched) on the same tensors, into res."
    from triton.testing import do_bench
    import torch.nn.functional as F
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
    do_ = torch.randn_like(sdpa())
    res[f"{name} sdpa fwd"] = do_bench(sdpa, return_mode="median")
    res[f"{name} sdpa fwd+bwd"] = do_bench(lambda: torch.autograd.grad(sdpa(), (qq, kk, vv), do_), return_mode="median")
    print(name, f"sdpa fwd {res[f'{name} sdpa fwd']:.3f} fwd+bwd {res[f'{name} sdpa fwd+bwd']:.3f}", flush=True)


def bench(part=0, nparts=1, warm=False):
    """Time ops/14's backward and the fused one over tiles at three shapes (warm: only compile this process's share
    of the variants, so that several processes fill Triton's cache at once before one timed run)."""
    from triton.testing import do_bench
    C = A._Config
    out_dir = os.environ.get("OUT", "/tmp")
    res = {}
    shapes = SHAPES
    cfgs = {"mla": [C(64, 64, 8, 2), C(64, 64, 8, 3), C(32, 128, 8, 2), C(64, 128, 8, 2), C(32, 64, 8, 2),
                    C(32, 64, 4, 2)],
            "qwen3": [C(64, 64, 8, 2), C(32, 128, 8, 2), C(32, 64, 4, 3), C(64, 128, 8, 2), C(32, 64, 8, 2)],
            "gptoss_win": [C(64, 64, 4, 3), C(64, 128, 8, 2), C(32, 64, 4, 2), C(64, 64, 8, 2)]}
    variants = [(name, cfg, 1, tma) for name in shapes for cfg in cfgs[name] for tma in (False, True)]
    variants.insert(0, ("mla", C(64, 64, 8, 2), 0, False))
    for name, shape in shapes.items():
        mine = [(i, cfg, r, t) for i, (n, cfg, r, t) in enumerate(variants) if n == name and i % nparts == part]
        if warm and not mine:
            continue
        args = _case(**shape, dev="cuda", dtype=torch.bfloat16)
        q, k, v = args[:3]
        if warm:
            for _, cfg, reduce, tma in mine:
                try:
                    bwd_fused(*args, cfg, reduce, tma)
                except Exception as e:
                    print(name, tuple(cfg), reduce, tma, "ERR", str(e)[:200], flush=True)
            continue
        want = A._bwd(*args)
        res[f"{name} ops14 bwd"] = t = do_bench(lambda: A._bwd(*args), return_mode="median")
        res[f"{name} ops14 fwd"] = tf = do_bench(lambda: A._fwd(q, k, v, args[3], args[8], args[9], args[10], args[11]),
                                                 return_mode="median")
        print(name, f"ops14 fwd {tf:.3f} bwd {t:.3f}", flush=True)
        if name != "gptoss_win":
            _sdpa_times(res, name, q, k, v)
        for _, cfg, reduce, tma in mine:
            key = f"{name} fused {tuple(cfg)} reduce {reduce} {'tma' if tma else 'ptr'}"
            try:
                got = bwd_fused(*args, cfg, reduce, tma)
                err = max((a.float() - b.float()).norm().item() / b.float().norm().item()
                          for a, b in zip(got, want) if b is not None)
                ms = do_bench(lambda: bwd_fused(*args, cfg, reduce, tma), return_mode="median")
            except Exception as e:
                print(key, "ERR", str(e)[:300], flush=True)
                continue
            res[key], res[key + " err"] = ms, err
            print(key, f"{ms:.3f} ms, rel err vs ops14 {err:.2e}", flush=True)
            json.dump(res, open(f"{out_dir}/attention_fused_bwd.json", "w"), indent=1)


def bench_split(part=0, nparts=1, warm=False):
    """ops/14's dq kernel, and the dk/dv kernel with its per-step tiles by pointer loads or by TMA, timed apart over
    tiles at three shapes; ops/14's whole backward and forward, and SDPA's, beside them. (warm: as for bench.)"""
    from triton.testing import do_bench
    C = A._Config
    out_dir = os.environ.get("OUT", "/tmp")
    res = {}
    shapes = SHAPES
    dq_cfgs = {"mla": [C(128, 64, 8, 3), C(128, 64, 8, 2), C(64, 64, 4, 2), C(64, 64, 4, 3), C(128, 32, 8, 3),
                       C(64, 128, 8, 2)],
               "qwen3": [C(64, 64, 4, 2), C(64, 64, 4, 3), C(128, 64, 8, 3), C(128, 64, 8, 2), C(64, 128, 8, 2)],
               "gptoss_win": [C(64, 64, 4, 2), C(64, 64, 4, 3), C(128, 64, 8, 3), C(128, 32, 4, 3)]}
    kv_cfgs = {"mla": [C(64, 128, 8, 3), C(64, 128, 8, 2), C(32, 128, 8, 3), C(64, 64, 4, 3), C(64, 64, 8, 3),
                       C(32, 64, 4, 3)],
               "qwen3": [C(32, 64, 4, 3), C(32, 64, 4, 2), C(64, 64, 4, 3), C(64, 128, 8, 3), C(32, 128, 8, 3),
                         C(64, 64, 8, 3)],
               "gptoss_win": [C(64, 64, 4, 3), C(64, 64, 4, 2), C(32, 64, 4, 3), C(64, 128, 8, 3)]}
    variants = [(name, kind, cfg, tma) for name in shapes for kind, table in (("dq", dq_cfgs), ("dkdv", kv_cfgs))
                for cfg in table[name] for tma in ((True,) if kind == "dq" else (False, True))]
    for name, shape in shapes.items():
        mine = [(kind, cfg, t) for i, (n, kind, cfg, t) in enumerate(variants) if n == name and i % nparts == part]
        args = _case(**shape, dev="cuda", dtype=torch.bfloat16)
        q, k, v = args[:3]
        delta_ = pre(q, args[4], args[6], args[7])
        run = lambda kind, cfg, tma: (dq_only(*args, cfg, delta_) if kind == "dq" else
                                      bwd_fused(*args, cfg, -1, tma, delta_))
        if warm:
            for kind, cfg, tma in mine:
                try:
                    run(kind, cfg, tma)
                except Exception as e:
                    print(name, kind, tuple(cfg), tma, "ERR", str(e)[:200], flush=True)
            continue
        want = A._bwd(*args)
        for key, fn in ((f"{name} ops14 bwd", lambda: A._bwd(*args)),
                        (f"{name} ops14 fwd", lambda: A._fwd(q, k, v, args[3], *args[8:])),
                        (f"{name} pre", lambda: pre(q, args[4], args[6], args[7]))):
            res[key] = do_bench(fn, return_mode="median")
            print(key, f"{res[key]:.3f}", flush=True)
        if name != "gptoss_win":
            _sdpa_times(res, name, q, k, v)
        for kind, cfg, tma in mine:
            key = f"{name} {kind} {tuple(cfg)} {'tma' if tma else 'ptr'}"
            try:
                got = run(kind, cfg, tma)
                pairs = [(got, want[0])] if kind == "dq" else [(got[1], want[1]), (got[2], want[2])]
                err = max((a.float() - b.float()).norm().item() / b.float().norm().item() for a, b in pairs)
                ms = do_bench(lambda: run(kind, cfg, tma), return_mode="median")
            except Exception as e:
                print(key, "ERR", str(e)[:300], flush=True)
                continue
            res[key], res[key + " err"] = ms, err
            print(key, f"{ms:.3f} ms, rel err vs ops14 {err:.2e}", flush=True)
            json.dump(res, open(f"{out_dir}/attention_split_bwd.json", "w"), indent=1)


if __name__ == "__main__":
    if INTERP:
        check_cpu()
    else:
        (bench_split if os.environ.get("MODE") == "split" else bench)(
            int(os.environ.get("PART", 0)), int(os.environ.get("NPARTS", 1)), os.environ.get("WARM") == "1")
