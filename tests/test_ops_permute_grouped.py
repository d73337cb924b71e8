"""Token permutation (pith_lit.ops.permute), the grouped expert linear (pith_lit.ops.grouped_linear) and the
operator benchmark command (benchmarks/ops.py), checked at other seeds and shapes than their notebooks.

Triton kernels run on CPU only under the interpreter, and `TRITON_INTERPRET=1` must be in the environment
before `@triton.jit` decorates them (that is, before pith_lit.ops.permute is first imported). A test marked
`@interpreted` therefore runs in this process only if it was started with the variable set; otherwise it
re-runs itself in a child pytest whose environment has it (conftest.subprocess_env).
"""
import functools
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, subprocess_env
from pith_lit.ops.grouped_linear import WeightGradQueue, grouped_linear
from pith_lit.ops.permute import gather_rows, sort_by_expert, weighted_gather


def interpreted(test):
    "Run `test` here under the Triton interpreter, or in a child pytest that has it."
    if os.environ.get("TRITON_INTERPRET") == "1":
        return test

    @functools.wraps(test)
    def in_child():
        node = f"{__file__}::{test.__name__}"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], cwd=ROOT,
                              env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{node} under TRITON_INTERPRET=1:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return in_child


def random_ids(T, k, E, gen):
    "Top-k style ids: k distinct experts per token; expert 0 is never chosen (an empty group)."
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] + 1 for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.int64)
    return ids


CASES = [(11, 3, 7, 1100, 5), (21, 4, 10, 3, 1), (1, 1, 2, 1, 1), (2, 3, 5, 64, 16), (0, 3, 5, 8, 4)]   # T k E H pad


def test_sort_by_expert_properties():
    gen = torch.Generator().manual_seed(11)
    for T, k, E, _, pad_to in CASES + [(200, 8, 64, 0, 1), (200, 8, 64, 0, 32)]:
        ids = random_ids(T, k, E, gen)
        src, row_index, counts = sort_by_expert(ids, E, pad_to)
        assert src.dtype == row_index.dtype == counts.dtype == torch.int64
        assert row_index.shape == (T, k) and counts.shape == (E,) and int(counts.sum()) == src.numel()
        assert counts[0] == 0 and (counts % pad_to == 0).all()
        assert int((src >= 0).sum()) == T * k and (pad_to > 1 or src.numel() == T * k)
        tokens = torch.arange(T).unsqueeze(1).expand(T, k)
        assert torch.equal(src[row_index], tokens)                    # every pair's row comes from its token
        assert row_index.flatten().unique().numel() == T * k           # one row per pair
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        for e in range(E):
            rows = src[starts[e]:starts[e + 1]]
            real = rows[rows >= 0]
            assert torch.equal(real, tokens[ids == e])                 # this expert's tokens, in token order
            assert (rows[real.numel():] == -1).all()                   # padding at the end of the group


def test_sort_by_expert_errors():
    cases = [(lambda: sort_by_expert(torch.zeros(3), 4), "(T, k) int64"),
             (lambda: sort_by_expert(torch.tensor([[0, -1]]), 4), "[0, 4)"),
             (lambda: sort_by_expert(torch.tensor([[0, 1]]), 0), "num_experts"),
             (lambda: gather_rows(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32)), "int64"),
             (lambda: gather_rows(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), impl="cuda"), "impl must"),
             (lambda: weighted_gather(torch.zeros(4, 3), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 3)),
              "weights (T, k)")]
    for bad, msg in cases:
        try:
            bad()
        except (ValueError, RuntimeError) as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(f"no error for {msg}")


@interpreted
def test_gather_rows_triton():
    gen = torch.Generator().manual_seed(12)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
        for T, k, E, H, pad_to in CASES:
            src, row_index, _ = sort_by_expert(random_ids(T, k, E, gen), E, pad_to)
            x = torch.randn(T, H, generator=gen).to(dtype)
            g = torch.randn(src.numel(), H, generator=gen).to(dtype)
            x64 = x.double().requires_grad_()
            want = gather_rows(x64, src, impl="torch")
            want.backward(g.double())
            xt = x.clone().requires_grad_()
            out = gather_rows(xt, src, impl="triton")
            out.backward(g)
            assert out.dtype == dtype and torch.equal(out, want.detach().to(dtype))
            assert (out[src < 0] == 0).all()
            torch.testing.assert_close(xt.grad.double(), x64.grad, rtol=tol, atol=tol)


@interpreted
def test_weighted_gather_triton():
    gen = torch.Generator().manual_seed(13)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        for T, k, E, H, pad_to in CASES:
            src, row_index, _ = sort_by_expert(random_ids(T, k, E, gen), E, pad_to)
            y = torch.randn(src.numel(), H, generator=gen).to(dtype)
            w = torch.rand(T, k, generator=gen)
            g = torch.randn(T, H, generator=gen).to(dtype)
            y64, w64 = y.double().requires_grad_(), w.double().requires_grad_()
            # float64 by hand: a loop over the k slots
            want = sum(w64[:, j:j + 1] * y64[row_index[:, j]] for j in range(k))
            want.backward(g.double())
            yt, wt = y.clone().requires_grad_(), w.clone().requires_grad_()
            out = weighted_gather(yt, row_index, wt, impl="triton")
            out.backward(g)
            assert out.dtype == dtype and out.shape == (T, H)
            torch.testing.assert_close(out.double(), want.detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(yt.grad.double(), y64.grad, rtol=tol, atol=tol)
            torch.testing.assert_close(wt.grad.double(), w64.grad, rtol=tol, atol=tol * max(H, 1) ** 0.5)
            assert (yt.grad[src < 0] == 0).all()
            assert wt.grad.dtype == torch.float32


def test_grouped_linear_matches_float64():
    gen = torch.Generator().manual_seed(14)
    for impl, dtype, tol in [("loop", torch.float32, 1e-5), ("grouped_mm", torch.float32, 1e-5),
                             ("grouped_mm", torch.bfloat16, 5e-2), ("loop", torch.bfloat16, 5e-2)]:
        for counts in ([0, 7, 0, 2, 11, 1], [0, 0], [3]):
            counts = torch.tensor(counts)
            N, E, n_in, n_out = int(counts.sum()), len(counts), 40, 16
            x = torch.randn(N, n_in, generator=gen).to(dtype)
            w = (torch.randn(E, n_out, n_in, generator=gen) / n_in ** 0.5).to(dtype)
            g = torch.randn(N, n_out, generator=gen).to(dtype)
            x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
            expert = torch.repeat_interleave(torch.arange(E), counts)
            want = torch.bmm(w64[expert], x64.unsqueeze(-1)).squeeze(-1)
            want.backward(g.double())
            xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = grouped_linear(xt, wt, counts, impl=impl)
            y.backward(g)
            for got, ref in [(y, want), (xt.grad, x64.grad), (wt.grad, w64.grad)]:
                assert got.dtype == dtype
                torch.testing.assert_close(got.double(), ref.detach(), rtol=tol, atol=tol)
            assert (wt.grad[counts == 0] == 0).all()


def test_deferred_weight_gradient_is_bitwise_identical():
    gen = torch.Generator().manual_seed(15)
    counts = torch.tensor([4, 0, 9, 2, 0])
    x0 = torch.randn(15, 8, generator=gen)
    w0 = torch.randn(5, 24, 8, generator=gen)
    for impl in ("loop", "grouped_mm"):
        results = []
        for queue in (None, WeightGradQueue()):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            for step in range(3):                            # accumulate over three backward passes
                (grouped_linear(x, w, counts, queue, impl) ** 2).sum().backward()
                if queue is not None:
                    assert len(queue) == 1 and (step > 0 or w.grad is None)   # dW waits for drain()
                    queue.drain()
                    assert len(queue) == 0
            results.append((x.grad, w.grad))
        (xa, wa), (xb, wb) = results
        assert torch.equal(xa, xb) and torch.equal(wa, wb), impl
        assert (wb[1] == 0).all() and (wb[4] == 0).all()


def test_deferred_through_a_view_equals_immediate():
    "A weight stored as (E, in, out) and passed as its .mT view: the deferred gradient reaches the parameter."
    torch.manual_seed(3)
    x, counts = torch.randn(7, 8), torch.tensor([3, 0, 4])
    grads = []
    for queue in (None, WeightGradQueue()):
        w = torch.randn(3, 8, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
        grouped_linear(x, w.mT, counts, queue).pow(2).sum().backward()
        if queue is not None:
            assert w.grad is None and len(queue) == 1
            queue.drain()
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1]) and (grads[1][1] == 0).all()


def test_bench_command_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the command would benchmark instead of refusing")
    proc = subprocess.run([sys.executable, "benchmarks/ops.py", "--json", "unused.json"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr and not (ROOT / "unused.json").exists()


def test_bench_table():
    "The benchmark's table on made-up numbers (the real ones need a GPU): one aligned row per measure."
    from benchmarks.ops import rows_of, table
    fake = rows_of("permute", {"gather fwd ms": 0.3125, "gather fwd % of copy": 78.04}) + \
        rows_of("grouped_linear", {"grouped_linear 768->2048 fwd+bwd TFLOP/s": 612.0})
    lines = table(fake).splitlines()
    assert len(lines) == 5 and lines[2].split() == ["permute", "gather", "fwd", "ms", "0.312"]
    assert lines[4].endswith(" 612.000") and len({len(l) for l in lines[2:]}) == 1
