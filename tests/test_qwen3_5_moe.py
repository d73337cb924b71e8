"""Qwen3.5-MoE beyond its notebook: five stages vs the sequential reference at another shape, positions of shape (S,)
and (B, S), packed documents, and agreement with Hugging Face transformers' Qwen3_5MoeForCausalLM (parameter names
and shapes, logits and gradients in float32 and float64, a sequence longer than one chunk of the gated delta rule,
packed documents against transformers run on each document alone). transformers is a test-only dependency."""
import dataclasses

import pytest
import torch

from conftest import assert_close, weighted_sum
from pith_lit.models.qwen3_5_moe import Config, Qwen3_5MoeForCausalLM, RMSNorm

LIN, FULL = "linear_attention", "full_attention"
# Both layer kinds twice, attention biases, a tied head, 4 query heads per KV head, 3 value heads per key head,
# a quarter of each full head rotated, top-3 of 6 experts beside the shared expert.
CFG = dict(vocab_size=50, hidden_size=24, num_hidden_layers=4, layer_types=[LIN, FULL, LIN, FULL],
           num_attention_heads=4, num_key_value_heads=1, head_dim=8, attention_bias=True,
           linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4,
           linear_conv_kernel_dim=3, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=12,
           shared_expert_intermediate_size=10, tie_word_embeddings=True,
           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5})
DECAY = ("A_log", "dt_bias", "in_proj_a.weight")


def hf_keys(state: dict) -> dict:
    "A state dict without the routers' selection bias, which is ours only (train/42) and has no place in this format."
    return {k: v for k, v in state.items() if not k.endswith(".e_score_correction_bias")}


def make(seed=1, **over):
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Config(**{**CFG, **over}))
    with torch.no_grad():  # norms start at their identity and biases at 0: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        for layer in model.model.layers.values():  # decays of about one per token (see the notebook's checks)
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 1.0)
    return model


def packed_positions(lengths_per_row):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def test_layer_kinds():
    model = make()
    assert [type(l.mixer).__name__ for l in model.model.layers.values()] == \
        ["GatedDeltaNet", "Attention", "GatedDeltaNet", "Attention"]
    assert Config(num_hidden_layers=8).layer_types == [LIN, LIN, LIN, FULL] * 2


@pytest.mark.parametrize("dtype, rel, grel", [(torch.float32, 1e-5, 1e-4), (torch.float64, 1e-11, 1e-10)])
def test_five_stages_match_reference(dtype, rel, grel):
    "Sequences longer than a 64-token chunk; the second case packs documents of 1, 64 and 2 tokens in a row."
    model = make(seed=3).to(dtype)
    ids = torch.randint(0, CFG["vocab_size"], (2, 67))
    for positions in (torch.arange(67), packed_positions([[1, 64, 2], [30, 37]])):
        logits, routings = model(ids, positions)
        ref = model.reference_forward(ids, positions)
        assert logits.dtype == dtype and logits.shape == (2, 67, CFG["vocab_size"])
        assert_close(logits, ref, rel, "logits")
        for r in routings:
            assert r.ids.shape == r.weights.shape == (134, 3) and r.probs.shape == (134, 6)
            assert r.counts.sum() == 134 * 3
        params = dict(model.named_parameters())
        g = torch.autograd.grad(weighted_sum(logits), list(params.values()))
        g_ref = torch.autograd.grad(weighted_sum(ref), list(params.values()))
        for name, a, b in zip(params, g, g_ref):   # in float32 the decay's parameters carry the chunked form's
            loose = dtype == torch.float32 and name.endswith(DECAY)   # rounding (the notebook's checks)
            assert_close(a, b, 1e-2 if loose else grel, f"grad of {name}")
            assert b.abs().max() > 0, name


def test_positions_shape():
    """(S,) and (B, S) positions agree (to rounding: (B, S) positions take the document path of the rule and the
    attention, with one document per row); positions are used (a different one changes the logits)."""
    model = make()
    ids = torch.randint(0, CFG["vocab_size"], (2, 6))
    with torch.no_grad():
        a, _ = model(ids, torch.arange(6))
        b, _ = model(ids, torch.arange(6).expand(2, 6))
        c, _ = model(ids, torch.tensor([[0, 1, 2, 3, 4, 5], [0, 2, 4, 6, 8, 10]]))
    assert_close(b, a, 1e-6, "(B, S) vs (S,) positions")
    assert_close(c[0], a[0], 1e-6, "same positions") and not torch.allclose(a[1], c[1], atol=1e-4)


def test_packed_documents_are_independent():
    "Each document of a packed row gets the logits it gets alone, in the five-stage forward."
    model = make(seed=4).double()
    ids = torch.randint(0, CFG["vocab_size"], (1, 70))
    lengths = [3, 1, 66]
    with torch.no_grad():
        packed = model(ids, packed_positions([lengths]))[0]
        start = 0
        for n in lengths:
            alone = model(ids[:, start:start + n])[0]
            assert_close(packed[:, start:start + n], alone, 1e-12, f"document at {start}")
            start += n
        whole = model(ids)[0]
    assert not torch.allclose(packed[:, 4:], whole[:, 4:])   # the restarts change what later documents see


def hf_config(cfg: Config):
    transformers = pytest.importorskip("transformers")
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "model_type"}
    return transformers.Qwen3_5MoeTextConfig(**kw, attn_implementation="eager", experts_implementation="eager")


# Seeds whose tokens have no near-tie in the router: transformers chooses the top-k in float32 even in float64.
@pytest.mark.parametrize("seed, over", [(5, {}), (7, dict(tie_word_embeddings=False, attention_bias=False,
                                                          layer_types=[FULL, LIN, LIN, LIN]))])
def test_matches_transformers(seed, over):
    transformers = pytest.importorskip("transformers")
    model = make(seed=seed, initializer_range=0.15, **over)  # large weights: every sub-block moves the logits
    hf = transformers.Qwen3_5MoeForCausalLM(hf_config(model.config))
    ours, theirs = hf_keys(model.state_dict()), hf.state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    hf.load_state_dict(ours, strict=True)
    ids = torch.randint(0, CFG["vocab_size"], (2, 70))   # longer than one chunk of 64
    # transformers computes the gated delta rule, norms, RoPE and the router in float32 even in a float64 model, so
    # float64 agrees to float32's rounding
    for dtype, rel, grel in ((torch.float32, 2e-5, 1e-3), (torch.float64, 2e-5, 1e-3)):
        model, hf = model.to(dtype), hf.to(dtype)
        logits, _ = model(ids, torch.arange(70) + 3)
        ref = hf(input_ids=ids, position_ids=(torch.arange(70) + 3).expand(2, 70)).logits
        assert logits.dtype == ref.dtype == dtype
        assert_close(logits, ref, rel, f"{dtype} logits vs transformers")
        params, hf_params = dict(model.named_parameters()), dict(hf.named_parameters())
        assert params.keys() == hf_params.keys()
        g = torch.autograd.grad(logits.sum(), list(params.values()))
        g_hf = torch.autograd.grad(ref.sum(), [hf_params[n] for n in params])
        for name, a, b in zip(params, g, g_hf):
            assert_close(a, b, grel, f"{dtype} grad of {name} vs transformers")


def test_packed_documents_match_transformers_per_document():
    """A packed row of three documents (one of a single token, one across the chunk boundary) against transformers
    run on each document alone."""
    transformers = pytest.importorskip("transformers")
    model = make(seed=6, initializer_range=0.15)
    hf = transformers.Qwen3_5MoeForCausalLM(hf_config(model.config))
    hf.load_state_dict(hf_keys(model.state_dict()))
    lengths = [1, 70, 9]
    ids = torch.randint(0, CFG["vocab_size"], (1, sum(lengths)))
    with torch.no_grad():
        packed = model(ids, packed_positions([lengths]))[0]
        start = 0
        for n in lengths:
            assert_close(packed[:, start:start + n], hf(input_ids=ids[:, start:start + n]).logits, 2e-5,
                         f"document at {start}")
            start += n


def test_init():
    model = make(seed=0, initializer_range=0.1, num_hidden_layers=8, layer_types=[], tie_word_embeddings=False,
                 linear_num_value_heads=64, linear_num_key_heads=2)
    model.init_weights()
    layers = model.model.layers
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert all(torch.all(w == 0) for w in norms) and len(norms) == 1 + 2 * 8 + 2 * 2   # zero-centred: scale 1
    lin, full = layers["0"].linear_attn, layers["3"].self_attn
    assert torch.all(lin.norm.weight == 1) and torch.all(lin.dt_bias == 1) and torch.all(full.q_proj.bias == 0)
    A = lin.A_log.exp()
    assert 0.01 <= A.min() and A.max() <= 16 and A.max() - A.min() > 8        # U(0.01, 16), spread
    out_std = 0.1 / 4  # 1/sqrt(2 * 8 layers)
    for p, std in [(model.lm_head.weight, 0.1), (layers["1"].mlp.experts.gate_up_proj, 0.1),
                   (layers["1"].mlp.experts.down_proj, out_std), (layers["1"].mlp.shared_expert.down_proj.weight,
                   out_std), (lin.out_proj.weight, out_std), (full.o_proj.weight, out_std),
                   (lin.in_proj_qkv.weight, 0.1), (full.q_proj.weight, 0.1), (layers["2"].mlp.gate.weight, 0.1)]:
        assert abs(p.std().item() / std - 1) < 0.15, (p.shape, p.std().item(), std)


@pytest.mark.parametrize("over, message", [
    (dict(layer_types=[LIN, "sliding_attention", LIN, FULL]), r"layer_types=.* must hold one of"),
    (dict(layer_types=[LIN, FULL]), r"for each of the num_hidden_layers=4 layers"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads=3 must divide num_attention_heads=4"),
    (dict(linear_num_key_heads=4, linear_num_value_heads=6),
     "linear_num_value_heads=6 must be a multiple of linear_num_key_heads=4"),
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and num_experts=4"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     "Qwen3.5 uses plain RoPE"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "Qwen3.5 uses plain RoPE"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}),
     r"partial_rotary_factor=0.3 gives 9.6 rotated channels of head_dim=32"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0}),
     r"partial_rotary_factor=0.0 gives 0.0 rotated channels"),
])
def test_config_errors(over, message):
    with pytest.raises(ValueError, match=message):
        Config(**over)
