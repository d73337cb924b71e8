"""Experiment: ops/15's block-scaled FP8 grouped GEMM (the forward-shaped product, same contract as
`fp8.fp8_grouped_mm`, whose results each form gives bit for bit) written in Gluon, Triton's lower-level language, with
A and B tiles loaded by TMA into a ring of shared-memory stages, in three forms:
- `_fp8_gemm_gluon`: one partition; each 128-deep product issued as an async warpgroup MMA, and with `overlap` the
  previous product promoted (acc += partial · scale) while the next one runs. K is a compile-time constant and the
  steps are unrolled, so no in-flight accumulator is a loop-carried value (ptxas serialises the MMAs otherwise).
- `_fp8_gemm_gluon_ws`: a producer warp issues the loads (`gl.warp_specialize`); the default warps multiply and
  promote.
- `_fp8_gemm_gluon_ws2`: DeepGEMM's structure: the producer warp and two math partitions of one warp group each, with
  half the tile's rows, their own loop and their own store; `early` says when each step's scales are read.
On the H200 the last, with the scales read a step ahead, runs at 0.89-1.08x ops/15's kernel; the first at about half
(benchmarks/RESULTS.md, "Attention and FP8 experiments"). Run on a GPU (sm90) from the repository root:
    PYTHONPATH=. python3 benchmarks/fp8_gluon.py --small    # awkward shapes against fp8_grouped_mm
    PYTHONPATH=. python3 benchmarks/fp8_gluon.py            # the bench shapes: times against ops/15 and bf16"""
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, fence_async_shared, warpgroup_mma,
                                                                warpgroup_mma_wait)


@gluon.jit
def _step(a_s, b_s, ready, a_desc, b_desc, zero, prev, i, row0, b_row, KB, BK: gl.constexpr, STAGES: gl.constexpr,
          nbytes: gl.constexpr, OVERLAP: gl.constexpr):
    "Issue step i's product (async); wait for step i - 1's (`prev`) and refill its stage. Returns (token, prev done)."
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    if OVERLAP:
        nxt = warpgroup_mma(a_s.index(slot), b_s.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
        done = warpgroup_mma_wait(num_outstanding=1, deps=(prev, ))
    else:
        done = warpgroup_mma_wait(num_outstanding=0, deps=(prev, ))
        nxt = warpgroup_mma(a_s.index(slot), b_s.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
    k_next = i - 1 + STAGES
    free = (i - 1) % STAGES
    pred = k_next < KB
    mbarrier.expect(ready.index(free), nbytes, pred)
    tma.async_copy_global_to_shared(a_desc, [row0, k_next * BK], ready.index(free), a_s.index(free), pred)
    tma.async_copy_global_to_shared(b_desc, [b_row, k_next * BK], ready.index(free), b_s.index(free), pred)
    return nxt, done


@gluon.jit
def _program_tile(tile_offs_ptr, N, E, BN: gl.constexpr, E_P2: gl.constexpr, num_warps: gl.constexpr):
    "(row tile t, column tile j, expert e) of this program; e = #{e : tile_offs[e+1] <= t}, E past the last tile."
    n_tiles = gl.cdiv(N, BN)
    t = gl.program_id(0) // n_tiles
    j = gl.program_id(0) % n_tiles
    lane_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    lanes = gl.arange(0, E_P2, lane_l)
    ends = gl.load(tile_offs_ptr + 1 + lanes, mask=lanes < E, other=2147483647)
    return t, j, gl.sum((ends <= t).to(gl.int32), axis=0)


@gluon.jit
def _tile_rows(row_offs_ptr, tile_offs_ptr, t, e, BM: gl.constexpr):
    "The first row of row tile t (of expert e) and the end of the expert's rows."
    return gl.load(row_offs_ptr + e) + (t - gl.load(tile_offs_ptr + e)) * BM, gl.load(row_offs_ptr + e + 1)


@gluon.jit
def _tile_setup(row_offs_ptr, tile_offs_ptr, sb_ptr, t, j, e, N, BM: gl.constexpr, BN: gl.constexpr,
                KB: gl.constexpr, mma_l: gl.constexpr):
    "(first row, the tile's rows and which are the expert's, first column, B's scales) of a whole-tile kernel."
    row0, row_end = _tile_rows(row_offs_ptr, tile_offs_ptr, t, e, BM)
    col0 = j * BN
    rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, mma_l))
    return row0, rows, rows < row_end, col0, sb_ptr + (e * gl.cdiv(N, 128) + col0 // 128) * KB


@gluon.jit
def _fp8_gemm_gluon(a_desc, b_desc, sa_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, E,
                    K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, E_P2: gl.constexpr,
                    STAGES: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    t, j, e = _program_tile(tile_offs_ptr, N, E, BN, E_P2, num_warps)
    if e < E:
        KB: gl.constexpr = (K + BK - 1) // BK
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 32])
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
        row0, rows, row_ok, col0, sb_base = _tile_setup(row_offs_ptr, tile_offs_ptr, sb_ptr, t, j, e, N, BM, BN, KB,
                                                        mma_l)

        a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        fence_async_shared()
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        b_row = e * N + col0
        for s in gl.static_range(STAGES):   # every stage starts full: step s in stage s
            pred = s < KB
            mbarrier.expect(ready.index(s), nbytes, pred)
            tma.async_copy_global_to_shared(a_desc, [row0, s * BK], ready.index(s), a_s.index(s), pred)
            tma.async_copy_global_to_shared(b_desc, [b_row, s * BK], ready.index(s), b_s.index(s), pred)

        zero = gl.zeros([BM, BN], gl.float32, mma_l)
        acc = gl.zeros([BM, BN], gl.float32, mma_l)
        # K is a compile-time constant and the loop over its steps is unrolled, so that the accumulator of the
        # product in flight is never a loop-carried value (whose copy would make ptxas serialise the MMAs).
        mbarrier.wait(ready.index(0), 0)
        part = warpgroup_mma(a_s.index(0), b_s.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        scale = gl.load(sa_ptr + rows, mask=row_ok, other=0.0) * gl.load(sb_base)
        for i in gl.static_range(1, KB):
            nxt, done = _step(a_s, b_s, ready, a_desc, b_desc, zero, part, i, row0, b_row, KB, BK, STAGES, nbytes,
                              OVERLAP)
            acc += done * scale[:, None]
            scale = gl.load(sa_ptr + i * M + rows, mask=row_ok, other=0.0) * gl.load(sb_base + i)
            part = nxt
        done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        acc += done * scale[:, None]
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
        cols = col0 + gl.arange(0, BN, col_l)
        ptrs = c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
        gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


@gluon.jit
def _ws_loader(a_desc, b_desc, a_s, b_s, ready, empty, row0, b_row, KB: gl.constexpr, BK: gl.constexpr,
               STAGES: gl.constexpr):
    "Producer warp: step i's A and B tiles into stage i % STAGES once the math warps have released it."
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for i in range(KB):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
        mbarrier.expect(ready.index(slot), nbytes)
        tma.async_copy_global_to_shared(a_desc, [row0, i * BK], ready.index(slot), a_s.index(slot))
        tma.async_copy_global_to_shared(b_desc, [b_row, i * BK], ready.index(slot), b_s.index(slot))


@gluon.jit
def _ws_math(a_s, b_s, ready, empty, sa_ptr, sb_base, rows, row_ok, M, KB: gl.constexpr, STAGES: gl.constexpr,
             BM: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    "Math warps: each product waited for, its stage released, then promoted (nothing in flight across iterations)."
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, BN, 32])
    zero = gl.zeros([BM, BN], gl.float32, mma_l)
    acc = gl.zeros([BM, BN], gl.float32, mma_l)
    for i in range(KB):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        part = warpgroup_mma(a_s.index(slot), b_s.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        mbarrier.arrive(empty.index(slot))
        scale = gl.load(sa_ptr + i * M + rows, mask=row_ok, other=0.0) * gl.load(sb_base + i)
        acc += done * scale[:, None]
    return (acc, )


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr, RELEASERS: gl.constexpr):
    "The warp-specialised kernels' ring: A and B stages, a `ready` barrier (the loads) and an `empty` one per stage."
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=RELEASERS)
    fence_async_shared()
    return a_s, b_s, ready, empty


@gluon.jit
def _fp8_gemm_gluon_ws(a_desc, b_desc, sa_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, E,
                       K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, E_P2: gl.constexpr,
                       STAGES: gl.constexpr, num_warps: gl.constexpr):
    "The same GEMM with a producer warp for the loads (gl.warp_specialize) and the default warps for the math."
    t, j, e = _program_tile(tile_offs_ptr, N, E, BN, E_P2, num_warps)
    if e < E:
        KB: gl.constexpr = (K + BK - 1) // BK
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 32])
        row0, rows, row_ok, col0, sb_base = _tile_setup(row_offs_ptr, tile_offs_ptr, sb_ptr, t, j, e, N, BM, BN, KB,
                                                        mma_l)
        a_s, b_s, ready, empty = _ring(a_desc, b_desc, STAGES, 1)
        res = gl.warp_specialize([(_ws_math, (a_s, b_s, ready, empty, sa_ptr, sb_base, rows, row_ok, M, KB, STAGES,
                                              BM, BN, num_warps)),
                                  (_ws_loader, (a_desc, b_desc, a_s, b_s, ready, empty, row0, e * N + col0, KB, BK,
                                                STAGES))], [1], [24])
        acc = res[0]
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        cols = col0 + gl.arange(0, BN, gl.SliceLayout(0, mma_l))
        ptrs = c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
        gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


@gluon.jit
def _ws2_math(a_s, b_s, ready, empty, sa_ptr, sb_base, c_ptr, row0, row_end, col0, M, N, HALF: gl.constexpr,
              KB: gl.constexpr, STAGES: gl.constexpr, BMH: gl.constexpr, BN: gl.constexpr, EARLY: gl.constexpr):
    "One math warp group: rows [HALF·BMH, (HALF+1)·BMH) of the tile, its own loop, promotion and store."
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows = row0 + HALF * BMH + gl.arange(0, BMH, gl.SliceLayout(1, mma_l))
    row_ok = rows < row_end
    zero = gl.zeros([BMH, BN], gl.float32, mma_l)
    acc = gl.zeros([BMH, BN], gl.float32, mma_l)
    nxt_sa = gl.load(sa_ptr + rows, mask=row_ok, other=0.0)
    nxt_sb = gl.load(sb_base)
    for i in range(KB):
        slot = i % STAGES
        if EARLY == 1:   # the step's scales are read before its product, so their latency hides under it
            scale = gl.load(sa_ptr + i * M + rows, mask=row_ok, other=0.0) * gl.load(sb_base + i)
        if EARLY == 2:   # read one step ahead
            scale = nxt_sa * nxt_sb
            nxt_sa = gl.load(sa_ptr + (i + 1) * M + rows, mask=row_ok & (i + 1 < KB), other=0.0)
            nxt_sb = gl.load(sb_base + i + 1, mask=i + 1 < KB, other=0.0)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        a_half = a_s.index(slot).slice(HALF * BMH, BMH, dim=0)
        part = warpgroup_mma(a_half, b_s.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        mbarrier.arrive(empty.index(slot))
        if EARLY == 0:
            scale = gl.load(sa_ptr + i * M + rows, mask=row_ok, other=0.0) * gl.load(sb_base + i)
        acc += done * scale[:, None]
    cols = col0 + gl.arange(0, BN, gl.SliceLayout(0, mma_l))
    ptrs = c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


@gluon.jit
def _fp8_gemm_gluon_ws2(a_desc, b_desc, sa_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, E,
                        K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, E_P2: gl.constexpr,
                        STAGES: gl.constexpr, EARLY: gl.constexpr, num_warps: gl.constexpr):
    """DeepGEMM's structure: a producer warp for the loads and two math warp groups as partitions of their own, each
    with half the tile's rows, so that one's promotion can run while the other's product is on the tensor cores."""
    gl.static_assert(num_warps == 4)
    t, j, e = _program_tile(tile_offs_ptr, N, E, BN, E_P2, num_warps)
    if e < E:
        row0, row_end = _tile_rows(row_offs_ptr, tile_offs_ptr, t, e, BM)
        col0 = j * BN
        KB: gl.constexpr = (K + BK - 1) // BK
        sb_base = sb_ptr + (e * gl.cdiv(N, 128) + col0 // 128) * KB
        a_s, b_s, ready, empty = _ring(a_desc, b_desc, STAGES, 2)   # both math warp groups release a stage
        gl.warp_specialize([(_ws2_math, (a_s, b_s, ready, empty, sa_ptr, sb_base, c_ptr, row0, row_end, col0, M, N,
                                         0, KB, STAGES, BM // 2, BN, EARLY)),
                            (_ws2_math, (a_s, b_s, ready, empty, sa_ptr, sb_base, c_ptr, row0, row_end, col0, M, N,
                                         1, KB, STAGES, BM // 2, BN, EARLY)),
                            (_ws_loader, (a_desc, b_desc, a_s, b_s, ready, empty, row0, e * N + col0, KB, BK,
                                          STAGES))], [4, 1], [232, 24])   # registers: math group, loader
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))


def fp8_grouped_mm_gluon(qa, sa, qb, sb, counts, out_dtype, bm=128, bn=128, stages=4, warps=8, overlap=True,
                         ws=False):
    "fp8.fp8_grouped_mm's contract (BK = 128, BN divides 128), by the Gluon kernel above."
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from pith_lit.ops import fp8
    (M, K), (E, N) = qa.shape, qb.shape[:2]
    c = torch.empty(M, N, dtype=out_dtype, device=qa.device)
    grid = fp8._max_tiles(M, E, bm) * triton.cdiv(N, bn)
    row_offs, tile_offs = fp8._schedule(counts, bm)
    a_l = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)
    b_l = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    a_d = TensorDescriptor(qa, [M, K], [K, 1], [bm, 128], a_l)
    qb2 = qb.reshape(E * N, K)
    b_d = TensorDescriptor(qb2, [E * N, K], [K, 1], [bn, 128], b_l)
    args = (a_d, b_d, sa.t().contiguous(), sb.contiguous(), c, row_offs, tile_offs, M, N, E)
    consts = dict(K=K, BM=bm, BN=bn, BK=128, E_P2=fp8._e_p2(E), STAGES=stages)
    if ws == 2:   # two math partitions of 4 warps; `overlap` then says when each step's scales are read: 0 after
        # its product, 1 before it, 2 one step ahead
        _fp8_gemm_gluon_ws2[(grid,)](*args, **consts, EARLY=overlap, num_warps=4)
    elif ws:      # one producer warp, the default warps multiply and promote; `overlap` unused
        _fp8_gemm_gluon_ws[(grid,)](*args, **consts, num_warps=warps)
    else:
        _fp8_gemm_gluon[(grid,)](*args, **consts, OVERLAP=overlap, num_warps=warps)
    return c


# (BM, BN, stages, warps, overlap, warp-specialised)
CONFIGS = [(128, 128, 4, 4, 0, 2), (128, 128, 4, 4, 1, 2), (128, 128, 4, 4, 2, 2), (128, 128, 3, 4, 2, 2),
           (128, 128, 2, 4, 2, 2)]


def small():
    "A few awkward shapes against ops/15's kernel: empty experts, partial tiles, K shorter than the stages."
    import torch
    from pith_lit.ops import fp8
    g = torch.Generator(device="cuda").manual_seed(0)
    for counts, K, N in [([130, 0, 257, 64], 384, 192), ([1, 300, 0, 5], 2048, 256), ([128, 128], 768, 128)]:
        counts = torch.tensor(counts, device="cuda")
        n, E = int(counts.sum()), counts.numel()
        x = torch.randn(n + 7, K, device="cuda", generator=g).bfloat16()
        w = torch.randn(E, N, K, device="cuda", generator=g).bfloat16()
        a = fp8.quantize_act(x, counts)
        qw, sw = fp8.quantize_weight(w)
        ref = fp8.fp8_grouped_mm(a.q, a.s, qw, sw, counts, torch.bfloat16)[:n].float()
        for bm, bn, warps, overlap, ws in [(64, 64, 4, True, False), (128, 128, 8, False, True),
                                           (128, 128, 4, 0, 2), (128, 128, 4, 1, 2), (128, 128, 4, 2, 2)]:
            out = fp8_grouped_mm_gluon(a.q, a.s, qw, sw, counts, torch.bfloat16, bm, bn, 4, warps, overlap, ws)
            torch.cuda.synchronize()
            err = ((out[:n].float() - ref).norm() / ref.norm()).item()
            print("small", counts.tolist(), K, N, bm, bn, warps, overlap, ws, f"{err:.2e}", flush=True)
            assert err < 1e-2, err


def main():
    import torch
    from triton.testing import do_bench
    from pith_lit.ops import fp8
    sys.path.insert(0, "benchmarks")
    from fp8_bench import routed_counts
    res = {}
    for name, (H, I, E, k) in {"qwen3": (2048, 768, 128, 8), "dsv2": (2048, 1408, 64, 6)}.items():
        counts = routed_counts(16384, E, k)
        n = int(counts.sum())
        g = torch.Generator(device="cuda").manual_seed(0)
        for proj, (K, N) in {"gate_up": (H, 2 * I), "down": (I, H)}.items():
            x = torch.randn(n, K, device="cuda", generator=g).bfloat16()
            w = (torch.randn(E, N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
            a = fp8.quantize_act(x, counts)
            qw, sw = fp8.quantize_weight(w)
            ref = fp8.fp8_grouped_mm(a.q, a.s, qw, sw, counts, torch.bfloat16)
            flops = 2 * n * N * K
            t_ref = do_bench(lambda: fp8.fp8_grouped_mm(a.q, a.s, qw, sw, counts, torch.bfloat16),
                             return_mode="median")
            offs = counts.cumsum(0).to(torch.int32)
            wt = w.transpose(1, 2)
            t_bf = do_bench(lambda: torch.nn.functional.grouped_mm(x, wt, offs=offs), return_mode="median")
            print(f"{name} {proj} ({n}x{K} -> {N}): ops15 {t_ref:.3f} ms {flops / t_ref / 1e9:.0f} TFLOP/s; "
                  f"bf16 {t_bf:.3f} ms {flops / t_bf / 1e9:.0f}", flush=True)
            res[f"{name} {proj} ops15"] = t_ref
            res[f"{name} {proj} bf16"] = t_bf
            for bm, bn, stages, warps, overlap, ws in CONFIGS:
                mode = ('late', 'early', 'ahead')[overlap] if ws == 2 else 'overlap' if overlap else 'serial'
                key = (f"{name} {proj} gluon{' ws' * bool(ws)}{'2' if ws == 2 else ''} bm{bm} bn{bn} st{stages} "
                       f"w{warps} {mode}")
                try:
                    out = fp8_grouped_mm_gluon(a.q, a.s, qw, sw, counts, torch.bfloat16, bm, bn, stages, warps,
                                               overlap, ws)
                    torch.cuda.synchronize()
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = do_bench(lambda: fp8_grouped_mm_gluon(a.q, a.s, qw, sw, counts, torch.bfloat16, bm, bn,
                                                              stages, warps, overlap, ws), return_mode="median")
                except Exception as ex:
                    print(key, "ERR", str(ex)[:400], flush=True)
                    continue
                res[key] = t
                print(f"{key}: {t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s, vs ops15 {err:.1e}", flush=True)
    return res


if __name__ == "__main__":
    import json, os
    if "--small" in sys.argv:
        small()
        sys.exit(0)
    r = main()
    json.dump(r, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_gluon.json"), "w"), indent=1)
