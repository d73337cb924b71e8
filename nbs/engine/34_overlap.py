# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # How much communication is hidden
#
# The point of the five-stage split and of DualPipeV is that all-to-alls and pipeline sends run *while* the GPU
# computes. Whether they do is a question for a profiler trace, not for the schedule's intentions: this notebook
# reads a `torch.profiler` trace (the Chrome-trace JSON that `prof.export_chrome_trace` writes) and reports, per
# rank and per stage, how much communication time was covered by compute kernels running at the same moment, and
# how much was *exposed* (the GPU did nothing but communicate).
#
# Definitions, on the GPU timeline of one trace:
# - **communication** = kernels whose name contains `nccl` (all-to-all, send/recv, all-reduce), on any stream;
# - **compute** = every other kernel;
# - **exposed** = the time covered by communication and by no compute kernel; **hidden** = communication time minus
#   exposed; the hidden fraction is hidden / communication. Times are measures of unions of intervals, so two
#   overlapping communication kernels are not counted twice.
# - **per stage**, the trace's `gpu_user_annotation` ranges (the GPU-side spans of `torch.profiler.record_function`
#   labels, such as the F, B and W slots of a DualPipeV step) cut the timeline; each label's row sums its windows;
# - **idle** = the time inside the trace's GPU span when no kernel at all runs: the GPU waits for the host
#   (launch overhead, a host synchronisation) rather than for the network.
#
# One caution when reading the numbers: an NCCL kernel starts when its stream reaches it and ends when the
# transfer is done, so its duration includes **waiting for the peer** to arrive at the same collective. When one
# rank has more work (more tokens routed to its experts, or a pipeline bubble), the other's communication kernels
# stretch by that difference. Exposed communication is therefore "the GPU waited on communication", for either
# reason; the byte volume alone would give much smaller times.
#
# `python benchmarks/overlap.py TRACE.json [TRACE.json ...]` prints one table per trace (one per rank), then the
# kernels that took the most GPU time (`--top N`); with `--peers` and the two traces of a two-rank group it splits
# each rank's communication into waiting for the other rank and transfer (below). The code is that script's, a
# measurement that stays outside the package; this notebook states what it computes and checks each piece.

# %%
import json

from benchmarks.overlap import (intersect, length, main, overlap_report, peer_report, subtract,
                                top_kernels, union)

# %% [markdown]
# ## Intervals
#
# Everything reduces to three operations on sorted, disjoint interval lists: the union (merge what overlaps),
# the intersection and the difference.

# %%
assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)] and length([(2, 3), (5, 6)]) == 2
assert subtract([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]

# %% [markdown]
# ## The report
#
# Check on a trace written by hand: an all-to-all of 100 µs of which a matmul covers the first 60, a send of
# 50 µs with nothing beside it, and two stage annotations. Half of the exposed time is the send.

# %%
def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def stage(name, ts, dur):
    return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur}


demo = {"traceEvents": [kernel("sm90_xmma_gemm_bf16", 0, 60), kernel("ncclDevKernel_AllToAll_RING", 0, 100),
                        kernel("ncclDevKernel_SendRecv", 200, 50), kernel("triton_gather_rows", 90, 20),
                        stage("F0+B1", 0, 150), stage("W1", 150, 120)]}
r = overlap_report(demo)
print(json.dumps(r, indent=1))
assert abs(r["total"]["comm_ms"] - 0.150) < 1e-9 and abs(r["total"]["exposed_ms"] - 0.080) < 1e-9
assert abs(r["stages"]["F0+B1"]["hidden_frac"] - 0.7) < 1e-9 and r["stages"]["W1"]["hidden_frac"] == 0.0
# the span is 0..250 µs; kernels cover 0..110 and 200..250, so the GPU idled for 90 µs
assert abs(r["total"]["span_ms"] - 0.250) < 1e-9 and abs(r["total"]["idle_ms"] - 0.090) < 1e-9
assert abs(r["total"]["compute_ms"] - 0.080) < 1e-9   # the matmul 0..60 and the gather 90..110
assert top_kernels(demo, 2) == [("ncclDevKernel_AllToAll_RING", 1, 0.1), ("sm90_xmma_gemm_bf16", 1, 0.06)]

# %% [markdown]
# ## Waiting for the peer, and moving bytes
#
# With the traces of both ranks of a two-rank group the two parts can be told apart. Every rank issues the same
# collectives in the same order on each of its NCCL streams, so the i-th NCCL kernel of a stream on one rank and
# the i-th of the matching stream on the other are the same collective (streams are matched by the order of their
# first NCCL kernel). A collective finishes at about the same moment on both ranks; the rank that started it
# earlier **waited for its peer** until the later one started, and from then on both were present: that part is
# the **transfer**. `peer_report(a, b)` splits rank a's NCCL time this way and says how much of each part compute
# covered. The two traces' clocks are aligned by the median difference of the collectives' end times (on one host
# they share a clock and the offset is near zero).
#
# Waiting exposed is a rank that had nothing to compute while the other rank was late (load imbalance, a slower
# host); transfer exposed is bytes moving with nothing beside them, the part the schedule is meant to hide.

# %% [markdown]
# Check by hand: rank a starts an all-to-all at 0 and rank b at 40 (µs), both finish at 100; a computes from 0 to
# 30 and from 70 to 90. Rank a waited 40 µs (10 of them exposed) and was present with b for 60 µs, of which 20
# had compute beside them. Rank b waited for nothing. Then b's clock is shifted by 1000 µs: the offset absorbs it.

# %%
a = {"traceEvents": [kernel("ncclDevKernel_SendRecv", 0, 100), kernel("gemm", 0, 30), kernel("gemm", 70, 20)]}
b = {"traceEvents": [kernel("ncclDevKernel_SendRecv", 40, 60)]}
ra, rb = peer_report(a, b), peer_report(b, a)
print(ra, rb, sep="\n")
assert abs(ra["wait_ms"] - 0.040) < 1e-9 and abs(ra["wait_exposed_ms"] - 0.010) < 1e-9
assert abs(ra["transfer_ms"] - 0.060) < 1e-9 and abs(ra["transfer_exposed_ms"] - 0.040) < 1e-9
assert rb["wait_ms"] == 0 and abs(rb["transfer_ms"] - 0.060) < 1e-9 and rb["transfer_hidden_frac"] == 0
late = {"traceEvents": [dict(e, ts=e["ts"] + 1000) for e in b["traceEvents"]]}
assert peer_report(a, late) == dict(ra, offset_us=-1000.0)

# %% [markdown]
# ## Command line
#
# On a GPU machine, record a step with `torch.profiler.profile(activities=[CPU, CUDA])` around
# `DualPipeV.step` (its slots are `record_function` ranges named as in its timeline: `F0`, `B1`, `F0&B1`, `W`,
# `comm`), export one trace per rank with `prof.export_chrome_trace(f"trace_rank{rank}.json")`, and run the
# command above on them.
