"""The optimizer step with gradient clipping on one GPU, over the parameter shapes of a bench config, in its optim
dtype: PyTorch's fused AdamW after clipping in place (the norm, then `g ← c·g`), against pith_lit's (engine/36
`grad_norm`, then ops/19 `AdamW.step(grad_scale=c)`). Each is timed alone (CUDA events, median of `reps`), with the
bytes it must move and the fraction of the HBM bandwidth (4.8 TB/s on the H200) that makes; the parts (the norm, each
update) too. The last line is JSON.

usage: PYTHONPATH=. python3 benchmarks/optimizer.py [CONFIG] [KEY=VALUE ...]
       (default configs/bench-qwen3-30b-a3b.toml; e.g. train.optim_dtype=float32 model.num_hidden_layers=4)
       BLOCKS="1024x4 4096x8" tries other (block, warps) of the kernel.
       train.optimizer=muon adds Muon's step over the model (its Newton–Schulz FLOPs and rate) and the experts'
       iteration on one layer's fused gate_up against the same as its two matrices (train/43)."""
import gc
import json
import os
import sys

import torch

import pith_lit.ops.adamw as adamw
from pith_lit.engine.fsdp import clip_factor, grad_norm
from pith_lit.train.config import load_config
from pith_lit.train.trainer import meta_model

HBM = 4.8e12
args = sys.argv[1:]
path = args.pop(0) if args and args[0].endswith(".toml") else "configs/bench-qwen3-30b-a3b.toml"
cfg = load_config(path, ["run.dir=/tmp/opt_bench"] + args)
dtype, reps = cfg.param_dtype, 10
shapes = [p.shape for p in meta_model(cfg)().parameters()]
n = sum(s.numel() for s in shapes)
gen = torch.Generator("cuda").manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype, generator=gen) * 0.02) for s in shapes]
for p in params:
    p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=gen) * 1e-3
size = params[0].element_size()
decay = [p for p in params if p.dim() >= 2]
groups = [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
theirs = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=True)
ours = adamw.AdamW(groups, lr=1e-4, betas=(0.9, 0.95))


def timed(fn) -> float:
    "Median ms of `fn` over `reps` runs after two warm-ups."
    out = []
    for i in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out[2:])[reps // 2]


norm0 = grad_norm(params)
c = clip_factor(norm0, 0.999 * norm0.item())   # clipping acts, and the gradients keep their size over the reps


def clip_in_place():
    grad_norm(params)
    torch._foreach_mul_([p.grad for p in params], c.to(dtype))


rows = {
    "norm": (lambda: grad_norm(params), 1),
    "clip in place (norm, g ← c·g)": (clip_in_place, 3),
    "torch fused AdamW": (theirs.step, 7),
    "ops/19 AdamW": (ours.step, 7),
    "today: clip in place + torch fused AdamW": (lambda: (clip_in_place(), theirs.step()), 10),
    "ops/19: norm + AdamW(grad_scale=c)": (lambda: ours.step(grad_scale=clip_factor(grad_norm(params), 0.999)), 8),
}
copy_src = torch.empty(2 ** 29, device="cuda", dtype=torch.float32)
copy_dst = torch.empty_like(copy_src)
res = {"config": path, "dtype": str(dtype), "params": n, "hbm_tb_s": HBM / 1e12,
       "copy_tb_s": round(2 * copy_src.numel() * 4 / timed(lambda: copy_dst.copy_(copy_src)) / 1e9, 2)}
print(f"{n / 1e9:.2f}B parameters of {len(params)} tensors, {dtype}; a device copy moves {res['copy_tb_s']} TB/s")
for name, (fn, per) in rows.items():
    ms = timed(fn)
    gb = per * size * n / 1e9
    res[name] = {"ms": round(ms, 2), "gb": round(gb, 1), "hbm_frac": round(gb / ms / (HBM / 1e12), 3)}
    print(f"{name:44s} {ms:8.2f} ms  {gb:6.1f} GB  {gb / ms:6.2f} TB/s  {res[name]['hbm_frac']:.0%} of HBM")
for bw in os.environ.get("BLOCKS", "").split():
    adamw.ADAMW_BLOCK, adamw.ADAMW_WARPS = map(int, bw.split("x"))
    ms = timed(ours.step)
    res[f"ops/19 AdamW {bw}"] = round(ms, 2)
    print(f"{'ops/19 AdamW, block x warps ' + bw:44s} {ms:8.2f} ms  {7 * size * n / 1e9 / ms:6.2f} TB/s")
if cfg.train.optimizer == "muon":   # Muon's step over the whole model, and its routed experts' Newton–Schulz alone
    from pith_lit.train.optim import NS_COEFFS, _split, orthogonalize
    from pith_lit.train.trainer import optimizer_for
    del params, decay, groups, theirs, ours, rows, copy_src, copy_dst, c, norm0   # rows' bound methods hold them
    gc.collect()
    torch.cuda.empty_cache()
    model = meta_model(cfg)().to_empty(device="cuda").to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02, generator=gen)
        p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=gen) * 1e-3
    muon = optimizer_for(cfg)(model)
    mats = [_split(p, muon.parts[p])[0] if p in muon.parts else p for g in muon.param_groups if g["muon"]
            for p in g["params"]]

    def flops(t):   # five iterations on each m × n matrix (m ≤ n): 4m²n + 2m³ each
        m, n = sorted(t.shape[-2:])
        return 5 * t[..., 0, 0].numel() * (4 * m * m * n + 2 * m ** 3)

    ex = next(m for m in model.modules() if hasattr(m, "MUON_PARTS"))
    w = ex.gate_up_proj.grad
    pair = _split(w, ex.MUON_PARTS["gate_up_proj"])[0]

    def elementwise_ns(m, steps=5):   # the iteration before baddbmm: each step's sums as element-wise passes
        x, (a, b, c) = m / (m.norm(dim=(-2, -1), keepdim=True) + 1e-7), NS_COEFFS
        for _ in range(steps):
            A = x @ x.mT
            x = a * x + (b * A + c * A @ A) @ x
        return x

    for name, fn, f in [("Muon step (model)", muon.step, sum(map(flops, mats))),
                        ("NS: gate and up, element-wise sums", lambda: elementwise_ns(pair), flops(pair)),
                        ("NS: one layer's gate_up, fused", lambda: orthogonalize(w), flops(w)),
                        ("NS: one layer's gate_up, as gate and up", lambda: orthogonalize(pair), flops(pair))]:
        ms = timed(fn)
        res[name] = {"ms": round(ms, 2), "tflop": round(f / 1e12, 2), "tflop_s": round(f / ms / 1e9)}
        print(f"{name:44s} {ms:8.2f} ms  {f / 1e12:7.2f} TFLOP  {f / ms / 1e9:6.0f} TFLOP/s")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        muon.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
print(json.dumps(res))
