"""FP8 experts with one scale per row (ops/15 `scaling="rows"`) against block scales and bf16, on one GPU (written for
an H200, torch 2.11, Triton 3.6). Run from the repository root:

    PYTHONPATH=. python3 benchmarks/fp8_rows.py [--tokens 16384] [--json /tmp/fp8_rows.json] [--parts gemm,mlp,quant]
        [--only qwen3-235b-a22b,...]     (--parts resources: no GPU needed)

At each model's expert shapes (`benchmarks/fp8_bench.py`'s MODELS and routing), `do_bench` medians:

- `gemm`: each of the three products alone, on operands quantized beforehand: bf16 `F.grouped_mm`, block scales
  (`fp8_grouped_mm`, `fp8_grouped_wgrad`), and row scales at several tiles, each with the tensor cores' partial sums
  promoted into fp32 never (`promote=None`, Triton's default on sm90) or every `promote` of K. `acc_err` is the
  relative error of a product against float64 of the same quantized operands (so it measures the accumulation
  alone), `err` against fp32 of the bf16 inputs (so it includes the quantization);
- `mlp`: a SwiGLU expert MLP forward + backward, bf16 against `fp8_swiglu_experts` with block and with row scales,
  with the weights' FP8 copies made beforehand (a step of several micro-batches) and made inside (a step of one);
  errors against the bf16 MLP, peak memory above the inputs;
- `quant`: the row-scaled quantization passes alone, in GB/s of bytes read and written;
- `wgrad`: the row recipe's weight gradient `dYᵀ B` (B the layer's input: X, or SwiGLU's output h) two ways: the
  columns of dY and of B each quantized per expert, or the columns of `dY ⊙ s_B` times B's FP8 rows transposed (the
  package's), each with and without promotion; `err` against float64 of the unquantized operands, `acc_err`
  against float64 of the same quantized operands, on the first four experts;
- `dense`: the dense projections of one attention layer (q, k and v stacked on one input, then o) at the three widths
  of issue 43 (`DENSE`), forward + backward: bf16 `F.linear` against ops/15 `fp8_linear` with row scales, and
  `fp8_linear`'s quantization passes alone (the GEMMs' share is the rest);
- `densekernels`: `fp8_linear` forward + backward at the same shapes under `torch.profiler`, each GPU kernel's time
  per call, largest first (which of its passes and GEMMs a dense layer's time goes to);
- `weights`: the weight passes a step of one micro-batch runs at the three widths of issue 43 (`WEIGHTS`: the
  experts' gate_up and down, the dense projections in FP8 under the 4096 gate), each layout alone as the forward and
  the backward make them (the transposed one also given the forward's scales, as the experts' backward is), at each
  rows-per-program and warp count of `quantize_weight_rows`'s two loops, and the forward layout with whole rows in
  one tile (`fp8.WEIGHT_ROW_TILE`) at each tile size and warp count; GB/s counts what the pass must move, 2 bytes
  read and 1 written per element (a second read of a block that falls out of L2 shows as a lower figure);
- `rowsweep`: the row passes a SwiGLU expert MLP runs, at each rows-per-program and warp count of `quantize_rows`
  (`fp8.ROWS_BM`, `fp8.ROWS_WARPS`), by two loops over K and with whole rows (`fp8.ROWS_WHOLE`), at
  `MODELS`' widths and the wide ones of issue 43 (`WIDE`), and the weight pass writing both layouts at each of its own
  (`fp8.WEIGHT_ROWS`, `fp8.WEIGHT_ROWS_WARPS`).
- `resources` (no GPU needed): each setting `weights` and `rowsweep` time, and the row-scaled GEMMs at `gemm`'s
  tiles, compiled for sm90 by the Triton installed here as the launcher specialises them: registers and stack bytes
  (spills) a thread, from `cuobjdump --dump-resource-usage` of the cubin, and shared memory a program.

In `weights` and `rowsweep` each case's note says whether the pass under that setting wrote the same bits as under
the package's own (`agreement`): "same", or "DIFFERS" and the parts that differ.

Every case runs inside try/except (fp8_bench's `run`). Nothing here is a test; the numbers go to RESULTS.md.
"""
import argparse
import datetime
import json

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from benchmarks.fp8_bench import DEV, MODELS, ROWS, mlp_inputs, reference, rel, report, routed_counts, run
from pith_lit.ops import fp8
from pith_lit.ops.experts import Fp8Weights
from pith_lit.ops.fp8 import GemmConfig, fp8_linear

TILES = [GemmConfig(128, 128, 128, 8, 4), GemmConfig(128, 128, 128, 8, 3), GemmConfig(128, 256, 128, 8, 3),
         GemmConfig(128, 256, 64, 8, 4), GemmConfig(256, 128, 128, 8, 3), GemmConfig(64, 256, 128, 4, 4)]
PROMOTED = [GemmConfig(128, 128, 128, 8, 4, 128), GemmConfig(128, 128, 256, 8, 3, 256),
            GemmConfig(128, 256, 128, 8, 3, 128)]


def expert_cols(qt, counts, i):
    "Expert i's columns of a column layout (`quantize_act(..., cols=True)`, `quantize_rows(..., trans=True)`), float64."
    tile = int(((counts[:i] + 127) // 128).sum())
    return qt[:, 128 * tile:128 * tile + int(counts[i])].double()


def bench_gemms(name, shape, tokens):
    torch.backends.cuda.matmul.allow_tf32 = False
    counts = routed_counts(tokens, shape["experts"], shape["top_k"])
    offs = counts.cumsum(0).to(torch.int32)
    n, E = int(counts.sum()), shape["experts"]
    few = int(counts[:4].sum())                                   # rows of the first four experts, for float64
    for proj, (n_in, n_out) in {"gate_up": (shape["hidden"], 2 * shape["ffn"]),
                                "down": (shape["ffn"], shape["hidden"])}.items():
        group = f"{name} {proj} {n_in}->{n_out}"
        g = torch.Generator(device=DEV).manual_seed(1)
        x = torch.randn(n, n_in, device=DEV, generator=g).bfloat16()
        w = (torch.randn(E, n_out, n_in, device=DEV, generator=g) / n_in ** 0.5).bfloat16()
        dy = torch.randn(n, n_out, device=DEV, generator=g).bfloat16()
        ref = reference(x, w, counts, dy)
        flops = 2 * n * n_in * n_out

        def case(label, fn, want, exact=None):
            def go():
                out = fn()
                errs = dict(err=rel(out, want))
                if exact is not None:
                    errs["acc_err"] = rel(out[:few] if out.dim() == 2 else out[:4], exact)
                report(group, label, do_bench(fn, return_mode="median"), flops, errs=errs)
            run(group, label, go)

        case("bf16 fwd", lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs), ref[0])
        case("bf16 dgrad", lambda: F.grouped_mm(dy, w, offs=offs), ref[1])
        case("bf16 wgrad", lambda: F.grouped_mm(dy.t(), x, offs=offs), ref[2])
        a, wq = fp8.quantize_act(x), fp8.quantize_weight(w)
        gq, wt = fp8.quantize_act(dy, counts, cols=True), fp8.quantize_weight(w, transposed=True)
        ac = fp8.quantize_act(x, counts, rows=False, cols=True)
        case("block fwd", lambda: fp8.fp8_grouped_mm(a.q, a.s, *wq, counts, torch.bfloat16), ref[0])
        case("block dgrad", lambda: fp8.fp8_grouped_mm(gq.q, gq.s, *wt, counts, torch.bfloat16), ref[1])
        case("block wgrad", lambda: fp8.fp8_grouped_wgrad(gq.qt, gq.st, ac.qt, ac.st, counts, torch.bfloat16), ref[2])
        # row scales: the operands, and float64 products of the quantized operands on the first four experts' rows
        r, (qw, sw) = fp8.quantize_rows(x, counts, trans=True), fp8.quantize_weight_rows(w)
        qwt, _ = fp8.quantize_weight_rows(w, transposed=True)
        rg = fp8.quantize_rows(dy, counts, mult=sw, col_amax=True, row_mult=r.s)
        gt, sg = fp8._group_cols(dy, counts, rg.col_amax, r.s)  # columns of dY ⊙ s_X; B is X's FP8 rows transposed
        d = lambda t: t.double()
        bounds = [0] + counts[:4].cumsum(0).tolist()
        ex_fwd = torch.cat([(d(r.q[a:b]) * d(r.s[a:b, None])) @ (d(qw[i]) * d(sw[i])[:, None]).T
                            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
        ex_dgrad = torch.cat([(d(rg.q[a:b]) * d(rg.s[a:b, None])) @ d(qw[i])
                              for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])
        ex_wgrad = torch.stack([(expert_cols(gt, counts, i) * d(sg[i])[:, None]) @ expert_cols(r.qt, counts, i).T
                                for i in range(4)])
        for cfg in TILES + PROMOTED:
            tag = f"{tuple(cfg[:5])} promote {cfg.promote}"
            case(f"rows fwd {tag}", lambda: fp8.fp8_grouped_mm(r.q, r.s, qw, sw, counts, torch.bfloat16, cfg),
                 ref[0], ex_fwd)
            case(f"rows dgrad {tag}", lambda: fp8.fp8_grouped_mm(rg.q, rg.s, qwt, None, counts, torch.bfloat16, cfg),
                 ref[1], ex_dgrad)
            if cfg.block_k <= 128:
                case(f"rows wgrad {tag}", lambda: fp8.fp8_grouped_wgrad(gt, sg, r.qt, None, counts, torch.bfloat16,
                                                                        cfg, group_scales=True), ref[2], ex_wgrad)


def bench_mlp(name, shape, tokens):
    from pith_lit.ops.grouped_linear import grouped_linear
    from pith_lit.ops.swiglu import swiglu
    counts, x, w1, w2, dy = mlp_inputs(shape, tokens)
    n, H, I = x.shape[0], shape["hidden"], shape["ffn"]
    group = f"{name} SwiGLU MLP {H}->{2 * I}->{H}"
    flops = 6 * n * H * 2 * I + 6 * n * I * H

    def fp8_mlp(scaling, fresh):
        kept = Fp8Weights(scaling, keep=True)
        def mlp():
            c = Fp8Weights(scaling, keep=True) if fresh else kept
            return fp8.fp8_swiglu_experts(x, w1, w2, counts, weight_gate_up=c.weight("gate_up", w1),
                                          weight_down=c.weight("down", w2), scaling=scaling)
        return mlp

    cases = {"bf16": lambda: grouped_linear(swiglu(grouped_linear(x, w1, counts)), w2, counts)}
    for scaling in fp8.SCALINGS:
        cases[f"fp8 {scaling}, copies kept"] = fp8_mlp(scaling, False)
        cases[f"fp8 {scaling}, weights quantized inside"] = fp8_mlp(scaling, True)
    outs = {}
    for label, mlp in cases.items():
        def go(label=label, mlp=mlp):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            y = mlp()
            outs[label] = [y.detach(), *torch.autograd.grad(y, (x, w1, w2), dy)]
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
            errs = {} if label == "bf16" else {
                f"err_{k}": rel(a, b) for k, a, b in zip(("y", "dx", "dw1", "dw2"), outs[label], outs["bf16"])}
            ms = do_bench(lambda: torch.autograd.grad(mlp(), (x, w1, w2), dy), return_mode="median")
            report(group, f"{label} fwd+bwd", ms, flops, errs=errs, note=f"peak +{peak:.2f} GiB")
        run(group, label, go)


def bench_quant(name, shape, tokens):
    counts = routed_counts(tokens, shape["experts"], shape["top_k"])
    n, H, I, E = int(counts.sum()), shape["hidden"], shape["ffn"], shape["experts"]
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(n, H, device=DEV, generator=g).bfloat16()
    gate_up = torch.randn(n, 2 * I, device=DEV, generator=g).bfloat16()
    w = torch.randn(E, 2 * I, H, device=DEV, generator=g).bfloat16()
    mult = fp8.pow2_scale(torch.rand(E, H, device=DEV) + 0.5)
    s = fp8.pow2_scale(torch.rand(n, device=DEV) + 0.5)                    # another operand's row scales
    r = fp8.quantize_rows(x, counts, col_amax=True, row_mult=s)
    group = f"{name} row passes"
    for label, fn, nbytes in [
            (f"quantize_rows x ({H})", lambda: fp8.quantize_rows(x, counts), n * H * 3),
            (f"quantize_rows x, trans ({H})", lambda: fp8.quantize_rows(x, counts, trans=True), n * H * 4),
            (f"quantize_rows x, mult, col_amax ({H})",
             lambda: fp8.quantize_rows(x, counts, mult=mult, col_amax=True, row_mult=s), n * H * 3),
            (f"quantize_rows swiglu ({I})", lambda: fp8.quantize_rows(gate_up, counts, act="swiglu"), n * I * 5),
            (f"quantize_rows swiglu, trans ({I})", lambda: fp8.quantize_rows(gate_up, counts, act="swiglu", trans=True),
             n * I * 6),
            (f"columns per expert x ({H})", lambda: fp8._group_cols(x, counts, r.col_amax, s), n * H * 3),
            (f"quantize_act rows+cols x ({H})", lambda: fp8.quantize_act(x, counts, cols=True), n * H * 4),
            ("quantize_weight_rows w1", lambda: fp8.quantize_weight_rows(w), w.numel() * 3),
            ("quantize_weight_rows w1 transposed", lambda: fp8.quantize_weight_rows(w, True), w.numel() * 3),
            ("quantize_weight_rows w1 both", lambda: fp8.quantize_weight_rows(w, "both"), w.numel() * 4),
            ("quantize_weight w1 (blocks)", lambda: fp8.quantize_weight(w), w.numel() * 3),
            ("quantize_weight w1 (blocks) transposed", lambda: fp8.quantize_weight(w, True), w.numel() * 3),
            ("quantize_weight w1 (blocks) both", lambda: fp8.quantize_weight(w, "both"), w.numel() * 4)]:
        run(group, label, lambda: report(group, label, do_bench(fn, return_mode="median"), nbytes=nbytes))


def agreement(got, want, used=None) -> str:
    """"same" when a pass under a sweep's setting wrote what it writes under the package's, bit for bit, wherever it
    defines its output (an `Fp8Rows`' q, s and column maxima, its transpose's first `used` columns; a weight pass's
    values and scales), else "DIFFERS: " and the parts that differ."""
    def parts(r):
        if isinstance(r, fp8.Fp8Rows):
            return {"q": r.q, "s": r.s, "col_amax": r.col_amax, "qt": None if r.qt is None else r.qt[:, :used]}
        return {"values": r[0], "scales": r[1]}
    bits = lambda t: t.view(torch.uint8) if t.dtype == fp8.FP8 else t
    bad = [k for (k, a), b in zip(parts(got).items(), parts(want).values())
           if (a is None) != (b is None) or a is not None and not torch.equal(bits(a), bits(b))]
    return "DIFFERS: " + ", ".join(bad) if bad else "same"


ROW_CASES = [(32, 4, 0), (32, 8, 0), (16, 4, 0), (64, 8, 0), (32, 4, 8192), (32, 8, 8192)]   # (ROWS_BM, ROWS_WARPS,
                                                                                           #  ROWS_WHOLE)
WIDE = {"qwen3-235b-a22b": dict(hidden=4096, ffn=1536, experts=128, top_k=8),   # rowsweep's widths of issue 43 too
        "deepseek-v3": dict(hidden=7168, ffn=2048, experts=64, top_k=8)}        # (V3 cut to 64 experts, as in e2e)


def bench_rowsweep(name, shape, tokens):
    counts, x, w1, _, dy = mlp_inputs(shape, tokens)
    x, w1, n, H, I, E = x.detach(), w1.detach(), x.shape[0], shape["hidden"], shape["ffn"], shape["experts"]
    g = torch.Generator(device=DEV).manual_seed(5)
    gate_up = torch.randn(n, 2 * I, device=DEV, generator=g).bfloat16()
    dh = torch.randn(n, I, device=DEV, generator=g).bfloat16()
    s = fp8.pow2_scale(torch.rand(n, device=DEV) + 0.5)                    # another operand's row scales
    mult_h, mult_i = (fp8.pow2_scale(torch.rand(E, k, device=DEV) + 0.5) for k in (H, 2 * I))
    passes = {f"x, trans ({H})": (lambda: fp8.quantize_rows(x, counts, trans=True), n * H * 4),
              f"swiglu, trans ({I})": (lambda: fp8.quantize_rows(gate_up, counts, act="swiglu", trans=True), n * I * 6),
              f"dy, mult, col_amax ({H})": (lambda: fp8.quantize_rows(dy, counts, mult=mult_h, col_amax=True,
                                                                       row_mult=s), n * H * 3),
              f"swiglu_grad, mult, col_amax ({2 * I})": (lambda: fp8.quantize_rows(
                  gate_up, counts, act="swiglu_grad", dh=dh, mult=mult_i, col_amax=True, row_mult=s), n * I * 8)}
    default = fp8.ROWS_BM, fp8.ROWS_WARPS, fp8.ROWS_WHOLE
    used = 128 * int(((counts + 127) // 128).sum())                  # the columns of qt the experts' tiles fill
    want = {label: fn() for label, (fn, _) in passes.items()}         # the package's settings
    try:
        for bm, warps, whole in ROW_CASES:
            fp8.ROWS_BM, fp8.ROWS_WARPS, fp8.ROWS_WHOLE = bm, warps, whole
            case = f"{bm} rows, {warps} warps" + (f", whole rows up to {whole}" if whole else ", two loops")
            for label, (fn, nbytes) in passes.items():
                group = f"{name} quantize_rows {label}"
                run(group, case, lambda: report(group, case, do_bench(fn, return_mode="median"), nbytes=nbytes,
                                                note=agreement(fn(), want[label], used)))
    finally:
        fp8.ROWS_BM, fp8.ROWS_WARPS, fp8.ROWS_WHOLE = default
    default = fp8.WEIGHT_ROWS, fp8.WEIGHT_ROWS_WARPS             # the weight pass writing both layouts
    group = f"{name} quantize_weight_rows w1 both"
    try:
        for rows, warps in [(64, 8), (32, 4), (32, 8), (64, 4), (128, 8), (16, 4)]:
            fp8.WEIGHT_ROWS, fp8.WEIGHT_ROWS_WARPS = rows, warps
            run(group, f"{rows} rows, {warps} warps", lambda: report(
                group, f"{rows} rows, {warps} warps", do_bench(lambda: fp8.quantize_weight_rows(w1, "both"),
                                                               return_mode="median"), nbytes=w1.numel() * 4))
    finally:
        fp8.WEIGHT_ROWS, fp8.WEIGHT_ROWS_WARPS = default


# (E, N, K) of each weight, w (E, N, K); E = 1: a dense projection's (N, K)
WEIGHTS = {"qwen3-30b-a3b": {"gate_up": (128, 1536, 2048), "down": (128, 2048, 768)},
           "qwen3-235b-a22b": {"gate_up": (128, 3072, 4096), "down": (128, 4096, 1536), "q": (1, 8192, 4096),
                               "o": (1, 4096, 8192)},
           "deepseek-v3": {"gate_up": (64, 4096, 7168), "down": (64, 7168, 2048), "o": (1, 7168, 16384),
                           "dense gate_up": (1, 36864, 7168), "dense down": (1, 7168, 18432)}}
WEIGHT_SWEEP = [(64, 8), (32, 8), (32, 4), (16, 4), (16, 2), (8, 4), (8, 2), (128, 8)]
WHOLE_SWEEP = [(16384, 8), (8192, 4), (8192, 8), (16384, 4), (16384, 16), (32768, 16)]   # (WEIGHT_ROW_TILE, warps)


# The row quantizers' arguments as `triton.compile` takes them (sm90), and the constexprs of each row pass
WEIGHT_ARGS = {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32", "N": "i32", "K": "i32",
               "s_e": "i32", "s_n": "i32", "s_k": "i32"}
ROW_ARGS = {"x_ptr": "*bf16", "dh_ptr": "*bf16", "mult_ptr": "*fp32", "rmult_ptr": "*fp32", "q_ptr": "*fp8e4nv",
            "s_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "amax_ptr": "*fp32", "row_offs_ptr": "*i32",
            "tile_offs_ptr": "*i32", "M": "i32", "K": "i32", "E": "i32", "LDT": "i32"}
ROW_PASSES = {   # name: (constexprs, the width K it quantizes from a shape's hidden size H and expert width I)
    "x, trans": (dict(MULT=False, RMULT=False, AMAX=False, ROWS=True, TRANS=True, ACT=0), lambda H, I: H),
    "swiglu, trans": (dict(MULT=False, RMULT=False, AMAX=False, ROWS=True, TRANS=True, ACT=1), lambda H, I: I),
    "dy, mult, col_amax": (dict(MULT=True, RMULT=True, AMAX=True, ROWS=True, TRANS=False, ACT=0), lambda H, I: H),
    "swiglu_grad, mult, col_amax": (dict(MULT=True, RMULT=True, AMAX=True, ROWS=True, TRANS=False, ACT=2),
                                    lambda H, I: 2 * I),
    "the transpose alone": (dict(MULT=False, RMULT=False, AMAX=False, ROWS=False, TRANS=True, ACT=0),
                            lambda H, I: H)}


def compile_sm90(kernel, types, constexprs, warps, stages=3):
    """`kernel` compiled for sm90 (an H100 or H200) down to its cubin by the Triton installed here; no GPU needed.
    Every argument in `types` is specialised as the launcher specialises it at the real shapes: pointers 16-byte
    aligned and integers multiples of 16 (`tt.divisibility`), which lets the compiler vectorise and pipeline loads;
    without it the code (and its registers) would be another kernel's."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = dict(types, **{name: "constexpr" for name in constexprs})
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in types}
    return triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def resources(kernel, types, constexprs, warps, stages=3) -> str:
    """Registers a thread, stack bytes a thread (where spills go) and shared memory a program of the compiled kernel,
    from cuobjdump and the compiler."""
    import os
    import re
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    compiled = compile_sm90(kernel, types, constexprs, warps, stages)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return f"{regs} registers, {stack} B stack, {compiled.metadata.shared} B shared"


GEMM_ARGS = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16",
             "row_offs_ptr": "*i32", "tile_offs_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "E": "i32"}
WGRAD_ARGS = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16",
              "tile_offs_ptr": "*i32", "M": "i32", "N": "i32", "LD": "i32"}


def bench_resources(name, shape, weights):
    """What Triton's compiler makes of each setting `weights` and `rowsweep` time, at `shape`'s widths, and of the
    row-scaled GEMMs at the tiles `gemm` times (no GPU): registers a thread, which with the warps set how many
    programs share an SM, stack bytes, where spilled registers go, and shared memory (a GEMM's pipelined stages)."""
    for cfg in dict.fromkeys([fp8.ROW_GEMM] + TILES):
        case = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}, {cfg.warps} warps, {cfg.stages} stages"
        for kernel, args, ce in ((fp8._fp8_gemm_kernel, GEMM_ARGS, dict(E_P2=fp8._e_p2(shape["experts"]), EVEN_K=True,
                                                                         ROW_SCALES=True)),
                                 (fp8._fp8_wgrad_kernel, WGRAD_ARGS, dict(GROUP_SCALES=True))):
            ce = dict(ce, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, HAS_SB=True, PROMOTE=None)
            group = f"{name} {kernel.__name__.strip('_')}"
            run(group, case, lambda: report(group, case, note=resources(kernel, args, ce, cfg.warps, cfg.stages)))
    for wname, (E, N, K) in weights.items():
        kp2 = triton.next_power_of_2(K)
        for layout, given in ((False, False), (True, False), (True, True)):
            group = f"{name} {wname} " + ("transposed" if layout else "forward") + (", scales given" if given else "")
            for rows, warps in WEIGHT_SWEEP:
                ce = dict(FWD=not layout, TRANS=layout, BN=rows, GIVEN=given, KP2=0)
                run(group, f"{rows} rows, {warps} warps", lambda: report(
                    group, f"{rows} rows, {warps} warps", note=resources(fp8._quant_weight_rows_kernel,
                                                                         WEIGHT_ARGS, ce, warps)))
            for tile, warps in WHOLE_SWEEP if not layout else ():
                if kp2 > tile:
                    continue
                ce = dict(FWD=True, TRANS=False, BN=tile // kp2, GIVEN=False, KP2=kp2)
                case = f"whole rows, {tile} elements, {warps} warps"
                run(group, case, lambda: report(group, case, note=resources(fp8._quant_weight_rows_kernel,
                                                                           WEIGHT_ARGS, ce, warps)))
    for label, (ce, width) in ROW_PASSES.items():
        K = width(shape["hidden"], shape["ffn"])
        group = f"{name} quantize_rows {label} ({K})"
        for bm, warps, whole in ROW_CASES:
            kp2 = fp8._rows_kp2(K, ce["TRANS"], whole)
            if whole and not kp2:                             # the package runs this pass by the two loops
                continue
            case = f"{bm} rows, {warps} warps" + (f", whole rows up to {whole}" if whole else ", two loops")
            args = dict(ce, E_P2=fp8._e_p2(shape["experts"]), BM=bm, KP2=kp2)
            run(group, case, lambda: report(group, case, note=resources(fp8._quant_rows_kernel, ROW_ARGS, args,
                                                                        warps)))


def bench_weights(name, weights):
    """Each weight's forward and transposed pass alone at each (rows per program, warps) of `WEIGHT_SWEEP` (two loops
    over K); the forward layout also with whole rows in a tile, at each (elements per program, warps) of
    `WHOLE_SWEEP`."""
    default = (fp8.WEIGHT_ROWS, fp8.WEIGHT_ROWS_GIVEN, fp8.WEIGHT_ROWS_WARPS, fp8.WEIGHT_ROW_TILE,
               fp8.WEIGHT_ROW_TILE_WARPS)
    g = torch.Generator(device=DEV).manual_seed(3)
    try:
        for wname, (E, N, K) in weights.items():
            w = (torch.randn(E, N, K, device=DEV, generator=g) * 0.02).bfloat16()
            w = w if E > 1 else w[0]
            scales = fp8.quantize_weight_rows(w)[1]
            for layout, given in ((False, None), (True, None), (True, scales)):   # the backward's: given the scales
                what = ("transposed" if layout else "forward") + (", scales given" if given is not None else "")
                group = f"{name} {wname} {what} {E}x{N}x{K}"
                fn = lambda: fp8.quantize_weight_rows(w, layout, scales=given)
                (fp8.WEIGHT_ROWS, fp8.WEIGHT_ROWS_GIVEN, fp8.WEIGHT_ROWS_WARPS, fp8.WEIGHT_ROW_TILE,
                 fp8.WEIGHT_ROW_TILE_WARPS) = default
                want = fn()                                                # the package's settings
                fp8.WEIGHT_ROW_TILE = 0
                time_it = lambda case: run(group, case, lambda: report(
                    group, case, do_bench(fn, return_mode="median"), nbytes=w.numel() * 3, note=agreement(fn(), want)))
                for rows, warps in WEIGHT_SWEEP:
                    fp8.WEIGHT_ROWS = fp8.WEIGHT_ROWS_GIVEN = rows
                    fp8.WEIGHT_ROWS_WARPS = warps
                    time_it(f"{rows} rows, {warps} warps")
                for tile, warps in WHOLE_SWEEP if not layout and given is None else ():
                    fp8.WEIGHT_ROW_TILE, fp8.WEIGHT_ROW_TILE_WARPS = tile, warps
                    if triton.next_power_of_2(K) <= tile:
                        time_it(f"whole rows, {tile} elements, {warps} warps")
            del w
    finally:
        (fp8.WEIGHT_ROWS, fp8.WEIGHT_ROWS_GIVEN, fp8.WEIGHT_ROWS_WARPS, fp8.WEIGHT_ROW_TILE,
         fp8.WEIGHT_ROW_TILE_WARPS) = default


def bench_wgrad(name, shape, tokens):
    from pith_lit.ops.swiglu import swiglu
    counts, x, w1, _, dy = mlp_inputs(shape, tokens)
    x, w1 = x.detach(), w1.detach()
    gate_up = F.grouped_mm(x, w1.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    bounds = [0] + counts[:4].cumsum(0).tolist()
    d = lambda t: t.double()
    for operand, src, act, b in [("x", x, None, x), ("h", gate_up, "swiglu", swiglu(gate_up))]:
        group = f"{name} wgrad dY^T {operand} ({dy.shape[1]}x{b.shape[1]})"
        exact = torch.stack([d(dy[a:c]).T @ d(b[a:c]) for a, c in zip(bounds[:-1], bounds[1:])])
        flops = 2 * dy.shape[0] * dy.shape[1] * b.shape[1]
        rb = fp8.quantize_rows(src, counts, act=act, col_amax=True, trans=True)
        rg = fp8.quantize_rows(dy, counts, col_amax=True)                       # both operands by columns
        gc, sg = fp8._group_cols(dy, counts, rg.col_amax, None)
        bc, sb = fp8._group_cols(src, counts, rb.col_amax, None, act=act)
        rf = fp8.quantize_rows(dy, counts, col_amax=True, row_mult=rb.s)         # dY ⊙ s_B by columns, B's rows
        fc, sf = fp8._group_cols(dy, counts, rf.col_amax, rb.s)
        cols = lambda qt, s, i: expert_cols(qt, counts, i) * (1 if s is None else d(s[i])[:, None])
        ways = {"columns of dY and B": (gc, sg, bc, sb), "columns of dY*s_B, B's rows": (fc, sf, rb.qt, None)}
        for way, ops in ways.items():
            quantized = torch.stack([cols(*ops[:2], i) @ cols(*ops[2:], i).T for i in range(4)])
            for cfg in (fp8.ROW_WGRAD, fp8.ROW_WGRAD._replace(promote=128)):
                label = f"{way}, promote {cfg.promote}"
                def go(ops=ops, quantized=quantized, cfg=cfg, label=label):
                    fn = lambda: fp8.fp8_grouped_wgrad(*ops, counts, torch.bfloat16, cfg, group_scales=True)
                    out = fn()[:4]
                    report(group, label, do_bench(fn, return_mode="median"), flops,
                           errs=dict(err=rel(out, exact), acc_err=rel(out, quantized)))
                run(group, label, go)


DENSE = {"qwen3-30b-a3b": dict(hidden=2048, outs=[4096, 512, 512], o_in=4096),    # 32 heads, 4 kv heads of 128
         "qwen3-235b-a22b": dict(hidden=4096, outs=[8192, 512, 512], o_in=8192),  # 64 heads, 4 kv heads of 128
         "deepseek-v3": dict(hidden=7168, outs=[1536, 576], o_in=16384)}          # MLA's down projections; o 128 × 128


def dense_layers(d, tokens):
    """One attention layer's dense projections of width `d` at `tokens`: {"qkv" or "o": (x, weights, dy)}, bf16, x
    and the weights requiring gradients."""
    g = torch.Generator(device=DEV).manual_seed(0)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device=DEV, generator=g) * scale).bfloat16()
    layers = {}
    for proj, (K, outs) in {"qkv": (d["hidden"], d["outs"]), "o": (d["o_in"], [d["hidden"]])}.items():
        x, ws = rnd(tokens, K).requires_grad_(), [rnd(n, K, scale=K ** -0.5).requires_grad_() for n in outs]
        layers[proj] = x, ws, rnd(tokens, sum(outs))
    return layers


def bench_dense(name, d, tokens):
    torch.backends.cuda.matmul.allow_tf32 = False
    for proj, (x, ws, dy) in dense_layers(d, tokens).items():
        N, K = sum(w.shape[0] for w in ws), x.shape[1]
        flops = 3 * 2 * tokens * N * K

        def bf16():
            torch.cat([F.linear(x, w) for w in ws], -1).backward(dy)

        def fp8_layer():
            fp8_linear(x, ws).backward(dy)

        def passes():                           # what fp8_linear quantizes, without its GEMMs
            w = fp8._stacked(ws)
            counts = torch.full((1,), tokens, dtype=torch.int64, device=DEV)
            fp8.quantize_rows(x, counts)
            fp8.quantize_weight_rows(w)
            _, sw = fp8.quantize_weight_rows(w, True)
            a = fp8.quantize_rows(x, counts, trans=True, rows=False)   # the backward's input pass, as _input_cols
            r = fp8.quantize_rows(dy, counts, mult=sw, col_amax=True, row_mult=a.s)
            fp8._group_cols(dy, counts, r.col_amax, a.s)

        with torch.no_grad():
            ref = torch.cat([F.linear(x, w) for w in ws], -1)
            err = rel(fp8_linear(x, ws), ref)
        for label, fn in (("bf16", bf16), ("fp8 rows", fp8_layer), ("fp8 passes alone", passes)):
            run(f"dense {name} {proj} {tokens}x{K}->{N}", label,
                lambda fn=fn, label=label: report(f"dense {name} {proj} {tokens}x{K}->{N}", label, do_bench(fn),
                                                  None if label.endswith("alone") else flops,
                                                  errs=dict(err=err) if label == "fp8 rows" else None))


def profile_dense(name, d, tokens, calls=5):
    "Each GPU kernel's mean time per `fp8_linear` forward + backward, at the shapes of `bench_dense`."
    for proj, (x, ws, dy) in dense_layers(d, tokens).items():
        K, N = x.shape[1], sum(w.shape[0] for w in ws)
        step = lambda: fp8_linear(x, ws).backward(dy)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3 / calls
        total = sum(kernels.values())
        print(f"densekernels {name} {proj} {tokens}x{K}->{N}: {total:.3f} ms of kernels per call", flush=True)
        for k, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {ms:8.3f} ms  {k[:110]}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--json")
    parser.add_argument("--parts", default="gemm,mlp,quant")
    parser.add_argument("--only", help="comma-separated model names (qwen3-235b-a22b, ...): run those alone")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if args.only:
        keep = lambda d: {k: v for k, v in d.items() if k in args.only.split(",")}
        for table in ("MODELS", "WIDE", "WEIGHTS", "DENSE"):
            globals()[table] = keep(globals()[table])
    gpu = torch.cuda.get_device_name() if parts != ["resources"] else "no GPU (resources: compiled for sm90)"
    print(f"{datetime.date.today()} {gpu} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if "resources" in parts:
        for name, shape in {**MODELS, **WIDE}.items():
            bench_resources(name, shape, WEIGHTS.get(name, {}))
    if "dense" in parts:
        for name, d in DENSE.items():
            bench_dense(name, d, args.tokens)
    if "weights" in parts:
        for name, weights in WEIGHTS.items():
            bench_weights(name, weights)
    if "densekernels" in parts:
        for name, d in DENSE.items():
            run(f"densekernels {name}", "fp8 rows", lambda name=name, d=d: profile_dense(name, d, args.tokens))
    for name, shape in MODELS.items():
        if "gemm" in parts:
            bench_gemms(name, shape, args.tokens)
        if "mlp" in parts:
            bench_mlp(name, shape, args.tokens)
        if "quant" in parts:
            bench_quant(name, shape, args.tokens)
        if "wgrad" in parts:
            bench_wgrad(name, shape, args.tokens)
        if "rowsweep" in parts:
            bench_rowsweep(name, shape, args.tokens)
    for name, shape in WIDE.items() if "rowsweep" in parts else ():
        bench_rowsweep(name, shape, args.tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                           rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
