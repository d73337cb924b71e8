#!/usr/bin/env bash
# The two-GPU measurements in benchmarks/RESULTS.md: expert parallelism, the overlapped schedule at pp 1 and
# DualPipeV at pp 2 against one GPU, on the bench configs. Run from the repository root on a machine with two GPUs:
#
#     OUT=/tmp/two_gpus bash benchmarks/two_gpus.sh [STEPS] [SUITE]
#
# SUITE `base` (the default): the bench configs as they are (Qwen3 at global batch 16), one and two GPUs, plain,
# overlapped and pipelined. SUITE `more`: Qwen3 at global batch 32 (8 micro-batches per rank at ep 2, so most
# DualPipeV slots pair a forward with a backward), with and without `train.compile`. SUITE `deep`:
# DeepSeek-V2-Lite at its full 27 layers on two GPUs at pp 2, and compiled Qwen3 at pp 2. SUITE `ep`: the
# overlapped ep 2 run of `more` again, and compiled plain ep 2. SUITES `combine`, `compiled` and `syncfree`: ep 2
# with combine summed on the experts' rank, with and without the sync-free dispatcher, uncompiled and compiled,
# overlapped and plain, some traces recorded without host-side operators (see the suites); `single`: the
# single-GPU baselines of `more` alone; `dsv2free`: DeepSeek-V2-Lite with the sync-free dispatcher; `mb4`: Qwen3
# at micro-batch 4 with the sync-free dispatcher; `streams`: the overlapped sync-free run with a second ep
# communicator for backward and with high-priority communication streams; `paired` and `carveout`: after the
# overlapped schedule's pairing change, without and with SMs left for communication (parallel.comm_sms);
# `gb64`: compiled micro-batch 4 at global batch 64, plain and overlapped; `alloc` (in six parts, PART=1 to 6):
# the same after the allocator, load-balance, one-rank pairing and permutation changes, each compared with its
# absence, compiled Qwen3 at pp 2 with and without fewer layers at the edges, and DeepSeek-V2-Lite. The suites
# measured before parallel.comm_sms existed run with it at 0, as they were measured; `carveout`, `gb64` and `alloc`
# use its value. Likewise every suite but `alloc` and `p2p` turns parallel.ep_permute_in_compute off (the
# load-balance change has no switch: those suites now run with it). `p2p` (PART=1 to 5): DualPipeV at pp 2 with
# its transfers beside compute or batched, and with different stage sizes (see the suite).
#
# Every run writes runs/two_gpus/<name>/{metrics.jsonl,trace-rank*.json} and runs/two_gpus/logs/<name>.log. The
# single-GPU baselines run side by side, one per GPU. Each multi-GPU run records one step with torch.profiler, and
# `python -m pith_lit.engine.overlap` reports its hidden and exposed communication. After each run, $OUT/two_gpus.tgz
# is refreshed with everything but the traces. The last thing printed is a table (also in $OUT/summary.json)
# made by benchmarks/summarise.py.
set -u
OUT=${OUT:-/tmp/two_gpus}
STEPS=${1:-30}
SUITE=${2:-base}
PROFILE=$((STEPS - 5))
LOGS=runs/two_gpus/logs
mkdir -p "$OUT" $LOGS
export PYTHONUNBUFFERED=1
Q=${Q:-configs/bench-qwen3-30b-a3b.toml}      # Q=configs/tiny.toml D=configs/tiny-deepseek-v2.toml: a CPU trial
D=${D:-configs/bench-deepseek-v2-lite.toml}
# Qwen3 at global batch 16 (8 micro-batches of 2 on one GPU; 4 per rank at ep 2; 8 through DualPipeV at pp 2).
QSET="--set train.global_batch=16 --set train.steps=$STEPS --set train.warmup=5 --set log.tensorboard=false"
Q32="$QSET --set train.global_batch=32"    # the suites more, deep and ep
DSET="--set train.steps=$STEPS --set train.warmup=5 --set log.tensorboard=false"
EP2="--set parallel.ep=2"
OVL="--set parallel.overlap=true"
FREE="--set parallel.ep_sync_free=true"
COMPILE="--set train.compile=true"
GPUONLY="--set log.profile_host=false"   # trace GPU kernels only
MB4="--set train.micro_batch=4"
G64="--set train.global_batch=64"
TWIN="--set parallel.ep_backward_group=true"   # backward's all-to-alls on a second communicator
PRIO="--set parallel.comm_priority=true"       # high-priority communication streams
SM16="--set parallel.comm_sms=16"
NOEXP="--set train.expandable_segments=false"
EXP="--set train.expandable_segments=true"
ONCOMM="--set parallel.ep_permute_in_compute=false"   # as before that setting existed
case $SUITE in carveout|gb64|alloc|p2p) SMS="" ;; *) SMS="--set parallel.comm_sms=0" ;; esac   # see above
case $SUITE in alloc|p2p) PIN="" ;; *) PIN="$ONCOMM" ;; esac

report() {  # NAME: the communication report of each rank's trace, and of both together (waiting and transfer)
  for r in 0 1; do
    [ -f runs/two_gpus/$1/trace-rank$r.json ] && \
      python3 -m pith_lit.engine.overlap runs/two_gpus/$1/trace-rank$r.json > "$LOGS/$1.overlap$r.txt"
  done
  [ -f runs/two_gpus/$1/trace-rank1.json ] && python3 -m pith_lit.engine.overlap --peers \
    runs/two_gpus/$1/trace-rank0.json runs/two_gpus/$1/trace-rank1.json > "$LOGS/$1.peers.txt"
}
keep() { tar czf "$OUT/two_gpus.tgz" --exclude 'trace-*' runs/two_gpus; }
singles() {  # the single-GPU baselines of Qwen3 at global batch 32, plain and compiled, one per GPU
  one qwen32_1gpu 0 $Q $Q32 &
  one qwen32c_1gpu 1 $Q $Q32 $COMPILE &
  wait
}
one() {  # NAME GPU CONFIG ARGS...: one process on one GPU, profiling one step
  local name=$1 gpu=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout 400 python3 -m pith_lit.train "$@" $PIN --set run.dir=runs/two_gpus/$name \
    --set log.profile_step=$PROFILE > "$LOGS/$name.log" 2>&1
  echo "$name: exit $? at $(date +%T)"
  report $name
}
two() {  # NAME CONFIG ARGS...: two processes, one per GPU, profiling one step
  local name=$1; shift
  timeout 400 python3 -m torch.distributed.run --nproc-per-node 2 -m pith_lit.train "$@" $SMS $PIN \
    --set run.dir=runs/two_gpus/$name --set log.profile_step=$PROFILE > "$LOGS/$name.log" 2>&1
  echo "$name: exit $? at $(date +%T)"
  report $name
  keep
}

case $SUITE in
base)
  # The single-GPU baselines, one per GPU, at the same time: plain, and the overlapped schedule (P = 1, nothing to
  # hide on one GPU, so this is its overhead).
  one qwen_1gpu 0 $Q $QSET &
  one qwen_1gpu_overlap 1 $Q $QSET --set parallel.overlap=true &
  wait
  keep
  two qwen_ep2 $Q $QSET --set parallel.ep=2
  two qwen_ep2_overlap $Q $QSET --set parallel.ep=2 --set parallel.overlap=true
  two qwen_pp2 $Q $QSET --set parallel.pp=2
  one dsv2_1gpu 0 $D $DSET
  two dsv2_ep2_overlap $D $DSET --set parallel.ep=2 --set parallel.overlap=true
  two dsv2_pp2 $D $DSET --set parallel.pp=2
  ;;
more)
  singles
  keep
  two qwen32_ep2 $Q $Q32 --set parallel.ep=2
  two qwen32_ep2_overlap $Q $Q32 --set parallel.ep=2 --set parallel.overlap=true
  two qwen32c_ep2_overlap $Q $Q32 --set parallel.ep=2 --set parallel.overlap=true --set train.compile=true
  ;;
deep)
  # DeepSeek-V2-Lite, all 27 layers (15.7B parameters), on two GPUs at pp 2 with the bench config's training
  # settings; and compiled Qwen3 at pp 2 for the compiled single-GPU run of `more`.
  two dsv2full_pp2 configs/deepseek-v2-lite.toml $DSET --set parallel.pp=2 --set parallel.ep=1 \
    --set train.global_batch=16 --set train.micro_batch=4 --set train.lr=3e-4 --set train.dtype=bfloat16 \
    --set train.optim_dtype=bfloat16 --set data.corpus=stdlib --set data.tokenizer=bytes --set ckpt.every=-1 \
    --set log.sample_tokens=0
  two qwen32c_pp2 $Q $Q32 --set parallel.pp=2 --set train.compile=true
  ;;
ep)
  # The ep 2 runs of `more` without their single-GPU baselines: after a change to the overlapped path
  two qwen32_ep2_overlap $Q $Q32 --set parallel.ep=2 --set parallel.overlap=true
  two qwen32c_ep2 $Q $Q32 --set parallel.ep=2 --set train.compile=true
  ;;
combine)
  # Combine summed on the experts' rank (parallel.ep_combine = sum, the default) at ep 2, overlapped and plain,
  # and the overlapped run again profiled without host-side operators.
  two qwen32_ep2_overlap_sum $Q $Q32 $EP2 $OVL
  two qwen32_ep2_overlap_sum_gpu $Q $Q32 $EP2 $OVL $GPUONLY
  two qwen32_ep2_sum $Q $Q32 $EP2
  ;;
compiled)
  # The same with train.compile: ep 2 overlapped (profiled without host-side operators) and plain.
  two qwen32c_ep2_overlap_sum_gpu $Q $Q32 $EP2 $OVL $COMPILE $GPUONLY
  two qwen32c_ep2_sum $Q $Q32 $EP2 $COMPILE
  ;;
syncfree)
  # The sync-free dispatcher (parallel.ep_sync_free: no host synchronisation per layer), uncompiled and compiled,
  # plain and overlapped (the overlapped runs profiled without host-side operators).
  two qwen32_ep2_free $Q $Q32 $EP2 $FREE
  two qwen32_ep2_overlap_free_gpu $Q $Q32 $EP2 $FREE $OVL $GPUONLY
  two qwen32c_ep2_free $Q $Q32 $EP2 $FREE $COMPILE
  two qwen32c_ep2_overlap_free_gpu $Q $Q32 $EP2 $FREE $OVL $COMPILE $GPUONLY
  ;;
dsv2free)
  # DeepSeek-V2-Lite bench with the sync-free dispatcher at ep 2, plain and overlapped, and its single-GPU baseline.
  one dsv2_1gpu 0 $D $DSET
  two dsv2_ep2_free $D $DSET $EP2 $FREE
  two dsv2_ep2_overlap_free_gpu $D $DSET $EP2 $FREE $OVL $GPUONLY
  ;;
mb4)
  # Micro-batch 4 (half the kernel launches per token) with the sync-free dispatcher at ep 2, and its 1-GPU run.
  one qwen32mb4_1gpu 0 $Q $Q32 $MB4
  two qwen32mb4_ep2_overlap_free_gpu $Q $Q32 $MB4 $EP2 $FREE $OVL $GPUONLY
  two qwen32mb4_ep2_free $Q $Q32 $MB4 $EP2 $FREE
  ;;
streams)
  # The overlapped ep 2 sync-free run with host operators recorded (both ranks' traces kept), then with backward's
  # all-to-alls on a second communicator (parallel.ep_backward_group), with high-priority communication streams
  # (parallel.comm_priority), and both; the last also at micro-batch 4.
  KEEP="qwen32_ep2_overlap_free qwen32_ep2_overlap_free_twin_gpu qwen32_ep2_overlap_free_prio_gpu"
  KEEP="$KEEP qwen32_ep2_overlap_free_twinprio_gpu qwen32mb4_ep2_overlap_free_twinprio_gpu"
  two qwen32_ep2_overlap_free $Q $Q32 $EP2 $FREE $OVL
  two qwen32_ep2_overlap_free_twin_gpu $Q $Q32 $EP2 $FREE $OVL $GPUONLY $TWIN
  two qwen32_ep2_overlap_free_prio_gpu $Q $Q32 $EP2 $FREE $OVL $GPUONLY $PRIO
  two qwen32_ep2_overlap_free_twinprio_gpu $Q $Q32 $EP2 $FREE $OVL $GPUONLY $TWIN $PRIO
  two qwen32mb4_ep2_overlap_free_twinprio_gpu $Q $Q32 $EP2 $FREE $OVL $GPUONLY $TWIN $PRIO $MB4
  ;;
mb4more)
  # Micro-batch 4, sync-free, continued: the overlapped run without and with the second communicator and
  # high-priority streams (the latter with host operators recorded), and everything compiled, with its 1-GPU run.
  KEEP="qwen32mb4_ep2_overlap_free_gpu qwen32mb4_ep2_overlap_free_twinprio qwen32mb4c_ep2_overlap_free_twinprio_gpu"
  one qwen32mb4c_1gpu 0 $Q $Q32 $MB4 $COMPILE
  two qwen32mb4_ep2_overlap_free_gpu $Q $Q32 $MB4 $EP2 $FREE $OVL $GPUONLY
  two qwen32mb4_ep2_overlap_free_twinprio $Q $Q32 $MB4 $EP2 $FREE $OVL $TWIN $PRIO
  two qwen32mb4c_ep2_free $Q $Q32 $MB4 $EP2 $FREE $COMPILE
  two qwen32mb4c_ep2_overlap_free_twinprio_gpu $Q $Q32 $MB4 $EP2 $FREE $OVL $TWIN $PRIO $COMPILE $GPUONLY
  ;;
paired)
  # After the overlapped schedule's pairing fix (no counts step with the sync-free dispatcher; at P = 1 only the
  # first forward and the last backward alone): micro-batch 2 with and without the second communicator and
  # high-priority streams, compiled micro-batch 4, and compiled micro-batch 4 at global batch 64 (8 micro-batches
  # per rank) with its single-GPU run.
  KEEP="qwen32_ep2_overlap_free_gpu qwen32mb4c_ep2_overlap_free_gpu qwen64mb4c_ep2_overlap_free_gpu"
  two qwen32_ep2_overlap_free_gpu $Q $Q32 $EP2 $FREE $OVL $GPUONLY
  two qwen32_ep2_overlap_free_twinprio_gpu $Q $Q32 $EP2 $FREE $OVL $GPUONLY $TWIN $PRIO
  two qwen32mb4c_ep2_overlap_free_gpu $Q $Q32 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY
  two qwen64mb4c_ep2_overlap_free_gpu $Q $Q32 $G64 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY
  one qwen64mb4c_1gpu 0 $Q $Q32 $G64 $MB4 $COMPILE
  ;;
carveout)
  # The runs of `paired` with 16 SMs left free by the matmuls (parallel.comm_sms) for the communication stream's
  # and NCCL's kernels, with and without the second communicator and high-priority streams.
  KEEP="qwen32mb4c_ep2_overlap_free_twinprio_sm16_gpu qwen64mb4c_ep2_overlap_free_twinprio_sm16_gpu"
  two qwen32mb4c_ep2_overlap_free_sm16_gpu $Q $Q32 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY $SM16
  two qwen32mb4c_ep2_overlap_free_twinprio_sm16_gpu $Q $Q32 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY $SM16 $TWIN $PRIO
  two qwen32_ep2_overlap_free_twinprio_sm16_gpu $Q $Q32 $EP2 $FREE $OVL $GPUONLY $SM16 $TWIN $PRIO
  two qwen64mb4c_ep2_overlap_free_twinprio_sm16_gpu $Q $Q32 $G64 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY $SM16 \
    $TWIN $PRIO
  ;;
gb64)
  # Compiled micro-batch 4 at global batch 64: one GPU, the plain loop, and the overlapped schedule with the default
  # parallel.comm_sms alone (the `carveout` run at this size also had the second communicator).
  KEEP="qwen64mb4c_ep2_overlap_free_sm16_gpu"
  one qwen64mb4c_1gpu 0 $Q $Q32 $G64 $MB4 $COMPILE
  two qwen64mb4c_ep2_free $Q $Q32 $G64 $MB4 $EP2 $FREE $COMPILE
  two qwen64mb4c_ep2_overlap_free_sm16_gpu $Q $Q32 $G64 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY
  ;;
alloc)
  # After three changes: the allocator's expandable segments (train.expandable_segments), the load-balance counts
  # all-reduced without waiting in the forward, and (parallel.overlap_edges) at pp 1 every half-model task but two
  # paired; then a fourth, the rows permuted on the compute stream (parallel.ep_permute_in_compute). In parts of
  # under ten minutes, PART=1 to 6. 1: compiled micro-batch 4 at global batch 64 on one GPU, with and without
  # expandable segments, side by side. 2: the same on two GPUs, overlapped with and without expandable segments,
  # and plain (parts 1 and 2 ran before the fourth change). 3: overlapped with the rows permuted on the compute
  # stream, again on the communication stream, and the former with the second communicator and high-priority
  # streams; compiled micro-batch 2 overlapped with overlap_edges (at micro-batch 4 it runs out of memory).
  # 4: compiled micro-batch 2 overlapped without overlap_edges; compiled Qwen3 at pp 2 (global batch 32). 5: the
  # latter with two layers in each edge stage (parallel.pp_edge_layers), four in the others. 6: DeepSeek-V2-Lite
  # bench overlapped at ep 2 with the defaults (the `dsv2free` run of the same name, after these changes).
  KEEP="qwen64mb4c_ep2_overlap_free_gpu qwen64mb4c_ep2_overlap_free_perm_gpu qwen64mb2c_ep2_overlap_free_edges_gpu"
  case ${PART:-1} in
  1)
    one qwen64mb4c_1gpu 0 $Q $Q32 $G64 $MB4 $COMPILE $EXP &
    one qwen64mb4c_1gpu_noexp 1 $Q $Q32 $G64 $MB4 $COMPILE $NOEXP &
    wait ;;
  2)
    two qwen64mb4c_ep2_overlap_free_gpu $Q $Q32 $G64 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY $EXP $ONCOMM
    two qwen64mb4c_ep2_overlap_free_noexp_gpu $Q $Q32 $G64 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY $NOEXP $ONCOMM
    two qwen64mb4c_ep2_free $Q $Q32 $G64 $MB4 $EP2 $FREE $COMPILE $EXP ;;
  3)
    two qwen64mb4c_ep2_overlap_free_perm_gpu $Q $Q32 $G64 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY
    two qwen64mb4c_ep2_overlap_free_oncomm_gpu $Q $Q32 $G64 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY $ONCOMM
    two qwen64mb4c_ep2_overlap_free_perm_twinprio_gpu $Q $Q32 $G64 $MB4 $EP2 $FREE $OVL $COMPILE $GPUONLY $TWIN $PRIO
    two qwen64mb2c_ep2_overlap_free_edges_gpu $Q $Q32 $G64 $EP2 $FREE $OVL $COMPILE $GPUONLY \
      --set parallel.overlap_edges=true ;;
  4)
    two qwen64mb2c_ep2_overlap_free_gpu $Q $Q32 $G64 $EP2 $FREE $OVL $COMPILE $GPUONLY
    two qwen32c_pp2 $Q $Q32 --set parallel.pp=2 $COMPILE $GPUONLY ;;
  5)
    two qwen32c_pp2_edge2 $Q $Q32 --set parallel.pp=2 $COMPILE $GPUONLY --set parallel.pp_edge_layers=2 ;;
  6)
    two dsv2_ep2_overlap_free_gpu $D $DSET $EP2 $FREE $OVL $GPUONLY ;;
  esac
  ;;
p2p)
  # DualPipeV's two ways of moving activations at pp 2 (compiled Qwen3 bench unless said otherwise). OV: transfers
  # beside compute (parallel.pp_overlap_p2p: one communicator per direction, each send as soon as its tensor exists,
  # each receive parallel.pp_recv_ahead actions early, waited for where it is first read); without it (the default)
  # a slot boundary's transfers start together and are waited for. Stage sizes from parallel.pp_stage_layers.
  # PART=1: the DualPipeV checks on the GPUs, then OV at global batch 32 in micro-batches of 2, even and 3-4-4-1.
  # PART=2: OV at global batch 64 in micro-batches of 4 (the pp 1 × ep 2 bench shape), even with receives one
  # action early and just in time, and 3-4-4-1 just in time. PART=3: OV, 3-4-3-2, 3-4-4-1 and 4-4-4-0. PART=4: the
  # checks with OV, and the default (batched) at 3-4-3-2. PART=5: DeepSeek-V2-Lite bench at pp 2 (global
  # batch 16: four micro-batches), OV even and 3-4-3-2, and batched even.
  KEEP="qwen32c_pp2 qwen32c_pp2_3441"
  SL="--set parallel.pp_stage_layers"
  OV="--set parallel.pp_overlap_p2p=true"
  A0="--set parallel.pp_recv_ahead=0"
  PP2="$Q $Q32 $G64 $MB4 --set parallel.pp=2 $COMPILE $GPUONLY"
  case ${PART:-1} in
  1)
    timeout 120 python3 -m torch.distributed.run --nproc-per-node 2 -m pith_lit.engine.dualpipev --device cuda \
      --micro 4 5 > "$LOGS/dualpipev_check.log" 2>&1
    echo "dualpipev checks: exit $? at $(date +%T)"
    two qwen32c_pp2 $Q $Q32 --set parallel.pp=2 $COMPILE $GPUONLY $OV
    two qwen32c_pp2_3441 $Q $Q32 --set parallel.pp=2 $COMPILE $GPUONLY $OV $SL=[3,4,4,1] ;;
  2)
    two qwen64mb4c_pp2 $PP2 $OV
    two qwen64mb4c_pp2_ahead0 $PP2 $OV $A0
    two qwen64mb4c_pp2_3441_ahead0 $PP2 $OV $A0 $SL=[3,4,4,1] ;;
  3)
    two qwen64mb4c_pp2_3432 $PP2 $OV $SL=[3,4,3,2]
    two qwen64mb4c_pp2_3441 $PP2 $OV $SL=[3,4,4,1]
    two qwen64mb4c_pp2_4440 $PP2 $OV $SL=[4,4,4,0] ;;
  4)
    timeout 120 python3 -m torch.distributed.run --nproc-per-node 2 -m pith_lit.engine.dualpipev --device cuda \
      --micro 4 5 --overlap-p2p > "$LOGS/dualpipev_check_overlap.log" 2>&1
    echo "dualpipev checks, overlap_p2p: exit $? at $(date +%T)"
    two qwen64mb4c_pp2_3432_batched $PP2 $SL=[3,4,3,2] ;;
  5)
    two dsv2_pp2 $D $DSET --set parallel.pp=2 $GPUONLY $OV
    two dsv2_pp2_3432 $D $DSET --set parallel.pp=2 $GPUONLY $OV $SL=[3,4,3,2]
    two dsv2_pp2_batched $D $DSET --set parallel.pp=2 $GPUONLY ;;
  esac
  ;;
single)
  # The single-GPU baselines of `more` alone: for a session that runs only `combine`, `compiled` or `syncfree`.
  singles
  ;;
*) echo "unknown suite $SUITE: use base, more, deep, ep, combine, compiled, syncfree, dsv2free, mb4, mb4more, streams, paired, carveout, gb64, alloc, p2p or single"
   exit 2 ;;
esac
for name in ${KEEP:-}; do   # both ranks' traces of each run a suite names in KEEP, one archive per run
  ls runs/two_gpus/$name/trace-rank*.json > /dev/null 2>&1 && tar czf "$OUT/$name.traces.tgz" runs/two_gpus/$name/trace-rank*.json
done
for name in qwen_1gpu_overlap qwen_ep2_overlap qwen32_ep2_overlap qwen32c_ep2_overlap_free_gpu; do   # traces to read at leisure, when small enough
  f=runs/two_gpus/$name/trace-rank0.json
  [ -f $f ] && [ $(stat -c %s $f) -lt 150000000 ] && gzip -c $f > "$OUT/$name.trace0.json.gz"
done
python3 benchmarks/summarise.py runs/two_gpus "$OUT/summary.json"
keep
