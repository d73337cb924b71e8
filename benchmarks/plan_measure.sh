#!/usr/bin/env bash
# Measurements the planner (engine/37_planner, 38_steptime, python -m pith_lit.plan) is built on and checked against,
# on one GPU:
#
#     OUT=/tmp/plan bash benchmarks/plan_measure.sh probes|configs NAME...
#
# probes: benchmarks/layer_probe.py on short cuts of the four bench models, eager and compiled, and the Qwen3 bench
#         with each recomputation: what each layer keeps for backward, its transients and its stages' times
#         -> $OUT/probes.jsonl
# configs NAME...: short runs of `python -m pith_lit.train` (STEPS, default 4) in the layouts named (see `case`
#         below); each line of $OUT/configs.jsonl holds the run's peak allocated and reserved memory and its tokens/s
#         (steps 3 on), beside the planner's prediction (`python -m pith_lit.plan CONFIG --check`)
# profiles NAME...: `python -m pith_lit.plan CONFIG --measure $OUT/profile_NAME.json`, the measured layer times the
#         planner predicts step times from (see `case` below)
# PROJ=DIR runs the train commands of `configs` from another tree (a copy of an earlier commit, for before/after).
set -u
OUT=${OUT:-/tmp/plan}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
ROOT=$(pwd)
what=$1; shift
Q=${Q:-configs/bench-qwen3-30b-a3b.toml} D=${D:-configs/bench-deepseek-v2-lite.toml} G=${G:-configs/bench-gpt-oss-20b.toml}
N=${N:-configs/bench-qwen3-5-moe.toml}   # Q=configs/tiny.toml ...: a CPU trial

probe() {  # CONFIG LAYERS OVERRIDES...
  timeout 240 python3 benchmarks/layer_probe.py "$@" >> "$OUT/probes.jsonl" 2> "$OUT/probe_err.log" \
    || { echo "probe $* failed:"; tail -3 "$OUT/probe_err.log"; }
  echo "probe $1 $2 ${*:3}: done at $(date +%T)"
}

config() {  # NAME CONFIG OVERRIDES...: four steps, then the measured peaks and speed beside the prediction
  local name=$1 cfg=$2; shift 2
  local sets=(--set run.dir=/tmp/cfg_$name --set train.steps=${STEPS:-4} --set train.warmup=1 --set log.tensorboard=false
              --set ckpt.every=-1 --set ckpt.resume=false --set log.every=1)
  for s in "$@"; do sets+=(--set "$s"); done
  (cd "${PROJ:-.}" && timeout ${LIMIT:-300} python3 -m pith_lit.train "$ROOT/$cfg" "${sets[@]}") > "$OUT/cfg_$name.log" 2>&1
  echo "config $name: exit $? at $(date +%T)"
  python3 - "$name" "$cfg" /tmp/cfg_$name/metrics.jsonl "$@" >> "$OUT/configs.jsonl" <<'EOF'
import json, subprocess, sys
name, cfg, path, sets = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
try:
    recs = [json.loads(l) for l in open(path)]
except OSError:
    print(json.dumps({"run": name, "error": "no metrics"})); sys.exit()
last = recs[2:] or recs
out = {"run": name, "config": cfg, "sets": sets, "peak_gib": max(r["peak_mem_gb"] for r in recs),
       "reserved_gib": max(r.get("peak_reserved_gb", 0) for r in recs),
       "tokens_per_s": len(last) / sum(1 / r["tokens_per_s"] for r in last), "loss": recs[-1]["loss"]}
plan = subprocess.run([sys.executable, "-m", "pith_lit.plan", cfg, "--check"] + [a for s in sets for a in ("--set", s)],
                      capture_output=True, text=True)
try:
    out["predicted"] = json.loads(plan.stdout.strip().splitlines()[-1])
except (IndexError, ValueError):
    out["predicted"] = {"error": (plan.stderr or plan.stdout)[-300:]}
print(json.dumps(out))
EOF
}

case $what in
probes)
  probe $Q 2 train.micro_batch=2
  probe $Q 2 train.micro_batch=2 train.compile=true
  probe $Q 2 train.micro_batch=2 train.recompute=attention
  probe $Q 2 train.micro_batch=2 train.recompute=layer
  probe $D 3 train.micro_batch=4
  probe $D 3 train.micro_batch=4 train.compile=true
  probe $G 2 train.micro_batch=2
  probe $G 2 train.micro_batch=2 train.compile=true
  probe $N 4 train.micro_batch=2
  probe $N 4 train.micro_batch=2 train.compile=true
  ;;
configs)
  for name in "$@"; do
    case $name in
      qwen_c4) config $name $Q train.compile=true train.micro_batch=4 train.global_batch=4 ;;
      qwen_e2) config $name $Q ;;
      qwen_overlap) config $name $Q train.compile=true train.micro_batch=4 train.global_batch=8 parallel.overlap=true ;;
      qwen_layer) config $name $Q train.micro_batch=4 train.global_batch=4 train.recompute=layer ;;
      qwen6_fp32) config $name $Q train.compile=true train.micro_batch=4 train.global_batch=8 model.num_hidden_layers=6 \
                    train.optim_dtype=float32 ;;
      dsv2_c4) config $name $D train.compile=true train.micro_batch=4 train.global_batch=4 ;;
      gptoss_*) config $name $G train.compile=true train.micro_batch=2 train.global_batch=2 log.profile_step=4 \
                  log.profile_host=false
                [ -f /tmp/cfg_$name/trace-rank0.json ] && \
                  python3 benchmarks/overlap.py /tmp/cfg_$name/trace-rank0.json > "$OUT/${name}_kernels.txt" ;;
      q35_c2) config $name $N train.compile=true ;;
      *) echo "unknown config $name" ;;
    esac
  done
  ;;
profiles)
  for name in "$@"; do
    case $name in
      qwen_c4) args=($Q --set train.compile=true --set train.micro_batch=4 --set train.global_batch=4) ;;
      qwen_e2) args=($Q) ;;
      dsv2_c4) args=($D --set train.compile=true --set train.micro_batch=4 --set train.global_batch=4) ;;
      gptoss_c2) args=($G --set train.compile=true --set train.micro_batch=2 --set train.global_batch=2) ;;
      *) echo "unknown profile $name"; continue ;;
    esac
    timeout ${LIMIT:-240} python3 -m pith_lit.plan "${args[@]}" --measure "$OUT/profile_$name.json" \
      > "$OUT/profile_$name.log" 2>&1
    echo "profile $name: exit $? at $(date +%T)"
  done
  ;;
*)
  echo "usage: plan_measure.sh probes | configs NAME... | profiles NAME..." >&2; exit 2 ;;
esac
