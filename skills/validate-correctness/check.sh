#!/usr/bin/env bash
# Runs nbs/validate/v01_training through papermill; prints PASS or FAIL last and exits 0 or 1.
#   bash skills/validate-correctness/check.sh [--gpu]
set -uo pipefail
cd "$(dirname "$0")/../.."
. skills/common.sh   # fail, $py (the project's interpreter), need
need "torch, pith_lit, jupytext, papermill"
"$py" scripts/sync_check.py >/dev/null || fail "notebooks and package disagree: python scripts/sync_check.py says what to run"
params=()
if [ "${1:-}" = "--gpu" ]; then
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || fail "--gpu asked for, but no CUDA device is visible"
  # the bench width (hidden 2048, 128 experts, vocab 151936, sequence 4096) with 2 layers, so the two runs'
  # checkpoints (about 11 GB each) fit the disk; checkpoints on, since the resume check needs one
  params=(-p config configs/bench-qwen3-30b-a3b.toml -p steps 30 -p min_drop 1.0 -p resume_rtol 0.01
          -p max_balance 16.0 -y 'overrides: ["model.num_hidden_layers=2", "train.warmup=5", "ckpt.every=0", "ckpt.keep=1"]')
fi
out=$PWD/out/validate
mkdir -p "$out"
"$bin/jupytext" --to ipynb nbs/validate/v01_training.py -o - 2>/dev/null |
  "$bin/papermill" - "$out/v01.out.ipynb" -p out_dir "$out" "${params[@]}" --no-progress-bar --log-output \
  > "$out/v01.log" 2>&1
rc=$?
grep -E '^(ok|FAIL) ' "$out/v01.log" | sed 's/^.*papermill.*- //' || true
[ $rc -eq 0 ] && grep -q PASS "$out/v01.out.ipynb" && { echo PASS; exit 0; }
tail -20 "$out/v01.log"
echo FAIL; exit 1
