# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # DeepSeek-V2
#
# DeepSeek-V2 (236B parameters, 21B active) and DeepSeek-V2-Lite (16B, 2.4B active) are decoder-only MoE
# transformers with two ideas of their own. **Multi-head latent attention** (MLA) compresses each token's keys
# and values into one small latent vector plus one rotary key shared by all heads, and expands them per head
# with a learned matrix. **DeepSeekMoE** splits the MLP into many small routed experts plus a few shared
# experts that every token uses; the router picks the top-k routed experts, optionally only from the best
# few groups of experts (group-limited routing, which bounds how many devices a token is sent to). The first
# `first_k_dense_replace` layers have a dense MLP instead.
#
# This notebook is self-contained: it defines every piece it uses, then cuts each decoder layer into the five
# stages of the layer protocol (models/protocol). Parameter names and shapes are those of Hugging Face
# transformers 5.x `DeepseekV2ForCausalLM`, so a checkpoint converts by name. The checks compare the five-stage
# forward with a plain sequential one; tests/test_deepseek_v2.py also compares against transformers itself.

# %%
#| default_exp models.deepseek_v2

# %%
#| export
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pith_lit.models.protocol import (MLP, CausalLM, Experts, Options, Routing, RoutedLayer, cfg, compute_dtype, cos_sin,
                                      hf_or, hf_rope, init_shared, linear, mlp_bytes, norm_bytes, project, projection,
                                      route_ids, router_bytes)
from pith_lit.ops.attention import attention_mask, causal_attention, documents
from pith_lit.ops.ring_attention import ring_attention

# %% [markdown]
# ## Configuration
#
# Field names are those of Hugging Face's `DeepseekV2Config` and of the checkpoints' `config.json`. Two fields
# that can be null there take a falsy value here, which a TOML file can write: `q_lora_rank = 0` means no
# low-rank query path (DeepSeek-V2-Lite), and `rope_scaling = {}` means plain RoPE. (transformers 5.x folds
# `rope_theta` and `rope_scaling` into one `rope_parameters` dict; it still reads them under these names.)
# `norm_topk_prob` is kept only so a `config.json` loads: transformers 5.x ignores it and both released models
# set it to false, so true is refused rather than given a meaning no reference can check.

# %%
#| export
YARN_KEYS = ("type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim")


@dataclass
class Config:
    "DeepSeek-V2 hyper-parameters. Field names are those of Hugging Face's `DeepseekV2Config`."
    model_type: str = cfg("deepseek_v2", "model family; selects the model module")
    vocab_size: int = cfg(4096, "vocabulary size (the default tokenizer, stdlib-bpe-4096, needs at least 4096; the byte "
                                 "tokenizer 259)", gt=0)
    hidden_size: int = cfg(128, "model width", gt=0)
    intermediate_size: int = cfg(384, "FFN width of the dense MLP in the first first_k_dense_replace layers", gt=0)
    moe_intermediate_size: int = cfg(64, "FFN width of one routed expert (and of one shared expert)", gt=0)
    num_hidden_layers: int = cfg(3, "number of decoder layers", gt=0)
    num_attention_heads: int = cfg(4, "attention heads", gt=0)
    num_key_value_heads: int = cfg(4, "must equal num_attention_heads: MLA expands keys and values per head", gt=0)
    n_shared_experts: int = cfg(1, "shared experts, run on every token as one MLP of width n·moe_intermediate_size",
                                   ge=0)
    n_routed_experts: int = cfg(8, "routed experts per MoE layer", ge=0)
    num_experts_per_tok: int = cfg(2, "routed experts chosen per token (top-k)", gt=0)
    routed_scaling_factor: float = cfg(1.0, "multiplies the chosen experts' router probabilities", gt=0)
    topk_method: str = cfg("greedy", "'greedy' (top-k of all experts) or 'group_limited_greedy' (top-k within "
                                     "the topk_group best of n_group groups)")
    n_group: int = cfg(1, "expert groups for group_limited_greedy; divides n_routed_experts", gt=0)
    topk_group: int = cfg(1, "groups a token may use under group_limited_greedy", gt=0)
    first_k_dense_replace: int = cfg(1, "the first this-many layers have a dense MLP, the rest are MoE", ge=0)
    norm_topk_prob: bool = cfg(False, "must be false (ignored by transformers; false in DeepSeek-V2 and V2-Lite)")
    q_lora_rank: int = cfg(0, "rank of the low-rank query path q_a_proj -> q_b_proj; 0 = one q_proj", ge=0)
    kv_lora_rank: int = cfg(64, "width of the compressed key/value latent", gt=0)
    qk_nope_head_dim: int = cfg(32, "per-head query/key channels without rotary embedding", gt=0)
    qk_rope_head_dim: int = cfg(16, "per-head query/key channels with rotary embedding (the key part is shared)", gt=0)
    v_head_dim: int = cfg(32, "per-head value channels", gt=0)
    rope_theta: float = cfg(10_000.0, "RoPE base frequency", gt=0)
    rope_scaling: dict = cfg({}, "{} for plain RoPE, or YaRN: {type = 'yarn', factor, original_max_position_"
                                 "embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}")
    max_position_embeddings: int = cfg(4096, "longest sequence the model is meant for (RoPE has no table)", gt=0)
    rms_norm_eps: float = cfg(1e-6, "epsilon of the layer norms (the two latent norms always use 1e-6)", gt=0)
    attention_bias: bool = cfg(False, "bias on q_a_proj, kv_a_proj_with_mqa and o_proj")
    tie_word_embeddings: bool = cfg(False, "share the embedding and output head weights")
    initializer_range: float = cfg(0.02, "standard deviation of the N(0, σ) initialisation", gt=0)

    def __post_init__(self):
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                             f"{self.num_attention_heads}: MLA expands keys and values for every head")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim < 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and >= 2 (RoPE rotates pairs)")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                             f"n_routed_experts={self.n_routed_experts}")
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method={self.topk_method!r} is not valid; use 'greedy' or 'group_limited_greedy'")
        if self.topk_method == "group_limited_greedy":
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                raise ValueError(f"n_group={self.n_group} must be >= 1 and divide n_routed_experts="
                                 f"{self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}")
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} is more than the "
                                 f"{self.topk_group * (self.n_routed_experts // self.n_group)} experts in "
                                 f"topk_group={self.topk_group} groups; raise topk_group or lower the top-k")
        if self.norm_topk_prob:
            raise ValueError("norm_topk_prob=True is not supported: transformers' DeepSeek-V2 ignores it and the "
                             "released models set it to false; set it to false")
        if self.rope_scaling:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            unknown = sorted(set(self.rope_scaling) - set(YARN_KEYS))
            if kind != "yarn" or unknown or "factor" not in self.rope_scaling:
                raise ValueError(f"rope_scaling={self.rope_scaling} is not valid: use {{}} for plain RoPE or a YaRN "
                                 f"dict with type='yarn', a factor, and only the keys {', '.join(YARN_KEYS)}")

    @property
    def routed_experts(self) -> int:
        "Routed experts per MoE layer, under the name every model family's Config shares (the engine reads it)."
        return self.n_routed_experts

    def is_moe_layer(self, i: int) -> bool:
        "Hugging Face's rule: the first `first_k_dense_replace` layers are dense, the rest MoE."
        return i >= self.first_k_dense_replace

# %% [markdown]
# ## RMSNorm
#
# `weight · x / sqrt(mean(x²) + ε)`, normalised in float32 (or float64 for a float64 model) so that bf16
# activations lose nothing to the reduction, then cast back before the weight multiplies, as Hugging Face does.

# %%
#| export
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(compute_dtype(x.dtype))
        return self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)

# %%
torch.manual_seed(0)
norm = RMSNorm(6, 1e-6)
with torch.no_grad(): norm.weight.uniform_()
xn = torch.randn(3, 6)
ref = norm.weight.double() * xn.double() / (xn.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
assert torch.allclose(norm(xn).double(), ref, rtol=1e-6, atol=0)
out_bf16 = norm.bfloat16()(xn.bfloat16())  # bf16 in, bf16 out, about 3 significant digits
assert out_bf16.dtype == torch.bfloat16 and torch.allclose(out_bf16.double(), ref, rtol=2e-2, atol=0)

# %% [markdown]
# ## Rotary position embedding, interleaved, and YaRN
#
# DeepSeek rotates **adjacent** channel pairs (2i, 2i+1) of the rotary part of a head, not the two halves as
# Llama and Qwen do: transformers writes it as multiplying the pair, read as a complex number, by
# `exp(i · position · f_i)` with `f_i = θ^(-2i/d)`. Positions are an explicit argument, (S,) or (B, S), because
# context parallelism gives each rank pieces of a sequence that are not contiguous. cos and sin are computed
# from the positions on every call, in float32 (float64 for a float64 model), and the rotation is done in that
# precision too.
#
# YaRN stretches the context a model was trained on (`original_max_position_embeddings`) by `factor`.
# A frequency that turns many times over the original context (more than `beta_fast` turns) is kept; one that
# turns fewer than `beta_slow` times is divided by `factor` (its positions are interpolated); between the two
# the frequency index blends linearly. The index where a frequency makes b turns over length L is
# `d · ln(L / (2π b)) / (2 ln θ)`, rounded outwards. YaRN also scales attention logits: cos and sin are multiplied
# by `m(factor, mscale) / m(factor, mscale_all_dim)` with `m(s, μ) = 0.1 μ ln s + 1` (or by `m(factor, 1)` when
# either is unset), and the softmax scale `1/√(d_nope + d_rope)` by `m(factor, mscale_all_dim)²`.
# DeepSeek-V2-Lite sets mscale = mscale_all_dim = 0.707 with factor 40: cos and sin are unchanged and every
# attention logit grows by 1.59×.

# %%
#| export
def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    "YaRN's attention-temperature term `0.1 · mscale · ln(scale) + 1` (1 when scale <= 1)."
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, scaling: dict, max_positions: int, dtype: torch.dtype,
                     device=None) -> tuple[Tensor, float]:
    """Per-pair angular frequencies (dim/2,) in `dtype`, and the factor cos and sin are multiplied by.

    `scaling` is {} for plain RoPE or a YaRN dict (see `Config.rope_scaling`)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=dtype) / dim)
    if not scaling:
        return inv_freq, 1.0
    factor, length = scaling["factor"], scaling.get("original_max_position_embeddings", max_positions)
    def index_of(turns):  # the frequency index that makes `turns` full turns over the original context
        return dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low = max(math.floor(index_of(scaling.get("beta_fast") or 32)), 0)
    high = min(math.ceil(index_of(scaling.get("beta_slow") or 1)), dim - 1)
    ramp = ((torch.arange(dim // 2, device=device, dtype=dtype) - low) / ((high - low) or 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)  # ramp 0: kept, ramp 1: interpolated
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return inv_freq, yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return inv_freq, yarn_mscale(factor)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    "Rotate adjacent channel pairs of `x` (B, heads, S, d) by angles for (S,) or (B, S) positions."
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
    x1, x2 = x.to(cos.dtype).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).to(x.dtype)

# %% [markdown]
# Checks: the rotation is the complex product written independently with `torch.view_as_complex`; the dot
# product of a rotated query and key depends only on the distance between their positions; (B, S) positions
# agree with (S,) positions repeated over the batch.

# %%
xr, pr = torch.randn(2, 3, 5, 8, dtype=torch.float64), torch.arange(5) * 7
f, _ = rope_frequencies(8, 10_000.0, {}, 4096, torch.float64)
rot = torch.polar(torch.ones(5, 4, dtype=torch.float64), pr[:, None].double() * f)
ref = torch.view_as_real(torch.view_as_complex(xr.unflatten(-1, (4, 2)).contiguous()) * rot).flatten(-2)
assert torch.allclose(apply_rope(xr, *cos_sin(pr, f, 1.0)), ref, rtol=0, atol=1e-14)
q1, k1 = torch.randn(2, 1, 1, 8, dtype=torch.float64)
def rotated_dot(pq, pk):
    return (apply_rope(q1, *cos_sin(torch.tensor([pq]), f, 1.0))
            * apply_rope(k1, *cos_sin(torch.tensor([pk]), f, 1.0))).sum()
assert torch.allclose(rotated_dot(7, 3), rotated_dot(107, 103))  # same distance, same product
assert not torch.allclose(rotated_dot(7, 3), rotated_dot(7, 4))
assert torch.equal(apply_rope(xr, *cos_sin(pr, f, 1.0)), apply_rope(xr, *cos_sin(pr.expand(2, 5), f, 1.0)))

# %% [markdown]
# YaRN with DeepSeek-V2-Lite's settings (d = 64, θ = 10⁴, factor 40 over 4096 positions): the fastest
# frequencies are untouched, the slowest divided by 40, the ones between in between; the cos/sin factor is 1.

# %%
lite_yarn = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                 mscale=0.707, mscale_all_dim=0.707)
f_plain, _ = rope_frequencies(64, 1e4, {}, 4096, torch.float64)
f_yarn, att = rope_frequencies(64, 1e4, lite_yarn, 163840, torch.float64)
low = math.floor(64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(1e4)))   # 10
high = math.ceil(64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(1e4)))    # 23
assert torch.equal(f_yarn[:low + 1], f_plain[:low + 1]) and torch.allclose(f_yarn[high:], f_plain[high:] / 40)
between = f_yarn[low + 1:high]
assert ((between < f_plain[low + 1:high]) & (between > f_plain[low + 1:high] / 40)).all()
assert att == 1.0 and abs(yarn_mscale(40, 0.707) ** 2 - 1.5896) < 1e-4
print(f"YaRN keeps {low + 1} of 32 frequencies, interpolates {32 - high}, blends {high - low - 1}")

# %% [markdown]
# ## The projections and the experts
#
# Every matrix a token's activations pass through in bulk is made by the constructors models/20 gives every family,
# and nowhere else: `projection` builds the attention and dense `MLP` projections (shared experts included), `Experts`
# holds the routed experts' stacked weights, and its `forward` is their only use. Switching precision is a change to
# these, not a patch elsewhere. The router and the output head stay in the model's dtype.
#
# The experts' weights are stacked 3-D tensors with transformers' names and layouts: `gate_up_proj` (E, 2I, H),
# the gate in the first I rows and the up projection in the last I, and `down_proj` (E, H, I). Stage 3 receives
# rows already grouped by expert, `counts[e]` rows for expert e, so each expert is one matmul over a contiguous
# row range: `grouped_linear` (ops/grouped_linear) runs them as one `F.grouped_mm` kernel on CUDA and as a loop
# over experts elsewhere; `swiglu` (ops/swiglu) is `silu(gate) · up`, a Triton kernel on CUDA. Both are checked
# against plain PyTorch in their own notebooks. The experts call them through `expert_mlp` (ops/experts): built with
# `fp8` (`Options.fp8`, `train.fp8`), the module holds an `Fp8Weights` and runs the FP8 layers of ops/15 instead.

# %% [markdown]
# ## Multi-head latent attention
#
# Queries: one projection `q_proj` to n heads of `d_nope + d_rope` channels, or (when `q_lora_rank` > 0, as in
# the full DeepSeek-V2) a low-rank path `q_a_proj` → RMSNorm → `q_b_proj`. Keys and values: `kv_a_proj_with_mqa`
# maps each token to a latent of `kv_lora_rank` channels plus **one** rotary key of `d_rope` channels that all
# heads share (the "MQA" in the name); the latent is normalised (`kv_a_layernorm`) and `kv_b_proj` expands it
# to every head's `d_nope` key channels and `d_v` value channels. Rotary embedding touches only the rope
# channels. A head's key is `[k_nope, rope(k_rope)]`, its query `[q_nope, rope(q_rope)]`; the values have a
# different width, which `F.scaled_dot_product_attention` accepts. The two latent norms use ε = 1e-6 whatever
# `rms_norm_eps` says, as transformers does.
#
# For inference only the latent and the shared rope key need caching, which is MLA's point; for training the
# expanded form below is the straightforward one. The normalised latent and the rotated shared key together are
# the *payload* (`kv_lora_rank + d_rope` channels per token) that `expand` turns into every head's keys and
# values: the local path expands it at once, and in a model built with a context-parallel group (`Options.cp_group`,
# ops/17) the payload is what travels the ring, each rank expanding what it receives.

# %%
#| export
class Attention(nn.Module):
    def __init__(self, c: Config, cp_group=None):
        super().__init__()
        n, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = n, c.q_lora_rank, c.kv_lora_rank
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.rope_theta, self.rope_scaling, self.max_positions = c.rope_theta, c.rope_scaling, c.max_position_embeddings
        if c.q_lora_rank:
            self.q_a_proj = projection(c.hidden_size, c.q_lora_rank, c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
            self.q_b_proj = projection(c.q_lora_rank, n * qk)
        else:
            self.q_proj = projection(c.hidden_size, n * qk)
        self.kv_a_proj_with_mqa = projection(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = projection(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = projection(n * c.v_head_dim, c.hidden_size, c.attention_bias)
        mscale_all_dim = c.rope_scaling.get("mscale_all_dim") if c.rope_scaling else None
        self.softmax_scale = qk ** -0.5 * (yarn_mscale(c.rope_scaling["factor"], mscale_all_dim) ** 2
                                           if mscale_all_dim else 1.0)
        self.ring = cp_group   # context parallelism: the ring's process group, or None (ops/17)

    def expand(self, payload: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (B, n, S, nope + rope) and values (B, n, S, v) from the payload (B, S, kv_lora_rank + rope): the
        normalised latent through `kv_b_proj` (its `weight`), and the rotated key shared by all heads."""
        B, S, _ = payload.shape
        latent, k_rope = payload.split([self.kv_lora_rank, self.rope], -1)
        kv = linear(latent, weight, self.kv_b_proj.fp8).view(B, S, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        return torch.cat((k_nope, k_rope.unsqueeze(1).expand(B, self.n_heads, S, self.rope)), -1), v

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        "x (B, S, H), positions (S,) or (B, S) -> (B, S, H)."
        B, S, _ = x.shape
        q, kv = project(x, self.q_a_proj if self.q_lora_rank else self.q_proj, self.kv_a_proj_with_mqa)
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.view(B, S, self.n_heads, -1).transpose(1, 2).split([self.nope, self.rope], -1)
        latent, k_rope = kv.split([self.kv_lora_rank, self.rope], -1)
        inv_freq, factor = rope_frequencies(self.rope, self.rope_theta, self.rope_scaling, self.max_positions,
                                            compute_dtype(x.dtype), x.device)
        cos, sin = cos_sin(positions, inv_freq, factor)
        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), -1)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin).squeeze(1)   # one rotated key for all heads
        payload = torch.cat((self.kv_a_layernorm(latent), k_rope), -1)   # what the ring passes
        docs = documents(positions)   # packed documents: positions restart at each one (ops/14)
        if self.ring is not None:  # the latent travels the ring, each rank expands it (ops/17)
            o = ring_attention(q, payload, self.ring, positions, self.expand, (self.kv_b_proj.weight,),
                               scale=self.softmax_scale)
            return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        k, v = self.expand(payload, self.kv_b_proj.weight)
        if docs is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        elif q.is_cuda:             # within documents, skipping the key blocks of other documents
            o = causal_attention(q, k, v, scale=self.softmax_scale, docs=docs)
        else:
            mask = attention_mask(S, S, q_doc=docs, k_doc=docs, device=q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))

# %% [markdown]
# Check against attention written out in float64 head by head, with the low-rank query path and YaRN on:
# each head's key and value taken from its rows of `kv_b_proj`, explicit scores with the YaRN temperature, a
# lower-triangular mask.

# %%
ca = Config(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=12, kv_lora_rank=10,
            qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=1.0,
                              mscale_all_dim=0.5))
attn = Attention(ca).double()
xa, pa, S = torch.randn(2, 5, 16, dtype=torch.float64), torch.arange(5) + 3, 5
with torch.no_grad():
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(xa)))                   # (B, S, 2 heads · 10)
    ckv = attn.kv_a_proj_with_mqa(xa)
    c_kv, k_r = attn.kv_a_layernorm(ckv[..., :10]), ckv[..., 10:]
    f, fac = rope_frequencies(4, ca.rope_theta, ca.rope_scaling, ca.max_position_embeddings, torch.float64)
    assert fac == yarn_mscale(4.0, 1.0) / yarn_mscale(4.0, 0.5) and fac != 1.0
    cos, sin = cos_sin(pa, f, fac)
    k_r = apply_rope(k_r.unsqueeze(1), cos, sin)[:, 0]                         # (B, S, 4), shared by the heads
    W = attn.kv_b_proj.weight.view(2, 11, 10)                                  # per head: 6 key rows, 5 value rows
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    heads = []
    for h in range(2):
        q_h = q[..., 10 * h:10 * (h + 1)]
        q_h = torch.cat((q_h[..., :6], apply_rope(q_h[..., 6:].unsqueeze(1), cos, sin)[:, 0]), -1)
        k_h = torch.cat((c_kv @ W[h, :6].T, k_r), -1)
        v_h = c_kv @ W[h, 6:].T
        scores = q_h @ k_h.transpose(-1, -2) / math.sqrt(10) * yarn_mscale(4.0, 0.5) ** 2
        heads.append(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v_h)
    ref = attn.o_proj(torch.cat(heads, -1))
    assert torch.allclose(attn(xa, pa), ref, rtol=0, atol=1e-12)

# %% [markdown]
# ## Router and the MLPs
#
# The router is a bias-free linear map to E logits and a softmax, both in float32 (float64 for a float64
# model): the weight is cast up before the matmul, as transformers does, so a bf16 model routes on float32
# logits. `greedy` takes the top-k of all E probabilities. `group_limited_greedy` splits the experts into
# `n_group` consecutive groups, scores each group by its best expert, keeps the `topk_group` best groups and
# takes the top-k among their experts (DeepSeek-V2 places a group on one device, so a token reaches at most
# `topk_group` devices). The chosen probabilities, times `routed_scaling_factor`, weight the experts' outputs;
# the full probabilities go into `Routing.probs` for the load-balance loss. The router's weight is
# `mlp.gate.weight` (E, H), as in transformers.
#
# As in the other families (train/42 explains both), `e_score_correction_bias` (E,), a buffer the trainer moves
# after each step, is added to the probabilities for choosing only: the groups are scored by their best biased
# probability and the top-k taken among the biased probabilities of the kept groups, while the weights are the
# unbiased probabilities times `routed_scaling_factor`. (DeepSeek-V3, where the name comes from, scores a group by
# the sum of its two best biased sigmoid scores; V2's max rule stays here.) Experts outside the kept groups are
# masked with −∞, since a biased score may be negative. `route = "round_robin"` (`Options.route`, `train.route`)
# assigns token t the experts t·k … t·k+k−1 mod E instead, group limit ignored, while the router still runs.
#
# The shared experts are one dense SwiGLU MLP of width `n_shared_experts · moe_intermediate_size`
# (`mlp.shared_experts`), and the dense layers' MLP is the same SwiGLU of width `intermediate_size`.

# %%
#| export
class Router(nn.Module):
    def __init__(self, c: Config, route: str = "learned"):
        super().__init__()
        self.top_k, self.method, self.scale = c.num_experts_per_tok, c.topk_method, c.routed_scaling_factor
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))
        self.route = route   # 'learned' or 'round_robin' (Options.route)

    def forward(self, x: Tensor) -> Routing:
        "x (T, H) -> Routing with ids, weights (in x's dtype) and probs (float32; float64 for a float64 model)."
        ct = compute_dtype(x.dtype)
        probs = F.linear(x.to(ct), self.weight.to(ct)).softmax(-1)
        scores = probs + self.e_score_correction_bias
        if self.method == "group_limited_greedy":
            groups = scores.unflatten(-1, (self.n_group, -1))                    # (T, G, E/G)
            best = groups.amax(-1).topk(self.topk_group, -1).indices             # (T, topk_group)
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(-1, best, True)
            scores = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
        ids = route_ids(scores, self.top_k, self.route)
        return Routing(ids, (probs.gather(-1, ids) * self.scale).to(x.dtype), probs)

class SparseMoE(nn.Module):
    "Holds the routed experts, the router (`gate`) and the shared experts under transformers' names."
    def __init__(self, c: Config, options: Options):
        super().__init__()
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, options.fp8)
        self.gate = Router(c, options.route)
        self.shared_experts = MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)

# %% [markdown]
# Check group-limited routing against a token-by-token Python loop: 12 experts in 4 groups of 3, the 2 best
# groups allowed, top-3. The chosen experts must be the 3 most probable among the 6 experts of the 2 groups
# whose best expert is most probable, and never an expert outside them, though greedy routing picks one for
# some tokens.

# %%
cr = Config(hidden_size=16, n_routed_experts=12, num_experts_per_tok=3, topk_method="group_limited_greedy",
            n_group=4, topk_group=2, routed_scaling_factor=2.5)
router = Router(cr)
nn.init.normal_(router.weight)
xg = torch.randn(40, 16)
r = router(xg)
assert r.ids.shape == r.weights.shape == (40, 3) and r.probs.shape == (40, 12) and r.probs.dtype == torch.float32
for t in range(40):
    p = r.probs[t].tolist()
    groups = sorted(range(4), key=lambda g: -max(p[3 * g:3 * g + 3]))[:2]
    allowed = [e for g in groups for e in range(3 * g, 3 * g + 3)]
    chosen = sorted(allowed, key=lambda e: -p[e])[:3]
    assert sorted(r.ids[t].tolist()) == sorted(chosen)
    assert torch.allclose(r.weights[t], 2.5 * r.probs[t, r.ids[t]])
greedy = Router(Config(hidden_size=16, n_routed_experts=12, num_experts_per_tok=3, routed_scaling_factor=2.5))
greedy.load_state_dict(router.state_dict())
differs = (greedy(xg).ids.sort(-1).values != r.ids.sort(-1).values).any(-1).sum().item()
assert differs > 0
print(f"group limit changed the choice of {differs} of 40 tokens")

# %% [markdown]
# The same loop with a bias, negative for some experts: groups and experts are chosen by probability plus bias,
# the weights are the unbiased probabilities. Round-robin gives every expert T·k/E = 10 of the 120 assignments.

# %%
bias = torch.linspace(-0.2, 0.2, 12)[torch.randperm(12, generator=torch.Generator().manual_seed(0))]
with torch.no_grad():
    router.e_score_correction_bias.copy_(bias)
rb = router(xg)
changed = (rb.ids.sort(-1).values != r.ids.sort(-1).values).any(-1).sum().item()
for t in range(40):
    s = (rb.probs[t] + bias).tolist()
    groups = sorted(range(4), key=lambda g: -max(s[3 * g:3 * g + 3]))[:2]
    chosen = sorted([e for g in groups for e in range(3 * g, 3 * g + 3)], key=lambda e: -s[e])[:3]
    assert sorted(rb.ids[t].tolist()) == sorted(chosen)
    assert torch.allclose(rb.weights[t], 2.5 * rb.probs[t, rb.ids[t]])
assert changed > 0 and torch.equal(rb.probs, r.probs)
rrouter = Router(cr, route="round_robin")
rrouter.load_state_dict(router.state_dict())
rr = rrouter(xg)
assert rr.ids.flatten().tolist() == [i % 12 for i in range(120)]
assert torch.allclose(rr.weights, 2.5 * rr.probs.gather(1, rr.ids))
print(f"the bias changed the choice of {changed} of 40 tokens")

# %% [markdown]
# ## The decoder layer in five stages
#
# Stage 1 is everything before the routed experts: `h + attention(input_layernorm(h))`, the post-attention
# norm, the shared experts added to the residual, and the router on the T = B·S flattened tokens. A dense layer
# finishes its MLP here and returns no routing. Stage 3 is the routed experts on grouped rows. Stage 5 adds, for
# each token, its k expert outputs weighted by the router to the residual (stages 3 and 5 are models/20's
# `RoutedLayer`, which `DecoderLayer` subclasses). Folding the shared experts into stage
# 1 lets them run while the dispatch all-to-all is in flight. Stages 1 and 5 have no data-dependent shapes, no
# host synchronisation and no Python branch on tensor values, so `torch.compile(fullgraph=True)` can take them
# whole; everything data-dependent lives in dispatch and stage 3.

# %%
#| export
class DecoderLayer(RoutedLayer):
    def __init__(self, c: Config, layer_idx: int, options: Options):
        super().__init__()
        self.self_attn = Attention(c, options.cp_group)
        self.mlp = SparseMoE(c, options) if c.is_moe_layer(layer_idx) else MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def stage1(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None, Routing | None]:
        """h (B, S, H) -> (h after attention and shared experts, x (B·S, H) for the routed experts, routing);
        a dense layer: (h after attention and MLP, None, None)."""
        h = h + self.self_attn(self.input_layernorm(h), positions)
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MLP):
            return h + self.mlp(x), None, None
        h = h + self.mlp.shared_experts(x)
        x = x.flatten(0, 1)
        return h, x, self.mlp.gate(x)

# %% [markdown]
# ## The model
#
# The module tree follows transformers' `DeepseekV2ForCausalLM` (`model.embed_tokens`, `model.layers.{i}`,
# `model.norm`, `lm_head`) so that parameter names match. `layers` is a `ModuleDict` keyed by the absolute
# layer index, so a pipeline stage can hold any subset of layers under their original names.
#
# Initialisation: every matrix N(0, σ) with σ = `initializer_range`; the projections that write into the
# residual stream (attention `o_proj`, the routed experts' `down_proj`, the shared experts' and a dense MLP's
# `down_proj`) get σ/√(2L), so the residual's variance does not grow with depth; norms start at 1, biases at 0.
# `init_weights` is separate from construction so a model built on the meta device can be materialised and
# initialised later.
#
# `reference_forward` is the check for everything the engine does: the same attention and norms run
# sequentially with no protocol piece, the routing written out again (group limit by a threshold on the group
# scores), and every expert applied to every token, masked by whether the token chose it.
#
# `DeepseekV2ForCausalLM` subclasses models/20's `CausalLM`, which holds the head and gives `prolog`, `epilog`,
# `forward` and `num_params`; this notebook writes the inner model, the initialisation, `reference_forward` and
# the FLOP count.
#
# The constructor takes the run's `Options` (models/20) beside the config and hands each field to the module that
# reads it: `cp_group` to every attention, `route` to every router, `fp8` to every routed experts module.

# %%
#| export
class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, config: Config, options: Options = Options()):
        super().__init__(config, lambda i: DecoderLayer(config, i, options),
                         RMSNorm(config.hidden_size, config.rms_norm_eps), options)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """Norms to 1, biases to 0, matrices N(0, σ) through `SeededInit` (the same values however the model was
        cut into stages and expert shards); `seed` defaults to torch's initial seed (`torch.manual_seed`)."""
        init, std, out_std = init_shared(self, seed, RMSNorm)
        for layer in self.model.layers.values():
            a = layer.self_attn
            for m in a.modules():
                if isinstance(m, nn.Linear):
                    init.normal_(m.weight, out_std if m is a.o_proj else std)
            moe = isinstance(layer.mlp, SparseMoE)
            mlp = layer.mlp.shared_experts if moe else layer.mlp
            init.normal_(mlp.gate_proj.weight, std); init.normal_(mlp.up_proj.weight, std)
            init.normal_(mlp.down_proj.weight, out_std)
            if moe:
                init.normal_(layer.mlp.gate.weight, std)
                layer.mlp.gate.e_score_correction_bias.zero_()
                init.normal_(layer.mlp.experts.gate_up_proj, std)
                init.normal_(layer.mlp.experts.down_proj, out_std)

    def reference_forward(self, input_ids: Tensor) -> Tensor:
        "Plain sequential forward for tests: no protocol stage, no dispatcher; each expert on all tokens, masked."
        c = self.config
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers.values():
            h = h + layer.self_attn(layer.input_layernorm(h), positions)
            x = layer.post_attention_layernorm(h)
            if isinstance(layer.mlp, MLP):
                h = h + layer.mlp(x)
                continue
            ct = compute_dtype(x.dtype)
            probs = torch.softmax(x.to(ct) @ layer.mlp.gate.weight.to(ct).T, -1)
            if c.topk_method == "group_limited_greedy":
                group_best = probs.unflatten(-1, (c.n_group, -1)).amax(-1)              # (B, S, G)
                threshold = group_best.topk(c.topk_group, -1).values[..., -1:]          # the topk_group-th best
                allowed = (group_best >= threshold).repeat_interleave(c.n_routed_experts // c.n_group, -1)
                top, ids = torch.where(allowed, probs, 0.0).topk(c.num_experts_per_tok, -1)
            else:
                top, ids = probs.topk(c.num_experts_per_tok, -1)
            top = (top * c.routed_scaling_factor).to(x.dtype)
            h = h + layer.mlp.shared_experts(x) + layer.mlp.experts.reference(x, top, ids)
        return self.lm_head(self.model.norm(h))

    def active_matmul_params(self) -> int:
        """Matmul parameters one token touches (for MFU): attention projections, router, k routed experts,
        shared experts or the dense MLP, head."""
        k, n = self.config.num_experts_per_tok, self.lm_head.weight.numel()
        for layer in self.model.layers.values():
            n += sum(m.weight.numel() for m in layer.self_attn.modules() if isinstance(m, nn.Linear))
            moe = isinstance(layer.mlp, SparseMoE)
            mlp = layer.mlp.shared_experts if moe else layer.mlp
            n += sum(p.weight.numel() for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            if moe:
                ex = layer.mlp.experts
                n += layer.mlp.gate.weight.numel() + k * (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel())
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 × active matmul parameters, plus attention's QKᵀ (qk head width
        qk_nope + qk_rope) and PV (v_head_dim) products, ×3 with backward, counted at half for the causal mask."""
        c = self.config
        qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        return 6 * self.active_matmul_params() + 3 * seq_len * c.num_attention_heads * (qk + v) * c.num_hidden_layers

# %% [markdown]
# ## Checks
#
# The five-stage forward and `reference_forward` must agree on logits and on every parameter's gradient:
# tightly in float32 and to rounding in float64, for greedy and group-limited routing, with and without the
# low-rank query path. Layer 0 is dense.

# %%
def compare(model, ids, atol):
    logits, routings = model(ids)
    ref = model.reference_forward(ids)
    assert torch.allclose(logits, ref, rtol=0, atol=atol), (logits - ref).abs().max()
    g = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
    g_ref = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(g, g_ref))
    return routings, worst

# %%
small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
             routed_scaling_factor=1.5, initializer_range=0.1)
ids = torch.randint(0, 64, (2, 7))
for method, q_lora_rank in (("greedy", 0), ("group_limited_greedy", 24)):
    torch.manual_seed(0)
    c = Config(**small, topk_method=method, n_group=4, topk_group=2, q_lora_rank=q_lora_rank)
    model = DeepseekV2ForCausalLM(c)
    routings, worst = compare(model, ids, atol=1e-6)
    assert worst < 1e-5, worst
    assert routings[0] is None and all(r.probs.shape == (14, 8) for r in routings[1:])
    routings, worst64 = compare(model.double(), ids, atol=1e-12)
    assert worst64 < 1e-12, worst64
    print(f"{method}, q_lora_rank={q_lora_rank}: worst relative gradient difference {worst:.1e} (float32), "
          f"{worst64:.1e} (float64)")

# %% [markdown]
# With group-limited routing and `topk_group = 1`, every token's experts lie in one group of 2 (of 4 groups).

# %%
torch.manual_seed(0)
model = DeepseekV2ForCausalLM(Config(**small, topk_method="group_limited_greedy", n_group=4, topk_group=1))
routings, worst = compare(model, ids, atol=1e-6)
assert worst < 1e-5, worst
for r in routings[1:]:
    assert (r.ids // 2 == r.ids[:, :1] // 2).all()

# %% [markdown]
# Stages 1 and 5 compile as whole graphs, here with YaRN and group-limited routing. The `aot_eager` backend
# traces forward and backward the way `torch.compile` does but skips code generation, so the check is quick on
# a CPU.

# %%
from pith_lit.models.protocol import LocalDispatcher
torch.manual_seed(0)
c = Config(**small, topk_method="group_limited_greedy", n_group=4, topk_group=2, q_lora_rank=24,
           rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                             mscale_all_dim=1.0))
model = DeepseekV2ForCausalLM(c)
layer, h_in = model.model.layers["1"], torch.randn(2, 7, c.hidden_size)
h1, x1, r1 = torch.compile(layer.stage1, fullgraph=True, backend="aot_eager")(h_in, torch.arange(7))
h1e, x1e, r1e = layer.stage1(h_in, torch.arange(7))
assert torch.allclose(h1, h1e) and torch.allclose(x1, x1e) and torch.equal(r1.ids, r1e.ids)
d = LocalDispatcher(c.n_routed_experts)
y = d.combine(d.reduce(layer.stage3(*d.expand(d.dispatch(x1, r1), r1)), r1), r1)
h5 = torch.compile(layer.stage5, fullgraph=True, backend="aot_eager")(h1, y)
assert torch.allclose(h5, layer.stage5(h1, y))
torch._dynamo.reset()  # drop the compiled graphs (and their teardown warnings at exit)

# %% [markdown]
# Parameter counts, against the formula from the config. Attention per layer: H·r_q + r_q·n·(d_nope + d_rope)
# for the query path, H·(r_kv + d_rope) + r_kv·n·(d_nope + d_v) for keys and values, n·d_v·H for the output,
# plus the two latent norms (r_q + r_kv). An MoE layer: E·H router, 3·H·I per routed expert, 3·H·I·n_shared
# shared; the dense layer 3·H·I_dense. Plus embedding, head and the 2L + 1 hidden-size norms.

# %%
H, L, E, k, n = c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok, c.num_attention_heads
I, rq, rkv = c.moe_intermediate_size, c.q_lora_rank, c.kv_lora_rank
qk, dv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
q_p = H * rq + rq * n * qk if rq else H * n * qk  # low-rank path or one q_proj
attn_p = q_p + H * (rkv + c.qk_rope_head_dim) + rkv * n * (c.qk_nope_head_dim + dv) + n * dv * H
moe_layers, shared = L - c.first_k_dense_replace, 3 * H * I * c.n_shared_experts
total = (2 * c.vocab_size * H + (2 * L + 1) * H + L * (rq + rkv) + L * attn_p
         + moe_layers * (E * H + E * 3 * H * I + shared) + c.first_k_dense_replace * 3 * H * c.intermediate_size)
active = (c.vocab_size * H + L * attn_p + moe_layers * (E * H + k * 3 * H * I + shared)
          + c.first_k_dense_replace * 3 * H * c.intermediate_size)
assert model.num_params() == total and model.active_matmul_params() == active
print(f"{total:,} parameters, {active:,} active matmul parameters per token")

# %% [markdown]
# On CUDA in bf16 the experts run through `F.grouped_mm`, and the permutations, SwiGLU and the weighted sum through
# Triton kernels. bf16 keeps 8 bits of mantissa and a few tokens' top-k flips, so logits and gradients differ from
# float32 by a few percent whichever way bf16 is computed. The check: the five-stage bf16 path is as close to
# the float32 reference as the plain sequential forward run in bf16 (measured on the H200 with torch 2.11:
# logits 9.3e-3 vs 9.3e-3, worst gradient 4.5e-2 vs 4.5e-2).

# %%
#| cuda
torch.manual_seed(0)
cg = Config(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
            n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2, q_lora_rank=256,
            kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
ref_model = DeepseekV2ForCausalLM(cg).cuda()
bf_model = DeepseekV2ForCausalLM(cg).cuda().bfloat16()
bf_model.load_state_dict(ref_model.state_dict())
ids = torch.randint(0, cg.vocab_size, (4, 256), device="cuda")
ref = ref_model.reference_forward(ids)
g_ref = torch.autograd.grad(ref.square().mean(), list(ref_model.parameters()))
rel_err = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
errs = {}
for name, fwd in (("five-stage", lambda: bf_model(ids)[0]), ("plain", lambda: bf_model.reference_forward(ids))):
    out = fwd()
    g = torch.autograd.grad(out.float().square().mean(), list(bf_model.parameters()))
    errs[name] = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(g, g_ref)]
five, plain = errs["five-stage"], errs["plain"]
print(f"bf16 vs fp32 relative error, five-stage (plain bf16): logits {five[0]:.1e} ({plain[0]:.1e}), "
      f"worst gradient {max(five[1:]):.1e} ({max(plain[1:]):.1e})")
assert all(f <= 1.25 * p + 1e-3 for f, p in zip(five, plain)), list(zip(five, plain))

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
Model = DeepseekV2ForCausalLM   # the model class, under the name every family gives it


def tiny_config(layers: int = 5, experts: int = 4, top_k: int = 2, dense: int = 2) -> Config:
    """The tiny model of the checks (engine/39 `tiny_model`): `experts` routed experts top-`top_k` and a shared
    expert, latent attention; the first layer is dense (DeepSeek's place for it: `dense` is not used)."""
    return Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=experts, num_experts_per_tok=top_k, first_k_dense_replace=1,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)

# %% [markdown]
# **config.json.** Nulls for `q_lora_rank`, `n_group` and `topk_group`, plain RoPE or YaRN, and `head_dim` and
# `qk_head_dim`, which transformers derives from the query/key widths. The hub spells no low-rank query path `q_lora_rank: null`
# and plain RoPE `rope_scaling: null`. The published checkpoints store each routed expert on its own.

# %%
#| export
HF_MODEL_TYPES = ("deepseek_v2",)     # the config.json model_types this family reads
HF_EXPERTS_ONE_BY_ONE = True          # save_hf writes each routed expert on its own, as the hub's checkpoints do
HF_READ_EXPERTS_ONE_BY_ONE = True     # load_hf reads them one by one too (and stacked, as transformers 5.x saves)
HF_RENAME = {}                        # stored name prefix -> ours
HF_READ_PAST = {}                     # stored name prefix -> what load_hf reads past


def from_hf(hf: dict) -> tuple[dict, dict, dict, set]:
    """config.json `hf` -> (the keys to read, the fields computed from them, the keys that must hold one value, the
    keys read past), by train/46's rules; a ValueError for what this family does not model."""
    theta, kind, rest = hf_rope(hf)
    if kind not in ("default", "yarn") or (kind == "default" and rest):
        raise ValueError(f"config.json: RoPE of type {kind!r} with {rest}: pith_lit's deepseek_v2 has plain RoPE "
                         "and YaRN")
    computed = {"rope_theta": theta, "rope_scaling": {"type": "yarn", **rest} if kind == "yarn" else {},
                "q_lora_rank": hf_or(hf, "q_lora_rank", 0), "n_group": hf_or(hf, "n_group", 1),
                "topk_group": hf_or(hf, "topk_group", 1),
                "num_key_value_heads": hf_or(hf, "num_key_value_heads", hf.get("num_attention_heads"))}
    fixed = {"hidden_act": "silu", "attention_dropout": 0.0, "mlp_bias": False, "scoring_func": "softmax",
             "moe_layer_freq": 1}
    read = {"rope_theta", "rope_scaling", "rope_parameters", "head_dim", "qk_head_dim", "pretraining_tp",
            "aux_loss_alpha", "seq_aux", "ep_size"}
    return hf, computed, fixed, read


def to_hf(c: Config) -> dict:
    "The config.json keys of `c` in the hub's spelling (without `architectures` and `torch_dtype`)."
    return asdict(c) | {"q_lora_rank": c.q_lora_rank or None, "rope_scaling": c.rope_scaling or None,
                        "hidden_act": "silu", "attention_dropout": 0.0, "mlp_bias": False}

# %% [markdown]
# **The planner.** Stage 1 keeps, per token: the input norm and its output, the queries (through the low-rank path and
# its norm where `q_lora_rank` > 0), the compressed latent through its norm, the decompressed keys and values, the
# attention's output (and its head-major copy for `o_proj`) and log-sum-exp, the post-attention norm; then a dense
# layer's MLP, or the shared experts, the residual and the router (with its float32 copy of the input).

# %%
#| export
def kept_by_part(c: Config, i: int, b: int, f: int, compiled: bool) -> dict:
    "Bytes per token layer `i` keeps for backward in stage 1, by part (the planner adds stage 3 and the output)."
    H, n, r, rope = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    qk, v = c.qk_nope_head_dim + rope, c.v_head_dim
    s1 = {"input norm": norm_bytes(H, b, f, compiled) + b * H,
          "q": b * n * qk + (norm_bytes(c.q_lora_rank, b, f, compiled, keep_input=b * c.q_lora_rank)
                             + b * c.q_lora_rank if c.q_lora_rank else 0),
          "latent": norm_bytes(r, b, f, compiled, keep_input=b * (r + rope)) + b * (r + rope),
          "k, v": b * n * (c.qk_nope_head_dim + v) + b * n * qk,
          "attention": 2 * b * n * v + 4 * n,   # its output, copied for o_proj (head-major), and the log-sum-exp
          "post norm": norm_bytes(H, b, f, compiled) + b * H}
    if not c.is_moe_layer(i):
        return s1 | {"mlp": mlp_bytes(c.intermediate_size, b, compiled)}
    shared = c.n_shared_experts * c.moe_intermediate_size
    return s1 | {"shared experts": mlp_bytes(shared, b, compiled) if shared else 0, "residual": b * H,
                 "router": router_bytes(c.n_routed_experts, c.num_experts_per_tok, b, f, f * H if b < f else 0)}


def kernel_attention_shape(c: Config, document_mask: bool, cp: int) -> tuple[int, int, int] | None:
    "(heads, q/k width, v width) where ops/14's kernels attend (documents, ring steps); None where SDPA does."
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    return (c.num_attention_heads, qk, c.v_head_dim) if document_mask or cp > 1 else None


def expert_width(c: Config) -> int:
    "The FFN width of one routed expert."
    return c.moe_intermediate_size


def router_one_hot(c: Config) -> int:
    "Values per routed pair that stage 3 keeps for the router besides the rows: none."
    return 0


FP32_NORM_GAIN = False   # the RMSNorms multiply their gain in the compute dtype

# %%
c5 = tiny_config(layers=3)
assert [c5.is_moe_layer(i) for i in range(3)] == [False, True, True] and Model is DeepseekV2ForCausalLM
hf = to_hf(c5)
assert hf["q_lora_rank"] is None and hf["rope_scaling"] is None and from_hf(hf)[1]["q_lora_rank"] == 0
assert kernel_attention_shape(c5, True, 1) == (4, 12, 8) and kernel_attention_shape(c5, False, 1) is None
assert "shared experts" in kept_by_part(c5, 1, 2, 4, False) and "mlp" in kept_by_part(c5, 0, 2, 4, False)
