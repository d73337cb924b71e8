"""The bf16 error of Qwen3.5-MoE's gradients against fp32 on a GPU, seed by seed: the five-stage path (ops/16's chunked
Triton kernels) and the plain sequential path (the per-token recurrence), for the decay's parameters (A_log, dt_bias)
of each linear-attention layer, and the worst ratio between the paths over every other parameter. The same tiny model
and measurement as models/24's GPU cell (tests/references.py `bf16_errors`); this is what its bound rests on.

usage: PYTHONPATH=. python3 benchmarks/decay_grad_error.py [SEEDS]   (default 8: seeds 0-7; one JSON line per seed)"""
import json
import sys

from pith_lit.models.qwen3_5_moe import Config, Qwen3_5MoeForCausalLM
from tests.references import bf16_errors

cg = Config(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
            linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
            shared_expert_intermediate_size=256)
short = lambda name: f"{name.split('.')[2]}.{name.split('.')[-1]}"   # layer.parameter
for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    names, five, plain = bf16_errors(Qwen3_5MoeForCausalLM, cg, seed)
    decay = [i for i, n in enumerate(names) if n.endswith(("A_log", "dt_bias"))]
    rest = [i for i in range(len(names)) if i not in decay]
    print(json.dumps({"seed": seed, "logits": [round(five[0], 4), round(plain[0], 4)],
                      "decay": [(short(names[i]), round(five[i + 1], 4), round(plain[i + 1], 4)) for i in decay],
                      "rest_worst_ratio": round(max(five[i + 1] / max(plain[i + 1], 1e-9) for i in rest), 3)}),
          flush=True)
