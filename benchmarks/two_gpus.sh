#!/usr/bin/env bash
# The two-GPU measurements of benchmarks/RESULTS.md: expert parallelism and DualPipeV against one GPU on the Qwen3
# bench config (compiled, global batch 64 in micro-batches of 4), and the checks against one process on the GPUs.
# Run from the repository root on a machine with two GPUs:
#
#     OUT=/tmp/two_gpus bash benchmarks/two_gpus.sh [STEPS] [SUITE]
#
# SUITE `core` (the default): one GPU; pp 1 × ep 2 overlapped with the sync-free dispatcher; pp 2 with the stages
# cut 3-4-3-2. SUITE `checks`: the EP and DualPipeV checks on the GPUs over NCCL. SUITE `dsv2`: the DeepSeek-V2-Lite
# bench (uncompiled, global batch 16) at ep 2 overlapped (parallel.comm_sms = 0, its faster setting) and at pp 2.
# Suites of earlier sessions, with settings since removed, are in the git history of this file (before the
# one-path change); RESULTS.md names the commit of each.
#
# Every run writes runs/two_gpus/<name>/{metrics.jsonl,trace-rank*.json} and runs/two_gpus/logs/<name>.log. Each
# multi-GPU run records one step with torch.profiler (GPU kernels only), and `python benchmarks/overlap.py`
# reports its hidden and exposed communication. After each run, $OUT/two_gpus.tgz is refreshed with everything but
# the traces. The last thing printed is a table (also in $OUT/summary.json) made by benchmarks/summarise.py.
set -u
OUT=${OUT:-/tmp/two_gpus}
STEPS=${1:-20}
SUITE=${2:-core}
PROFILE=$((STEPS - 5))
LOGS=runs/two_gpus/logs
mkdir -p "$OUT" $LOGS
export PYTHONUNBUFFERED=1
Q=${Q:-configs/bench-qwen3-30b-a3b.toml}      # Q=configs/tiny.toml D=configs/tiny-deepseek-v2.toml: a CPU trial
D=${D:-configs/bench-deepseek-v2-lite.toml}
COMMON="--set train.steps=$STEPS --set train.warmup=5 --set log.tensorboard=false --set log.profile_host=false"
QB="$Q $COMMON --set train.global_batch=64 --set train.micro_batch=4 --set train.compile=true"
DB="$D $COMMON"

report() {  # NAME: the communication report of each rank's trace, and of both together (waiting and transfer)
  for r in 0 1; do
    [ -f runs/two_gpus/$1/trace-rank$r.json ] && \
      python3 benchmarks/overlap.py runs/two_gpus/$1/trace-rank$r.json > "$LOGS/$1.overlap$r.txt"
  done
  [ -f runs/two_gpus/$1/trace-rank1.json ] && python3 benchmarks/overlap.py --peers \
    runs/two_gpus/$1/trace-rank0.json runs/two_gpus/$1/trace-rank1.json > "$LOGS/$1.peers.txt"
}
keep() { tar czf "$OUT/two_gpus.tgz" --exclude 'trace-*' runs/two_gpus; }
one() {  # NAME GPU ARGS...: one process on one GPU
  local name=$1 gpu=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout 400 python3 -m pith_lit.train "$@" --set run.dir=runs/two_gpus/$name \
    > "$LOGS/$name.log" 2>&1
  echo "$name: exit $? at $(date +%T)"
}
two() {  # NAME ARGS...: two processes, one per GPU, profiling one step
  local name=$1; shift
  timeout 400 python3 -m torch.distributed.run --nproc-per-node 2 -m pith_lit.train "$@" \
    --set run.dir=runs/two_gpus/$name --set log.profile_step=$PROFILE > "$LOGS/$name.log" 2>&1
  echo "$name: exit $? at $(date +%T)"
  report $name
  keep
}

case $SUITE in
core)
  one qwen64mb4c_1gpu 0 $QB
  keep
  two qwen64mb4c_ep2_overlap_free $QB --set parallel.ep=2 --set parallel.ep_sync_free=true --set parallel.overlap=true
  two qwen64mb4c_pp2_3432 $QB --set parallel.pp=2 "--set" "parallel.pp_stage_layers=[3,4,3,2]"
  ;;
checks)
  for check in "ep --tokens 4096" "pipeline --micro 4 5" "pipeline --micro 2 3 --ep 2"; do
    timeout 200 python3 -m torch.distributed.run --nproc-per-node 2 -m pith_lit.testing $check --device cuda \
      > "$LOGS/check_${check%% *}.log" 2>&1
    echo "checks ($check): exit $? at $(date +%T)"
  done
  ;;
dsv2)
  one dsv2_1gpu 0 $DB
  two dsv2_ep2_overlap_free $DB --set parallel.ep=2 --set parallel.ep_sync_free=true --set parallel.overlap=true \
    --set parallel.comm_sms=0
  two dsv2_pp2 $DB --set parallel.pp=2
  ;;
*)
  echo "unknown suite $SUITE: core, checks or dsv2" >&2
  exit 2
  ;;
esac
python3 benchmarks/summarise.py runs/two_gpus "$OUT/summary.json"
