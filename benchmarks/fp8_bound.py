"""What bounds ops/15's block-scaled FP8 grouped GEMM on one GPU: the same kernel with and without its per-128-K
scaling, against bf16 `F.grouped_mm`. Run from the repository root:

    PYTHONPATH=. python benchmarks/fp8_bound.py

At the Qwen3-30B-A3B expert shapes (128 experts × 1,032 rows, gate/up 2048 -> 1536 and down 768 -> 2048):

- `fp8_grouped_mm`: the forward GEMM as the FP8 layer runs it; each 128-deep step is a fresh `tl.dot` whose result is
  multiplied by the two scales and added to the fp32 accumulator (promotion every 128 of K);
- `unscaled`: the same kernel, tiles and launch, with the scales dropped and the products accumulated inside
  `tl.dot` (`acc = tl.dot(a, b, acc)`): what Triton reaches on this schedule when nothing happens between steps;
- bf16 `F.grouped_mm` on the same rows.

Times are medians of `triton.testing.do_bench`; TFLOP/s count 2·rows·in·out. Nothing here is a test.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from pith_lit.ops.fp8 import (GemmConfig, _e_p2, _expert_of_tile, _max_tiles, _schedule, fp8_grouped_mm,
                              quantize_act, quantize_weight)


@triton.jit
def _unscaled_kernel(a_ptr, b_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, K, E,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_P2: tl.constexpr):
    n_tiles = tl.cdiv(N, BN)
    t = tl.program_id(0) // n_tiles
    j = tl.program_id(0) % n_tiles
    e = _expert_of_tile(t, tile_offs_ptr, E, E_P2)
    if e >= E:
        return
    rows = tl.load(row_offs_ptr + e) + (t - tl.load(tile_offs_ptr + e)) * BM + tl.arange(0, BM)
    row_ok = rows < tl.load(row_offs_ptr + e + 1)
    cols = j * BN + tl.arange(0, BN)
    col_ok = cols < N
    kk = tl.arange(0, BK)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * N * K + cols.to(tl.int64)[:, None] * K + kk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def unscaled(qa, qb, counts, cfg=GemmConfig()):
    (M, K), (E, N) = qa.shape, qb.shape[:2]
    c = torch.empty(M, N, dtype=torch.bfloat16, device=qa.device)
    row_offs, tile_offs = _schedule(counts, cfg.block_m)
    grid = _max_tiles(M, E, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    _unscaled_kernel[(grid,)](qa, qb, c, row_offs, tile_offs, M, N, K, E, BM=cfg.block_m, BN=cfg.block_n,
                              BK=cfg.block_k, E_P2=_e_p2(E), num_warps=cfg.warps, num_stages=cfg.stages)
    return c


def main():
    E, per = 128, 1032
    counts = torch.full((E,), per, device="cuda", dtype=torch.int64)
    offs = counts.cumsum(0).to(torch.int32)
    M = E * per
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · Triton {triton.__version__}")
    for name, (n_in, n_out) in {"gate_up 2048->1536": (2048, 1536), "down 768->2048": (768, 2048)}.items():
        x = torch.randn(M, n_in, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, n_out, n_in, device="cuda", dtype=torch.bfloat16) / n_in ** 0.5
        a = quantize_act(x, counts)
        qw, sw = quantize_weight(w)
        flops = 2 * M * n_in * n_out
        ref = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
        cases = {"fp8_grouped_mm (scaled every 128 of K)": lambda: fp8_grouped_mm(a.q, a.s, qw, sw, counts,
                                                                                 torch.bfloat16),
                 "unscaled (acc inside tl.dot)": lambda: unscaled(a.q, qw, counts),
                 "bf16 F.grouped_mm": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs)}
        for case, fn in cases.items():
            ms = do_bench(fn, warmup=25, rep=100)
            err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
            note = f"  rel. to bf16 {err:.2e}" if case.startswith("fp8") else ""   # unscaled values are not y
            print(f"{name:20s} {case:40s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s{note}")
        for cfg in (GemmConfig(128, 128, 128, 8, 3), GemmConfig(128, 256, 128, 8, 3), GemmConfig(64, 128, 128, 4, 4)):
            ms = do_bench(lambda: unscaled(a.q, qw, counts, cfg), warmup=25, rep=100)
            print(f"{name:20s} {'unscaled ' + str(tuple(cfg)):40s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
