#!/usr/bin/env bash
# FP8 against bf16 at the three widths of RESULTS.md "FP8 end to end" (one H200 or H100), and the quantization passes'
# settings at the two wider widths. On the GPU machine, from the repository root, carrying .bench (a copy of
# ../shared/bench with its TorchTitan wheels; see its README):
#
#     OUT=$OUT bash benchmarks/fp8_widths.sh SUITE...
#
# Each SUITE runs bf16 and FP8 in the same call on the harness's data, 14 compiled steps each (deep 12, copies 10), and
# prints their tokens/s, FP8 / bf16 and both peaks (tokens/s: the harmonic mean of steps 6 to the last). The cuts,
# each small enough for one 80 GB card:
#   235b     Qwen3-235B-A22B's width (hidden 4096, 128 experts of 1536, top 8, 64 query and 4 KV heads), 2 layers,
#            micro-batches of 4 and of 8
#   v3       DeepSeek-V3's width (hidden 7168, MLA with V3's ranks and 128 heads, one shared expert and 64 routed
#            experts of 2048 with top 8, V3's dense width 18432), 2 layers: one dense, one MoE; micro-batch 4
#   qwen3    the Qwen3-30B-A3B bench cut to 6 layers, micro-batches of 4 and of 8
#   deep     the 235B and V3 cuts with 3 layers (V3's: one dense, two MoE), micro-batch 4, 12 steps (bf16 at the 235B
#            width runs out of an H100's memory in its 13th): less the 2-layer runs, what FP8 does to one layer
#   copies   the Qwen3 cut (6 layers) and the 235B cut (2 layers), four micro-batches of 4 a step, 10 steps: bf16, FP8
#            with each use quantizing its weights (the default) and FP8 keeping the copies (train.fp8_keep_copies)
#   profile  one profiled step of each dtype at the 235B cut (micro-batch 4), read by benchmarks/anatomy.py
#   kernels  benchmarks/fp8_rows.py --parts weights,rowsweep at the 235B and V3 widths: the settings of
#            quantize_weight_rows and quantize_rows (two loops, whole rows), each checked bit for bit against the
#            package's own
# Runs per suite: copies six, 235b, qwen3 and deep four, v3 and profile two. sidebyside.sh stops a run after
# PITH_TIMEOUT (300 s) and prints each run's wall time: choose the suites of one call so that their runs fit its 600 s.
set -u
OUT=${OUT:-/tmp/fp8_widths}
BENCH=${BENCH:-.bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
S="train.compile=true+train.steps=14"
M4="train.micro_batch=4+train.global_batch=4"
M8="train.micro_batch=8+train.global_batch=8"
F="train.fp8=true+train.fp8_scaling=rows"
C235="model.hidden_size=4096+model.moe_intermediate_size=1536+model.num_attention_heads=64+model.num_key_value_heads=4"
CV3="model.hidden_size=7168+model.intermediate_size=18432+model.moe_intermediate_size=2048"
CV3="$CV3+model.num_attention_heads=128+model.num_key_value_heads=128+model.q_lora_rank=1536"
CV3="$CV3+model.n_shared_experts=1+model.n_routed_experts=64+model.num_experts_per_tok=8"
L2="model.num_hidden_layers=2"
L3="model.num_hidden_layers=3"
L6="model.num_hidden_layers=6"

pairs() {  # NAME MODEL SETS [NAME MODEL SETS ...]: bf16 and FP8 of each (and, with KEEP=1, FP8 keeping the experts'
           # copies for the step, train.fp8_keep_copies), in one sidebyside.sh call
  local parts=()
  while [ $# -ge 3 ]; do
    parts+=("pith:b$1:$2:$3" "pith:f$1:$2:$3+$F")
    [ "${KEEP:-0}" = 1 ] && parts+=("pith:k$1:$2:$3+$F+train.fp8_keep_copies=true")
    shift 3
  done
  local log
  log=$OUT/e2e_$(date +%H%M%S).log
  OUT=$OUT/e2e PROJ=. bash "$BENCH/sidebyside.sh" "${parts[@]}" > "$log" 2>&1
  grep -E " rc=" "$log"
  python3 - "$OUT/e2e/results.jsonl" <<'EOF'
import json, sys
runs = {r["run"]: r for r in map(json.loads, open(sys.argv[1])) if r.get("system") == "pith_lit"}
print(f"{'cut':17s} {'bf16 tokens/s':>14s} {'FP8 tokens/s':>13s} {'FP8 / bf16':>11s} {'peak bf16 / FP8 GiB':>20s}")
for name in [n[1:] for n in runs if n.startswith("b")]:
    for v, label in [("f", name)] + [("k", name + " kept")] * ("k" + name in runs):
        b, f = runs.get("b" + name, {}), runs.get(v + name, {})
        tb, tf = b.get("tokens_per_s") or 0, f.get("tokens_per_s") or 0
        ratio = f"{tf / tb:.3f}x" if tb and tf else "-"
        peaks = f"{b.get('peak_gib', '-')!s:>9s} / {f.get('peak_gib', '-')!s:<9s}"
        why = "" if tb and tf else f"  {b.get('error') or f.get('error') or 'a run did not finish: see its log'}"
        print(f"{label:17s} {tb:>14,d} {tf:>13,d} {ratio:>11s} {peaks}{why}")
EOF
  cat "$OUT/e2e/results.jsonl" >> "$OUT/results.jsonl"
}

for suite in "$@"; do
  echo "=== $suite $(date +%T)"
  case $suite in
    235b) pairs 235m4 qwen3-30b-a3b "$S+$M4+$C235+$L2" 235m8 qwen3-30b-a3b "$S+$M8+$C235+$L2" ;;
    v3) pairs v3m4 deepseek-v2-lite "$S+$M4+$CV3+$L2" ;;
    qwen3) pairs q6m4 qwen3-30b-a3b "$S+$M4+$L6" q6m8 qwen3-30b-a3b "$S+$M8+$L6" ;;
    copies) KEEP=1 pairs q6g16 qwen3-30b-a3b "$S+$M4+$L6+train.global_batch=16+train.steps=10" \
      235g16 qwen3-30b-a3b "$S+$M4+$C235+$L2+train.global_batch=16+train.steps=10" ;;
    deep) pairs 235l3 qwen3-30b-a3b "$S+$M4+$C235+$L3+train.steps=12" \
      v3l3 deepseek-v2-lite "$S+$M4+$CV3+$L3+train.steps=12" ;;
    profile)
      P="$S+$M4+$C235+$L2+log.profile_step=8+train.steps=9"
      OUT=$OUT/profile PROJ=. bash "$BENCH/sidebyside.sh" "pith:pb235:qwen3-30b-a3b:$P" \
        "pith:pf235:qwen3-30b-a3b:$P+$F" > "$OUT/profile.log" 2>&1
      for n in pb235 pf235; do
        echo "--- $n"
        PYTHONPATH=. python3 benchmarks/anatomy.py /tmp/pith_$n 2>&1 | tee "$OUT/anatomy_$n.txt" | tail -25
      done ;;
    kernels)
      PYTHONPATH=. python3 benchmarks/fp8_rows.py --parts weights,rowsweep --only qwen3-235b-a22b,deepseek-v3 \
        --json "$OUT/fp8_rows.json" 2>&1 | tee "$OUT/fp8_rows.log" | grep -E "whole rows|DIFFERS|FAILED|^20" ;;
    *) echo "unknown suite $suite: one of 235b v3 qwen3 deep copies profile kernels" ;;
  esac
done
