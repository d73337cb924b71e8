#!/usr/bin/env bash
# On the GPU machine, from the repository root: run the GPU cells of every notebook that has one
# (`nbdev_test --flags cuda`, each notebook alone, its CPU cells too), one line per notebook, and the tail of each
# failing log into $OUT/cuda_fail.txt.
#   OUT=$OUT bash benchmarks/cuda_notebooks.sh [NAME ...]     (NAME: e.g. 16_gated_delta_rule; default: all)
set -u
OUT=${OUT:-/tmp/out}; L=/tmp/nblogs; mkdir -p "$OUT" "$L"
names=("$@")
[ ${#names[@]} -gt 0 ] || mapfile -t names < <(grep -l "^#| cuda" -r nbs --include=*.py | xargs -n1 basename | sed 's/\.py$//' | sort)
for name in "${names[@]}"; do
  nb=$(ls nbs/*/"$name".ipynb) || continue
  t0=$(date +%s)
  timeout -k 10 "${NB_TIMEOUT:-300}" nbdev_test --flags cuda --path "$nb" > "$L/$name.log" 2>&1; rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/cuda_summary.txt"
  [ $rc = 0 ] || { echo "=== $name rc=$rc"; tail -c 5000 "$L/$name.log"; } >> "$OUT/cuda_fail.txt"
done
