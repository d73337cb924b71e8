"""dq from a stored dSᵀ against dq recomputed (ops/14), in one process per call. Results: benchmarks/RESULTS.md,
"dq from a stored dS". Run on a GPU from the repository root, one or more parts:
    PYTHONPATH=. python3 benchmarks/attention_ds.py tiles dkdv rounds
- tiles: at each of `BENCH_SHAPES`, the backward alone (`_bwd` under `do_bench`) recomputed and stored with each
  `dq_ds` tile of a small sweep, its kernels (torch.profiler), and the gradients' largest difference between the
  two ways; the dk, dv tiles those of the table before the stored way (`DKDV_BEFORE`);
- dkdv: at the MLA and Qwen3 shapes, each dk, dv tile of a sweep, stored (dq tile 64, 64, 4, 3) and recomputed;
- rounds: forward+backward through autograd at the same two shapes, three rounds of stored, recomputed and SDPA:
  `do_bench` medians, the host's time per call (50 calls issued back to back) and the sum of the GPU kernels."""
import sys
import torch
from triton.testing import do_bench
import pith_lit.ops.attention as A
from attention_bwd_compare import gpu_host_ms, profile, inputs as mod_inputs  # benchmarks/: the script's folder

inputs = lambda *shape: mod_inputs(A, *shape)

BIG = 1 << 40
DQ_TILES = [A._Config(*c) for c in ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                                    (64, 128, 4, 3), (128, 32, 8, 4))]
DKDV_TILES = [A._Config(*c) for c in ((32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (64, 64, 4, 2), (64, 64, 8, 2),
                                      (32, 128, 8, 3), (64, 128, 8, 2), (16, 64, 4, 4))]
DKDV_BEFORE = {64: A._Config(64, 64, 4, 2), 128: A._Config(32, 64, 4, 3), 256: A._Config(32, 64, 4, 3)}


def width(dqk, dv):
    return 64 if max(dqk, dv) <= 64 else 128 if max(dqk, dv) <= 128 and dqk + dv <= 256 else 256


def kernels(fn):
    return ", ".join(f"{k.removeprefix('_attn_bwd_').removesuffix('_kernel')} {t:.3f}" for k, t in profile(fn).items())


def part_tiles():
    for shape, (B, S, Hq, Hkv, dqk, dv, sinks, window) in A.BENCH_SHAPES.items():
        table = A.CUDA_CONFIGS[width(dqk, dv)]
        keep = dict(table)
        table["dkdv"] = DKDV_BEFORE[width(dqk, dv)]
        args = inputs(B, S, Hq, Hkv, dqk, dv, sinks, window)
        ref = A._bwd(*args, ds_budget=0)
        t = do_bench(lambda: A._bwd(*args, ds_budget=0), return_mode="median")
        print(f"{shape} recompute: backward {t:.3f} ms; {kernels(lambda: A._bwd(*args, ds_budget=0))}", flush=True)
        mib = A.ds_bytes(B, Hq, S, S, dqk, dv, 2, BIG) / 2**20
        for cfg in DQ_TILES:
            table["dq_ds"] = cfg
            got = A._bwd(*args, ds_budget=BIG)
            t = do_bench(lambda: A._bwd(*args, ds_budget=BIG), return_mode="median")
            err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                      for a, b in zip(got[:3], ref[:3]))
            print(f"{shape} ds {tuple(cfg)}: backward {t:.3f} ms, dS {mib:.0f} MiB, max rel diff {err:.2e}; "
                  f"{kernels(lambda: A._bwd(*args, ds_budget=BIG))}", flush=True)
        table.update(keep)
        args = ref = None
        torch.cuda.empty_cache()


def part_dkdv():
    for shape in ("deepseek-mla causal", "qwen3 causal"):
        B, S, Hq, Hkv, dqk, dv, sinks, window = A.BENCH_SHAPES[shape]
        table = A.CUDA_CONFIGS[width(dqk, dv)]
        keep = dict(table)
        table["dq_ds"] = A._Config(64, 64, 4, 3)
        args = inputs(B, S, Hq, Hkv, dqk, dv, sinks, window)
        for cfg in DKDV_TILES:
            table["dkdv"] = cfg
            t = do_bench(lambda: A._bwd(*args, ds_budget=BIG), return_mode="median")
            t0 = do_bench(lambda: A._bwd(*args, ds_budget=0), return_mode="median")
            print(f"{shape} dkdv {tuple(cfg)}: stored {t:.3f} ({kernels(lambda: A._bwd(*args, ds_budget=BIG))}), "
                  f"recomputed {t0:.3f}", flush=True)
        table.update(keep)
        args = None
        torch.cuda.empty_cache()


def part_rounds():
    budget_before = A.DS_BUDGET
    for shape in ("deepseek-mla causal", "qwen3 causal"):
        B, S, Hq, Hkv, dqk, dv, sinks, window = A.BENCH_SHAPES[shape]
        q, k, v, s = A._bench_inputs(B, S, Hq, Hkv, dqk, dv, sinks)
        dout = torch.randn(B, Hq, S, dv, device="cuda", dtype=torch.bfloat16)
        fl = lambda: torch.autograd.grad(A.flash_attention(q, k, v, s, window=window)[0], [q, k, v], dout)
        sd = lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), [q, k, v], dout)
        for r in range(3):
            res = []
            for name, budget in (("stored", BIG), ("recomputed", 0)):
                A.DS_BUDGET = budget
                t, host = gpu_host_ms(fl)
                ksum = sum(profile(fl, "").values())
                res.append(f"{name} {t:.3f} (host {host:.3f}, kernels {ksum:.3f})")
            res.append(f"sdpa {do_bench(sd, return_mode='median'):.3f}")
            print(f"{shape} fwd+bwd round {r}: " + "; ".join(res), flush=True)
        A.DS_BUDGET = budget_before
        q = k = v = dout = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    for part in sys.argv[1:] or ["tiles", "dkdv", "rounds"]:
        {"tiles": part_tiles, "dkdv": part_dkdv, "rounds": part_rounds}[part]()
