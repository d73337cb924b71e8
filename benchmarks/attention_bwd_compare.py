"""ops/14 against an earlier version of itself, in one process: at each of `BENCH_SHAPES`, the backward alone
(`_bwd` under `do_bench`), its host time per call (50 calls issued back to back) and each of its kernels
(torch.profiler), forward and backward through autograd replayed from a CUDA graph (GPU time alone), then
both versions' `bench()` (forward and forward+backward through autograd, beside SDPA).
Results: benchmarks/RESULTS.md, "Attention backward by TMA". Run on a GPU from the repository root:
    git show b57213c:pith_lit/ops/attention.py > /tmp/attention_old.py
    PYTHONPATH=. OLD=/tmp/attention_old.py python3 benchmarks/attention_bwd_compare.py"""
import importlib.util, os, time
import torch
from triton.testing import do_bench, do_bench_cudagraph
import pith_lit.ops.attention as new


def load_old(path):
    "The file at `path` as a module of pith_lit.ops (so that its relative imports resolve)."
    spec = importlib.util.spec_from_file_location("pith_lit.ops._attention_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def inputs(mod, B, S, Hq, Hkv, dqk, dv, sinks, window):
    "The arguments of mod._bwd at one bench shape, laid out as the models lay them out."
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda H, D: torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16().transpose(1, 2)
    q, k, v = mk(Hq, dqk), mk(Hkv, dqk), mk(Hkv, dv)
    s = torch.randn(Hq, device="cuda", generator=g) if sinks else None
    scale, m, qd, kd = mod._check_args(q, k, v, s, True, window, None, None, None, 0, 0)
    out, lse = mod._fwd(q, k, v, s, m, scale, qd, kd)
    dout = torch.randn(B, Hq, S, dv, device="cuda", generator=g).bfloat16()
    return (q, k, v, s, out, lse, dout, None, m, scale, qd, kd)


def gpu_host_ms(fn):
    "(GPU ms by do_bench, host ms per call over 50 calls queued without a sync) of fn."
    gpu = do_bench(fn, return_mode="median")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    host = (time.perf_counter() - t0) / 50 * 1e3
    torch.cuda.synchronize()
    return gpu, host


def profile(fn, prefix="_attn_bwd"):
    "{kernel: mean ms} of the kernels whose names start with `prefix`, over 10 calls of fn."
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / e.count / 1e3 for e in prof.key_averages()
            if e.device_time_total > 0 and e.key.startswith(prefix)}


def backward_times(mod, args):
    "(GPU ms, host ms per call, {kernel: ms}) of mod._bwd(*args)."
    fn = lambda: mod._bwd(*args)
    return (*gpu_host_ms(fn), profile(fn))


if __name__ == "__main__":
    old = load_old(os.environ["OLD"])
    for shape, (B, S, Hq, Hkv, dqk, dv, sinks, window) in new.BENCH_SHAPES.items():
        for name, mod in (("before", old), ("after", new)):
            gpu, host, kernels = backward_times(mod, inputs(mod, B, S, Hq, Hkv, dqk, dv, sinks, window))
            each = ", ".join(f"{k.removeprefix('_attn_bwd_').removesuffix('_kernel')} {t:.3f}"
                             for k, t in kernels.items())
            print(f"{shape} {name}: backward {gpu:.3f} ms, host {host:.3f} ms/call, {each}", flush=True)
        for name, mod in (("before", old), ("after", new)):  # forward+backward replayed from a CUDA graph
            q, k, v, s = mod._bench_inputs(B, S, Hq, Hkv, dqk, dv, sinks)
            dout = torch.randn(B, Hq, S, dv, device="cuda", dtype=torch.bfloat16)
            leaves = [q, k, v] + ([s] if s is not None else [])
            fn = lambda: torch.autograd.grad(mod.flash_attention(q, k, v, s, window=window)[0], leaves, dout)
            print(f"{shape} {name}: fwd+bwd graph {do_bench_cudagraph(fn, return_mode='median'):.3f} ms", flush=True)
    for name, mod in (("before", old), ("after", new)):
        for k, v in mod.bench().items():
            if (k.endswith(" ms") or "max err" in k) and not any(w in k for w in ("sdpa flash", "cudnn", "efficient")):
                print(f"{name} {k}: {v:.3f}", flush=True)
