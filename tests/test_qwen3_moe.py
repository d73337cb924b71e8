"""Qwen3-MoE beyond its notebook: five stages vs the sequential reference at another shape, and agreement with
Hugging Face transformers' Qwen3MoeForCausalLM (parameter names and shapes, and logits with the same weights).
transformers is a test-only dependency."""
import dataclasses

import pytest
import torch

from conftest import assert_close, assert_grads_match, assert_positions_used
from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM


def hf_keys(state: dict) -> dict:
    "A state dict without the routers' selection bias, which is ours only (train/42) and has no place in this format."
    return {k: v for k, v in state.items() if not k.endswith(".e_score_correction_bias")}


# Every layer choice at once: a dense layer from mlp_only_layers and one from the sparse step (layer 0),
# unnormalised top-3 of 6 experts, attention biases, a tied head, MQA-like grouping (4 query heads per KV head).
CFG = dict(vocab_size=50, hidden_size=24, moe_intermediate_size=12, intermediate_size=40, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=1, head_dim=6, num_experts=6, num_experts_per_tok=3,
           norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3], attention_bias=True,
           tie_word_embeddings=True, rope_theta=10_000.0)


def make(seed=1, **over):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Config(**{**CFG, **over}))
    with torch.no_grad():  # biases and norms start at 0 and 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_layer_kinds():
    model = make()
    kinds = [type(l.mlp).__name__ for l in model.model.layers.values()]
    assert kinds == ["MLP", "SparseMoE", "MLP", "MLP"]  # (i + 1) % 2 == 0 -> MoE, except layer 3


@pytest.mark.parametrize("dtype, rel, grel", [(torch.float32, 1e-5, 1e-4), (torch.float64, 1e-12, 1e-11)])
def test_five_stages_match_reference(dtype, rel, grel):
    model = make(seed=3, decoder_sparse_step=1, mlp_only_layers=[2]).to(dtype)
    ids = torch.randint(0, CFG["vocab_size"], (3, 11))
    logits, routings = model(ids)
    ref = model.reference_forward(ids)
    assert logits.dtype == dtype and logits.shape == (3, 11, CFG["vocab_size"])
    assert_close(logits, ref, rel, "logits")
    assert [r is None for r in routings] == [False, False, True, False]
    for r in filter(None, routings):
        assert r.ids.shape == r.weights.shape == (33, 3)
        assert r.counts.sum() == 33 * 3 and r.probs.shape == (33, 6)
    assert_grads_match(model, logits, ref, grel)


def test_positions_shape():
    assert_positions_used(make(), CFG["vocab_size"])


def hf_model(cfg: Config):
    transformers = pytest.importorskip("transformers")
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("model_type", "rope_theta")}
    hf_cfg = transformers.Qwen3MoeConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                                         attn_implementation="eager")
    return transformers.Qwen3MoeForCausalLM(hf_cfg)


@pytest.mark.parametrize("over", [{}, dict(tie_word_embeddings=False, attention_bias=False, norm_topk_prob=True)])
def test_matches_transformers(over):
    model = make(seed=5, initializer_range=0.15, **over)  # large weights: every sub-block moves the logits
    hf = hf_model(model.config)
    ours, theirs = hf_keys(model.state_dict()), hf.state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    hf.load_state_dict(ours)
    ids = torch.randint(0, CFG["vocab_size"], (2, 9))
    positions = torch.arange(9) + 5
    with torch.no_grad():
        logits, _ = model(ids, positions)
        ref = hf(input_ids=ids, position_ids=positions.expand(2, 9)).logits
    assert_close(logits, ref, 1e-5, "logits vs transformers")


def test_init():
    model = make(seed=0, initializer_range=0.1, num_hidden_layers=8, tie_word_embeddings=False)
    model.init_weights()
    layers = model.model.layers
    assert torch.all(model.model.norm.weight == 1) and torch.all(layers["0"].self_attn.q_proj.bias == 0)
    out_std = 0.1 / 4  # 1/sqrt(2 * 8 layers)
    for p, std in [(model.lm_head.weight, 0.1), (layers["1"].mlp.experts.gate_up_proj, 0.1),
                   (layers["1"].mlp.experts.down_proj, out_std), (layers["0"].mlp.down_proj.weight, out_std),
                   (layers["0"].self_attn.o_proj.weight, out_std), (layers["0"].self_attn.q_proj.weight, 0.1)]:
        assert abs(p.std().item() / std - 1) < 0.15, (p.shape, p.std().item(), std)


@pytest.mark.parametrize("over, message", [
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=4"),
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and num_experts=4"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0 must be >= 1"),
])
def test_config_errors(over, message):
    with pytest.raises(ValueError, match=message):
        Config(**over)
