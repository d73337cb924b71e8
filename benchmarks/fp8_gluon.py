"""Experiment: ops/15's block-scaled FP8 grouped GEMM written in Gluon (Triton's lower-level language) so that each
128-deep product's promotion (acc += partial · scale) can run while the tensor cores compute the next product: the
products are issued as async warpgroup MMAs, and the wait before a promotion leaves the newest one in flight. K is a
compile-time constant and the loop over its steps is unrolled, so no in-flight accumulator is a loop-carried value.
A and B tiles come by TMA into a ring of shared-memory stages. Same contract as `fp8.fp8_grouped_mm`, whose results it
gives bit for bit; on the H200 it runs at about half that kernel's speed (benchmarks/RESULTS.md, "Attention and FP8
experiments"). Run on a GPU (sm90) from the repository root:
    PYTHONPATH=. python3 benchmarks/fp8_gluon.py --small    # awkward shapes against fp8_grouped_mm
    PYTHONPATH=. python3 benchmarks/fp8_gluon.py            # the bench shapes: times against ops/15 and bf16"""
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
def _fp8_gemm_gluon(a_desc, b_desc, sa_ptr, sb_ptr, c_ptr, row_offs_ptr, tile_offs_ptr, M, N, E,
                    K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, E_P2: gl.constexpr,
                    STAGES: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    n_tiles = gl.cdiv(N, BN)
    t = gl.program_id(0) // n_tiles
    j = gl.program_id(0) % n_tiles
    # the expert of tile t: #{e : tile_offs[e+1] <= t}
    lane_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    lanes = gl.arange(0, E_P2, lane_l)
    ends = gl.load(tile_offs_ptr + 1 + lanes, mask=lanes < E, other=2147483647)
    e = gl.sum((ends <= t).to(gl.int32), axis=0)
    if e < E:
        row0 = gl.load(row_offs_ptr + e) + (t - gl.load(tile_offs_ptr + e)) * BM
        row_end = gl.load(row_offs_ptr + e + 1)
        col0 = j * BN
        KB: gl.constexpr = (K + BK - 1) // BK

        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BN, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
        rows = row0 + gl.arange(0, BM, row_l)
        row_ok = rows < row_end
        sb_base = sb_ptr + (e * gl.cdiv(N, 128) + col0 // 128) * KB

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


def fp8_grouped_mm_gluon(qa, sa, qb, sb, counts, out_dtype, bm=128, bn=128, stages=4, warps=8, overlap=True):
    "fp8.fp8_grouped_mm's contract (BK = 128, BN divides 128), by the Gluon kernel above."
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from pith_lit.ops import fp8
    (M, K), (E, N) = qa.shape, qb.shape[:2]
    KB = triton.cdiv(K, 128)
    c = torch.empty(M, N, dtype=out_dtype, device=qa.device)
    grid = fp8._max_tiles(M, E, bm) * triton.cdiv(N, bn)
    row_offs, tile_offs = fp8._schedule(counts, bm)
    a_l = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)
    b_l = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    a_d = TensorDescriptor(qa, [M, K], [K, 1], [bm, 128], a_l)
    qb2 = qb.reshape(E * N, K)
    b_d = TensorDescriptor(qb2, [E * N, K], [K, 1], [bn, 128], b_l)
    _fp8_gemm_gluon[(grid,)](a_d, b_d, sa.t().contiguous(), sb.contiguous(), c, row_offs, tile_offs, M, N, E,
                             K=K, BM=bm, BN=bn, BK=128, E_P2=fp8._e_p2(E), STAGES=stages, OVERLAP=overlap,
                             num_warps=warps)
    return c


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
        for bm, bn, warps in [(128, 64, 8), (64, 64, 4), (128, 128, 8)]:
            for overlap in (True, False):
                out = fp8_grouped_mm_gluon(a.q, a.s, qw, sw, counts, torch.bfloat16, bm, bn, 4, warps, overlap)
                torch.cuda.synchronize()
                err = ((out[:n].float() - ref).norm() / ref.norm()).item()
                print("small", counts.tolist(), K, N, bm, bn, warps, overlap, f"{err:.2e}", flush=True)
                assert err < 1e-2, err


def main():
    import torch
    from triton.testing import do_bench
    from pith_lit.ops import fp8
    sys_path = __import__("sys").path
    sys_path.insert(0, "benchmarks")
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
            for bm, bn, stages, warps, overlap in [(128, 64, 4, 8, True), (128, 64, 4, 8, False),
                                                   (128, 64, 6, 8, True), (64, 64, 4, 4, True),
                                                   (64, 64, 8, 4, True), (128, 128, 4, 8, True)]:
                key = f"{name} {proj} gluon bm{bm} bn{bn} st{stages} w{warps} {'overlap' if overlap else 'serial'}"
                try:
                    out = fp8_grouped_mm_gluon(a.q, a.s, qw, sw, counts, torch.bfloat16, bm, bn, stages, warps,
                                               overlap)
                    torch.cuda.synchronize()
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = do_bench(lambda: fp8_grouped_mm_gluon(a.q, a.s, qw, sw, counts, torch.bfloat16, bm, bn,
                                                              stages, warps, overlap), return_mode="median")
                except Exception as ex:
                    print(key, "ERR", str(ex)[:400], flush=True)
                    continue
                res[key] = t
                print(f"{key}: {t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s, vs ops15 {err:.1e}", flush=True)
    return res


if __name__ == "__main__":
    import json, os, sys
    if "--small" in sys.argv:
        small()
        sys.exit(0)
    r = main()
    json.dump(r, open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_gluon.json"), "w"), indent=1)
