"""The bf16 error of Qwen3.5-MoE's gradients against fp32 on a GPU, seed by seed: the five-stage path (ops/16's chunked
Triton kernels) and the plain sequential path (the per-token recurrence), for the decay's parameters (A_log, dt_bias)
of each linear-attention layer, and the worst ratio between the paths over every other parameter. The same tiny model
as models/24's GPU cell; this is what its bound on the decay's gradients rests on.

usage: PYTHONPATH=. python3 benchmarks/decay_grad_error.py [SEEDS]   (default 8: seeds 0-7; one JSON line per seed)"""
import sys
import torch, json
from pith_lit.models.qwen3_5_moe import Config, Qwen3_5MoeForCausalLM
rel_err = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
for seed in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    torch.manual_seed(seed)
    cg = Config(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                shared_expert_intermediate_size=256)
    ref_model = Qwen3_5MoeForCausalLM(cg).cuda()
    bf_model = Qwen3_5MoeForCausalLM(cg).cuda().bfloat16()
    bf_model.load_state_dict(ref_model.state_dict())
    ids = torch.randint(0, cg.vocab_size, (4, 256), device="cuda")
    pos = torch.cat([torch.arange(100), torch.arange(156)]).expand(4, 256).cuda()
    ref = ref_model.reference_forward(ids, pos)
    g_ref = torch.autograd.grad(ref.square().mean(), list(ref_model.parameters()))
    errs = {}
    for name, fwd in (("five", lambda: bf_model(ids, pos)[0]), ("plain", lambda: bf_model.reference_forward(ids, pos))):
        out = fwd()
        g = torch.autograd.grad(out.float().square().mean(), list(bf_model.parameters()))
        errs[name] = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(g, g_ref)]
    names = [n for n, _ in bf_model.named_parameters()]
    decay = [i for i, n in enumerate(names) if n.endswith(("A_log", "dt_bias"))]
    rest = [i for i in range(len(names)) if i not in decay]
    print(json.dumps({"seed": seed, "logits": [round(errs["five"][0], 4), round(errs["plain"][0], 4)],
        "decay": [(names[i].split(".")[2] + "." + names[i].split(".")[-1], round(errs["five"][i + 1], 4), round(errs["plain"][i + 1], 4)) for i in decay],
        "rest_worst_ratio": round(max(errs["five"][i + 1] / max(errs["plain"][i + 1], 1e-9) for i in rest), 3)}), flush=True)
