"""The anatomy of one training step on one GPU, from the trace `log.profile_step` leaves in a run's directory: the GPU
time of each kernel class (grouped GEMMs, dense GEMMs, attention, Qwen3.5's gated delta rule (ops/16), permutation
and routing, norms and element-wise ops, cross-entropy, optimizer, clipping, copies) and the time no kernel runs
(host idle, by the kernel before each gap), each beside its limit on the H200: FLOPs at 789 TFLOP/s for the
matmuls and attention, bytes at 4.8 TB/s for the optimizer, the clipping norm and the cross-entropy's pass over the
logits. FLOPs come from the model built on the meta device (6 × active matmul parameters per token, split into routed
experts and the rest, plus the family's attention FLOPs). A run with `train.fp8` has two classes more: ops/15's FP8
GEMMs (the experts' and the dense projections' in FP8 alike: one kernel for both) and its quantization passes
(weights, rows, columns); its GEMM classes show no limit, since which FLOPs run in FP8 depends on
`train.fp8_dense_min`.

usage: PYTHONPATH=. python3 benchmarks/anatomy.py RUN_DIR [RANK]   (prints a markdown table, then one JSON line)"""
import gzip
import json
import re
import sys
from pathlib import Path

from pith_lit.train.config import load_config
from pith_lit.train.trainer import meta_model

PEAK_FLOPS, HBM = 789e12, 4.8e12
CLASSES = [  # (class, pattern on the kernel's name), first match wins
    ("optimizer", r"adam"),
    ("clipping", r"_sum_squares|multi_tensor_apply|foreach|LpNorm|lpnorm"),
    ("cross-entropy", r"_ce_rows"),
    ("attention", r"attn|flash|fmha|sdpa|_attention"),
    ("gated delta rule", r"_wy_kernel|_state_fwd_kernel|_out_fwd_kernel|_state_bwd_kernel|_chunk_bwd_kernel"),
    ("FP8 GEMMs", r"_fp8_gemm|_fp8_wgrad"),
    ("FP8 quantization", r"^_quant_|_expert_max_kernel"),
    ("grouped GEMMs", r"grouped|Grouped|GroupProblem"),
    ("dense GEMMs", r"gemm|nvjet|xmma|wgmma|cutlass|sm90_|Kernel2"),
    ("permutation and routing", r"gather|scatter|_sum_rows|index|sort|topk|radix|histogram|scan|cumsum|bincount"),
    ("copies", r"^Memcpy|^Memset|^memcpy|^memset"),
    ("norms and element-wise", r"."),
]


def kernels(trace: dict) -> list[tuple[str, float, float]]:
    "(name, start µs, duration µs) of every GPU kernel and memory operation in a Chrome trace."
    return [(e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def busy_us(spans) -> float:
    "Length of the union of (start, duration) intervals."
    total, end = 0.0, float("-inf")
    for s, d in sorted(spans):
        if s + d > end:
            total += s + d - max(s, end)
            end = s + d
    return total


def idle_after(ks) -> dict:
    "Host idle by the kernel that finished last before each gap (its name's first 70 characters): ms."
    out, end, last = {}, None, ""
    for name, s, d in sorted(ks, key=lambda k: k[1]):
        if end is not None and s > end:
            out[last[:70]] = out.get(last[:70], 0.0) + (s - end) / 1e3
        if end is None or s + d > end:
            end, last = s + d, name
    return out


def limits(cfg) -> dict:
    "Each class's limit in ms for one step of `cfg`'s model and batch."
    model, c = meta_model(cfg)(), cfg.model
    tokens, k = cfg.train.global_batch * cfg.train.seq_len, c.num_experts_per_tok
    routed = k * sum(p[0].numel() for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3)
    active, params = model.active_matmul_params(), sum(p.numel() for p in model.parameters())
    attention = model.flops_per_token(cfg.train.seq_len) - 6 * active
    size = cfg.param_dtype.itemsize
    return {"grouped GEMMs": 6 * routed * tokens / PEAK_FLOPS * 1e3,
            "dense GEMMs": 6 * (active - routed) * tokens / PEAK_FLOPS * 1e3,
            "attention": attention * tokens / PEAK_FLOPS * 1e3,
            "optimizer": 7 * size * params / HBM * 1e3,
            "clipping": size * params / HBM * 1e3,
            "cross-entropy": 2 * 2 * tokens * c.vocab_size / HBM * 1e3}


def anatomy(run: Path, rank: int = 0) -> dict:
    cfg = load_config(str(run / "config.toml"), [])
    path = next(p for p in (run / f"trace-rank{rank}.json", run / f"trace-rank{rank}.json.gz") if p.exists())
    trace = json.loads((gzip.open if path.suffix == ".gz" else open)(path, "rb").read())
    ks = kernels(trace)
    start, end = min(s for _, s, _ in ks), max(s + d for _, s, d in ks)
    out = {name: {"ms": 0.0, "kernels": 0, "top": {}} for name, _ in CLASSES}
    for name, _, dur in ks:
        cls = next(c for c, pat in CLASSES if re.search(pat, name))
        o = out[cls]
        o["ms"] += dur / 1e3
        o["kernels"] += 1
        short = name[:70]
        o["top"][short] = o["top"].get(short, 0.0) + dur / 1e3
    span = (end - start) / 1e3
    out["host idle"] = {"ms": span - busy_us([(s, d) for _, s, d in ks]) / 1e3, "kernels": 0, "top": idle_after(ks)}
    for cls, ms in limits(cfg).items():
        if not (cfg.train.fp8 and cls.endswith("GEMMs")):
            out[cls]["limit_ms"] = ms
    for o in out.values():
        o["top"] = dict(sorted(o["top"].items(), key=lambda kv: -kv[1])[:4])
    return {"run": run.name, "span_ms": span, "classes": out}


if __name__ == "__main__":
    res = anatomy(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    span = res["span_ms"]
    print(f"{res['run']}: GPU span of the profiled step {span:.1f} ms\n")
    print("| class | ms | share | kernels | limit ms | of limit |\n| --- | --- | --- | --- | --- | --- |")
    for cls, o in res["classes"].items():
        ms, lim = o["ms"], o.get("limit_ms")
        print(f"| {cls} | {ms:.1f} | {ms / span:.1%} | {o['kernels']} | {f'{lim:.1f}' if lim else '-'} | "
              f"{f'{lim / ms:.0%}' if lim and ms else '-'} |")
    for cls, o in res["classes"].items():
        if o["top"]:
            print(f"{cls}: " + "; ".join(f"{n} {ms:.1f}" for n, ms in o["top"].items()))
    print(json.dumps(res))
