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
"$py" - "$gpu" "$out" <<'PY' > "$out/check.log" 2>&1 || { tail -30 "$out/check.log"; fail "see the lines above"; }
import re, sys
from pith_lit.train.config import load_config
from pith_lit.train.trainer import memory_prints, train
gpu, out = sys.argv[1] == "1", sys.argv[2]
base = ["train.steps=3", "train.warmup=1", "ckpt.every=-1", "log.tensorboard=false", "log.sample_tokens=0"]
base = (["model.num_hidden_layers=2"] if gpu else ["run.device=cpu"]) + base
path = "configs/bench-qwen3-30b-a3b.toml" if gpu else None
plain = train(load_config(path, base + [f"run.dir={out}/plain"]), quiet=True)["history"]
lines = []
with memory_prints(lines.append):
    watched = train(load_config(path, base + [f"run.dir={out}/watched"]), quiet=True)["history"]
print("\n".join(lines[:12] + ["..."] + lines[-3:]))
assert [r["loss"] for r in plain] == [r["loss"] for r in watched], "memory_prints changed the losses"
layers = load_config(path, base).model.num_hidden_layers
for what in [f"layer {i} {w}" for i in range(layers) for w in ("forward", "backward")] + ["the loss",
                                                                                         "the optimizer step"]:
    assert any(f"after {what}:" in line for line in lines), f"no line after {what}"
if gpu:
    peaks = [float(m.group(1)) for m in (re.search(r"peak so far ([\d.]+)", l) for l in lines) if m]
    assert peaks and min(peaks) > 0 and peaks == sorted(peaks), "a GPU line without bytes, or a peak that fell"
print(f"{len(lines)} lines; the losses equal the plain run's")
PY
cat "$out/check.log"
echo PASS
