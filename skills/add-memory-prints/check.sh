#!/usr/bin/env bash
# Trains three steps plain and inside memory_prints: the same losses, every point printed; prints PASS or FAIL.
#   bash skills/add-memory-prints/check.sh [--gpu]
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
out=$PWD/out/add-memory-prints
rm -rf "$out" && mkdir -p "$out"
if [ $gpu = 1 ]; then
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    fail "--gpu asked for a CUDA device, but none is visible"
fi
sets=(--set train.steps=3 --set train.warmup=1 --set ckpt.every=-1 --set log.tensorboard=false
      --set log.sample_tokens=0)
if [ $gpu = 1 ]; then args=(configs/bench-qwen3-30b-a3b.toml --set model.num_hidden_layers=2 "${sets[@]}")
else args=(--set run.device=cpu "${sets[@]}"); fi
# the plain run in a process of its own (two runs in one process would set up NCCL twice)
"$py" -m pith_lit.train "${args[@]}" --set run.dir="$out/plain" > "$out/plain.log" 2>&1 ||
  { tail -20 "$out/plain.log"; fail "the plain run failed"; }
# on a GPU two identical runs need not agree to the bit (atomic additions): a second plain run measures that spread
if [ $gpu = 1 ]; then
  "$py" -m pith_lit.train "${args[@]}" --set run.dir="$out/again" > "$out/again.log" 2>&1 ||
    { tail -20 "$out/again.log"; fail "the second plain run failed"; }
fi
"$py" - "$out" "${args[@]}" <<'PY' > "$out/check.log" 2>&1 || { tail -30 "$out/check.log"; fail "see the lines above"; }
import json, re, sys
import torch
from pith_lit.train.config import parse_args
from pith_lit.train.trainer import train
sys.path.insert(0, "skills/add-memory-prints")
from memory_prints import memory_prints
out, argv = sys.argv[1], sys.argv[2:]
cfg = parse_args(argv + ["--set", f"run.dir={out}/watched"])
lines = []
with memory_prints(lines.append):
    watched = train(cfg, quiet=True)["history"]
print("\n".join(lines[:12] + ["..."] + lines[-3:]))
def losses(run):
    return [json.loads(line)["loss"] for line in open(f"{out}/{run}/metrics.jsonl")]
def spread(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
plain, seen = losses("plain"), [r["loss"] for r in watched]
noise = spread(losses("again"), plain) if torch.cuda.is_available() else 0.0
print(f"losses: plain {plain}, watched {seen}; plain run against plain run: {noise:.3g} relative")
assert len(seen) == len(plain) and spread(seen, plain) <= 3 * noise, (
    f"memory_prints changed the losses by {spread(seen, plain):.3g} relative, more than three times a second plain "
    f"run's spread ({noise:.3g})")
for what in [f"layer {i} {w}" for i in range(cfg.model.num_hidden_layers) for w in ("forward", "backward")] + [
        "the loss", "the optimizer step"]:
    assert any(f"after {what}:" in line for line in lines), f"no line after {what}"
if torch.cuda.is_available():
    peaks = [float(m.group(1)) for m in (re.search(r"peak so far ([\d.]+)", l) for l in lines) if m]
    assert peaks and min(peaks) > 0 and peaks == sorted(peaks), "a GPU line without bytes, or a peak that fell"
print(f"{len(lines)} lines; the losses agree with the plain run's within three times a second plain run's spread")
PY
cat "$out/check.log"
echo PASS
