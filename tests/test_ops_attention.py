"""Flash attention (pith_lit.ops.attention) against its float64 reference, under the Triton interpreter.

Each group runs in its own process (`python tests/test_ops_attention.py <group>`) with TRITON_INTERPRET=1 set
before Triton is imported. Sizes are small (S 40-130, head dims 8-40) and tiles small (16, 32) so that every
row spans several key blocks and each group takes seconds on two CPU cores.
"""
import subprocess
import sys
import warnings

import pytest

from conftest import group_main, run_group

GROUPS = ["forward", "backward", "skipping", "api"]


@pytest.mark.parametrize("group", GROUPS)
def test_attention(group):
    run_group(__file__, group)


# ---- helpers (run in the child process) ----

def _rel(a, b):
    "max |a - b| / max |b| over the finite entries of b; non-finite entries must agree exactly."
    import torch
    a, b = a.double(), b.double()
    assert a.shape == b.shape, (a.shape, b.shape)
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)) and torch.equal(a[~fin], b[~fin]), "non-finite entries differ"
    return 0.0 if not fin.any() else ((a - b)[fin].abs().max() / b[fin].abs().max().clamp_min(1e-30)).item()


def _inputs(B, Hq, Hkv, Sq, Sk, dqk, dv, seed, sinks=False, cu=None, layout="bshd", dtype=None):
    """q, k, v as (B, S, H, D) projections viewed as (B, H, S, D) (or contiguous), sinks, and document ids from
    flash-attn style cu_seqlens over the B·Sq tokens (keys use the same ids: Sq == Sk)."""
    import torch
    from references import doc_ids
    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed)
    mk = lambda S, H, D: torch.randn(B, S, H, D, generator=g).to(dtype)
    q, k, v = mk(Sq, Hq, dqk), mk(Sk, Hkv, dqk), mk(Sk, Hkv, dv)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if layout == "contiguous":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kw = {}
    if isinstance(cu, tuple):  # separate query and key ids, as runs [(id, length), ...] shared by the batch
        runs = lambda r: torch.cat([torch.full((n,), i) for i, n in r]).expand(B, -1)
        kw.update(q_doc=runs(cu[0]), k_doc=runs(cu[1]))
    elif cu is not None:
        ids = doc_ids(torch.tensor(cu), B, Sq)
        kw.update(q_doc=ids, k_doc=ids)
    return q, k, v, (torch.randn(Hq, generator=g) * 2 if sinks else None), kw


def _ref(q, k, v, sinks, **kw):
    from pith_lit.ops.attention import attention_reference
    return attention_reference(q.double(), k.double(), v.double(), None if sinks is None else sinks.double(), **kw)


def _check_case(case, seed, grads=True, tol=1e-5, blocks=(16, 16), dtype=None):
    """Forward and (with grads) every gradient of flash_attention, through autograd with a loss that uses out and
    lse, against autograd through the float64 reference."""
    import torch
    from pith_lit.ops.attention import attention_reference, flash_attention
    (B, Hq, Hkv, Sq, Sk, dqk, dv), opts = case
    opts = dict(opts)
    q, k, v, sinks, kw = _inputs(B, Hq, Hkv, Sq, Sk, dqk, dv, seed, opts.pop("sinks", False), opts.pop("cu", None),
                                 opts.pop("layout", "bshd"), dtype)
    kw.update(opts)
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
    out, lse = flash_attention(q, k, v, sinks, blocks=blocks, **kw)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    out_r, lse_r = attention_reference(*ref_leaves[:3], ref_leaves[3] if sinks is not None else None, **kw)
    errs = {"out": _rel(out, out_r), "lse": _rel(lse, lse_r)}
    assert out.shape == (B, Hq, Sq, dv) and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    assert out.dtype == q.dtype and out.transpose(1, 2).is_contiguous()
    if grads:
        g = torch.Generator().manual_seed(seed + 1)
        dout = torch.randn(out.shape, generator=g).to(out.dtype)
        dlse = torch.randn(lse.shape, generator=g)
        fin = torch.isfinite(lse_r)
        got = torch.autograd.grad((out * dout).sum() + (torch.where(fin, lse, 0) * dlse).sum(), leaves)
        want = torch.autograd.grad((out_r * dout.double()).sum() + (torch.where(fin, lse_r, 0) * dlse).sum(),
                                   ref_leaves)
        for name, a, b, leaf in zip(("dq", "dk", "dv", "dsinks"), got, want, leaves):
            assert torch.isfinite(a).all() and a.dtype == leaf.dtype, name
            errs[name] = _rel(a, b)
        assert got[0].stride() == q.stride() and got[1].stride() == k.stride() and got[2].stride() == v.stride()
    assert max(errs.values()) < tol, (case, errs)
    return errs


# Awkward cases: (B, Hq, Hkv, Sq, Sk, Dqk, Dv), options. Document layouts differ between the rows of a batch.
CASES = [
    ((2, 6, 2, 83, 83, 32, 32), {}),                                                   # ragged causal GQA
    ((1, 3, 1, 71, 71, 16, 16), dict(window=5, sinks=True)),                          # MQA, window, sinks
    ((2, 2, 2, 47, 47, 16, 16), dict(window=1000, sinks=True)),                       # window > sequence
    ((1, 2, 1, 66, 66, 40, 24), dict(window=30)),                                     # Dqk 32+16 (masked), Dv 24
    ((1, 2, 2, 37, 37, 8, 16), dict(causal=False, sinks=True)),                       # tiny head dim, no mask
    ((2, 4, 2, 60, 60, 16, 16), dict(cu=[0, 1, 2, 30, 31, 60, 61, 100, 119, 120])),  # length-1 documents
    ((2, 2, 1, 96, 96, 16, 32), dict(cu=[0, 40, 41, 96, 150, 192], window=17, sinks=True)),
    ((1, 2, 2, 40, 56, 16, 16), dict(q_offset=56)),                                   # keys before: full
    ((1, 2, 2, 40, 56, 16, 16), dict(k_offset=40, sinks=True)),                       # keys after: none
    ((1, 2, 1, 45, 60, 16, 16), dict(q_offset=20, k_offset=5, window=21)),           # partial overlap
    ((1, 2, 1, 45, 60, 16, 16), dict(q_offset=20, k_offset=31, causal=True)),        # some rows empty
    ((1, 2, 1, 50, 30, 16, 16), dict(q_offset=60, k_offset=0, causal=False, window=70)),  # window only
    ((2, 2, 1, 50, 50, 16, 16), dict(cu=[0, 7, 8, 50, 77, 100], causal=False)),       # documents, no causal
    # a ring step: a query chunk at 56.. against the key chunk 0..55, documents crossing the chunk boundary
    ((1, 2, 1, 40, 56, 16, 16), dict(cu=([(2, 10), (3, 1), (4, 29)], [(0, 20), (1, 1), (2, 35)]), q_offset=56,
                                     window=50, sinks=True)),
]


# ---- groups ----

def group_forward():
    import torch
    from pith_lit.ops.attention import flash_attention
    for i, case in enumerate(CASES):
        _check_case(case, seed=1000 + i, grads=False, blocks=(16, 32) if i % 2 else (32, 16))
    # default (interpreter) tiles: one or two blocks per row
    _check_case(((1, 4, 2, 130, 130, 32, 32), dict(window=50, sinks=True)), seed=1100, grads=False, blocks=None)
    # the offset extremes: keys entirely before the queries = full attention; entirely after = nothing visible
    q, k, v, _, _ = _inputs(1, 2, 2, 40, 56, 16, 16, seed=1101)
    full = flash_attention(q, k, v, causal=False, blocks=(16, 16))
    before = flash_attention(q, k, v, q_offset=56, blocks=(16, 16))
    assert _rel(before[0], full[0]) < 1e-6 and _rel(before[1], full[1]) < 1e-6
    out, lse = flash_attention(q, k, v, k_offset=40, blocks=(16, 16))
    assert (out == 0).all() and (lse == float("-inf")).all()
    # empty sizes
    q, k, v, _, _ = _inputs(2, 2, 1, 9, 0, 16, 16, seed=1102)
    out, lse = flash_attention(q, k, v, torch.zeros(2))
    assert (out == 0).all() and (lse == 0).all()
    out, lse = flash_attention(*_inputs(1, 2, 1, 0, 9, 16, 16, seed=1103)[:3])
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


def _force_stored_ds():
    """From here on every backward takes dq from a stored dSᵀ (whatever the head dims), its buffer filled with NaN
    first: an entry read but never written shows up in dq."""
    import pith_lit.ops.attention as A
    real = A._ds_buffer

    def forced(q, Sk, Dv, dot, budget):
        t = real(q, Sk, Dv, dot, 1 << 40)
        return None if t is None else t.fill_(float("nan"))
    A._ds_buffer = forced


def group_backward():
    for stored in (False, True):  # dq recomputed (these head dims' default), then from dSᵀ
        if stored:
            _force_stored_ds()
        for i, case in enumerate(CASES):
            _check_case(case, seed=2000 + i, blocks=(32, 16) if i % 2 else (16, 32))
        _check_case(((2, 4, 1, 100, 100, 16, 16), dict(sinks=True, layout="contiguous")), seed=2100, blocks=None)


def group_skipping():
    """NaN in every block the mask hides entirely from one query block (key blocks), or from one key block
    (query blocks: q, dO, out, lse), must not reach that block's output or gradients: the kernels skip it."""
    import torch
    from pith_lit.ops.attention import attention_bwd, attention_fwd, attention_mask, check_args
    warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
    bm, bn, S = 16, 16, 64
    cases = [dict(window=11), dict(cu=[0, 2, 3, 40, 64], window=25, sinks=True), dict(cu=[0, 17, 18, 50, 64]), {}]
    for seed, opts in enumerate(cases + cases, 3000):
        if seed == 3000 + len(cases):  # the same again with dq from dSᵀ
            _force_stored_ds()
        opts = dict(opts)
        q, k, v, sinks, kw = _inputs(1, 2, 1, S, S, 16, 16, seed, opts.pop("sinks", False), opts.pop("cu", None))
        kw.update(opts)
        scale, m, q_doc, k_doc = check_args(q, k, v, sinks, True, kw.get("window"), None, kw.get("q_doc"),
                                             kw.get("k_doc"), 0, 0)
        keep = attention_mask(S, S, **kw)[0, 0]
        out, lse = attention_fwd(q, k, v, sinks, m, scale, q_doc, k_doc, (bm, bn))
        dout = torch.randn_like(out)
        want = attention_bwd(q, k, v, None, out, lse, dout, None, m, scale, q_doc, k_doc, (bm, bn))
        hidden = lambda kp, r0, rows, block: [c0 for c0 in range(0, S, block) if not kp[r0:r0 + rows, c0:c0 + block].any()]
        n = 0
        for r0 in range(0, S, bm):
            kp, vp = k.clone(), v.clone()
            for c0 in hidden(keep, r0, bm, bn):
                kp[:, :, c0:c0 + bn] = vp[:, :, c0:c0 + bn] = float("nan")
                n += 1
            o, l = attention_fwd(q, kp, vp, sinks, m, scale, q_doc, k_doc, (bm, bn))
            assert _rel(o[:, :, r0:r0 + bm], out[:, :, r0:r0 + bm]) < 1e-6, (opts, r0)
            assert _rel(l[:, :, r0:r0 + bm], lse[:, :, r0:r0 + bm]) < 1e-6, (opts, r0)
            dq = attention_bwd(q, kp, vp, None, out, lse, dout, None, m, scale, q_doc, k_doc, (bm, bn))[0]
            assert _rel(dq[:, :, r0:r0 + bm], want[0][:, :, r0:r0 + bm]) < 1e-6, (opts, r0)
        for c0 in range(0, S, bn):
            ts = [t.clone() for t in (q, out, dout, lse)]
            for r0 in hidden(keep.T, c0, bn, bm):
                for t in ts:
                    t[:, :, r0:r0 + bm] = float("nan")
                n += 1
            _, dk, dv, _ = attention_bwd(ts[0], k, v, None, ts[1], ts[3], ts[2], None, m, scale, q_doc, k_doc, (bm, bn))
            assert _rel(dk[:, :, c0:c0 + bn], want[1][:, :, c0:c0 + bn]) < 1e-6, (opts, c0)
            assert _rel(dv[:, :, c0:c0 + bn], want[2][:, :, c0:c0 + bn]) < 1e-6, (opts, c0)
        assert n > 10, (opts, n)


def group_api():
    import torch
    from pith_lit.ops.attention import FlashAttention, attention_reference, doc_positions, flash_attention
    from references import doc_ids
    # helpers: ids and positions for rows of different layouts, a document crossing a row boundary
    ids = doc_ids(torch.tensor([0, 3, 3, 7, 8, 10]), 2, 5)
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 0, 0, 2, 2], [2, 2, 3, 4, 4]]
    assert doc_positions(ids).tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 1]]
    with pytest.raises(ValueError, match="cu_seqlens"):
        doc_ids(torch.tensor([0, 3, 9]), 2, 5)
    # fp16 and bf16 (loaded, computed in fp32; bf16 stores truncate under the interpreter)
    _check_case(((1, 2, 1, 60, 60, 32, 32), dict(window=20, sinks=True)), seed=4000, dtype=torch.float16, tol=3e-3)
    _check_case(((1, 2, 1, 60, 60, 32, 32), dict(cu=[0, 25, 60])), seed=4001, dtype=torch.bfloat16, tol=3e-2)
    # a slice of a fused qkv projection: no copy needed, exact gradients
    g = torch.Generator().manual_seed(4002)
    qkv = torch.randn(2, 50, (4 + 2 + 2) * 16, generator=g, requires_grad=True)
    q, k, v = (t.unflatten(-1, (-1, 16)).transpose(1, 2) for t in qkv.split([64, 32, 32], -1))
    out, lse = flash_attention(q, k, v, window=13, blocks=(16, 16))
    out.sum().backward()
    qkv64 = qkv.detach().double().requires_grad_()
    q, k, v = (t.unflatten(-1, (-1, 16)).transpose(1, 2) for t in qkv64.split([64, 32, 32], -1))
    attention_reference(q, k, v, window=13)[0].sum().backward()
    assert _rel(qkv.grad, qkv64.grad) < 1e-5
    # saved for backward: inputs, out and lse, never a (Sq, Sk) matrix
    q, k, v, sinks, _ = _inputs(1, 2, 1, 40, 40, 16, 16, seed=4003, sinks=True)
    q.requires_grad_()
    out, lse = flash_attention(q, k, v, sinks)
    assert not any(t is not None and t.shape[-2:] == (40, 40) for t in out.grad_fn.saved_tensors)
    # an explicit scale; gradients of lse alone; no_grad
    out, lse = flash_attention(q, k, v, sinks, scale=0.7)
    out_r, lse_r = attention_reference(q.double(), k.double(), v.double(), sinks.double(), scale=0.7)
    assert _rel(out, out_r) < 1e-5 and _rel(lse, lse_r) < 1e-5
    (gq,) = torch.autograd.grad(lse.sum(), q)
    (gq_r,) = torch.autograd.grad(lse_r.sum(), q)
    assert _rel(gq, gq_r) < 1e-5
    with torch.no_grad():
        assert not flash_attention(q, k, v)[0].requires_grad
    # sinks that need no gradient: none is computed, the others are exact
    (gq,) = torch.autograd.grad(flash_attention(q, k, v, sinks, window=9)[0].sum(), q)
    (gq_r,) = torch.autograd.grad(attention_reference(q.double(), k.double(), v.double(), sinks.double(),
                                                      window=9)[0].sum(), q)
    assert _rel(gq, gq_r) < 1e-5
    assert type(out.grad_fn).__name__ == f"{FlashAttention.__name__}Backward"
    # bad input: a clear ValueError from both implementations
    ok = dict(q=torch.randn(2, 4, 8, 16), k=torch.randn(2, 2, 8, 16), v=torch.randn(2, 2, 8, 16))
    i8 = lambda *s: torch.zeros(*s, dtype=torch.int32)
    bad = [
        ("multiple of the key/value heads", dict(ok, k=torch.randn(2, 3, 8, 16), v=torch.randn(2, 3, 8, 16)), {}),
        ("multiple of the key/value heads", dict(ok, q=torch.randn(2, 5, 8, 16)), {}),
        ("same head dim", dict(ok, q=torch.randn(2, 4, 8, 24)), {}),
        ("agree in batch, heads and length", dict(ok, v=torch.randn(2, 1, 8, 16)), {}),
        ("agree in batch, heads and length", dict(ok, v=torch.randn(2, 2, 7, 16)), {}),
        ("same batch size", dict(ok, q=torch.randn(3, 4, 8, 16)), {}),
        ("4-D tensor", dict(ok, k=torch.randn(2, 8, 16)), {}),
        ("sinks must be", ok, dict(sinks=torch.randn(4, 1))),
        ("q_doc must be", ok, dict(q_doc=i8(2, 9), k_doc=i8(2, 8))),
        ("q_doc must be", ok, dict(q_doc=torch.zeros(2, 8), k_doc=i8(2, 8))),
        ("k_doc must be", ok, dict(q_doc=i8(2, 8), k_doc=i8(1, 8))),
        ("both q_doc and k_doc", ok, dict(k_doc=i8(2, 8))),
        ("window must be", ok, dict(window=-3)),
        ("window must be", ok, dict(window=2.5)),
        ("q_offset must be", ok, dict(q_offset=1.5)),
        ("one floating dtype", dict(ok, k=torch.randn(2, 2, 8, 16).half()), {}),
    ]
    for msg, t, kw in bad:
        for fn in (flash_attention, attention_reference):
            with pytest.raises(ValueError, match=msg):
                fn(t["q"], t["k"], t["v"], **kw)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        flash_attention(ok["q"].double(), ok["k"].double(), ok["v"].double())
    with pytest.raises(ValueError, match="blocks must be"):
        flash_attention(**ok, blocks=(8, 16))


if __name__ == "__main__":
    group_main(globals(), GROUPS)
