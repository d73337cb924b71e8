"""FP8 expert and dense linear layers (pith_lit.ops.fp8) against bf16, on one GPU (written for an H200, torch 2.11,
Triton 3.6). Run from the repository root:

    PYTHONPATH=. python benchmarks/fp8_bench.py [--tokens 16384] [--json /tmp/fp8_bench.json] [--no-sweep]
        [--mlp-only] [--quant-sweep]

For each model's expert shapes (Qwen3-30B-A3B: hidden 2048, expert FFN 768, 128 experts, top-8; DeepSeek-V2-Lite:
hidden 2048, expert FFN 1408, 64 experts, top-6) and each projection (gate/up: hidden -> 2·FFN, down: FFN -> hidden),
with `tokens × top-k` rows from random top-k routing, each expert's rows rounded up to a multiple of 16 (what the
row-wise `torch._scaled_grouped_mm` of the eighth session's table needed, kept so the rows compare; the same counts
for every case):

- forward + backward through autograd (quantization included) of bf16 `F.grouped_mm` and `fp8_grouped_linear` with
  the block-scaled Triton kernels; TFLOP/s count 3 products of
  2·rows·in·out each; relative errors (Frobenius) of y, dx, dw against an fp32 per-expert reference on the same bf16
  inputs;
- the forward GEMM alone on operands quantized beforehand (bf16 grouped_mm, Triton block-scaled), and the
  backward's two Triton GEMMs (input gradient, weight gradient) the same way;
- the quantization passes alone, in GB/s (bytes read + written);
- the whole SwiGLU expert MLP forward + backward: bf16, FP8 with the layers apart, FP8 with SwiGLU fused into the
  quantization passes (`fp8_swiglu_experts`), the weights' FP8 copies made beforehand as in a step;
- a tile sweep of the Triton forward GEMM and weight-gradient GEMM (Qwen3's gate/up shape), printing the best.

Then the dense layer: `fp8_linear` (tests/fp8_linear.py; F.scaled_mm with 1x128 / 128x128 block scales) forward +
backward and the forward `F.scaled_mm` alone, against bf16 `F.linear` / `torch.mm`, at 16K tokens × (2048 -> 4096)
and (4096 -> 2048).

Every case runs inside try/except: a failure prints its error and the rest still runs. Times are medians of
`triton.testing.do_bench`. Nothing here is a test; the numbers go to benchmarks/RESULTS.md with the date and GPU.
"""
import argparse
import datetime
import json
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from pith_lit.ops import fp8
from pith_lit.ops.experts import Fp8Weights
from pith_lit.ops.fp8 import GemmConfig
from tests.fp8_linear import fp8_linear, scaled_mm_blockwise

DEV = "cuda"
MODELS = {"qwen3-30b-a3b": dict(hidden=2048, ffn=768, experts=128, top_k=8),
          "deepseek-v2-lite": dict(hidden=2048, ffn=1408, experts=64, top_k=6)}
SWEEP = [GemmConfig(128, 128, 128, 8, 3), GemmConfig(128, 128, 128, 8, 4), GemmConfig(128, 128, 128, 8, 5),
         GemmConfig(128, 128, 128, 4, 4), GemmConfig(128, 128, 64, 8, 4), GemmConfig(128, 128, 64, 4, 4),
         GemmConfig(64, 128, 128, 4, 4), GemmConfig(128, 256, 128, 8, 3), GemmConfig(256, 128, 128, 8, 3),
         GemmConfig(64, 256, 128, 8, 3)]
ROWS = []


def rel(a, b):
    "‖a − b‖ / ‖b‖ in fp32 (the tensors here are too large for float64 copies to be cheap)."
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def report(group, case, ms=None, flops=None, nbytes=None, errs=None, note=""):
    row = dict(group=group, case=case, ms=ms, tflops=flops / ms / 1e9 if ms and flops else None,
               gbps=nbytes / ms / 1e6 if ms and nbytes else None, **(errs or {}), note=note)
    ROWS.append(row)
    fmt = lambda v, f: format(v, f) if isinstance(v, float) else "-"
    errs_s = " ".join(f"{k}={v:.2e}" for k, v in (errs or {}).items())
    print(f"{group:36s} {case:34s} {fmt(ms, '9.3f')} ms  {fmt(row['tflops'], '7.1f')} TFLOP/s  "
          f"{fmt(row['gbps'], '7.1f')} GB/s  {errs_s} {note}", flush=True)


def run(group, case, fn):
    "Run one case; on failure print the error and go on."
    try:
        fn()
    except Exception as e:  # a benchmark keeps going; the error is printed in full
        report(group, case, note=f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        print("".join(traceback.format_exception(e, limit=-4))[:3000], flush=True)
    torch.cuda.empty_cache()


def routed_counts(tokens, experts, top_k, seed=0):
    "Rows per expert from random top-k routing, each rounded up to a multiple of 16 (int64, on the GPU)."
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.randn(tokens, experts, device=DEV, generator=g).topk(top_k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    return (counts + 15) // 16 * 16


def reference(x, w, counts, dy):
    "y, dx, dw in fp32, one expert at a time, from the bf16 inputs."
    bounds = [0] + counts.cumsum(0).tolist()
    y = torch.empty(x.shape[0], w.shape[1], device=DEV)
    dx = torch.empty(x.shape, device=DEV)
    dw = torch.empty(w.shape, device=DEV)
    for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        xe, we, ge = x[a:b].float(), w[e].float(), dy[a:b].float()
        y[a:b], dx[a:b], dw[e] = xe @ we.T, ge @ we, ge.T @ xe
    return y, dx, dw


def bench_experts(name, shape, tokens, sweep):
    torch.backends.cuda.matmul.allow_tf32 = False
    counts = routed_counts(tokens, shape["experts"], shape["top_k"])
    offs = counts.cumsum(0).to(torch.int32)
    n = int(counts.sum())
    print(f"\n{name}: {tokens} tokens x top-{shape['top_k']} -> {n} rows over {shape['experts']} experts "
          f"(min {int(counts.min())}, max {int(counts.max())} rows per expert)")
    for proj, (n_in, n_out) in {"gate_up": (shape["hidden"], 2 * shape["ffn"]),
                                "down": (shape["ffn"], shape["hidden"])}.items():
        group = f"{name} {proj} {n_in}->{n_out}"
        g = torch.Generator(device=DEV).manual_seed(1)
        x = torch.randn(n, n_in, device=DEV, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(shape["experts"], n_out, n_in, device=DEV, generator=g) / n_in ** 0.5).bfloat16()
        w.requires_grad_()
        dy = torch.randn(n, n_out, device=DEV, generator=g).bfloat16()
        ref = reference(x.detach(), w.detach(), counts, dy)
        flops = 2 * n * n_in * n_out

        def fwd_bwd(case, layer):
            def go():
                y = layer()
                dx, dw = torch.autograd.grad(y, (x, w), dy)
                errs = dict(err_y=rel(y, ref[0]), err_dx=rel(dx, ref[1]), err_dw=rel(dw, ref[2]))
                ms = do_bench(lambda: torch.autograd.grad(layer(), (x, w), dy), return_mode="median")
                report(group, case, ms, 3 * flops, errs=errs)
            run(group, case, go)

        fwd_bwd("bf16 grouped_mm fwd+bwd", lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs))
        fwd_bwd("fp8 triton fwd+bwd", lambda: fp8.fp8_grouped_linear(x, w, counts, impl="triton"))

        xd, wd = x.detach(), w.detach()

        def fwd_only(case, gemm):
            def go():
                y = gemm()
                ms = do_bench(gemm, return_mode="median")
                report(group, case, ms, flops, errs=dict(err_y=rel(y, ref[0])))
            run(group, case, go)

        fwd_only("bf16 grouped_mm fwd GEMM", lambda: F.grouped_mm(xd, wd.transpose(-2, -1), offs=offs))
        q = {}
        run(group, "quantize x and w", lambda: q.update(a=fp8.quantize_act(xd), w=fp8.quantize_weight(wd)))
        if q:
            fwd_only("fp8 triton fwd GEMM",
                     lambda: fp8.fp8_grouped_mm(q["a"].q, q["a"].s, *q["w"], counts, torch.bfloat16))
            # the backward's two GEMMs alone, on operands quantized beforehand (the errors are against dx, dw)
            gq, wt = fp8.quantize_act(dy, counts, cols=True), fp8.quantize_weight(wd, transposed=True)
            aq = fp8.quantize_act(xd, counts, rows=False, cols=True)
            for case, gemm, want in [
                    ("fp8 triton dgrad GEMM", lambda: fp8.fp8_grouped_mm(gq.q, gq.s, *wt, counts, torch.bfloat16),
                     ref[1]),
                    ("fp8 triton wgrad GEMM", lambda: fp8.fp8_grouped_wgrad(gq.qt, gq.st, aq.qt, aq.st, counts,
                                                                           torch.bfloat16), ref[2])]:
                run(group, case, lambda: report(group, case, do_bench(gemm, return_mode="median"), flops,
                                                errs=dict(err=rel(gemm(), want))))

        def quant(case, fn, nbytes):
            run(group, case, lambda: report(group, case, do_bench(fn, return_mode="median"), nbytes=nbytes))
        quant("quantize_act rows+cols", lambda: fp8.quantize_act(xd, counts, rows=True, cols=True),
              n * n_in * (2 + 1 + 1))
        quant("quantize_act rows", lambda: fp8.quantize_act(xd), n * n_in * (2 + 1))
        quant("quantize_weight", lambda: fp8.quantize_weight(wd), wd.numel() * (2 + 1))
        quant("quantize_weight transposed", lambda: fp8.quantize_weight(wd, transposed=True), wd.numel() * (2 + 1))

        if sweep and q and proj == "gate_up" and name == next(iter(MODELS)):
            g8 = fp8.quantize_act(dy, counts, rows=False, cols=True)
            a8 = fp8.quantize_act(xd, counts, rows=False, cols=True)
            for kind, fn in [("fwd GEMM", lambda c: fp8.fp8_grouped_mm(q["a"].q, q["a"].s, *q["w"], counts,
                                                                      torch.bfloat16, c)),
                             ("wgrad GEMM", lambda c: fp8.fp8_grouped_wgrad(g8.qt, g8.st, a8.qt, a8.st, counts,
                                                                           torch.bfloat16, c))]:
                best = None
                for cfg in SWEEP:
                    if kind == "fwd GEMM" and 128 % cfg.block_n:   # one B scale per 128 columns: BN divides 128
                        continue
                    case = f"sweep {kind} {tuple(cfg)}"
                    def go(cfg=cfg, case=case):
                        nonlocal best
                        ms = do_bench(lambda: fn(cfg), return_mode="median")
                        report(group, case, ms, flops)
                        if best is None or ms < best[1]:
                            best = (cfg, ms)
                    run(group, case, go)
                if best:
                    print(f"best {kind}: {best[0]} {best[1]:.3f} ms, {flops / best[1] / 1e9:.1f} TFLOP/s "
                          f"(default {GemmConfig()})")


def mlp_inputs(shape, tokens):
    "counts, x, w_gate_up, w_down (the three needing gradients) and dy of a SwiGLU expert MLP, bf16, seeded."
    counts = routed_counts(tokens, shape["experts"], shape["top_k"])
    n, H, I, E = int(counts.sum()), shape["hidden"], shape["ffn"], shape["experts"]
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(n, H, device=DEV, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * I, H, device=DEV, generator=g) / H ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device=DEV, generator=g) / I ** 0.5).bfloat16().requires_grad_()
    return counts, x, w1, w2, torch.randn(n, H, device=DEV, generator=g).bfloat16()


def bench_mlp(name, shape, tokens):
    """A SwiGLU expert MLP, forward + backward: bf16 (grouped_mm, swiglu, grouped_mm), FP8 with the layers apart
    (`fp8_grouped_linear`, swiglu, `fp8_grouped_linear`) and FP8 fused (`fp8_swiglu_experts`). The FP8 cases use one
    `Fp8Weights` made before timing, as a step's copies: the weights' quantization is not timed."""
    from pith_lit.ops.grouped_linear import grouped_linear
    from pith_lit.ops.swiglu import swiglu
    counts, x, w1, w2, dy = mlp_inputs(shape, tokens)
    n, H, I = x.shape[0], shape["hidden"], shape["ffn"]
    group = f"{name} SwiGLU MLP {H}->{2 * I}->{H}"
    copies = Fp8Weights("block", keep=True)
    c1, c2 = copies.weight("gate_up", w1), copies.weight("down", w2)
    cases = {"bf16": lambda: grouped_linear(swiglu(grouped_linear(x, w1, counts)), w2, counts),
             "fp8 apart": lambda: fp8.fp8_grouped_linear(swiglu(fp8.fp8_grouped_linear(x, w1, counts, weight=c1)),
                                                         w2, counts, weight=c2),
             "fp8 fused": lambda: fp8.fp8_swiglu_experts(x, w1, w2, counts, weight_gate_up=c1, weight_down=c2)}
    outs = {}
    for case, mlp in cases.items():
        def go(case=case, mlp=mlp):
            y = mlp()
            outs[case] = [y.detach(), *torch.autograd.grad(y, (x, w1, w2), dy)]
            errs = {} if case == "bf16" else {
                f"err_{k}": rel(a, b) for k, a, b in zip(("y", "dx", "dw1", "dw2"), outs[case], outs["bf16"])}
            if case == "fp8 fused" and "fp8 apart" in outs:
                errs["vs_apart"] = max(rel(a, b) for a, b in zip(outs[case], outs["fp8 apart"]))
            ms = do_bench(lambda: torch.autograd.grad(mlp(), (x, w1, w2), dy), return_mode="median")
            report(group, f"{case} fwd+bwd", ms, 6 * n * H * 2 * I + 6 * n * I * H, errs=errs)
        run(group, case, go)


def bench_quant_sweep(name, shape, tokens, warps=(4, 8, 16)):
    "quantize_act's passes at each warp count (`fp8.QUANT_WARPS`), GB/s of bytes read + written."
    counts = routed_counts(tokens, shape["experts"], shape["top_k"])
    n, H, I = int(counts.sum()), shape["hidden"], shape["ffn"]
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(n, H, device=DEV, generator=g).bfloat16()
    gate_up = torch.randn(n, 2 * I, device=DEV, generator=g).bfloat16()
    dh = torch.randn(n, I, device=DEV, generator=g).bfloat16()
    passes = {f"x rows+cols ({H})": (lambda: fp8.quantize_act(x, counts, cols=True), n * H * 4),
              f"x rows ({H})": (lambda: fp8.quantize_act(x, counts), n * H * 3),
              f"swiglu rows+cols ({I})": (lambda: fp8.quantize_act(gate_up, counts, cols=True, act="swiglu"),
                                          n * I * 6),
              f"swiglu_grad rows+cols ({2 * I})": (lambda: fp8.quantize_act(gate_up, counts, cols=True,
                                                                            act="swiglu_grad", dh=dh), n * I * 10)}
    default = fp8.QUANT_WARPS
    for w in warps:
        fp8.QUANT_WARPS = w
        for case, (fn, nbytes) in passes.items():
            run(f"{name} quantize_act", f"{case} {w} warps",
                lambda: report(f"{name} quantize_act", f"{case} {w} warps", do_bench(fn, return_mode="median"),
                               nbytes=nbytes))
    fp8.QUANT_WARPS = default


def bench_dense(tokens):
    for n_in, n_out in [(2048, 4096), (4096, 2048)]:
        group = f"dense {tokens}x{n_in}->{n_out}"
        g = torch.Generator(device=DEV).manual_seed(2)
        x = torch.randn(tokens, n_in, device=DEV, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(n_out, n_in, device=DEV, generator=g) / n_in ** 0.5).bfloat16().requires_grad_()
        dy = torch.randn(tokens, n_out, device=DEV, generator=g).bfloat16()
        xf, wf, gf = x.detach().float(), w.detach().float(), dy.float()
        ref = (xf @ wf.T, gf @ wf, gf.T @ xf)
        flops = 2 * tokens * n_in * n_out
        for case, layer in [("bf16 linear fwd+bwd", lambda: F.linear(x, w)),
                            ("fp8_linear scaled_mm fwd+bwd", lambda: fp8_linear(x, w, impl="scaled_mm"))]:
            def go(layer=layer, case=case):
                y = layer()
                dx, dw = torch.autograd.grad(y, (x, w), dy)
                errs = dict(err_y=rel(y, ref[0]), err_dx=rel(dx, ref[1]), err_dw=rel(dw, ref[2]))
                ms = do_bench(lambda: torch.autograd.grad(layer(), (x, w), dy), return_mode="median")
                report(group, case, ms, 3 * flops, errs=errs)
            run(group, case, go)
        xd, wd = x.detach(), w.detach()
        def go_mm():
            ms = do_bench(lambda: torch.mm(xd, wd.T), return_mode="median")
            report(group, "bf16 mm fwd GEMM", ms, flops, errs=dict(err_y=rel(torch.mm(xd, wd.T), ref[0])))
        run(group, "bf16 mm fwd GEMM", go_mm)
        def go_scaled():
            a, (qw, sw) = fp8.quantize_act(xd), fp8.quantize_weight(wd)
            gemm = lambda: scaled_mm_blockwise(a.q, a.s, qw, sw)
            ms = do_bench(gemm, return_mode="median")
            report(group, "F.scaled_mm 1x128/128x128 fwd GEMM", ms, flops, errs=dict(err_y=rel(gemm(), ref[0])))
        run(group, "F.scaled_mm 1x128/128x128 fwd GEMM", go_scaled)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (rows = tokens x top-k)")
    parser.add_argument("--json", help="also write the rows, with the GPU and versions, to this file")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument("--mlp-only", action="store_true", help="only the SwiGLU expert MLPs")
    parser.add_argument("--quant-sweep", action="store_true", help="also time quantize_act at 4, 8 and 16 warps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_bench needs a CUDA GPU (sm90 for the FP8 tensor cores)")
    env = dict(gpu=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability(),
               torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat(),
               tokens=args.tokens)
    print(env)
    for name in args.models.split(","):
        if not args.mlp_only:
            run(name, "setup", lambda: bench_experts(name, MODELS[name], args.tokens, not args.no_sweep))
        run(name, "setup", lambda: bench_mlp(name, MODELS[name], args.tokens))
        if args.quant_sweep:
            run(name, "setup", lambda: bench_quant_sweep(name, MODELS[name], args.tokens))
    if not args.mlp_only:
        run("dense", "setup", lambda: bench_dense(args.tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=ROWS), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
