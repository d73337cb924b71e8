#!/usr/bin/env bash
# Compares the planner's prediction with a measured tiny run; prints PASS or FAIL.
#   bash skills/estimate-memory/check.sh [--gpu]
set -uo pipefail
cd "$(dirname "$0")/../.."
. skills/common.sh   # fail, $py (the project's interpreter), need
gpu=0
while [ $# -gt 0 ]; do
  case $1 in
    --gpu) gpu=1 ;;
    *) fail "unknown option $1; use [--gpu]" ;;
  esac
  shift
done
need "torch, pith_lit"
out=$PWD/out/estimate-memory
rm -rf "$out" && mkdir -p "$out"
if [ $gpu = 1 ]; then
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    fail "--gpu asked for a CUDA device, but none is visible"
  "$py" -m pith_lit.train configs/bench-qwen3-30b-a3b.toml --set model.num_hidden_layers=2 --set train.steps=3 \
    --set train.warmup=1 --set run.dir="$out/run" --set log.tensorboard=false --set ckpt.every=-1 \
    > "$out/train.log" 2>&1 || { tail -20 "$out/train.log"; fail "training failed"; }
  "$py" - "$out/run/metrics.jsonl" <<'PY' || fail "the measured peak is more than 10% from the prediction (above)"
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
measured, predicted = max(r["peak_mem_gb"] for r in recs), recs[-1]["predicted_peak_gb"]
print(f"peak allocated: measured {measured:.2f} GiB, predicted {predicted:.2f} GiB ({predicted / measured - 1:+.1%})")
assert abs(predicted / measured - 1) <= 0.10
PY
else
  "$py" - <<'PY' > "$out/state.log" 2>&1 || { cat "$out/state.log"; fail "the run's state differs from the planner's count"; }
import tempfile, torch
from pith_lit.engine.planner import rank_units
from pith_lit.train.config import load_config
from pith_lit.train.optim import optimizer_states
from pith_lit.train.trainer import build_run, meta_model, train_step
cfg = load_config(overrides=[f"run.dir={tempfile.mkdtemp()}", "run.device=cpu", "log.tensorboard=false",
                             "train.steps=1", "train.warmup=0"])
run = build_run(cfg)
train_step(run, 0)
local = lambda t: t.to_local() if hasattr(t, "to_local") else t
params = sum(local(p).numel() * p.element_size() for p in run.model.parameters())
states = sum(local(v).numel() * v.element_size() for s in run.optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0)
units = rank_units(meta_model(cfg)(), cfg.workload(), 0, optimizer_states(cfg.train.optimizer))
width = cfg.param_dtype.itemsize
want = sum(u.shard for u in units) * width, sum(u.states for u in units) * width
print(f"parameters: {params:,} bytes held, {want[0]:,} predicted; optimizer states: {states:,} held, {want[1]:,} "
      "predicted")
assert (params, states) == want
PY
  cat "$out/state.log"
  echo "(the peak itself needs a GPU: --gpu)"
fi
echo PASS
