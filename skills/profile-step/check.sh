#!/usr/bin/env bash
# Records one training step with torch.profiler and runs the communication report on it; prints PASS or FAIL.
#   bash skills/profile-step/check.sh [--gpu] [--gpus 2]
set -uo pipefail
cd "$(dirname "$0")/../.."
. skills/common.sh   # fail, $py (the project's interpreter), need
gpu=0; gpus=1
while [ $# -gt 0 ]; do
  case $1 in
    --gpu) gpu=1 ;;
    --gpus) gpu=1; gpus=${2:?--gpus needs a number}; shift ;;
    *) fail "unknown option $1; use [--gpu] [--gpus N]" ;;
  esac
  shift
done
need "torch, pith_lit"
out=$PWD/out/profile-step
rm -rf "$out" && mkdir -p "$out"
args=(--set run.dir="$out/run" --set train.steps=3 --set train.warmup=1 --set log.profile_step=2
      --set log.tensorboard=false --set log.sample_tokens=0 --set ckpt.every=-1)
launch=("$py" -m pith_lit.train)
if [ $gpu = 1 ]; then
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= $gpus else 1)" ||
    fail "--gpu asked for $gpus CUDA device(s), but fewer are visible"
  args=(configs/bench-qwen3-30b-a3b.toml "${args[@]}" --set model.num_hidden_layers=2)
  if [ "$gpus" -gt 1 ]; then
    launch=("$py" -m torch.distributed.run --nproc-per-node "$gpus" -m pith_lit.train)
    args+=(--set parallel.ep="$gpus" --set parallel.overlap=true --set train.global_batch=$((4 * gpus)))
  fi
fi
"${launch[@]}" "${args[@]}" > "$out/train.log" 2>&1 || { tail -20 "$out/train.log"; fail "training failed"; }
traces=("$out"/run/trace-rank*.json)
[ -f "${traces[0]}" ] || fail "no trace written to $out/run (log.profile_step did not record)"
"$py" benchmarks/overlap.py "${traces[@]}" --top 10 > "$out/report.txt" 2>&1 ||
  { cat "$out/report.txt"; fail "the report failed"; }
cat "$out/report.txt"
"$py" - "$gpu" "${traces[@]}" <<'PY' || fail "the trace or the report is missing what a step does (above)"
import json, sys
from benchmarks.overlap import overlap_report
gpu, paths = sys.argv[1] == "1", sys.argv[2:]
for path in paths:
    trace = json.load(open(path))
    names = {ev.get("name") for ev in trace["traceEvents"]}
    assert names & {"aten::mm", "aten::addmm", "aten::_grouped_mm", "aten::bmm"}, f"{path}: no matmul recorded"
    if gpu:
        total = overlap_report(trace)["total"]
        assert total["compute_ms"] > 0, f"{path}: no GPU compute kernels in the trace"
        print(f"ok {path}: compute {total['compute_ms']:.1f} ms, communication {total['comm_ms']:.1f} ms")
    else:
        print(f"ok {path}: the step's matmuls are in the trace")
PY
echo PASS
