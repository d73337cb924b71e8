"""What bounds ops/15's block-scaled FP8 grouped GEMM on one GPU: the same kernel with and without its per-128-K
scaling, against bf16 `F.grouped_mm`. Run from the repository root:

    PYTHONPATH=. python benchmarks/fp8_bound.py

At the Qwen3-30B-A3B expert shapes (128 experts × 1,032 rows, gate/up 2048 -> 1536 and down 768 -> 2048):

- `fp8_grouped_mm`: the forward GEMM as the FP8 layer runs it; each 128-deep step is a fresh `tl.dot` whose result is
  multiplied by the two scales and added to the fp32 accumulator (promotion every 128 of K);
- `unscaled`: the same kernel, tiles and launch, with the scales dropped and the products accumulated inside
  `tl.dot` (`acc = tl.dot(a, b, acc)`): what Triton reaches on this schedule when nothing happens between steps;
- `paired`: two 128-deep products issued before either is promoted, so that the second can run while the first
  waits (each pipeline stage holds both K-steps);
- `ws`: ops/15's kernel with its K loop warp-specialised by Triton (`tl.range(..., warp_specialize=True)`);
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
def _tile(a_ptr, b_ptr, row_offs_ptr, tile_offs_ptr, N, K, E, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, E_P2: tl.constexpr):
    """This program's output tile, as ops/15's kernel takes it: expert (E past the last tile), rows, columns, masks,
    and the pointers to the first K-step of A and B."""
    n_tiles = tl.cdiv(N, BN)
    t = tl.program_id(0) // n_tiles
    j = tl.program_id(0) % n_tiles
    e = _expert_of_tile(t, tile_offs_ptr, E, E_P2)
    safe = tl.minimum(e, E - 1)                     # no read past the offsets for a program with nothing to do
    rows = tl.load(row_offs_ptr + safe) + (t - tl.load(tile_offs_ptr + safe)) * BM + tl.arange(0, BM)
    row_ok = rows < tl.load(row_offs_ptr + safe + 1)
    cols = j * BN + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :]
    b_ptrs = b_ptr + safe.to(tl.int64) * N * K + cols.to(tl.int64)[:, None] * K + kk[None, :]
    return e, rows, row_ok, cols, cols < N, a_ptrs, b_ptrs


@triton.jit
def _store(c_ptr, acc, rows, row_ok, cols, col_ok, N):
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _b_scales(sb_ptr, e, N, K, BN: tl.constexpr):
    "B's scales of this program's tile, one per 128 of K (BN divides 128: the tile lies in one block of columns)."
    return sb_ptr + (e * tl.cdiv(N, 128) + (tl.program_id(0) % tl.cdiv(N, BN)) * BN // 128) * tl.cdiv(K, 128)


@triton.jit
def _step_scale(sa_ptr, sb_ptrs, k0, M, rows, row_ok):
    "The scale of the K-step at k0 for each row of the tile: A's per row (stored (KB, M)) times B's one."
    return tl.load(sa_ptr + (k0 // 128) * M + rows, mask=row_ok, other=0.0) * tl.load(sb_ptrs + k0 // 128)


@triton.jit
def _unscaled_kernel(a_ptr, b_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, K, E,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_P2: tl.constexpr):
    e, rows, row_ok, cols, col_ok, a_ptrs, b_ptrs = _tile(a_ptr, b_ptr, row_offs_ptr, tile_offs_ptr, N, K, E, BM, BN,
                                                          BK, E_P2)
    if e >= E:
        return
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    _store(c_ptr, acc, rows, row_ok, cols, col_ok, N)


@triton.jit
def _paired_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, K, E,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_P2: tl.constexpr):
    # two 128-deep products per iteration, both issued before either is scaled (K a multiple of 2·BK)
    e, rows, row_ok, cols, col_ok, a_ptrs, b_ptrs = _tile(a_ptr, b_ptr, row_offs_ptr, tile_offs_ptr, N, K, E, BM, BN,
                                                          BK, E_P2)
    if e >= E:
        return
    sb_ptrs = _b_scales(sb_ptr, e, N, K, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, 2 * BK):
        a0 = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b0 = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        a1 = tl.load(a_ptrs + BK, mask=row_ok[:, None], other=0.0)
        b1 = tl.load(b_ptrs + BK, mask=col_ok[:, None], other=0.0)
        d0 = tl.dot(a0, tl.trans(b0))
        d1 = tl.dot(a1, tl.trans(b1))
        acc += (d0 * _step_scale(sa_ptr, sb_ptrs, k0, M, rows, row_ok)[:, None]
                + d1 * _step_scale(sa_ptr, sb_ptrs, k0 + BK, M, rows, row_ok)[:, None])
        a_ptrs += 2 * BK
        b_ptrs += 2 * BK
    _store(c_ptr, acc, rows, row_ok, cols, col_ok, N)


@triton.jit
def _ws_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, K, E,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_P2: tl.constexpr, STAGES: tl.constexpr):
    # ops/15's kernel with its K loop warp-specialised by Triton (loads in their own warps)
    e, rows, row_ok, cols, col_ok, a_ptrs, b_ptrs = _tile(a_ptr, b_ptr, row_offs_ptr, tile_offs_ptr, N, K, E, BM, BN,
                                                          BK, E_P2)
    if e >= E:
        return
    sb_ptrs = _b_scales(sb_ptr, e, N, K, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES, warp_specialize=True):
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs + k0, mask=col_ok[:, None], other=0.0)
        acc += tl.dot(a, tl.trans(b)) * _step_scale(sa_ptr, sb_ptrs, k0, M, rows, row_ok)[:, None]
    _store(c_ptr, acc, rows, row_ok, cols, col_ok, N)


@triton.jit
def _outer_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, K, E,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_P2: tl.constexpr):
    # ops/15's kernel with B's scale loaded per column, so each step's scale is a BM × BN tile (a multiply
    # and a multiply-add per accumulator element)
    e, rows, row_ok, cols, col_ok, a_ptrs, b_ptrs = _tile(a_ptr, b_ptr, row_offs_ptr, tile_offs_ptr, N, K, E, BM, BN,
                                                          BK, E_P2)
    if e >= E:
        return
    sb_ptrs = sb_ptr + (e * tl.cdiv(N, 128) + cols // 128) * tl.cdiv(K, 128)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        sa = tl.load(sa_ptr + (k0 // 128) * M + rows, mask=row_ok, other=0.0)
        sb = tl.load(sb_ptrs + k0 // 128, mask=col_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        a_ptrs += BK
        b_ptrs += BK
    _store(c_ptr, acc, rows, row_ok, cols, col_ok, N)


@triton.jit
def _pipelined_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, K, E,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_P2: tl.constexpr):
    # ops/15's kernel with the product of step i+1 issued before step i is promoted (BN divides 128)
    e, rows, row_ok, cols, col_ok, a_ptrs, b_ptrs = _tile(a_ptr, b_ptr, row_offs_ptr, tile_offs_ptr, N, K, E, BM, BN,
                                                          BK, E_P2)
    if e >= E:
        return
    sb_ptrs = _b_scales(sb_ptr, e, N, K, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
    b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
    d = tl.dot(a, tl.trans(b))
    s = _step_scale(sa_ptr, sb_ptrs, 0, M, rows, row_ok)
    for k0 in range(BK, K, BK):
        a_ptrs += BK
        b_ptrs += BK
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        d_next = tl.dot(a, tl.trans(b))
        acc += d * s[:, None]
        d = d_next
        s = _step_scale(sa_ptr, sb_ptrs, k0, M, rows, row_ok)
    acc += d * s[:, None]
    _store(c_ptr, acc, rows, row_ok, cols, col_ok, N)


def _launch(kernel, qa, qb, counts, cfg, scales=(), **meta):
    "One of the kernels above on ops/15's tile schedule: C (M, N) in bf16; `scales` (sa, sb) for the scaled ones."
    (M, K), (E, N) = qa.shape, qb.shape[:2]
    c = torch.empty(M, N, dtype=torch.bfloat16, device=qa.device)
    row_offs, tile_offs = _schedule(counts, cfg.block_m)
    grid = _max_tiles(M, E, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    operands = (qa, scales[0].t(), qb, scales[1].contiguous()) if scales else (qa, qb)
    kernel[(grid,)](*operands, c, row_offs, tile_offs, M, N, K, E, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                    E_P2=_e_p2(E), num_warps=cfg.warps, **meta)
    return c


def ws(qa, sa, qb, sb, counts, cfg=GemmConfig(stages=3)):   # the stages go to tl.range
    return _launch(_ws_kernel, qa, qb, counts, cfg, (sa, sb), STAGES=cfg.stages)


def paired(qa, sa, qb, sb, counts, cfg=GemmConfig(stages=2)):   # each stage holds two K-steps
    assert qa.shape[1] % (2 * cfg.block_k) == 0 and cfg.block_k == 128
    return _launch(_paired_kernel, qa, qb, counts, cfg, (sa, sb), num_stages=cfg.stages)


def outer(qa, sa, qb, sb, counts, cfg=GemmConfig()):
    return _launch(_outer_kernel, qa, qb, counts, cfg, (sa, sb), num_stages=cfg.stages)


def pipelined(qa, sa, qb, sb, counts, cfg=GemmConfig()):
    assert 128 % cfg.block_n == 0 and qa.shape[1] % cfg.block_k == 0
    return _launch(_pipelined_kernel, qa, qb, counts, cfg, (sa, sb), num_stages=cfg.stages)


def unscaled(qa, qb, counts, cfg=GemmConfig()):
    return _launch(_unscaled_kernel, qa, qb, counts, cfg, num_stages=cfg.stages)


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
                 "outer (a scale per element, as before)": lambda: outer(a.q, a.s, qw, sw, counts),
                 "pipelined (next product issued first)": lambda: pipelined(a.q, a.s, qw, sw, counts),
                 "paired (two products, then both scaled)": lambda: paired(a.q, a.s, qw, sw, counts),
                 "warp-specialised K loop": lambda: ws(a.q, a.s, qw, sw, counts),
                 "unscaled (acc inside tl.dot)": lambda: unscaled(a.q, qw, counts),
                 "bf16 F.grouped_mm": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs)}
        for case, fn in cases.items():
            try:
                ms = do_bench(fn, warmup=25, rep=100)
            except Exception as e:   # a variant this Triton cannot build here
                print(f"{name:20s} {case:40s} failed: {str(e).splitlines()[0][:100]}")
                continue
            err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
            note = "" if case.startswith("unscaled") else f"  rel. to bf16 {err:.2e}"   # unscaled values are not y
            print(f"{name:20s} {case:40s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s{note}")
        for cfg in (GemmConfig(128, 128, 128, 8, 3), GemmConfig(128, 256, 128, 8, 3), GemmConfig(64, 128, 128, 4, 4)):
            ms = do_bench(lambda: unscaled(a.q, qw, counts, cfg), warmup=25, rep=100)
            print(f"{name:20s} {'unscaled ' + str(tuple(cfg)):40s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")
        for label, fn, cfgs in [("paired", paired, (GemmConfig(128, 128, 128, 8, 2), GemmConfig(128, 128, 128, 8, 3))),
                                ("ws", ws, (GemmConfig(128, 128, 128, 8, 2), GemmConfig(128, 128, 128, 8, 4),
                                            GemmConfig(128, 128, 128, 4, 3), GemmConfig(64, 128, 128, 4, 3)))]:
            for cfg in cfgs:
                try:
                    ms = do_bench(lambda: fn(a.q, a.s, qw, sw, counts, cfg), warmup=25, rep=100)
                    print(f"{name:20s} {label + ' ' + str(tuple(cfg)):40s} {ms:8.3f} ms "
                          f"{flops / ms / 1e9:7.1f} TFLOP/s")
                except Exception as e:   # a tile that does not fit in shared memory or registers
                    print(f"{name:20s} {label + ' ' + str(tuple(cfg)):40s} failed: {str(e).splitlines()[0][:80]}")


if __name__ == "__main__":
    main()
