"""DeepSeek-V2 beyond its notebook: five stages vs the sequential reference at other shapes, and agreement with
Hugging Face transformers' DeepseekV2ForCausalLM (parameter names and shapes, RoPE/YaRN frequencies, and logits
with the same weights). transformers is a test-only dependency."""
import dataclasses
import math

import pytest
import torch

from conftest import assert_close, assert_grads_match, assert_positions_used
from pith_lit.models.deepseek_v2 import Config, DeepseekV2ForCausalLM, rope_frequencies


def hf_keys(state: dict) -> dict:
    "A state dict without the routers' selection bias, which is ours only (train/42) and has no place in this format."
    return {k: v for k, v in state.items() if not k.endswith(".e_score_correction_bias")}


# Every choice at once: two dense layers, group-limited top-3 of 8 experts in 4 groups (2 groups allowed), two
# shared experts, a scaled router, the low-rank query path, attention biases, a tied head, YaRN whose cos/sin
# factor and softmax temperature are both not 1.
YARN = dict(type="yarn", factor=8.0, original_max_position_embeddings=16, beta_fast=16, beta_slow=2, mscale=1.0,
            mscale_all_dim=0.5)
CFG = dict(vocab_size=50, hidden_size=24, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
           n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
           routed_scaling_factor=2.0, first_k_dense_replace=2, q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=6,
           qk_rope_head_dim=4, v_head_dim=5, attention_bias=True, tie_word_embeddings=True, rope_scaling=YARN,
           max_position_embeddings=128)
PLAIN = dict(topk_method="greedy", q_lora_rank=0, attention_bias=False, tie_word_embeddings=False, rope_scaling={},
             first_k_dense_replace=1, routed_scaling_factor=1.0)


def make(seed=1, **over):
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(Config(**{**CFG, **over}))
    with torch.no_grad():  # biases and norms start at 0 and 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_layer_kinds():
    model = make()
    assert [type(l.mlp).__name__ for l in model.model.layers.values()] == ["MLP", "MLP", "SparseMoE", "SparseMoE"]
    attn = model.model.layers["0"].self_attn
    assert hasattr(attn, "q_a_proj") and not hasattr(attn, "q_proj")
    attn = make(q_lora_rank=0).model.layers["0"].self_attn
    assert hasattr(attn, "q_proj") and not hasattr(attn, "q_a_proj")


@pytest.mark.parametrize("over", [{}, PLAIN], ids=["group-yarn-qlora", "greedy-plain"])
@pytest.mark.parametrize("dtype, rel, grel", [(torch.float32, 1e-5, 1e-4), (torch.float64, 1e-12, 1e-11)])
def test_five_stages_match_reference(over, dtype, rel, grel):
    model = make(seed=3, initializer_range=0.1, **over).to(dtype)
    ids = torch.randint(0, CFG["vocab_size"], (3, 11))
    logits, routings = model(ids)
    ref = model.reference_forward(ids)
    assert logits.dtype == dtype and logits.shape == (3, 11, CFG["vocab_size"])
    assert_close(logits, ref, rel, "logits")
    dense = model.config.first_k_dense_replace
    assert [r is None for r in routings] == [True] * dense + [False] * (4 - dense)
    for r in filter(None, routings):
        assert r.ids.shape == r.weights.shape == (33, 3)
        assert r.counts.sum() == 33 * 3 and r.probs.shape == (33, 8)
    assert_grads_match(model, logits, ref, grel)


def test_positions_shape():
    assert_positions_used(make(), CFG["vocab_size"])


def hf_config(cfg: Config):
    "transformers' DeepseekV2Config for ours: 0 -> None for q_lora_rank, rope_theta/rope_scaling -> rope_parameters."
    transformers = pytest.importorskip("transformers")
    skip = ("model_type", "rope_theta", "rope_scaling", "q_lora_rank")
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    if cfg.rope_scaling:
        rope = {k: v for k, v in cfg.rope_scaling.items() if k != "type"} | {"rope_type": "yarn"}
    else:
        rope = {"rope_type": "default"}
    return transformers.DeepseekV2Config(**kw, q_lora_rank=cfg.q_lora_rank or None,
                                         rope_parameters=rope | {"rope_theta": cfg.rope_theta},
                                         attn_implementation="eager", experts_implementation="eager")


@pytest.mark.parametrize("over", [{}, PLAIN], ids=["group-yarn-qlora", "greedy-plain"])
def test_matches_transformers(over):
    """Random weights in transformers' model, copied into ours by name with strict=True; same logits.

    transformers computes RMSNorm, the router and RoPE in float32 even in a float64 model, so the float64
    comparison is as tight as float32 rounding allows, not float64's."""
    transformers = pytest.importorskip("transformers")
    model = make(**over)
    torch.manual_seed(7)
    hf = transformers.DeepseekV2ForCausalLM(hf_config(model.config))
    with torch.no_grad():  # large weights: every sub-block moves the logits
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    theirs = hf.state_dict()
    assert {k: tuple(v.shape) for k, v in hf_keys(model.state_dict()).items()} == \
        {k: tuple(v.shape) for k, v in theirs.items()}
    missing, unexpected = model.load_state_dict(theirs, strict=False)
    assert not unexpected and sorted(missing) == sorted(model.state_dict().keys() - hf_keys(model.state_dict()).keys())
    assert model.model.layers["0"].self_attn.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    ids = torch.randint(0, CFG["vocab_size"], (2, 9))
    positions = torch.arange(9) + 5
    for dtype, rel in ((torch.float32, 1e-5), (torch.float64, 1e-6)):
        model, hf = model.to(dtype), hf.to(dtype)
        with torch.no_grad():
            logits, routings = model(ids, positions)
            ref = hf(input_ids=ids, position_ids=positions.expand(2, 9)).logits
        assert_close(logits, ref, rel, f"{dtype} logits vs transformers")


def test_yarn_frequencies_match_transformers():
    "DeepSeek-V2-Lite's YaRN (64 rope channels, factor 40 over 4096): frequencies and the cos/sin factor."
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    lite = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                mscale=0.707, mscale_all_dim=0.707)
    factors = []
    for scaling, length in ((lite, 163840), ({**lite, "mscale": 1.0}, 163840),
                            ({**lite, "beta_fast": 8, "beta_slow": 2, "factor": 4, "mscale_all_dim": 0.5}, 16384)):
        cfg = Config(qk_rope_head_dim=64, rope_scaling=scaling, max_position_embeddings=length)
        inv_freq, factor = rope_frequencies(64, cfg.rope_theta, scaling, cfg.max_position_embeddings, torch.float32)
        hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(cfg))
        assert torch.allclose(inv_freq, hf_inv_freq, rtol=1e-6, atol=0) and factor == pytest.approx(hf_factor)
        factors.append(factor)
    assert factors[0] == 1.0 and factors[1] > 1.0 and factors[2] > 1.0, factors


def test_init():
    model = make(seed=0, initializer_range=0.1, num_hidden_layers=8, tie_word_embeddings=False)
    model.init_weights()
    layers = model.model.layers
    assert torch.all(model.model.norm.weight == 1) and torch.all(layers["0"].self_attn.kv_a_layernorm.weight == 1)
    assert torch.all(layers["0"].self_attn.o_proj.bias == 0)
    out_std = 0.1 / 4  # 1/sqrt(2 * 8 layers)
    a = layers["0"].self_attn
    for p, std in [(model.lm_head.weight, 0.1), (layers["2"].mlp.experts.gate_up_proj, 0.1),
                   (layers["2"].mlp.experts.down_proj, out_std), (layers["2"].mlp.shared_experts.down_proj.weight,
                                                                  out_std),
                   (layers["2"].mlp.shared_experts.up_proj.weight, 0.1), (layers["2"].mlp.gate.weight, 0.1),
                   (layers["0"].mlp.down_proj.weight, out_std), (a.o_proj.weight, out_std),
                   (a.q_b_proj.weight, 0.1), (a.kv_b_proj.weight, 0.1), (a.kv_a_proj_with_mqa.weight, 0.1)]:
        assert abs(p.std().item() / std - 1) < 0.15, (p.shape, p.std().item(), std)


def test_lite_shapes_on_meta():
    "DeepSeek-V2-Lite's real config builds (on the meta device) with the published parameter count, about 15.7B."
    lite = Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                  num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                  n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=0,
                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  max_position_embeddings=163840,
                  rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                    beta_slow=1, mscale=0.707, mscale_all_dim=0.707))
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(lite)
    assert 15.6e9 < model.num_params() < 15.8e9, model.num_params()
    assert 2.4e9 < model.active_matmul_params() < 2.8e9, model.active_matmul_params()
    scale = model.model.layers["0"].self_attn.softmax_scale
    assert scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)


@pytest.mark.parametrize("over, message", [
    (dict(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=4"),
    (dict(qk_rope_head_dim=5), "qk_rope_head_dim=5 must be even"),
    (dict(n_routed_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and n_routed_experts=4"),
    (dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not valid; use 'greedy' or 'group_limited_greedy'"),
    (dict(topk_method="group_limited_greedy", n_group=3), "n_group=3 must be >= 1 and divide n_routed_experts=8"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=5), "topk_group=5 must be between 1 and n_group=4"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, num_experts_per_tok=3),
     "num_experts_per_tok=3 is more than the 2 experts in topk_group=1 groups"),
    (dict(norm_topk_prob=True), "norm_topk_prob=True is not supported"),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), "rope_scaling=.* is not valid"),
    (dict(rope_scaling=dict(type="yarn", factor=2.0, truncate=False)), "only the keys type, rope_type, factor"),
])
def test_config_errors(over, message):
    with pytest.raises(ValueError, match=message):
        Config(**over)
