"""Operator benchmarks: every kernel of pith_lit.ops timed at the real models' sizes against the eager code it
replaces, as a fraction of the machine's ceilings (device copy, read plus written, and bf16 matmul, both measured on
the H200). One process prints one table, so a change to any kernel is measured the same way. From the repository
root, on a GPU:

    python benchmarks/ops.py --json benchmarks/ops.json

Each `<op>_bench()` returns a plain dict, `{"<kernel> <pass> <measure>": number}`. The table has one row per entry,
grouped by op; `--json` writes the same rows with the GPU, the software versions and the date, ready to be summarised
in benchmarks/RESULTS.md. Without a GPU it says so and exits 2. The kernel notebooks' GPU cells import these
functions and assert their targets on the numbers."""
import argparse
import contextlib
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # pith_lit and tests.references, from any cwd
from pith_lit.ops.attention import flash_attention, attention_reference  # noqa: E402
from pith_lit.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from pith_lit.ops.grouped_linear import grouped_linear  # noqa: E402
from pith_lit.ops.permute import gather_rows, sort_by_expert, weighted_gather  # noqa: E402
from pith_lit.ops.swiglu import clamped_swiglu, clamped_swiglu_ref, swiglu, swiglu_ref  # noqa: E402
from tests.references import cross_entropy_ref  # noqa: E402

COPY_CEILING = 4.3e12     # bytes/s read plus written, H200 device-to-device copy (measured)
MATMUL_CEILING = 789e12   # bf16 dense matmul FLOP/s, measured on the H200


# SwiGLU (ops/10). Bytes are the measure: forward reads 2·N·I and writes N·I elements, backward reads 3·N·I and
# writes 2·N·I. Each call replays as a CUDA graph: the host's launch of one fwd+bwd through autograd takes about as
# long as the GPU's run, and in training these launches queue behind larger kernels. Backward alone is fwd+bwd minus
# fwd (autograd runs a backward on its forward's stream, which a graph captured on another stream cannot include).
def _swiglu_times(fn, x: torch.Tensor, dy: torch.Tensor) -> dict:
    "Median ms of `fn` forward and forward+backward, replayed as CUDA graphs; backward is their difference."
    from triton.testing import do_bench_cudagraph
    fwd = do_bench_cudagraph(lambda: fn(x), return_mode="median")
    both = do_bench_cudagraph(lambda: torch.autograd.grad(fn(x), x, dy), return_mode="median")
    return {"fwd": fwd, "bwd": both - fwd, "fwd+bwd": both}


def swiglu_bench(n: int = 131072, i: int = 768) -> dict:
    "Both SwiGLUs, Triton vs eager, bf16 on CUDA: ms, GB/s, % of the copy ceiling, speed-up."
    min_elems = {"fwd": 3, "bwd": 5, "fwd+bwd": 8}  # elements of N·I that must be read + written
    out = {}
    for name, fast, ref in [("swiglu", swiglu, swiglu_ref), ("clamped_swiglu", clamped_swiglu, clamped_swiglu_ref)]:
        x = torch.randn(n, 2 * i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(n, i, device="cuda", dtype=torch.bfloat16)
        t_fast, t_ref = _swiglu_times(fast, x, dy), _swiglu_times(ref, x, dy)
        for pas, elems in min_elems.items():
            gbps = elems * n * i * x.element_size() / t_fast[pas] / 1e6
            out.update({f"{name} {pas} ms": t_fast[pas], f"{name} {pas} GB/s": gbps,
                        f"{name} {pas} % of copy": 100 * gbps * 1e9 / COPY_CEILING,
                        f"{name} {pas} eager ms": t_ref[pas], f"{name} {pas} speed-up": t_ref[pas] / t_fast[pas]})
    return out


# Permutation (ops/11), at Qwen3-30B-A3B's shape. Bytes are counted as the kernel must move them: the gather reads
# and writes N rows; the weighted gather reads N rows and writes T; the gather's backward reads N rows and writes T;
# the weighted gather's backward reads T rows (each k times, counted once) and N rows of `y`, and writes N rows. The
# gather can exceed 100% of the ceiling: each row of `x` is read k times, and the re-reads partly hit the L2.
def permute_bench(T: int = 16384, H: int = 2048, E: int = 128, k: int = 8) -> dict:
    "sort_by_expert time; permute and un-permute, fwd and bwd, Triton vs eager, bf16 on CUDA: ms, GB/s, % of copy."
    from triton.testing import do_bench
    dev, dt = "cuda", torch.bfloat16
    ids = torch.randn(T, E, device=dev).topk(k, dim=1).indices
    src, row_index, _ = sort_by_expert(ids, E)
    N = src.numel()
    x = torch.randn(T, H, device=dev, dtype=dt)
    y = torch.randn(N, H, device=dev, dtype=dt)
    w = torch.rand(T, k, device=dev)
    gN, gT = torch.randn(N, H, device=dev, dtype=dt), torch.randn(T, H, device=dev, dtype=dt)

    def fwd_bwd(fn, *args, grad):
        ins = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
        out = fn(*ins)
        return lambda: torch.autograd.grad(out, [a for a in ins if a.requires_grad], grad, retain_graph=True)

    cases = {   # name: (triton fn, eager fn, bytes moved)
        "gather fwd": (lambda: gather_rows(x, src, impl="triton"), lambda: gather_rows(x, src, impl="torch"),
                       2 * N * H * 2),
        "gather bwd": (fwd_bwd(lambda a, s: gather_rows(a, s, impl="triton"), x, src, grad=gN),
                       fwd_bwd(lambda a, s: gather_rows(a, s, impl="torch"), x, src, grad=gN),
                       (N + T) * H * 2),
        "gather bwd by row_index": (fwd_bwd(lambda a, s: gather_rows(a, s, row_index, impl="triton"), x, src, grad=gN),
                                    fwd_bwd(lambda a, s: gather_rows(a, s, impl="torch"), x, src, grad=gN),
                                    (N + T) * H * 2),
        "weighted_gather fwd": (lambda: weighted_gather(y, row_index, w, impl="triton"),
                                lambda: weighted_gather(y, row_index, w, impl="torch"), (N + T) * H * 2),
        "weighted_gather bwd": (
            fwd_bwd(lambda a, i, b: weighted_gather(a, i, b, impl="triton"), y, row_index, w, grad=gT),
            fwd_bwd(lambda a, i, b: weighted_gather(a, i, b, impl="torch"), y, row_index, w, grad=gT),
            (T + 2 * N) * H * 2),
    }
    out = {"sort_by_expert ms": do_bench(lambda: sort_by_expert(ids, E), return_mode="median")}
    for name, (fast, eager, nbytes) in cases.items():
        ms, eager_ms = do_bench(fast, return_mode="median"), do_bench(eager, return_mode="median")
        out.update({f"{name} ms": ms, f"{name} GB/s": nbytes / ms / 1e6,
                    f"{name} % of copy": 100 * nbytes / ms / 1e-3 / COPY_CEILING,
                    f"{name} eager ms": eager_ms, f"{name} speed-up": eager_ms / ms})
    return out


# The grouped expert linear (ops/12) against raw F.grouped_mm (autograd's own backward) at Qwen3-30B-A3B's expert
# shapes, with counts from random top-8 routing. FLOPs are 3 × 2 × N × in × out (the forward and both gradients).
def grouped_linear_bench(T: int = 16384, k: int = 8, E: int = 128, shapes=((2048, 1536), (768, 2048))) -> dict:
    "grouped_linear fwd+bwd vs raw F.grouped_mm fwd+bwd, bf16 on CUDA: ms, TFLOP/s, % of the matmul ceiling."
    from triton.testing import do_bench
    ids = torch.randn(T, E, device="cuda").topk(k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    N = T * k
    out = {}
    for n_in, n_out in shapes:
        x = torch.randn(N, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(E, n_out, n_in, device="cuda") / n_in ** 0.5).to(torch.bfloat16).requires_grad_()
        g = torch.randn(N, n_out, device="cuda", dtype=torch.bfloat16)
        def ours():
            torch.autograd.grad(grouped_linear(x, w, counts), (x, w), g)
        def raw():
            torch.autograd.grad(F.grouped_mm(x, w.transpose(-2, -1), offs=offs), (x, w), g)
        ms, raw_ms = do_bench(ours, return_mode="median"), do_bench(raw, return_mode="median")
        tflops = 3 * 2 * N * n_in * n_out / ms / 1e9
        name = f"grouped_linear {n_in}->{n_out} fwd+bwd"
        out.update({f"{name} ms": ms, f"{name} TFLOP/s": tflops,
                    f"{name} % of matmul": 100 * tflops * 1e12 / MATMUL_CEILING,
                    f"{name} raw grouped_mm ms": raw_ms, f"{name} time / raw": ms / raw_ms})
    return out


# Attention (ops/14) against SDPA on the same tensors, with `q, k, v` as transposed `(B, S, H, D)` projections (the
# layout the models pass): SDPA as its dispatcher picks (printed), and with each fused backend forced. FLOPs count the
# two forward products (`2·(Dqk + Dv)` per visible query-key pair) and five backward products (`2·(3·Dqk + 2·Dv)`,
# recomputation included, FA's convention); a causal layer counts half the pairs, a window layer the pairs it sees.
ATTENTION_SHAPES = {  # name: (B, S, Hq, Hkv, Dqk, Dv, sinks, window)
    "qwen3 causal": (2, 4096, 32, 4, 128, 128, False, None),
    "gpt-oss causal+sinks": (2, 4096, 64, 8, 64, 64, True, None),
    "gpt-oss window128+sinks": (2, 4096, 64, 8, 64, 64, True, 128),
    "deepseek-mla causal": (4, 2048, 16, 16, 192, 128, False, None),
}


def _pairs(S: int, window: int | None) -> float:
    "Visible (query, key) pairs of one causal head: S²/2, or Σ_i min(i + 1, W) with a window."
    return S * S / 2 if window is None else float(sum(min(i + 1, window) for i in range(S)))


def attention_inputs(B, S, Hq, Hkv, dqk, dv, sinks, seed=0):
    "bf16 `q, k, v` on CUDA as transposed `(B, S, H, D)` projections, and fp32 sinks (or None); all leaves."
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda H, D: torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16().transpose(1, 2).requires_grad_()
    s = torch.randn(Hq, device="cuda", generator=g).requires_grad_() if sinks else None
    return mk(Hq, dqk), mk(Hkv, dqk), mk(Hkv, dv), s


def _attention_errors(B, S, Hq, Hkv, dqk, dv, sinks, window) -> dict:
    "Max |Δ| / max |ref| of out, lse and every gradient: bf16 kernels vs the fp32 reference on the same inputs."
    q, k, v, s = attention_inputs(B, S, Hq, Hkv, dqk, dv, sinks, seed=1)
    out, lse = flash_attention(q, k, v, s, window=window)
    dout = torch.randn_like(out)
    leaves = [q, k, v] + ([s] if s is not None else [])
    grads = torch.autograd.grad((out.float() * dout.float()).sum() + lse.sum(), leaves)
    leaves32 = [t.detach().float().requires_grad_() for t in leaves]
    out_r, lse_r = attention_reference(*leaves32[:3], leaves32[3] if s is not None else None, window=window)
    grads_r = torch.autograd.grad((out_r * dout.float()).sum() + lse_r.sum(), leaves32)
    err = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()
    res = {"out": err(out, out_r), "lse": err(lse, lse_r)}
    res.update({n: err(a, b) for n, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, grads_r)})
    if s is None and window is None:  # and against SDPA's bf16 output
        res["out vs sdpa"] = err(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).float())
    return res


def _sdpa_calls(q, k, v) -> dict:
    """SDPA on the same causal GQA inputs: as dispatched, and with each fused backend forced. The flash backend
    takes one head dim for q, k and v, so at MLA's shape V is padded to Dqk and the output cut back (what a model
    does to use it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    pad = q.shape[-1] - v.shape[-1]

    def call(backend=None):
        def fn():
            vv = F.pad(v, (0, pad)) if pad and backend == SDPBackend.FLASH_ATTENTION else v
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                o = F.scaled_dot_product_attention(q, k, vv, is_causal=True, enable_gqa=True)
            return o[..., :v.shape[-1]]
        return fn
    return {" sdpa causal": call(), " sdpa flash": call(SDPBackend.FLASH_ATTENTION),
            " sdpa cudnn": call(SDPBackend.CUDNN_ATTENTION), " sdpa efficient": call(SDPBackend.EFFICIENT_ATTENTION)}


def _sdpa_choice(q, k, v) -> str:
    "The backend SDPA's dispatcher picks for causal GQA attention on these inputs."
    from torch.nn.attention import SDPBackend
    idx = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=None, enable_gqa=True)
    return next((n for n, b in SDPBackend.__members__.items() if int(b) == idx), str(idx))


def attention_bench(err_len: int = 512) -> dict:
    """fwd and fwd+bwd of flash_attention vs SDPA (bf16, CUDA) at the models' shapes: ms, TFLOP/s, errors. SDPA
    runs as dispatched (`sdpa causal`, its pick printed) and with each fused backend forced (a backend that refuses
    the inputs is left out). `fwd+bwd graph ms` times ours and SDPA as dispatched replayed from a CUDA graph: the
    GPU's time without the host's (launches, descriptors, autograd), which a step whose GPU is busy hides."""
    from triton.testing import do_bench, do_bench_cudagraph
    res = {}
    for name, (B, S, Hq, Hkv, dqk, dv, sinks, window) in ATTENTION_SHAPES.items():
        q, k, v, s = attention_inputs(B, S, Hq, Hkv, dqk, dv, sinks)
        dout = torch.randn(B, Hq, S, dv, device="cuda", dtype=torch.bfloat16)
        leaves = [q, k, v] + ([s] if s is not None else [])
        print(f"{name}: SDPA dispatches to {_sdpa_choice(q.detach(), k.detach(), v.detach())}")
        cases = {"": (lambda: flash_attention(q, k, v, s, window=window)[0], _pairs(S, window), leaves)}
        cases.update({who: (fn, _pairs(S, None), leaves[:3]) for who, fn in _sdpa_calls(q, k, v).items()})
        for who, (fn, pairs, grad_of) in cases.items():
            fl_fwd, fl_bwd = 2 * B * Hq * pairs * (dqk + dv), 2 * B * Hq * pairs * (3 * dqk + 2 * dv)
            try:
                fwd = do_bench(fn, return_mode="median")
            except RuntimeError as e:   # a forced backend that does not take these inputs
                print(f"{name}{who}: not run ({str(e).splitlines()[0][:90]})")
                continue
            both = do_bench(lambda: torch.autograd.grad(fn(), grad_of, dout), return_mode="median")
            res[f"{name}{who} fwd ms"] = fwd
            res[f"{name}{who} fwd TFLOP/s"] = fl_fwd / fwd / 1e9
            res[f"{name}{who} fwd+bwd ms"] = both
            res[f"{name}{who} fwd+bwd TFLOP/s"] = (fl_fwd + fl_bwd) / both / 1e9
            if who in ("", " sdpa causal"):
                res[f"{name}{who} fwd+bwd graph ms"] = do_bench_cudagraph(
                    lambda: torch.autograd.grad(fn(), grad_of, dout), return_mode="median")
        res[f"{name} fwd+bwd graph speed-up vs sdpa causal"] = (res[f"{name} sdpa causal fwd+bwd graph ms"]
                                                                / res[f"{name} fwd+bwd graph ms"])
        res[f"{name} fwd+bwd % of matmul"] = 100 * res[f"{name} fwd+bwd TFLOP/s"] * 1e12 / MATMUL_CEILING
        for who in (" sdpa causal", " sdpa flash"):
            if f"{name}{who} fwd+bwd ms" in res:
                res[f"{name} fwd+bwd speed-up vs{who}"] = res[f"{name}{who} fwd+bwd ms"] / res[f"{name} fwd+bwd ms"]
        del q, k, v, s, dout, leaves
        torch.cuda.empty_cache()
        for what, e in _attention_errors(1, err_len, Hq, Hkv, dqk, dv, sinks, window).items():
            res[f"{name} max err {what}"] = e
    return res


# Linear cross-entropy (ops/13): the fused version does the same three matmuls as eager (6·T·H·V flops), so its floor
# is matmul time; what it removes is the fp32 logits' traffic and memory. Peak memory is measured above the inputs.
def _peak_bytes(fn) -> int:
    "Peak device memory allocated while `fn()` runs, above what was allocated before it."
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def cross_entropy_bench(T: int = 16384, H: int = 2048, V: int = 151936, chunk_size: int | None = None) -> dict:
    "Fused vs eager linear cross-entropy, fwd+bwd in bf16 on CUDA: ms, TFLOP/s, % of matmul ceiling, peak GB."
    from triton.testing import do_bench
    h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::50] = -100
    runs = {"linear_cross_entropy": lambda: linear_cross_entropy(h, w, labels, chunk_size=chunk_size).backward(),
            "eager": lambda: cross_entropy_ref(h, w, labels).backward()}
    res = {}
    for name, run in runs.items():
        h.grad = w.grad = None
        peak = _peak_bytes(run) / 1e9
        ms = do_bench(run, rep=1000, grad_to_none=[h, w], return_mode="median")  # ~15 runs of 50-70 ms
        res[name] = {"ms": ms, "peak GB": peak, "TFLOP/s": 6 * T * H * V / ms / 1e9}
    fused, eager = res["linear_cross_entropy"], res["eager"]
    key = "linear_cross_entropy fwd+bwd"
    return {f"{key} ms": fused["ms"], f"{key} TFLOP/s": fused["TFLOP/s"],
            f"{key} % of matmul": 100 * fused["TFLOP/s"] * 1e12 / MATMUL_CEILING, f"{key} peak GB": fused["peak GB"],
            f"{key} eager ms": eager["ms"], f"{key} eager TFLOP/s": eager["TFLOP/s"],
            f"{key} eager peak GB": eager["peak GB"], f"{key} speed-up": eager["ms"] / fused["ms"],
            f"{key} peak / eager peak": fused["peak GB"] / eager["peak GB"]}


# The command. The list is written out: a new kernel notebook adds its benchmark here.
BENCHES = {"swiglu": swiglu_bench, "permute": permute_bench, "grouped_linear": grouped_linear_bench,
           "attention": attention_bench, "cross_entropy": cross_entropy_bench}


def rows_of(module: str, results: dict) -> list[dict]:
    "One row per measured number of one op's benchmark."
    return [{"module": module, "measure": measure, "value": float(value)} for measure, value in results.items()]


def table(rows: list[dict]) -> str:
    "The rows as one aligned text table, in the order given."
    width = max([len("measure")] + [len(r["measure"]) for r in rows])
    lines = [f"{'module':16s} {'measure':{width}s} {'value':>12s}", "-" * (30 + width)]
    lines += [f"{r['module']:16s} {r['measure']:{width}s} {r['value']:12.3f}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/ops.py",
                                     description="Time every pith_lit kernel against eager PyTorch and the ceilings.")
    parser.add_argument("--json", metavar="PATH", help="also write the rows, GPU and versions to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/ops.py measures GPU kernels and needs a CUDA GPU; none is visible here "
              "(torch.cuda.is_available() is False). Run it on the GPU machine.", file=sys.stderr)
        sys.exit(2)
    rows = []
    for module, bench in BENCHES.items():
        rows += rows_of(module, bench())
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; ceilings: copy {COPY_CEILING / 1e12:.1f} TB/s, bf16 matmul {MATMUL_CEILING / 1e12:.0f} TFLOP/s")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": gpu,
                       "torch": torch.__version__, "triton": triton.__version__, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
