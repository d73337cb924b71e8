"""Fused SwiGLU (nbs/ops/10) and fused linear cross-entropy (nbs/ops/13): the notebooks' checks on other seeds
and shapes, plus bf16 plumbing, saved tensors and gradient selection.

Triton decides at import whether a kernel is interpreted (TRITON_INTERPRET=1), and another test module may already
have imported pith_lit.ops without it, so each group of checks runs in a fresh subprocess: pytest calls
`python tests/test_ops_swiglu_ce.py <group>` with `conftest.subprocess_env()`, and the group's function below
does the work. On a machine with CUDA the same checks run on the GPU with compiled kernels.
"""
import subprocess
import sys

import pytest


def _run_group(name: str):
    from conftest import ROOT, subprocess_env
    proc = subprocess.run([sys.executable, __file__, name], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert f"{name} OK" in proc.stdout, proc.stdout[-4000:]


@pytest.mark.parametrize("group", ["swiglu", "clamped", "ce_rows", "linear_ce"])
def test_group(group):
    _run_group(group)


# ---- the groups, run in the subprocess ----

def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _check_act(fn, ref, shapes, seed, scale, dtype=None, tol=1e-6):
    "fn (Triton) vs ref in float64: forward and input gradient, on fresh N(0, scale²) inputs."
    import torch
    torch.manual_seed(seed)
    for shape in shapes:
        x = (torch.randn(shape) * scale).to(dtype or torch.float32).requires_grad_()
        y = fn(x)
        dy = torch.randn_like(y)
        y.backward(dy)
        x64 = x.detach().double().requires_grad_()
        y64 = ref(x64)
        y64.backward(dy.double())
        assert y.dtype == x.dtype and y.shape == y64.shape and x.grad.dtype == x.dtype
        errs = _rel(y, y64), _rel(x.grad, x64.grad)
        assert max(errs) < tol, (shape, dtype, errs)


def group_swiglu():
    import torch
    from pith_lit.ops.swiglu import SwiGLUFunction, swiglu, swiglu_ref
    fn = lambda x: swiglu(x, impl="triton")
    _check_act(fn, swiglu_ref, [(53, 260), (3, 600), (1, 2), (0, 20), (4, 3, 66), (513, 16)], seed=11, scale=4)
    _check_act(fn, swiglu_ref, [(29, 2 * 97)], seed=12, scale=2, dtype=torch.bfloat16, tol=1e-2)
    # a transposed (non-contiguous) input
    x = torch.randn(2 * 45, 31).t().requires_grad_()
    assert not x.is_contiguous()
    y = swiglu(x, impl="triton")
    y.sum().backward()
    x64 = x.detach().double().requires_grad_()
    swiglu_ref(x64).sum().backward()
    assert _rel(y, swiglu_ref(x64)) < 1e-6 and _rel(x.grad, x64.grad) < 1e-6
    # forward saves only its input: silu is recomputed in backward
    x = torch.randn(7, 24, requires_grad=True)
    y = SwiGLUFunction.apply(x)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0] is x, [t.shape for t in saved]
    # impl=None follows the device; bad input names the problem
    assert torch.equal(swiglu(x), swiglu(x, impl="triton" if x.is_cuda else "torch"))
    for bad, call in [("even last dimension", lambda: swiglu(torch.randn(3, 9))),
                      ("impl must be", lambda: swiglu(x, impl="gpu"))]:
        with pytest.raises(ValueError, match=bad):
            call()


def group_clamped():
    import torch
    from pith_lit.ops.swiglu import clamped_swiglu, clamped_swiglu_ref
    for limit, alpha, seed in [(7.0, 1.702, 21), (1.5, 2.5, 22)]:
        fn = lambda x: clamped_swiglu(x, limit, alpha, impl="triton")
        ref = lambda x: clamped_swiglu_ref(x, limit, alpha)
        _check_act(fn, ref, [(45, 130), (1, 1536), (0, 8), (2, 9, 34), (300, 2)], seed=seed, scale=3 * limit)
    _check_act(lambda x: clamped_swiglu(x, impl="triton"), clamped_swiglu_ref, [(31, 2 * 70)], seed=23, scale=8,
               dtype=torch.bfloat16, tol=1e-2)
    # interleaving: gate is column 2j, up column 2j+1
    x = torch.tensor([[1.0, 2.0, -3.0, 0.5]])
    s = torch.sigmoid(1.702 * torch.tensor([1.0, -3.0]))
    assert torch.allclose(clamped_swiglu(x, impl="triton")[0], torch.tensor([3.0, 1.5]) * torch.tensor([1.0, -3.0]) * s)
    # clamps zero exactly the clamped entries' gradient (σ = 6: about 12% of gates, 24% of ups clamped, and no
    # gate so negative that sigmoid underflows to an exact zero)
    x = (torch.randn(40, 64) * 6).requires_grad_()
    clamped_swiglu(x, impl="triton").sum().backward()
    gate, up = x.detach()[:, ::2], x.detach()[:, 1::2]
    assert (gate > 7).any() and (up.abs() > 7).any()
    assert torch.equal(x.grad[:, ::2] == 0, gate > 7) and torch.equal(x.grad[:, 1::2] == 0, up.abs() > 7)


def group_ce_rows():
    import torch
    from pith_lit.ops.cross_entropy import ce_rows_torch, ce_rows_triton
    torch.manual_seed(31)
    for rows, V in [(9, 4097), (4, 8200), (1, 3), (0, 100), (17, 513)]:
        logits = torch.randn(rows, V) * 5
        labels = torch.randint(0, V, (rows,))
        labels[::3] = -7  # a custom ignore_index
        fast, ref = logits.clone(), logits.double()
        loss_fast, loss_ref = ce_rows_triton(fast, labels, -7), ce_rows_torch(ref, labels, -7)
        assert loss_fast.dtype == torch.float32 and _rel(loss_fast, loss_ref) < 1e-6 and _rel(fast, ref) < 1e-6
        assert (loss_fast[::3] == 0).all() and (fast[::3] == 0).all()
    # bf16 logits: loaded as bf16, computed in fp32, gradient stored as bf16
    logits = torch.randn(6, 5000).bfloat16()
    labels = torch.randint(0, 5000, (6,))
    fast, ref = logits.clone(), logits.double()
    assert _rel(ce_rows_triton(fast, labels, -100), ce_rows_torch(ref, labels, -100)) < 1e-6
    assert fast.dtype == torch.bfloat16 and _rel(fast, ref) < 1e-2
    # a label outside [0, V) gives NaN, not a silent value
    assert ce_rows_triton(torch.randn(2, 10), torch.tensor([10, 3]), -100).isnan().tolist() == [True, False]


def group_linear_ce():
    import torch
    from pith_lit.ops.cross_entropy import linear_cross_entropy
    from references import cross_entropy_ref
    torch.manual_seed(41)
    for T, H, V, chunk, n_ignored in [(70, 12, 4200, 32, 9), (5, 20, 64, 100, 1), (33, 8, 9000, 1, 0),
                                      (64, 16, 50, 16, 64), (12, 4, 7, None, 3)]:
        h = torch.randn(T, H)
        w = torch.randn(V, H) * 2 / H ** 0.5
        labels = torch.randint(0, V, (T,))
        labels[torch.randperm(T)[:n_ignored]] = -100
        h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
        loss64 = cross_entropy_ref(h64, w64, labels)
        (loss64 * 0.7).backward()
        for impl, dtype, tol in [("triton", torch.float32, 1e-5), ("torch", torch.float64, 1e-12),
                                 ("triton", torch.bfloat16, 2e-2)]:
            hh, ww = h.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
            loss = linear_cross_entropy(hh, ww, labels, chunk_size=chunk, impl=impl)
            (loss * 0.7).backward()
            ref_loss, ref_gh, ref_gw = (loss64, h64.grad, w64.grad) if dtype != torch.bfloat16 else \
                _bf16_ref(hh.detach(), ww.detach(), labels)
            errs = _rel(loss, ref_loss), _rel(hh.grad, ref_gh), _rel(ww.grad, ref_gw)
            assert max(errs) < tol, (T, H, V, chunk, impl, dtype, errs)
            assert loss.dtype == torch.promote_types(dtype, torch.float32) and ww.grad.dtype == dtype
    # all ignored: zero loss, zero gradients
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.full((6,), -100), chunk_size=4, impl="triton")
    loss.backward()
    assert loss.item() == 0 and (h.grad == 0).all() and (w.grad == 0).all()
    # only the weight needs a gradient: h's is never computed
    h, w = torch.randn(10, 4), torch.randn(11, 4, requires_grad=True)
    labels = torch.randint(0, 11, (10,))
    loss = linear_cross_entropy(h, w, labels, chunk_size=3, impl="triton")
    assert loss.grad_fn.saved_tensors[0] is None
    loss.backward()
    w64 = w.detach().double().requires_grad_()
    cross_entropy_ref(h.double(), w64, labels).backward()
    assert h.grad is None and _rel(w.grad, w64.grad) < 1e-5
    # evaluation: no gradient work, same loss
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, chunk_size=3, impl="triton")
    assert not loss.requires_grad and abs(loss.item() - cross_entropy_ref(h, w.detach(), labels).item()) < 1e-4
    with pytest.raises(ValueError, match="same H"):
        linear_cross_entropy(h, torch.randn(11, 5), labels)
    with pytest.raises(ValueError, match="one per row of h"):
        linear_cross_entropy(h, w, labels[None])


def _bf16_ref(h, w, labels):
    "Loss and gradients of the eager reference on the same bf16 values, computed in float64 (scaled by 0.7)."
    from references import cross_entropy_ref
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    loss = cross_entropy_ref(h64, w64, labels)
    (loss * 0.7).backward()
    return loss, h64.grad, w64.grad


if __name__ == "__main__":
    import os

    import torch
    if torch.cuda.is_available():
        torch.set_default_device("cuda")
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1", "the Triton checks on CPU need TRITON_INTERPRET=1"
    match sys.argv[1]:
        case "swiglu":
            group_swiglu()
        case "clamped":
            group_clamped()
        case "ce_rows":
            group_ce_rows()
        case "linear_ce":
            group_linear_ce()
        case other:
            raise SystemExit(f"unknown group {other!r}; use swiglu, clamped, ce_rows or linear_ce")
    print(f"{sys.argv[1]} OK")
