"""GPT-OSS beyond its notebook: five stages vs the sequential reference at another shape and layer pattern, and
agreement with Hugging Face transformers' GptOssForCausalLM (state_dict names, shapes and layouts; RoPE tables;
logits and gradients with the same weights, on sequences longer than the sliding window). transformers is a
test-only dependency."""
import dataclasses
import types

import pytest
import torch

from conftest import assert_close, assert_grads_match, assert_positions_used, weighted_sum
from pith_lit.models.gpt_oss import Config, GptOssForCausalLM, rope_cos_sin, sink_attention, sink_attention_reference


def hf_keys(state: dict) -> dict:
    "A state dict without the routers' selection bias, which is ours only (train/42) and has no place in this format."
    return {k: v for k, v in state.items() if not k.endswith(".e_score_correction_bias")}


# A layer pattern that is not the default alternation, MQA-like grouping (4 query heads per KV head), top-3 of 6,
# a tied head, a window of 7 on 20-token sequences, and a head_dim whose 3 RoPE pairs fall one on each side of
# YaRN's ramp and one on it.
CFG = dict(vocab_size=50, hidden_size=24, intermediate_size=12, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=1, head_dim=6, num_local_experts=6, num_experts_per_tok=3, sliding_window=7,
           layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
           tie_word_embeddings=True)
S = 20


def make(seed=1, **over):
    torch.manual_seed(seed)
    model = GptOssForCausalLM(Config(**{**CFG, **over}))
    with torch.no_grad():  # biases, sinks and norms start at 0, ~0 and 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("dtype, rel, grel", [(torch.float32, 1e-5, 1e-4), (torch.float64, 1e-12, 1e-11)])
def test_five_stages_match_reference(dtype, rel, grel):
    model = make(seed=3).to(dtype)
    ids = torch.randint(0, CFG["vocab_size"], (3, S))
    logits, routings = model(ids)
    ref = model.reference_forward(ids)
    assert logits.dtype == dtype and logits.shape == (3, S, CFG["vocab_size"])
    assert_close(logits, ref, rel, "logits")
    for r in routings:
        assert r.ids.shape == r.weights.shape == (3 * S, 3)
        assert r.counts.sum() == 3 * S * 3 and r.probs.shape == (3 * S, 6)
        assert torch.allclose(r.weights.sum(-1), torch.ones((), dtype=dtype))
    for name, a in assert_grads_match(model, logits, ref, grel).items():
        if name.endswith("sinks"):
            assert (a.abs() > 0).all(), f"{name} gets a zero gradient: {a}"


def test_sink_attention_larger_window_and_bf16():
    "SDPA-with-a-sink-key equals explicit scores; in bf16 it is closer to float64 than the bf16 explicit version."
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, n, 40, 16, dtype=torch.float64) for n in (6, 2, 2))
    sinks = 2 * torch.randn(6, dtype=torch.float64)
    for window in (1, 9, 40, None):
        assert_close(sink_attention(q, k, v, sinks, window), sink_attention_reference(q, k, v, sinks, window), 1e-14,
                     f"window {window}")
    exact = sink_attention_reference(q, k, v, sinks, 9)
    bf = [t.bfloat16() for t in (q, k, v, sinks)]
    assert_close(sink_attention(*bf, 9).double(), exact, 2e-2, "bf16 sink attention")


def test_positions_shape():
    assert_positions_used(make(), CFG["vocab_size"])


def hf_model(cfg: Config):
    "transformers' GptOssForCausalLM for `cfg`, with eager attention and eager experts (they run in float64)."
    transformers = pytest.importorskip("transformers")
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "model_type"}
    hf_cfg = transformers.GptOssConfig(**kw, attn_implementation="eager", experts_implementation="eager")
    return transformers.GptOssForCausalLM(hf_cfg)


def test_config_fields_are_transformers_names():
    transformers = pytest.importorskip("transformers")
    ours = {f.name for f in dataclasses.fields(Config)}
    theirs = set(transformers.GptOssConfig().to_dict())
    assert ours <= theirs, sorted(ours - theirs)
    assert transformers.GptOssConfig(num_hidden_layers=4).layer_types == Config().layer_types
    assert transformers.GptOssConfig().rope_parameters == {**Config().rope_parameters}


@pytest.mark.parametrize("head_dim, truncate", [(6, False), (64, False), (64, True)])
def test_rope_matches_transformers(head_dim, truncate):
    "Our YaRN cos/sin equal transformers' rotary embedding, which computes in float32, to float32 rounding."
    cfg = Config(**{**CFG, "head_dim": head_dim, "num_hidden_layers": 1, "layer_types": [],
                    "rope_parameters": {**Config().rope_parameters, "truncate": truncate}})
    hf = hf_model(cfg)
    positions = torch.arange(300).expand(2, 300) * 7  # angles up to ~2000 rad
    cos_hf, sin_hf = hf.model.rotary_emb(torch.empty(0), positions)
    cos, sin = rope_cos_sin(positions, head_dim, cfg.rope_parameters, torch.float32)
    assert cos.shape == cos_hf.shape == (2, 300, head_dim // 2)
    # float32 angles near 2000 rad carry an absolute rounding error of about 2000 · 6e-8 ≈ 1e-4
    assert_close(cos, cos_hf, 3e-4, "cos")
    assert_close(sin, sin_hf, 3e-4, "sin")
    assert_close(cos[:, :10], cos_hf[:, :10], 1e-6, "cos, positions < 70")
    assert_close(sin[:, :10], sin_hf[:, :10], 1e-6, "sin, positions < 70")


def float64_norms_and_rope(hf, cfg: Config):
    """transformers computes RMSNorm and RoPE in float32 even in a float64 model. For a float64 comparison, run its
    RMSNorm formula without that cast, and our RoPE (test_rope_matches_transformers checks it against theirs)."""
    def norm_forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    for m in hf.modules():
        if type(m).__name__ == "GptOssRMSNorm":
            m.forward = types.MethodType(norm_forward, m)

    class Rope(torch.nn.Module):
        def forward(self, x, position_ids):
            return rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_parameters, x.dtype)
    hf.model.rotary_emb = Rope()


@pytest.mark.parametrize("dtype, over", [
    (torch.float32, {}),
    (torch.float64, {}),
    (torch.float64, dict(tie_word_embeddings=False, attention_bias=False, num_key_value_heads=2, layer_types=[])),
])
def test_matches_transformers(dtype, over):
    "transformers' weights load strictly into our model; logits (and in float64 every gradient) agree."
    cfg = Config(**{**CFG, **over, "initializer_range": 0.15})  # large weights: every sub-block moves the logits
    torch.manual_seed(5)
    hf = hf_model(cfg)
    with torch.no_grad():  # transformers' init leaves biases at 0 and norms at 1; randomise all of it
        for name, p in hf.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) + (1.0 if "norm" in name else 0.0))
    model = GptOssForCausalLM(cfg)
    theirs = hf.state_dict()
    assert {k: tuple(v.shape) for k, v in hf_keys(model.state_dict()).items()} == \
        {k: tuple(v.shape) for k, v in theirs.items()}
    missing, unexpected = model.load_state_dict(theirs, strict=False)
    assert not unexpected and sorted(missing) == sorted(model.state_dict().keys() - hf_keys(model.state_dict()).keys())
    hf, model = hf.to(dtype), model.to(dtype)
    if dtype == torch.float64:
        float64_norms_and_rope(hf, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, S))
    positions = torch.arange(S) + 3
    logits, _ = model(ids, positions)
    ref = hf(input_ids=ids, position_ids=positions.expand(2, S)).logits
    assert_close(logits, ref, 1e-5 if dtype == torch.float32 else 1e-12, "logits vs transformers")
    if dtype == torch.float64:
        ours, hfs = dict(model.named_parameters()), dict(hf.named_parameters())
        g = torch.autograd.grad(weighted_sum(logits), list(ours.values()))
        g_hf = torch.autograd.grad(weighted_sum(ref), [hfs[n] for n in ours])
        for name, a, b in zip(ours, g, g_hf):
            assert_close(a, b, 1e-10, f"grad of {name} vs transformers")


def test_init():
    model = make(seed=0, initializer_range=0.1, num_hidden_layers=8, layer_types=[], tie_word_embeddings=False,
                 hidden_size=64, intermediate_size=32)
    model.init_weights()
    layers = model.model.layers
    assert torch.all(model.model.norm.weight == 1) and torch.all(layers["0"].self_attn.q_proj.bias == 0)
    assert torch.all(layers["3"].mlp.router.bias == 0) and torch.all(layers["3"].mlp.experts.down_proj_bias == 0)
    out_std = 0.1 / 4  # 1/sqrt(2 * 8 layers)
    for p, std in [(model.lm_head.weight, 0.1), (layers["1"].mlp.experts.gate_up_proj, 0.1),
                   (layers["1"].mlp.experts.down_proj, out_std), (layers["0"].self_attn.o_proj.weight, out_std),
                   (layers["0"].self_attn.q_proj.weight, 0.1), (layers["2"].mlp.router.weight, 0.1),
                   (torch.cat([l.self_attn.sinks for l in layers.values()]), 0.1)]:
        assert abs(p.std().item() / std - 1) < 0.25, (p.shape, p.std().item(), std)
    assert [l.self_attn.sliding_window for l in layers.values()] == [7, None] * 4


@pytest.mark.parametrize("over, message", [
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=4"),
    (dict(num_local_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and num_local_expert"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(layer_types=["full_attention"] * 3), r"layer_types=\['full_attention', 'full_attention', 'full_attention'\] "
                                               r"must hold one of .* for each of the num_hidden_layers=4 layers"),
    (dict(layer_types=["sliding_attention", "full", "full_attention", "full_attention"]), "must hold one of"),
    (dict(sliding_window=0), "sliding_window=0 must be >= 1"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_parameters has keys .* it needs exactly"),
    (dict(rope_parameters={**Config().rope_parameters, "rope_type": "default"}),
     "rope_type='default', factor=32.0: GPT-OSS uses rope_type 'yarn' with factor >= 1"),
])
def test_config_errors(over, message):
    with pytest.raises(ValueError, match=message):
        Config(**over)


def test_flops_per_token():
    "With no sliding layer, the count is every family's causal formula; a window cuts only the attention term."
    full = make(layer_types=["full_attention"] * 4)
    c = full.config
    attention = 6 * S * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    assert full.flops_per_token(S) == 6 * full.active_matmul_params() + attention
    assert make().flops_per_token(S) < full.flops_per_token(S)
    assert make().flops_per_token(CFG["sliding_window"]) == full.flops_per_token(CFG["sliding_window"])
    assert Config().routed_experts == Config().num_local_experts == 8
