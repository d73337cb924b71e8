"""The tile sweep behind ops/14_attention's CUDA_CONFIGS (benchmarks/RESULTS.md, "Attention backward: its tiles,
TMA, and dq from a stored dS"): for the GPT-OSS shapes (head dim 64, window 128 and full causal, sinks), the Qwen3 shape (head dim 128,
causal) and DeepSeek's MLA shape (192/128, causal), each
kernel's candidate tiles in turn, the others at the table's entries; forward times for the forward kernel,
forward+backward for the backward kernels. Run on a GPU from the repository root:
    PYTHONPATH=. OUT=/tmp python3 benchmarks/attention_tiles.py
It writes $OUT/attention_tiles.json and prints one line per candidate."""
import itertools, json, os
import torch
from triton.testing import do_bench
import pith_lit.ops.attention as A

out = os.environ.get("OUT", "/tmp")
res = {}
# 3. sweep
def inputs(B, S, Hq, Hkv, dqk, dv, sinks):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, Hq, dqk, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(B, S, Hkv, dqk, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(B, S, Hkv, dv, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    s = torch.randn(Hq, device="cuda", generator=g).requires_grad_() if sinks else None
    return q, k, v, s
C = A._Config
cands = {"fwd": [C(128, 64, 4, 3), C(128, 64, 8, 3), C(128, 128, 8, 3), C(64, 64, 4, 3), C(128, 32, 4, 3),
                 C(128, 64, 8, 4), C(64, 128, 4, 3)],
         "dq": [C(*c) for c in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))],
         "dkdv": [C(*c) for c in itertools.product((32, 64), (64, 128), (4, 8), (2, 3))]}
shapes = {"gptoss_win": ((2, 4096, 64, 8, 64, 64, True), 128), "gptoss_full": ((2, 4096, 64, 8, 64, 64, True), None),
          "qwen3": ((2, 4096, 32, 4, 128, 128, False), None), "mla": ((4, 2048, 16, 16, 192, 128, False), None)}
sweep = {}
for name, (shape, window) in shapes.items():
    q, k, v, s = inputs(*shape)
    dqk, dv = shape[4], shape[5]
    width = 64 if max(dqk, dv) <= 64 else 128 if max(dqk, dv) <= 128 and dqk + dv <= 256 else 256
    table = A.CUDA_CONFIGS[width]
    default = dict(table)
    leaves = [q, k, v] + ([s] if s is not None else [])
    dout = torch.randn(shape[0], shape[2], shape[1], shape[5], device="cuda", dtype=torch.bfloat16)
    fwdkind = "fwd_masked" if window else "fwd"
    for kind in (fwdkind, "dq", "dkdv"):
        for c in cands["fwd" if kind.startswith("fwd") else kind]:
            table.update(default)
            table[kind] = c
            try:
                if kind.startswith("fwd"):
                    ms = do_bench(lambda: A.flash_attention(q, k, v, s, window=window)[0], return_mode="median")
                else:
                    ms = do_bench(lambda: torch.autograd.grad(A.flash_attention(q, k, v, s, window=window)[0], leaves, dout),
                                  return_mode="median")
            except Exception as e:
                ms = float("nan"); print(name, kind, c, "ERR", str(e)[:200], flush=True)
            sweep[f"{name} {kind} {tuple(c)}"] = ms
            print(f"{name:12s} {kind:10s} {tuple(c)} {ms:.3f} ms", flush=True)
    table.update(default)
    del q, k, v, s, dout, leaves
    torch.cuda.empty_cache()
res["sweep"] = sweep
json.dump(res, open(f"{out}/attention_tiles.json", "w"), indent=1)
