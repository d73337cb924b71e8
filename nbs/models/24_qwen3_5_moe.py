# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Qwen3.5-MoE
#
# Qwen3.5-MoE (Qwen3.5-35B-A3B and its relatives) is a hybrid: three of every four decoder layers mix tokens
# with **Gated DeltaNet**, a linear attention whose state is one matrix per head (ops/16), and every fourth
# with gated softmax attention. Every layer's MLP is a mixture of experts with a **shared expert** beside the
# routed ones. Next to Qwen3-MoE it differs in these places, each with its section below.

# %% [markdown]
# - `layer_types` names each layer `linear_attention` or `full_attention`;
# - the linear-attention layer: projections to `q, k, v` (through a short causal convolution), an output gate
#   `z`, a write strength `b` and a decay `a`; the gated delta rule; a norm gated by `silu(z)`; the output
#   projection;
# - full attention has **partial RoPE** (only the first quarter of each head's channels rotate), a per-head
#   **output gate** that `q_proj` produces beside the queries, and q/k norms; heads are 256 wide;
# - the norms outside the linear-attention layer are **zero-centred**: `x̂ · (1 + weight)`, weight starting at 0;
# - the MoE block adds a shared SwiGLU expert, scaled per token by `sigmoid(shared_expert_gate(x))`; the router
#   always renormalises its top-k.
#
# The notebook is self-contained: it defines every piece it uses, then cuts each decoder layer into the five
# stages of the layer protocol (models/protocol). Parameter names and shapes are those of Hugging Face
# transformers 5.x `Qwen3_5MoeForCausalLM` (the text model; the published checkpoints are the multimodal
# `Qwen3_5MoeForConditionalGeneration`, whose language model train/46 reads). The checks compare the five-stage
# forward with a plain sequential one; tests/test_qwen3_5_moe.py also compares against transformers itself.

# %%
#| default_exp models.qwen3_5_moe

# %%
#| export
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pith_lit.models.protocol import (MLP, CausalLM, Experts, Options, Routing, RoutedLayer, cfg, compute_dtype,
                                      hf_or, hf_rope, init_shared, mlp_bytes, norm_bytes, project, projection,
                                      rope_cos_sin, route_ids, router_bytes)
from pith_lit.ops.attention import attention_mask, documents
from pith_lit.ops.gated_delta_rule import (causal_conv1d, chunk_gated_delta_rule, chunk_gated_delta_rule_torch,
                                           gated_delta_rule_reference, gated_rms_norm, gdn_gates)

# %% [markdown]
# ## Config
#
# Field names are those of transformers 5.x `Qwen3_5MoeTextConfig`. RoPE is one `rope_parameters` dict, as in
# transformers 5: `rope_theta` and `partial_rotary_factor` (the fraction of each head's channels that rotate).
# `layer_types` left empty is transformers' default: every fourth layer full attention, the rest linear. The
# defaults are tiny, so the checks run in seconds, but keep Qwen3.5's ratios: a quarter of the layers full, a
# quarter of the head rotated, twice as many value heads as key heads in the linear layers.

# %%
#| export
LAYER_TYPES = ("linear_attention", "full_attention")
ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor")


@dataclass
class Config:
    "Qwen3.5-MoE hyper-parameters. Field names are those of Hugging Face's `Qwen3_5MoeTextConfig` (transformers 5.x)."
    model_type: str = cfg("qwen3_5_moe", "model family; selects the model module")
    vocab_size: int = cfg(4096, "vocabulary size (the default tokenizer, stdlib-bpe-4096, needs at least 4096; the byte "
                                 "tokenizer 259)", gt=0)
    hidden_size: int = cfg(128, "model width", gt=0)
    num_hidden_layers: int = cfg(4, "number of decoder layers", gt=0)
    layer_types: list = cfg([], "per layer 'linear_attention' or 'full_attention'; [] = every fourth layer full")
    num_attention_heads: int = cfg(4, "query heads of a full-attention layer", gt=0)
    num_key_value_heads: int = cfg(2, "key/value heads of a full-attention layer; divides num_attention_heads", gt=0)
    head_dim: int = cfg(32, "width of one full-attention head", gt=0)
    attention_bias: bool = cfg(False, "bias on the full-attention q/k/v/o projections")
    rope_parameters: dict = cfg({"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
                                "RoPE: base rope_theta, on the first partial_rotary_factor · head_dim channels of a head")
    max_position_embeddings: int = cfg(32768, "longest sequence the model is meant for (RoPE has no table)", gt=0)
    linear_num_key_heads: int = cfg(2, "query/key heads of a linear-attention layer", gt=0)
    linear_num_value_heads: int = cfg(4, "value heads of a linear-attention layer; a multiple of "
                                         "linear_num_key_heads", gt=0)
    linear_key_head_dim: int = cfg(32, "width of one linear-attention query/key head", gt=0)
    linear_value_head_dim: int = cfg(32, "width of one linear-attention value head", gt=0)
    linear_conv_kernel_dim: int = cfg(4, "width of the causal convolution before the gated delta rule", gt=0)
    num_experts: int = cfg(8, "routed experts per layer (every layer is MoE)", gt=0)
    num_experts_per_tok: int = cfg(2, "experts chosen per token (top-k)", gt=0)
    moe_intermediate_size: int = cfg(128, "FFN width of one routed expert", gt=0)
    shared_expert_intermediate_size: int = cfg(128, "FFN width of the shared expert", gt=0)
    rms_norm_eps: float = cfg(1e-6, "epsilon of every RMSNorm", gt=0)
    router_aux_loss_coef: float = cfg(0.001, "Hugging Face's load-balance weight, kept for conversion; "
                                             "the trainer's weight is train.lb_coef", ge=0)
    tie_word_embeddings: bool = cfg(False, "share the embedding and output head weights")
    initializer_range: float = cfg(0.02, "standard deviation of the N(0, σ) initialisation", gt=0)

    def __post_init__(self):
        if not self.layer_types:  # Hugging Face's default: full attention on layers 3, 7, 11, ...
            self.layer_types = [LAYER_TYPES[(i + 1) % 4 == 0] for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types={self.layer_types} must hold one of {LAYER_TYPES} for each of the "
                             f"num_hidden_layers={self.num_hidden_layers} layers; or [] for every fourth full")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}; change one of them")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads} (each key head serves a group of "
                             "value heads)")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                             f"num_experts={self.num_experts}")
        rp = self.rope_parameters
        if sorted(rp) != sorted(ROPE_KEYS) or rp["rope_type"] != "default":
            raise ValueError(f"rope_parameters={rp}: Qwen3.5 uses plain RoPE, the keys {sorted(ROPE_KEYS)} with "
                             "rope_type 'default'")
        rot = self.head_dim * rp["partial_rotary_factor"]
        if not 0 < rot <= self.head_dim or rot != int(rot) or int(rot) % 2:
            raise ValueError(f"rope_parameters.partial_rotary_factor={rp['partial_rotary_factor']} gives "
                             f"{rot} rotated channels of head_dim={self.head_dim}; it must give an even whole "
                             "number between 2 and head_dim (RoPE rotates pairs of channels)")

    @property
    def routed_experts(self) -> int:
        "Routed experts per MoE layer, under the name every model family's Config shares (the engine reads it)."
        return self.num_experts

    @property
    def rotary_dim(self) -> int:
        "Channels of a full-attention head that RoPE rotates: the first partial_rotary_factor · head_dim."
        return int(self.head_dim * self.rope_parameters["partial_rotary_factor"])

# %%
assert Config().layer_types == ["linear_attention"] * 3 + ["full_attention"]
assert Config(num_hidden_layers=8).layer_types.count("full_attention") == 2 and Config().rotary_dim == 8
assert Config().routed_experts == 8

# %% [markdown]
# ## Norms
#
# Two RMS norms. `RMSNorm`, on the residual stream and on the full-attention queries and keys, is
# **zero-centred**: `x̂ · (1 + weight)` with `x̂ = x / sqrt(mean(x²) + ε)` and the weight starting at 0, so weight
# decay pulls the scale towards 1 rather than 0. It normalises and scales in float32 (float64 for a float64
# model) and casts back last, as transformers does. The linear-attention layer's output norm is the other one,
# `GatedRMSNorm`: a plain `weight · x̂` (weight starting at 1), times `silu(z)`; ops/16's `gated_rms_norm` computes
# it.

# %%
#| export
class RMSNorm(nn.Module):
    "Zero-centred RMSNorm: x / sqrt(mean(x²) + ε) · (1 + weight); weight starts at 0."
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        ct = compute_dtype(x.dtype)
        xf = x.to(ct)
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * (1 + self.weight.to(ct))).to(x.dtype)


class GatedRMSNorm(nn.Module):
    "weight · x / sqrt(mean(x²) + ε) · silu(z) over the last dim (ops/16's gated_rms_norm); weight starts at 1."
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps)

# %%
torch.manual_seed(0)
norm = RMSNorm(6, 1e-6)
with torch.no_grad(): norm.weight.uniform_(-0.5, 0.5)
xn = torch.randn(3, 6)
ref = (1 + norm.weight.double()) * xn.double() / (xn.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
assert torch.allclose(norm(xn).double(), ref, rtol=1e-6, atol=0)
assert torch.allclose(RMSNorm(6, 1e-6)(xn), xn / xn.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())  # weight 0: scale 1

# %% [markdown]
# ## Partial rotary embedding
#
# RoPE rotates only the first `rotary_dim = partial_rotary_factor · head_dim` channels of a head (64 of 256 in
# Qwen3.5), in the rotate-half layout among those: channel pair i is (i, i + rotary_dim/2), turned by
# `position · θ^(-2i/rotary_dim)`. The other channels pass unchanged. transformers builds Qwen3.5's angles as
# multimodal RoPE (separate temporal, height and width positions interleaved over the pairs); text has the
# same position in all three, which is this plain form. Positions are an explicit argument, (S,) or (B, S);
# the angles are computed from them on every call, in float32 (float64 for a float64 model), by models/20's
# `rope_cos_sin` over the first `rotary_dim` channels.

# %%
#| export
def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    "Rotate the first cos.shape[-1] channels of `x` (B, heads, S, head_dim) for (S,) or (B, S) positions."
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
    rot, rest = x[..., :cos.shape[-1]], x[..., cos.shape[-1]:]
    r1, r2 = rot.chunk(2, -1)
    return torch.cat((rot * cos + torch.cat((-r2, r1), -1) * sin, rest), -1)

# %% [markdown]
# Check: the unrotated channels are untouched, and the rotated part's dot product depends only on the distance
# between the two positions.

# %%
q1, k1 = torch.randn(2, 1, 1, 16, dtype=torch.float64)
def rotated(x, p):
    return apply_rope(x, *rope_cos_sin(torch.tensor([p]), 4, 10_000.0, torch.float64))
assert torch.equal(rotated(q1, 7)[..., 4:], q1[..., 4:])
dot = lambda pq, pk: (rotated(q1, pq) * rotated(k1, pk)).sum()
assert torch.allclose(dot(7, 3), dot(107, 103)) and not torch.allclose(dot(7, 3), dot(7, 4))
xr = torch.randn(2, 3, 5, 16)
cs1, cs2 = rope_cos_sin(torch.arange(5), 4, 1e6, xr.dtype), rope_cos_sin(torch.arange(5).expand(2, 5), 4, 1e6, xr.dtype)
assert torch.equal(apply_rope(xr, *cs1), apply_rope(xr, *cs2))

# %% [markdown]
# ## The projections and the experts
#
# Every dense projection is made by `projection` and the routed experts are `Experts`, models/20's constructors, as in
# Qwen3-MoE: stacked weights with transformers' names and layouts, `gate_up_proj` (E, 2I, H) (gate rows first) and
# `down_proj` (E, H, I), run on rows grouped by expert through `expert_mlp` (ops/experts: `grouped_linear` and
# `swiglu`, or FP8 when built with `Options.fp8`, `train.fp8`; ops/12, ops/10, ops/15). The shared expert is
# models/20's plain SwiGLU `MLP` of three projections. The router, the shared expert's gate and the output head stay
# in the model's dtype.

# %% [markdown]
# ## Gated full attention
#
# `q_proj` makes twice the query width: per head, the first `head_dim` outputs are the query and the next
# `head_dim` a gate. The queries and keys are normalised per head (`q_norm`, `k_norm`, zero-centred), rotated
# (partial RoPE), and attend causally with grouped-query heads; each output channel is then scaled by
# `sigmoid(gate)` before `o_proj`, which lets a head write nothing.
#
# The attention is `F.scaled_dot_product_attention` (SDPA) on both devices: ops/14's kernel is tiled and tuned for
# the other families' head dims, and Qwen3.5's heads are 256 wide. A whole sequence per row is SDPA's causal mode;
# packed documents (positions that restart, ops/14 `documents`) give an explicit mask, causal and within the
# document. `reference` writes the scores out, for `reference_forward`.

# %%
#| export
class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.head_dim, self.rotary_dim, self.theta = c.head_dim, c.rotary_dim, c.rope_parameters["rope_theta"]
        self.q_proj = projection(c.hidden_size, 2 * c.num_attention_heads * c.head_dim, c.attention_bias)
        self.k_proj = projection(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.v_proj = projection(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.o_proj = projection(c.num_attention_heads * c.head_dim, c.hidden_size, c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        "x (B, S, H) -> rotated q (B, n_q, S, d), rotated k and v (B, n_kv, S, d), gate (B, S, n_q·d)."
        B, S, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = q.view(B, S, -1, 2 * self.head_dim).chunk(2, -1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.view(B, S, -1, self.head_dim)).transpose(1, 2)
        v = v.view(B, S, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.theta, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate.reshape(B, S, -1)

    def out(self, o: Tensor, gate: Tensor) -> Tensor:
        "Attention output o (B, n_q, S, d), gated per channel, through o_proj -> (B, S, H)."
        return self.o_proj(o.transpose(1, 2).flatten(2) * torch.sigmoid(gate))

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        "x (B, S, H), positions (S,) or (B, S) -> (B, S, H)."
        q, k, v, gate = self.qkv(x, positions)
        docs = documents(positions)   # packed documents: positions restart at each one (ops/14)
        if docs is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            mask = attention_mask(q.shape[2], q.shape[2], q_doc=docs, k_doc=docs, device=q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.out(o, gate)

    def reference(self, x: Tensor, positions: Tensor) -> Tensor:
        "The same with explicit (B, n_q, S, S) scores and key/value heads repeated: for tests."
        q, k, v, gate = self.qkv(x, positions)
        rep, S, docs = q.shape[1] // k.shape[1], q.shape[2], documents(positions)
        keep = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        if docs is not None:
            keep = keep & (docs[:, None, :, None] == docs[:, None, None, :])
        scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(self.head_dim)
        return self.out(scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v.repeat_interleave(rep, 1), gate)

# %% [markdown]
# Check, in float64: SDPA against the explicit scores with two packed documents, which must also equal running
# each document alone with its own positions.

# %%
ca = Config(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
attn = Attention(ca).double()
with torch.no_grad():
    for p in (attn.q_norm.weight, attn.k_norm.weight): p.uniform_(-0.5, 0.5)
xa = torch.randn(2, 9, 16, dtype=torch.float64)
packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], list(range(9))])
with torch.no_grad():
    for pos in (torch.arange(9), packed):
        assert torch.allclose(attn(xa, pos), attn.reference(xa, pos), rtol=0, atol=1e-12)
    alone = torch.cat([attn(xa[:1, :4], torch.arange(4)), attn(xa[:1, 4:], torch.arange(5))], 1)
    assert torch.allclose(attn(xa, packed)[:1], alone, rtol=0, atol=1e-12)

# %% [markdown]
# ## Gated DeltaNet, the linear-attention layer
#
# Everything a linear-attention layer does is local to its sequence, so it all runs in stage 1:
#
# 1. `in_proj_qkv` makes `[q | k | v]` (key width `linear_num_key_heads · linear_key_head_dim` for q and k, value
#    width `linear_num_value_heads · linear_value_head_dim`), which goes through a depthwise causal convolution of
#    width `linear_conv_kernel_dim` and SiLU (`conv1d.weight` (channels, 1, width), transformers' `nn.Conv1d`
#    layout);
# 2. `in_proj_z` makes the output gate, `in_proj_b` the write strength `β = sigmoid(b)` and `in_proj_a` the decay
#    `g = −e^{A_log} · softplus(a + dt_bias)`, one per value head (`A_log`, `dt_bias` (value heads,));
# 3. the gated delta rule (ops/16) with q and k l2-normalised, starting each sequence from a zero state;
# 4. `norm`, an RMS norm per value head gated by `silu(z)`, then `out_proj`.
#
# Training never carries the recurrent state from one micro-batch to the next: each row starts from zero, as
# attention starts with no keys. Packed documents restart the state and the convolution where the positions
# restart (ops/16 `docs`, the ids that ops/14's `documents` makes from positions), so no token sees another
# document. On CUDA the rule is the Triton `chunk_gated_delta_rule`; on the CPU the same chunked form in torch,
# `chunk_gated_delta_rule_torch`. `reference` runs the per-token loop, `gated_delta_rule_reference`.

# %%
#| export
class GatedDeltaNet(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        key_dim, value_dim = self.nk * self.dk, self.nv * self.dv
        conv_dim = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, c.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, c.rms_norm_eps)
        self.out_proj = projection(value_dim, c.hidden_size)
        self.in_proj_qkv = projection(c.hidden_size, conv_dim)
        self.in_proj_z = projection(c.hidden_size, value_dim)
        self.in_proj_b = projection(c.hidden_size, self.nv, fp8=False)   # the gates' inputs stay in the compute dtype
        self.in_proj_a = projection(c.hidden_size, self.nv, fp8=False)

    def inputs(self, x: Tensor, docs: Tensor | None):
        "x (B, S, H) -> the rule's q, k (B, S, nk, dk), v (B, S, nv, dv), g, β (B, S, nv), and the gate z (B, S, nv, dv)."
        B, S, _ = x.shape
        qkv, z, a, b = project(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_a, self.in_proj_b)
        qkv = causal_conv1d(qkv, self.conv1d.weight[:, 0], docs)
        q, k, v = qkv.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], -1)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        return (q.view(B, S, self.nk, self.dk), k.view(B, S, self.nk, self.dk), v.view(B, S, self.nv, self.dv), g,
                beta, z.view(B, S, self.nv, self.dv))

    def out(self, o: Tensor, z: Tensor) -> Tensor:
        "The rule's output o (B, S, nv, dv), normed and gated by z, through out_proj -> (B, S, H)."
        return self.out_proj(self.norm(o, z).flatten(2))

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        "x (B, S, H), positions (S,) or (B, S) -> (B, S, H); each row starts from a zero state."
        docs = documents(positions)
        q, k, v, g, beta, z = self.inputs(x, docs)
        if x.is_cuda:
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, docs=docs)
        else:
            o, _ = chunk_gated_delta_rule_torch(q, k, v, g, beta, docs=docs)
        return self.out(o, z)

    def reference(self, x: Tensor, positions: Tensor) -> Tensor:
        "The same through the per-token recurrence: for tests."
        docs = documents(positions)
        q, k, v, g, beta, z = self.inputs(x, docs)
        return self.out(gated_delta_rule_reference(q, k, v, g, beta, docs=docs)[0], z)

# %% [markdown]
# Check in float64 at a length that is not a multiple of the 64-token chunk, with several packed documents per
# row (one of length 1, one across the chunk boundary): the chunked form equals the per-token loop, and a packed
# row equals its documents run one by one, each from a zero state with its own convolution.

# %%
cl = Config(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=6)
gdn = GatedDeltaNet(cl).double()
with torch.no_grad():
    for p in gdn.parameters(): p.normal_(0, 0.3)
    gdn.A_log.uniform_(-2, 1)
lens = [[1, 30, 40, 6], [77]]
packed = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
xg = torch.randn(2, 77, 16, dtype=torch.float64)
with torch.no_grad():
    for pos in (torch.arange(77), packed):
        assert torch.allclose(gdn(xg, pos), gdn.reference(xg, pos), rtol=0, atol=1e-12)
    alone = torch.cat([gdn(xg[:1, s:s + n], torch.arange(n)) for s, n in zip([0, 1, 31, 71], lens[0])], 1)
    assert torch.allclose(gdn(xg, packed)[:1], alone, rtol=0, atol=1e-12)
    assert not torch.allclose(gdn(xg, packed)[:1], gdn(xg, torch.arange(77))[:1])   # the restarts matter
print("linear attention: chunked == per-token loop, packed == documents one by one (float64)")

# %% [markdown]
# ## Router and the MoE block
#
# The router is Qwen3-MoE's: a bias-free linear map to E logits, a softmax in float32, the top-k renormalised to
# sum to 1 (always, in Qwen3.5), the full probabilities in `Routing.probs` for the load-balance loss; the same
# `e_score_correction_bias` buffer and `route` (`Options.route`) steer the choice (train/42). The block holds it as
# `mlp.gate`, the routed experts as `mlp.experts`, the shared expert as `mlp.shared_expert` and its gate as
# `mlp.shared_expert_gate` (H → 1), as transformers names them. `shared` is the shared expert's contribution,
# which stage 1 folds into the residual.

# %%
#| export
class Router(nn.Module):
    def __init__(self, c: Config, route: str = "learned"):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts))
        self.route = route   # 'learned' or 'round_robin' (Options.route)

    def forward(self, x: Tensor) -> Routing:
        "x (T, H) -> Routing with ids, weights (in x's dtype) and probs (float32; float64 for a float64 model)."
        probs = F.linear(x, self.weight).to(compute_dtype(x.dtype)).softmax(-1)
        ids = route_ids(probs + self.e_score_correction_bias, self.top_k, self.route)
        weights = probs.gather(-1, ids)
        return Routing(ids, (weights / weights.sum(-1, keepdim=True)).to(x.dtype), probs)


class SparseMoeBlock(nn.Module):
    "The router, the routed experts, the shared expert and its gate, under transformers' names."
    def __init__(self, c: Config, options: Options):
        super().__init__()
        self.gate = Router(c, options.route)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, options.fp8)
        self.shared_expert = MLP(c.hidden_size, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def shared(self, x: Tensor) -> Tensor:
        "The shared expert's output scaled per token by sigmoid(shared_expert_gate(x))."
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

# %%
cr = Config(hidden_size=16, num_experts=6, num_experts_per_tok=3)
router = Router(cr)
nn.init.normal_(router.weight)
xr = torch.randn(10, 16)
r = router(xr)
assert torch.allclose(r.weights.sum(-1), torch.ones(10)) and r.probs.dtype == torch.float32
assert torch.equal(r.probs.gather(1, r.ids), r.probs.sort(-1, descending=True).values[:, :3])

# %% [markdown]
# ## The decoder layer in five stages
#
# Stage 1 is everything before the routed experts: the token mixer of the layer's type (linear or full attention) on
# `input_layernorm(h)` with its residual, the post-attention norm, the shared expert folded into the residual, and the
# router on the T = B·S flattened tokens. Stage 3 is the routed experts on grouped rows; stage 5 adds each token's
# router-weighted sum (both are models/20's `RoutedLayer`, which `DecoderLayer` subclasses). The layer type is a
# Python constant per layer, and neither mixer has a data-dependent shape, host synchronisation or branch on tensor
# values, so `torch.compile(fullgraph=True)` takes stages 1 and 5 whole.

# %%
#| export
class DecoderLayer(RoutedLayer):
    def __init__(self, c: Config, layer_idx: int, options: Options):
        super().__init__()
        self.layer_type = c.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = Attention(c)
        self.mlp = SparseMoeBlock(c, options)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        "The token mixer: `linear_attn` (Gated DeltaNet) or `self_attn` (gated full attention)."
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn

    def stage1(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Routing]:
        "h (B, S, H) -> (h after the mixer and the shared expert, x (B·S, H) for the experts, routing)."
        h = h + self.mixer(self.input_layernorm(h), positions)
        x = self.post_attention_layernorm(h)
        h = h + self.mlp.shared(x)
        x = x.flatten(0, 1)
        return h, x, self.mlp.gate(x)

# %% [markdown]
# ## The model
#
# The module tree follows transformers' `Qwen3_5MoeForCausalLM` (`model.embed_tokens`, `model.layers.{i}`,
# `model.norm`, `lm_head`), so parameter names match; `layers` is a `ModuleDict` keyed by the absolute layer
# index, so a pipeline stage can hold any subset.
#
# Initialisation: every matrix N(0, σ) with σ = `initializer_range` (the convolution too); the projections that
# write into the residual stream (`o_proj`, `out_proj`, the experts' and the shared expert's `down_proj`) get
# σ/√(2L); zero-centred norms start at 0 (scale 1) and the gated norms at 1; `dt_bias` at 1 and `A_log` at
# log U(0.01, 16), as in transformers, so the heads start with decays spread from slow to fast.
#
# `reference_forward` is the check for everything the engine does: the layers run sequentially with no protocol
# piece, the per-token recurrence and explicit-score attention, and every expert applied to every token, masked by
# whether the token chose it. It takes positions too, so packed documents can be checked.
#
# `Qwen3_5MoeForCausalLM` subclasses models/20's `CausalLM`, which holds the head and gives `prolog`, `epilog`,
# `forward` and `num_params`; this notebook writes the inner model, the initialisation, `reference_forward` and
# the FLOP count.
#
# The constructor takes the run's `Options` (models/20) and hands `route` to every router and `fp8` to every experts
# module. It refuses a `cp_group`: the linear attention's recurrent state runs along the whole sequence, so this
# family has no ring (train/config refuses `parallel.cp > 1` for it too).
#
# **FLOPs per token** (for MFU): 6 × active matmul parameters (projections, router, shared expert and its gate,
# k experts, head; the depthwise convolution's `2 · channels · width` is not a matmul and is left out), plus the
# token mixers' products that have no parameters, forward counted × 3 for training:
#
# - full attention, as for every family: QKᵀ and PV, 2·2·heads·head_dim per key, over S/2 keys (causal);
# - linear attention, the chunked form's products per chunk of C = 64 tokens and value head: `KKᵀ`, `QKᵀ`
#   (2C²·d_k each), `W` and `U` (2C²·(d_k + d_v)), the state read and update (4C·d_k·d_v), and the output
#   (2C·d_k·d_v + 2C²·d_v), i.e. per token `2C·(3d_k + 2d_v) + 6d_k·d_v`; the inverse of `I + A` is left out, as
#   attention's softmax is. It does not grow with the sequence length.

# %%
#| export
GDR_CHUNK = 64   # the chunk of the gated delta rule's chunked form (ops/16's default), for the FLOP count


class Qwen3_5MoeForCausalLM(CausalLM):
    def __init__(self, config: Config, options: Options = Options()):
        if options.cp_group is not None:
            raise ValueError("Qwen3.5-MoE has no context-parallel form: its linear attention carries a recurrent "
                             "state along the sequence; build it with Options(cp_group=None) (parallel.cp = 1)")
        super().__init__(config, lambda i: DecoderLayer(config, i, options),
                         RMSNorm(config.hidden_size, config.rms_norm_eps), options)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """Zero-centred norms to 0, gated norms to 1, biases to 0, matrices N(0, σ) through `SeededInit` (the same
        values however the model was cut into stages and expert shards); `seed` defaults to torch's initial seed."""
        init, std, out_std = init_shared(self, seed, GatedRMSNorm)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.zero_()
        for layer in self.model.layers.values():
            if layer.layer_type == "linear_attention":
                a = layer.linear_attn
                for p in (a.in_proj_qkv.weight, a.in_proj_z.weight, a.in_proj_b.weight, a.in_proj_a.weight,
                          a.conv1d.weight):
                    init.normal_(p, std)
                init.normal_(a.out_proj.weight, out_std)
                a.dt_bias.fill_(1.0)
                init.uniform_(a.A_log, 0.01, 16).log_()
            else:
                a = layer.self_attn
                for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight): init.normal_(p, std)
                init.normal_(a.o_proj.weight, out_std)
            mlp = layer.mlp
            for p in (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.shared_expert.gate_proj.weight,
                      mlp.shared_expert.up_proj.weight, mlp.shared_expert_gate.weight):
                init.normal_(p, std)
            init.normal_(mlp.experts.down_proj, out_std)
            init.normal_(mlp.shared_expert.down_proj.weight, out_std)
            mlp.gate.e_score_correction_bias.zero_()

    def reference_forward(self, input_ids: Tensor, positions: Tensor | None = None) -> Tensor:
        "Plain sequential forward for tests: the recurrence, explicit attention, each expert on all tokens, masked."
        c = self.config
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers.values():
            h = h + layer.mixer.reference(layer.input_layernorm(h), positions)
            x = layer.post_attention_layernorm(h)
            mlp = layer.mlp
            probs = torch.softmax(x @ mlp.gate.weight.T, -1, dtype=compute_dtype(x.dtype))
            top, ids = probs.topk(c.num_experts_per_tok, -1)
            top = (top / top.sum(-1, keepdim=True)).to(x.dtype)
            s = mlp.shared_expert
            out = torch.sigmoid(x @ mlp.shared_expert_gate.weight.T) * (
                (F.silu(x @ s.gate_proj.weight.T) * (x @ s.up_proj.weight.T)) @ s.down_proj.weight.T)
            h = h + out + mlp.experts.reference(x, top, ids)
        return self.lm_head(self.model.norm(h))

    def active_matmul_params(self) -> int:
        """Matmul weights one token touches (for MFU): the mixer's projections, router, shared expert and its gate,
        k experts, head."""
        k, n = self.config.num_experts_per_tok, self.lm_head.weight.numel()
        for layer in self.model.layers.values():
            a = layer.mixer
            projections = ((a.in_proj_qkv, a.in_proj_z, a.in_proj_b, a.in_proj_a, a.out_proj)
                           if layer.layer_type == "linear_attention" else (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
            mlp, s = layer.mlp, layer.mlp.shared_expert
            n += sum(p.weight.numel() for p in (*projections, mlp.gate, mlp.shared_expert_gate, s.gate_proj,
                                                s.up_proj, s.down_proj))
            n += k * (mlp.experts.gate_up_proj[0].numel() + mlp.experts.down_proj[0].numel())
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 × active matmul parameters, plus (×3 for training) full attention's QKᵀ and PV
        over S/2 keys and linear attention's chunked products, 2C·(3d_k + 2d_v) + 6·d_k·d_v per value head (C = 64)."""
        c, C = self.config, GDR_CHUNK
        full = c.layer_types.count("full_attention")
        attn = 2 * 2 * c.num_attention_heads * c.head_dim * seq_len / 2
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        linear = c.linear_num_value_heads * (2 * C * (3 * dk + 2 * dv) + 6 * dk * dv)
        return 6 * self.active_matmul_params() + 3 * (full * attn + (c.num_hidden_layers - full) * linear)

# %% [markdown]
# ## Checks
#
# The five-stage forward and `reference_forward` must agree on logits and on every parameter's gradient, in
# float32 and float64, with linear and full layers mixed and a sequence longer than one chunk. The zero-centred
# norms start at scale 1, so they are moved off their start first; otherwise a norm applied as `weight · x̂` would
# go unseen.
#
# In float32 the decay's parameters (`A_log`, `dt_bias`, `in_proj_a`) are the exception. The chunked form reaches
# their gradients through the cumulative sum of the log-decays within a chunk, which with transformers' initial
# decays (`e^{A_log}` up to 16 per token) runs into the hundreds and is then differenced, so float32's rounding
# shows in those gradients far above the other parameters' (the per-token loop has no such sum). They get 1e-2 in
# float32; float64 holds every gradient tightly.

# %%
DECAY = ("A_log", "dt_bias", "in_proj_a.weight")


def compare(model, ids, atol, positions=None):
    "Logits within atol; returns the routings and each parameter's gradient difference relative to its largest entry."
    logits, routings = model(ids, positions)
    ref = model.reference_forward(ids, positions)
    assert torch.allclose(logits, ref, rtol=0, atol=atol), (logits - ref).abs().max()
    g = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
    g_ref = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    return routings, {n: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                      for (n, _), a, b in zip(model.named_parameters(), g, g_ref)}


def worst(errs, decay=None):
    "The largest error among the decay's parameters (decay=True), the others (False) or all (None)."
    return max(e for n, e in errs.items() if decay is None or n.endswith(DECAY) == decay)

# %%
torch.manual_seed(0)
c = Config(vocab_size=64, hidden_size=32, num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
           "linear_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
try:
    Qwen3_5MoeForCausalLM(c, Options(cp_group=object()))   # any group: the family has no ring
except ValueError as e:
    assert "no context-parallel form" in str(e), e
else:
    raise AssertionError("a Qwen3.5-MoE with a cp_group was built")
model = Qwen3_5MoeForCausalLM(c)
with torch.no_grad():
    for m in model.modules():
        if isinstance(m, RMSNorm): m.weight.uniform_(-0.3, 0.3)
ids = torch.randint(0, c.vocab_size, (2, 70))
routings, errs = compare(model, ids, atol=1e-5)
assert worst(errs, decay=False) < 1e-4 and worst(errs, decay=True) < 1e-2, errs
assert all(r.probs.shape == (140, 4) and r.counts.sum() == 280 for r in routings)
print(f"float32: worst relative gradient difference {worst(errs, False):.1e}, decay's parameters {worst(errs, True):.1e}")
model = model.double()
routings, errs = compare(model, ids, atol=1e-11)
assert worst(errs) < 1e-10, errs
print(f"float64: logits within 1e-11, worst relative gradient difference {worst(errs):.1e}")

# %% [markdown]
# Packed documents: with (B, S) positions that restart, the five stages still equal the reference, and a row
# holding three documents gives each document the logits it gets alone.

# %%
doc_lens = [5, 64, 1]
packed = torch.stack([torch.cat([torch.arange(n) for n in doc_lens]), torch.arange(70)])
routings, errs = compare(model, ids, atol=1e-11, positions=packed)
assert worst(errs) < 1e-10, errs
with torch.no_grad():
    logits = model(ids, packed)[0]
    starts = [0, 5, 69]
    for s, n in zip(starts, doc_lens):
        assert torch.allclose(logits[0, s:s + n], model(ids[:1, s:s + n])[0][0], rtol=0, atol=1e-11)

# %% [markdown]
# Skewed routing: a large constant in embedding channel 0 and router weights on that channel send every token's
# first choice to expert 3 and its second to expert 1.

# %%
with torch.no_grad():
    model.model.embed_tokens.weight[:, 0] = 10.0
    for layer in model.model.layers.values():
        gate = layer.mlp.gate.weight
        gate.zero_()
        gate[:, 0] = torch.tensor([-50.0, 50.0, 0.0, 100.0], dtype=gate.dtype)
routings, errs = compare(model, ids[:, :9], atol=1e-11)
assert worst(errs) < 1e-10, errs
assert all((r.ids[:, 0] == 3).all() and r.counts.tolist() == [0, 18, 0, 18] for r in routings)

# %% [markdown]
# Stages 1 and 5 compile as whole graphs, for both kinds of layer (`aot_eager` traces forward and backward as
# `torch.compile` does, without code generation).

# %%
from pith_lit.models.protocol import LocalDispatcher
model = model.float()
h_in = torch.randn(2, 9, c.hidden_size)
for i in ("0", "1"):
    layer = model.model.layers[i]
    h1, x1, r1 = torch.compile(layer.stage1, fullgraph=True, backend="aot_eager")(h_in, torch.arange(9))
    h1e, x1e, r1e = layer.stage1(h_in, torch.arange(9))
    assert torch.allclose(h1, h1e, atol=1e-6) and torch.allclose(x1, x1e, atol=1e-6) and torch.equal(r1.ids, r1e.ids)
    d = LocalDispatcher(c.num_experts)
    y = d.combine(d.reduce(layer.stage3(*d.expand(d.dispatch(x1, r1), r1)), r1), r1)
    h5 = torch.compile(layer.stage5, fullgraph=True, backend="aot_eager")(h1, y)
    assert torch.allclose(h5, layer.stage5(h1, y))
torch._dynamo.reset()  # drop the compiled graphs (and their teardown warnings at exit)

# %% [markdown]
# Parameter counts, against the formula from the config. A linear layer: `in_proj_qkv` H·(2K + V), `in_proj_z`
# H·V, `in_proj_b` and `in_proj_a` H·n_v each, the convolution (2K + V)·w, `dt_bias` and `A_log` n_v each, the
# gated norm d_v, `out_proj` V·H (K, V the total key and value widths). A full layer: `q_proj` 2·H·n_q·d, `k_proj`
# and `v_proj` H·n_kv·d, `o_proj` n_q·d·H, the q/k norms 2d. Every layer: router E·H, experts 3·H·I each, the shared
# expert 3·H·I_s and its gate H, two norms 2H. Active: no convolution, norms, `dt_bias` or `A_log`, k experts.
# Then the FLOP count for two sequence lengths: the difference is the full-attention term alone.

# %%
H, L, E, k = c.hidden_size, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok
Kw, Vw = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
nv, w, d = c.linear_num_value_heads, c.linear_conv_kernel_dim, c.head_dim
nq, nkv, I, Is = c.num_attention_heads, c.num_key_value_heads, c.moe_intermediate_size, c.shared_expert_intermediate_size
lin_active = H * (2 * Kw + Vw) + H * Vw + 2 * H * nv + Vw * H
full_active = 2 * H * nq * d + 2 * H * nkv * d + nq * d * H
moe_active, moe_all = E * H + 3 * H * Is + H + k * 3 * H * I, E * H + 3 * H * Is + H + E * 3 * H * I
n_lin, n_full = c.layer_types.count("linear_attention"), c.layer_types.count("full_attention")
total = (2 * c.vocab_size * H + H + n_lin * (lin_active + (2 * Kw + Vw) * w + 2 * nv + c.linear_value_head_dim)
         + n_full * (full_active + 2 * d) + L * (moe_all + 2 * H))
active = c.vocab_size * H + n_lin * lin_active + n_full * full_active + L * moe_active
assert model.num_params() == total and model.active_matmul_params() == active
assert model.flops_per_token(200) - model.flops_per_token(100) == n_full * 6 * 100 * nq * d
print(f"{total:,} parameters, {active:,} active matmul parameters per token")

# %% [markdown]
# On CUDA in bf16 the linear-attention layers run the Triton kernels of ops/16, the experts `F.grouped_mm`, the
# permutations and SwiGLU Triton kernels. The check: the five-stage bf16 path is as close to the float32 reference
# as the plain sequential forward run in bf16, with packed documents.

# %%
#| cuda
from tests.references import bf16_errors

cg = Config(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
            linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
            shared_expert_intermediate_size=256)
names, five, plain = bf16_errors(Qwen3_5MoeForCausalLM, cg, 0)   # tests/references.py
decay = {i + 1 for i, n in enumerate(names) if n.endswith(("A_log", "dt_bias"))}
print(f"bf16 vs fp32 relative error, five-stage (plain bf16): logits {five[0]:.1e} ({plain[0]:.1e}), "
      f"worst gradient outside the decay's {max(f for i, f in enumerate(five) if i and i not in decay):.1e} "
      f"({max(p for i, p in enumerate(plain) if i and i not in decay):.1e})")
for i, (f, p) in enumerate(zip(five, plain)):
    if i not in decay:
        assert f <= 1.25 * p + 1e-3, (i, f, p)
# The decay's parameters (A_log, dt_bias) sum per-token gate gradients over every token, and their cancellation
# magnifies bf16 rounding in both paths, the chunked kernel's differences of cumulative decays more: over seeds 0-7
# on the H200 each such gradient is 1-135% from fp32, the five-stage path's 0.2-7x the plain path's, summed over the
# layers 1.0-3.4x (RESULTS.md). So these are compared summed over the layers and over four seeds.
sums = [sum(e[i] for i in decay) for e in (five, plain)]
for seed in (1, 2, 3):
    sums = [a + sum(e[i] for i in decay) for a, e in zip(sums, bf16_errors(Qwen3_5MoeForCausalLM, cg, seed)[1:])]
print(f"decay gradients' errors summed over layers and seeds 0-3: five-stage {sums[0]:.2f}, plain {sums[1]:.2f}")
assert sums[0] <= 2 * sums[1], sums

# %% [markdown]
# ## What the rest of pith_lit asks of the family
#
# The trainer, the planner (engine/37), the Hugging Face conversion (train/46) and the checks across processes
# (engine/39) find this module by its `model_type` (models/29_family `family`) and read the same names in every
# family: `Model`, the model class; `tiny_config`, the tiny model of the checks; the config.json translation both
# ways (`from_hf`, `to_hf`) and how the hub's checkpoints store the tensors (`HF_*`); and, for the planner, what a
# layer keeps from forward to backward by part (`kept_by_part`) and the few facts the planner's general formulas
# ask of a family (`kernel_attention_shape`, `expert_width`, `router_one_hot`, `FP32_NORM_GAIN`).

# %%
#| export
Model = Qwen3_5MoeForCausalLM   # the model class, under the name every family gives it


def tiny_config(layers: int = 5, experts: int = 4, top_k: int = 2, dense: int = 2) -> Config:
    """The tiny model of the checks (engine/39 `tiny_model`): `experts` routed experts top-`top_k` and a shared
    expert, every fourth layer full attention and the others linear attention, no dense layer (`dense` is not used)."""
    return Config(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=16, shared_expert_intermediate_size=24)

# %% [markdown]
# **config.json.** Qwen3.5-MoE comes two ways. transformers' text model writes `model_type: qwen3_5_moe_text` with the
# keys at the top. The published checkpoints are the multimodal model, `model_type: qwen3_5_moe`, whose language
# model's keys sit in `text_config` beside a `vision_config` we do not read (the head's tying sits at the top).
# RoPE is `rope_parameters` with `partial_rotary_factor`, and multimodal RoPE's `mrope_section` and
# `mrope_interleaved`, which text-only positions make plain RoPE (the three sections see the same position).
# Without `layer_types`, `full_attention_interval` (default 4) places the full-attention layers, as transformers
# does. The multi-token-prediction head's keys (`mtp_*`) describe weights we read past. We write the text model.
#
# **Tensors.** A multimodal checkpoint stores the language model's tensors as `model.language_model.X` for our
# `model.X` (the head is `lm_head.weight` in both), next to the vision tower (`model.visual.*`); both kinds may hold
# the multi-token-prediction head (`mtp.*`), which transformers' text model reads past too. The published
# checkpoints stack the experts, and transformers' `save_pretrained` writes them one by one: we read both and
# write them stacked.

# %%
#| export
HF_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")   # the text model, and the multimodal one (its language model)
HF_EXPERTS_ONE_BY_ONE = False         # save_hf writes the routed experts stacked, as the published checkpoints do
HF_READ_EXPERTS_ONE_BY_ONE = True     # load_hf reads them one by one too, as transformers' save_pretrained writes them
HF_RENAME = {"model.language_model.": "model."}   # stored name prefix -> ours
HF_READ_PAST = {"model.visual.": "the vision tower (model.visual.*)",
                "mtp.": "the multi-token-prediction head (mtp.*)"}   # stored name prefix -> what load_hf reads past


def _text_config(hf: dict) -> dict:
    "The text config of a multimodal Qwen3.5-MoE config.json, with the head's tying, which sits at its top."
    text = dict(hf.get("text_config") or {})
    if text.get("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
        raise ValueError(f"config.json: text_config.model_type = {text['model_type']!r}; pith_lit reads the "
                         "language model of qwen3_5_moe checkpoints, whose text_config is qwen3_5_moe_text")
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if text.get("tie_word_embeddings", tie) != tie:
        raise ValueError(f"config.json: tie_word_embeddings = {tie} but text_config.tie_word_embeddings = "
                         f"{text['tie_word_embeddings']}; make them agree")
    return text | {"tie_word_embeddings": tie}


def from_hf(hf: dict) -> tuple[dict, dict, dict, set]:
    """config.json `hf` -> (the keys to read, the fields computed from them, the keys that must hold one value, the
    keys read past), by train/46's rules; a ValueError for what this family does not model."""
    if hf.get("model_type") == "qwen3_5_moe":    # multimodal: its language model
        hf = _text_config(hf)
    theta, kind, rest = hf_rope(hf)
    rest = {k: v for k, v in rest.items() if k not in ("mrope_section", "mrope_interleaved")}
    partial = rest.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if kind != "default" or rest or partial is None:
        raise ValueError(f"config.json: RoPE of type {kind!r} with {rest}, partial_rotary_factor {partial}: pith_lit's "
                         "qwen3_5_moe has plain RoPE on a partial_rotary_factor of each head")
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                      for i in range(hf.get("num_hidden_layers", 0))]
    computed = {"rope_parameters": {"rope_type": kind, "rope_theta": theta, "partial_rotary_factor": partial},
                "layer_types": types}
    fixed = {"hidden_act": "silu", "attention_dropout": 0.0, "attn_output_gate": True}
    read = {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "full_attention_interval",
            "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "mamba_ssm_dtype"}
    return hf, computed, fixed, read


def to_hf(c: Config) -> dict:
    "The config.json keys of `c` in the hub's spelling: the text model, transformers' Qwen3_5MoeForCausalLM."
    return asdict(c) | {"model_type": "qwen3_5_moe_text", "hidden_act": "silu", "attention_dropout": 0.0}

# %% [markdown]
# **The planner.** Stage 1 keeps, per token: the input norm (its gain in float32) and its output; in a full-attention
# layer q and k through their per-head norms, the output gate (`o_proj(o · σ(gate))` keeps σ(gate) and the product),
# v, the attention's output and log-sum-exp; in a linear-attention layer the causal convolution in float32 (the
# input's copy, three shifted copies and the pre-activation, eager; compiled, its bf16 input and three float32
# copies: measured, the partitioner's choice, not derived) and its output, the gates, the l2-normalised q and k,
# the gated output norm; then the post-attention norm, the shared expert with its gate, the residual and the router.

# %%
#| export
def kept_by_part(c: Config, i: int, b: int, f: int, compiled: bool) -> dict:
    "Bytes per token layer `i` keeps for backward in stage 1, by part (the planner adds stage 3 and the output)."
    H, comp = c.hidden_size, compiled
    s1 = {"input norm": norm_bytes(H, b, f, comp, fp32_gain=True) + b * H}
    if c.layer_types[i] == "full_attention":
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q, kv = hq * d, hkv * d
        s1 |= {"q": norm_bytes(q, b, f, comp, fp32_gain=True, groups=hq, keep_input=2 * b * q) + b * q,
               "gate": 2 * b * q,                       # σ(gate) and the gated output o_proj reads
               "k, v": norm_bytes(kv, b, f, comp, fp32_gain=True, groups=hkv, keep_input=b * kv) + 2 * b * kv,
               "attention": b * q + 4 * hq}
    else:
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        kd, vd = nk * dk, nv * dv
        D, W = 2 * kd + vd, c.linear_conv_kernel_dim
        conv = b * D + 3 * f * D if comp else (W + 1) * f * D
        l2 = 2 * f * nk if comp else 2 * (f * kd + f * nk)
        out_norm = 2 * b * vd + f * nv if comp else 3 * f * vd + b * vd + f * nv
        s1 |= {"convolution": conv + b * D,              # and its output (q, k, v are views of it)
               "gates": 3 * f * nv + b * nv,
               "q, k": l2 + 2 * b * kd,                  # l2-normalised q and k, kept by the rule's kernel
               "output norm": out_norm + b * vd}         # and the gated output out_proj reads
    shared = c.shared_expert_intermediate_size
    return s1 | {"post norm": norm_bytes(H, b, f, comp, fp32_gain=True) + b * H,
                 "shared expert": mlp_bytes(shared, b, comp) + b + b * H,   # and its gate σ and output
                 "residual": b * H,
                 "router": router_bytes(c.num_experts, c.num_experts_per_tok, b, f, f * c.num_experts_per_tok + f)}


def kernel_attention_shape(c: Config, document_mask: bool, cp: int) -> tuple[int, int, int] | None:
    "(heads, q/k width, v width) where ops/14's kernels attend: never (SDPA attends the full-attention layers)."
    return None


def expert_width(c: Config) -> int:
    "The FFN width of one routed expert."
    return c.moe_intermediate_size


def router_one_hot(c: Config) -> int:
    "Values per routed pair that stage 3 keeps for the router besides the rows: none."
    return 0


FP32_NORM_GAIN = True    # the RMSNorms multiply their gain in float32

# %%
c5 = tiny_config(layers=4)
assert c5.layer_types == ["linear_attention"] * 3 + ["full_attention"] and Model is Qwen3_5MoeForCausalLM
hf = to_hf(c5)
assert hf["model_type"] == "qwen3_5_moe_text" and from_hf(hf)[1]["layer_types"] == c5.layer_types
text, computed, _, _ = from_hf({"model_type": "qwen3_5_moe", "text_config": hf, "tie_word_embeddings": False})
assert text["tie_word_embeddings"] is False and computed["layer_types"] == c5.layer_types
assert "gate" in kept_by_part(c5, 3, 2, 4, False) and "convolution" in kept_by_part(c5, 0, 2, 4, False)
