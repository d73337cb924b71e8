"""The gated delta rule (pith_lit.ops.gated_delta_rule) against its per-token float64 loop, under the Triton
interpreter.

Each group runs in its own process (`python tests/test_ops_gated_delta_rule.py <group>`) with TRITON_INTERPRET=1
set before Triton is imported. Sizes are small (T up to 80, head dims 16-32, chunks of 16) so that sequences span
several chunks and each group takes seconds on two CPU cores.
"""
import pytest

from conftest import group_main, run_group

GROUPS = ["forward", "backward", "api"]


@pytest.mark.parametrize("group", GROUPS)
def test_gated_delta_rule(group):
    run_group(__file__, group)


# ---- helpers (run in the child process) ----

def _rel(a, b):
    "max |a - b| / max |b| in float64 (|a| when b is all zero)."
    a, b = a.double(), b.double()
    assert a.shape == b.shape, (a.shape, b.shape)
    m = b.abs().max()
    return (a - b).abs().max().item() / (m.item() if m > 0 else 1.0)


def _docs(*rows):
    "(B, T) int32 document ids from per-row lists of document lengths."
    import torch
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).int()


def _inputs(B, T, Hk, Hv, K, V, seed, state=True):
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    return (r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, Hv, V), -F.softplus(r(B, T, Hv) * 2 - 1),
            torch.sigmoid(r(B, T, Hv) * 2), r(B, Hv, K, V) * 0.3 if state else None)


def _ref(q, k, v, g, beta, s0, docs, **kw):
    from pith_lit.ops.gated_delta_rule import gated_delta_rule_reference
    d = lambda t: None if t is None else t.double()
    return gated_delta_rule_reference(d(q), d(k), d(v), d(g), d(beta), initial_state=d(s0), docs=docs,
                                      output_final_state=True, **kw)


# (B, T, Hk, Hv, K, V), initial state, documents: chunk-unaligned lengths, T below one chunk, documents of length 1
# at a row's start, middle and end, boundaries on and off chunk starts, rows with different layouts.
CASES = [
    ((2, 61, 2, 4, 16, 24), True, None),
    ((1, 80, 1, 3, 32, 16), False, None),
    ((1, 5, 1, 2, 16, 16), True, None),
    ((1, 1, 1, 1, 16, 16), True, None),
    ((2, 67, 1, 2, 16, 16), True, ([1, 15, 16, 1, 1, 33], [32, 1, 34])),
    ((1, 50, 2, 2, 24, 32), True, ([7, 9, 1, 32, 1],)),
    ((2, 33, 2, 4, 16, 16), False, ([33], [1] * 33)),
]


def _case(i):
    shape, state, lens = CASES[i]
    q, k, v, g, beta, s0 = _inputs(*shape, seed=100 + i, state=state)
    docs = None if lens is None else _docs(*(lens * shape[0] if len(lens) == 1 else lens))
    return shape, q, k, v, g, beta, s0, docs


# ---- groups ----

def group_forward():
    "Outputs and final states of the kernels (and of the torch chunked form) against the loop."
    from pith_lit.ops.gated_delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_torch
    for i in range(len(CASES)):
        shape, q, k, v, g, beta, s0, docs = _case(i)
        o_r, s_r = _ref(q, k, v, g, beta, s0, docs)
        kw = dict(initial_state=s0, docs=docs, output_final_state=True, chunk_size=16)
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        assert o.shape == o_r.shape and o.dtype == v.dtype and s.shape == s_r.shape
        assert _rel(o, o_r) < 1e-5 and _rel(s, s_r) < 1e-5, (shape, _rel(o, o_r), _rel(s, s_r))
        o_t, s_t = chunk_gated_delta_rule_torch(*(t.double() for t in (q, k, v, g, beta)),
                                                initial_state=None if s0 is None else s0.double(), docs=docs,
                                                output_final_state=True, chunk_size=16)
        assert _rel(o_t, o_r) < 1e-10 and _rel(s_t, s_r) < 1e-10, shape
    # no l2 norm (keys of norm about 0.8, so that β|k|² < 2 and the rule is stable), an explicit scale, chunks of 32
    shape, q, k, v, g, beta, s0, docs = _case(4)
    o_r, s_r = _ref(q, k * 0.2, v, g, beta, s0, docs, use_qk_l2norm=False, scale=0.3)
    o, s = chunk_gated_delta_rule(q * 0.2, k * 0.2, v, g, beta, initial_state=s0, docs=docs, output_final_state=True,
                                  use_qk_l2norm=False, scale=1.5, chunk_size=32)
    assert _rel(o, o_r) < 1e-5 and _rel(s, s_r) < 1e-5
    # documents: a packed row equals each document run alone
    q, k, v, g, beta, _ = _inputs(1, 40, 1, 2, 16, 16, seed=150, state=False)
    lens = [1, 20, 1, 18]
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, docs=_docs(lens), chunk_size=16)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        o_alone, _ = _ref(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], None, None)
        assert _rel(o[:, sl], o_alone) < 1e-5, (start, n)
        start += n


def group_backward():
    "Every gradient (dq, dk, dv, dg, dβ, d initial state) through autograd, loss on output and final state."
    import torch
    from pith_lit.ops.gated_delta_rule import chunk_gated_delta_rule
    for i in range(len(CASES)):
        shape, q, k, v, g, beta, s0, docs = _case(i)
        leaves = [t.requires_grad_() for t in (q, k, v, g, beta)] + ([s0.requires_grad_()] if s0 is not None else [])
        o, s = chunk_gated_delta_rule(*leaves[:5], initial_state=s0, docs=docs, output_final_state=True,
                                      chunk_size=16)
        gen = torch.Generator().manual_seed(200 + i)
        do, ds = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
        got = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves)
        l64 = [t.detach().double().requires_grad_() for t in leaves]
        o_r, s_r = _ref(*l64[:5], l64[5] if s0 is not None else None, docs)
        want = torch.autograd.grad((o_r * do.double()).sum() + (s_r * ds.double()).sum(), l64)
        for name, a, b, t in zip(("dq", "dk", "dv", "dg", "dbeta", "ds0"), got, want, leaves):
            assert a.dtype == t.dtype and torch.isfinite(a).all(), (shape, name)
            assert _rel(a, b) < 2e-5, (shape, name, _rel(a, b))
    # gradients of the output alone, and of the final state alone
    shape, q, k, v, g, beta, s0, docs = _case(4)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, s0)]
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    for pick in (0, 1):
        y = chunk_gated_delta_rule(*leaves[:5], initial_state=s0, docs=docs, output_final_state=True,
                                   chunk_size=16)[pick]
        y_r = _ref(*l64, docs)[pick]
        got = torch.autograd.grad(y.sum(), leaves, allow_unused=True, materialize_grads=True)
        want = torch.autograd.grad(y_r.sum(), l64, allow_unused=True, materialize_grads=True)
        assert max(_rel(a, b) for a, b in zip(got, want)) < 2e-5, pick


def group_api():
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf
    from pith_lit.ops.gated_delta_rule import (causal_conv1d, chunk_gated_delta_rule, chunk_gated_delta_rule_torch,
                                               gated_delta_rule_reference)
    # transformers' chunked version on one document, default chunk of 64
    q, k, v, g, beta, s0 = _inputs(1, 70, 2, 4, 32, 32, seed=300)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_hf, s_hf = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    assert _rel(o, o_hf) < 1e-5 and _rel(s, s_hf) < 1e-5
    # compiled whole (forward and backward graphs), documents
    docs = _docs([1, 30, 9], [40])
    q, k, v, g, beta, s0 = _inputs(2, 40, 1, 2, 16, 16, seed=301)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, s0)]
    fn = lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], docs=docs, output_final_state=True,
                                           chunk_size=16)
    o, s = torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves)
    got = torch.autograd.grad(o.sum() + s.sum(), leaves)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    o_r, s_r = _ref(*l64, docs)
    want = torch.autograd.grad(o_r.sum() + s_r.sum(), l64)
    assert _rel(o, o_r) < 1e-5 and max(_rel(a, b) for a, b in zip(got, want)) < 2e-5
    torch._dynamo.reset()
    # bf16 / fp16 inputs (float32 inside; bf16 stores truncate under the interpreter)
    for dtype, tol in ((torch.float16, 3e-3), (torch.bfloat16, 3e-2)):
        q, k, v, g, beta, _ = _inputs(1, 40, 1, 2, 32, 32, seed=302, state=False)
        o, _ = chunk_gated_delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), g, beta, docs=docs[:1], chunk_size=16)
        o_r, _ = _ref(q.to(dtype), k.to(dtype), v.to(dtype), g, beta, None, docs[:1])
        assert o.dtype == dtype and _rel(o, o_r) < tol, (dtype, _rel(o, o_r))
    # the torch chunked form's gradients (the CPU training path)
    q, k, v, g, beta, s0 = _inputs(2, 40, 1, 2, 16, 16, seed=303)
    l64 = [t.double().requires_grad_() for t in (q, k, v, g, beta, s0)]
    o, s = chunk_gated_delta_rule_torch(*l64[:5], initial_state=l64[5], docs=docs, output_final_state=True,
                                        chunk_size=16)
    got = torch.autograd.grad(o.sum() + s.sum(), l64)
    o_r, s_r = gated_delta_rule_reference(*l64[:5], initial_state=l64[5], docs=docs, output_final_state=True)
    want = torch.autograd.grad(o_r.sum() + s_r.sum(), l64)
    assert max(_rel(a, b) for a, b in zip(got, want)) < 1e-10
    # the convolution resets at documents: equal to each document convolved alone
    x, w = torch.randn(2, 40, 6), torch.randn(6, 4)
    y = causal_conv1d(x, w, docs)
    for r, lens in enumerate([[1, 30, 9], [40]]):
        ref = torch.cat([F.silu(F.conv1d(p.T[None], w[:, None], padding=3, groups=6)[0, :, :len(p)].T)
                         for p in x[r].split(lens)])
        assert _rel(y[r], ref) < 1e-6
    # bad input: a clear ValueError from the kernels' function and from the reference
    q, k, v, g, beta, s0 = _inputs(1, 8, 2, 4, 16, 16, seed=304)
    ok = dict(q=q, k=k, v=v, g=g, beta=beta)
    bad = [
        ("multiple of the key heads", dict(ok, v=torch.randn(1, 8, 3, 16), g=g[..., :3], beta=beta[..., :3]), {}),
        ("same shape", dict(ok, k=torch.randn(1, 8, 2, 32)), {}),
        ("must agree", dict(ok, g=g[:, :7]), {}),
        ("must be a 4-D", dict(ok, q=q[0]), {}),
        ("initial_state must have shape", ok, dict(initial_state=s0[:, :2])),
        ("docs must be", ok, dict(docs=torch.zeros(1, 7, dtype=torch.int32))),
        ("docs must be", ok, dict(docs=torch.zeros(1, 8))),
    ]
    for msg, t, kw in bad:
        for fn in (chunk_gated_delta_rule, gated_delta_rule_reference):
            with pytest.raises(ValueError, match=msg):
                fn(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)
    with pytest.raises(ValueError, match="chunk_size must be"):
        chunk_gated_delta_rule(**ok, chunk_size=24)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        chunk_gated_delta_rule(q.double(), k.double(), v.double(), g, beta)


if __name__ == "__main__":
    group_main(globals(), GROUPS)
