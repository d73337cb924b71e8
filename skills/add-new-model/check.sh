#!/usr/bin/env bash
# The checks a model family must pass; prints PASS or FAIL last and exits 0 or 1.
#   bash skills/add-new-model/check.sh MODEL_TYPE        e.g. qwen3_moe, deepseek_v2, gpt_oss
# 1. its notebook nbs/models/2?_MODEL_TYPE.ipynb through nbdev_test (five stages vs reference_forward, ...)
# 2. tests/test_MODEL_TYPE.py (stage equivalence at other shapes, agreement with transformers' model class)
# 3. the Hugging Face round trip in tests/test_hf.py, the cases whose id starts with MODEL_TYPE
# 4. two training steps of the family's default (tiny) config through python -m pith_lit.train
set -uo pipefail
cd "$(dirname "$0")/../.."
. skills/common.sh   # fail, $py (the project's interpreter), need
[ $# -eq 1 ] || fail "usage: bash skills/add-new-model/check.sh MODEL_TYPE (e.g. qwen3_moe)"
type=$1
need "torch, pith_lit, pytest, transformers, nbdev"
"$py" scripts/sync_check.py >/dev/null ||
  fail "notebooks and package disagree: python scripts/sync_check.py says what to run"
"$py" - "$type" <<'PY' || fail "$type is not wired into the package (see the message above and SKILL.md steps 1 and 3)"
import sys
from pith_lit.models.family import MODEL_TYPES, family
from pith_lit.train.trainer import build_model
t = sys.argv[1]
if t not in MODEL_TYPES:
    sys.exit(f"{t!r} is not in pith_lit.models.family.MODEL_TYPES {MODEL_TYPES}")
names = ("Config", "Model", "tiny_config", "from_hf", "to_hf", "HF_MODEL_TYPES", "HF_EXPERTS_ONE_BY_ONE",
         "HF_READ_EXPERTS_ONE_BY_ONE", "HF_RENAME", "HF_READ_PAST", "kept_by_part", "kernel_attention_shape",
         "expert_width", "router_one_hot", "FP32_NORM_GAIN")
missing = [n for n in names if not hasattr(family(t), n)]
if missing:
    sys.exit(f"pith_lit.models.{t} lacks {', '.join(missing)} (SKILL.md step 1, the family interface)")
model = build_model(family(t).Config())
assert model.config.routed_experts >= 0 and model.flops_per_token(16) > 0
PY
nbs=(nbs/models/2?_"$type".ipynb)
[ -f "${nbs[0]}" ] || fail "no notebook nbs/models/2?_$type.ipynb (SKILL.md step 1)"
[ -f "tests/test_$type.py" ] || fail "no tests/test_$type.py (SKILL.md step 4)"
runs=$PWD/out/skills/add-new-model   # the tokenized corpus is cached in $runs/cache, shared by the model types
out=$runs/$type
rm -rf "$out" && mkdir -p "$out"
export OMP_NUM_THREADS=1 TRITON_INTERPRET=1
ok=1
step() {  # step NAME COMMAND...: run it, keep its output in $out/NAME.log, print ok or FAIL with the log's tail
  local name=$1; shift
  if "$@" >"$out/$name.log" 2>&1; then
    echo "ok   $name"
  else
    echo "FAIL $name (log: $out/$name.log)"; tail -15 "$out/$name.log"; ok=0
  fi
}
step notebook "$bin/nbdev_test" --path "${nbs[0]}"
step tests "$py" -m pytest -q "tests/test_$type.py"
step hf-parity "$py" -m pytest -q tests/test_hf.py -k "test_matches_transformers and $type"  # exit 5: no case
rm -rf "$runs/run-$type"
step train "$py" -m pith_lit.train --set model.model_type="$type" --set run.dir="$runs/run-$type" --set train.steps=2 \
  --set train.warmup=0 --set train.global_batch=2 --set train.micro_batch=2 --set train.seq_len=32 \
  --set log.tensorboard=false --set log.sample_tokens=0 --set ckpt.every=0
[ $ok -eq 1 ] && { echo PASS; exit 0; }
echo FAIL; exit 1
