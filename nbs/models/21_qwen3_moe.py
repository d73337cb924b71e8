# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Qwen3-MoE
#
# Qwen3-MoE (Qwen3-30B-A3B and its relatives) is a decoder-only transformer whose MLP is a mixture of experts:
# grouped-query attention with an RMSNorm on every query and key head, rotary position embeddings, and a
# softmax router that sends each token to its top-k of E SwiGLU experts. There are no shared experts. A layer
# listed in `mlp_only_layers` (or skipped by `decoder_sparse_step`) has a dense SwiGLU MLP instead.
#
# This notebook is self-contained: it defines every piece it uses, then cuts each decoder layer into the five
# stages of the layer protocol (models/protocol). Parameter names and shapes are those of Hugging Face
# transformers 5.x `Qwen3MoeForCausalLM`, so a checkpoint converts by name. The checks compare the five-stage
# forward with a plain sequential one; tests/test_qwen3_moe.py also compares against transformers itself.

# %%
#| default_exp models.qwen3_moe

# %%
#| export
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pith_lit.models.protocol import (MLP, CausalLM, Experts, Options, Routing, RoutedLayer, cfg, compute_dtype,
                                      hf_or, hf_rope, init_shared, mlp_bytes, norm_bytes, project, projection,
                                      rope_cos_sin, route_ids, router_bytes)
from pith_lit.ops.attention import attention_mask, causal_attention, documents
from pith_lit.ops.ring_attention import kv_payload, ring_attention, split_kv

# %%
#| export
@dataclass
class Config:
    "Qwen3-MoE hyper-parameters. Field names are those of Hugging Face's `Qwen3MoeConfig`."
    model_type: str = cfg("qwen3_moe", "model family; selects the model module")
    vocab_size: int = cfg(4096, "vocabulary size (the default tokenizer, stdlib-bpe-4096, needs at least 4096; the byte "
                                 "tokenizer 259)", gt=0)
    hidden_size: int = cfg(128, "model width", gt=0)
    moe_intermediate_size: int = cfg(128, "FFN width of one routed expert", gt=0)
    intermediate_size: int = cfg(512, "FFN width of a dense MLP layer (layers listed in mlp_only_layers)", gt=0)
    num_hidden_layers: int = cfg(4, "number of decoder layers", gt=0)
    num_attention_heads: int = cfg(4, "query heads", gt=0)
    num_key_value_heads: int = cfg(2, "key/value heads (grouped-query attention); divides num_attention_heads", gt=0)
    head_dim: int = cfg(32, "width of one attention head", gt=0)
    num_experts: int = cfg(8, "routed experts per MoE layer", ge=0)
    num_experts_per_tok: int = cfg(2, "experts chosen per token (top-k)", gt=0)
    norm_topk_prob: bool = cfg(True, "renormalise the top-k router probabilities to sum to 1")
    decoder_sparse_step: int = cfg(1, "every n-th layer is MoE (1 = all layers)", gt=0)
    mlp_only_layers: list = cfg([], "layer indices that use a dense MLP instead of experts")
    rms_norm_eps: float = cfg(1e-6, "epsilon of every RMSNorm", gt=0)
    rope_theta: float = cfg(1_000_000.0, "RoPE base frequency", gt=0)
    max_position_embeddings: int = cfg(4096, "longest sequence the model is meant for (RoPE has no table)", gt=0)
    attention_bias: bool = cfg(False, "bias on the q/k/v/o projections")
    tie_word_embeddings: bool = cfg(False, "share the embedding and output head weights")
    initializer_range: float = cfg(0.02, "standard deviation of the N(0, σ) initialisation", gt=0)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}; change one of them")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of channels)")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1 (1 = every layer MoE)")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                             f"num_experts={self.num_experts}")

    @property
    def routed_experts(self) -> int:
        "Routed experts per MoE layer, under the name every model family's Config shares (the engine reads it)."
        return self.num_experts

    def is_moe_layer(self, i: int) -> bool:
        "Hugging Face's rule: layer i is MoE unless listed in mlp_only_layers or off the sparse step."
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

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
# ## Rotary position embedding
#
# Channel pair i of a head (channels i and i + d/2, the "rotate-half" layout of Hugging Face's Qwen3) is rotated
# by the angle `position · θ^(-2i/d)`. Positions are an explicit argument, (S,) or (B, S), because context
# parallelism gives each rank pieces of a sequence that are not contiguous. The angles are computed in float32
# from the positions on every call: no table to keep in sync with the dtype or device of the model. The tables of
# cos and sin are models/20's `rope_cos_sin` (Qwen3.5 uses the same layout).

# %%
#| export
def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    "Rotate `x` (B, heads, S, head_dim) by angles for (S,) or (B, S) positions."
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin

# %% [markdown]
# The point of a rotation by position: the dot product of a rotated query and key depends only on the distance
# between their positions. Shifting both positions by the same amount must leave it unchanged, and (B, S)
# positions must agree with (S,) positions repeated over the batch.

# %%
q1, k1 = torch.randn(2, 1, 1, 8, dtype=torch.float64)
def rotated_dot(pq, pk):
    cq, sq = rope_cos_sin(torch.tensor([pq]), 8, 10_000.0, torch.float64)
    ck, sk = rope_cos_sin(torch.tensor([pk]), 8, 10_000.0, torch.float64)
    return (apply_rope(q1, cq, sq) * apply_rope(k1, ck, sk)).sum()
assert torch.allclose(rotated_dot(7, 3), rotated_dot(107, 103))  # same distance, same product
assert not torch.allclose(rotated_dot(7, 3), rotated_dot(7, 4))
xr = torch.randn(2, 3, 5, 8)
cs1, cs2 = rope_cos_sin(torch.arange(5), 8, 1e6, xr.dtype), rope_cos_sin(torch.arange(5).expand(2, 5), 8, 1e6, xr.dtype)
assert torch.equal(apply_rope(xr, *cs1), apply_rope(xr, *cs2))

# %% [markdown]
# ## The projections and the experts
#
# Every matrix a token's activations pass through in bulk is made by the constructors models/20 gives every family,
# and nowhere else: `projection` builds the attention (and dense `MLP`) projections, `Experts` holds the routed
# experts' stacked weights, and its `forward` is their only use. Switching precision is a change to these, not a patch
# elsewhere. The router and the output head stay in the model's dtype.
#
# The experts' weights are stacked 3-D tensors with transformers' names and layouts: `gate_up_proj` (E, 2I, H),
# the gate in the first I rows and the up projection in the last I, and `down_proj` (E, H, I). Stage 3 receives
# rows already grouped by expert, `counts[e]` rows for expert e, so each expert is one matmul over a contiguous
# row range: `grouped_linear` (ops/grouped_linear) runs them as one `F.grouped_mm` kernel on CUDA and as a loop
# over experts (one host synchronisation to read `counts`) elsewhere; `swiglu` (ops/swiglu) is
# `silu(gate) · up`, a Triton kernel on CUDA. Both are checked against plain PyTorch in their own notebooks. The
# experts call them through `expert_mlp` (ops/experts). Built with `fp8` (`Options.fp8`, `train.fp8`), the module
# holds an `Fp8Weights`, and `expert_mlp` runs the FP8 layers of ops/15 on the step's copies instead, with SwiGLU
# computed inside their quantization passes.

# %% [markdown]
# ## Attention
#
# Grouped-query attention: `num_key_value_heads` key/value heads, each shared by
# `num_attention_heads / num_key_value_heads` query heads. Qwen3 normalises every query and key head with its
# own RMSNorm over `head_dim` (`q_norm`, `k_norm`) before RoPE. The attention itself is
# `F.scaled_dot_product_attention` with a causal mask; the mask is by place in the given sequence, which is what
# a whole sequence per micro-batch needs. Built with a context-parallel group (`Options.cp_group`, ops/17), the
# module holds a rank's zigzag chunks instead, and attends through the ring over the whole sequence's keys and values.

# %%
#| export
class Attention(nn.Module):
    def __init__(self, c: Config, cp_group=None):
        super().__init__()
        self.head_dim, self.rope_theta = c.head_dim, c.rope_theta
        self.q_proj = projection(c.hidden_size, c.num_attention_heads * c.head_dim, c.attention_bias)
        self.k_proj = projection(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.v_proj = projection(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.o_proj = projection(c.num_attention_heads * c.head_dim, c.hidden_size, c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.ring = cp_group   # context parallelism: the ring's process group, or None (ops/17)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        "x (B, S, H), positions (S,) or (B, S) -> (B, S, H)."
        B, S, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = self.q_norm(q.view(B, S, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, S, -1, self.head_dim)).transpose(1, 2)
        v = v.view(B, S, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        docs = documents(positions)   # packed documents: positions restart at each one (ops/14)
        if self.ring is not None:  # this rank's zigzag chunks over the whole sequence's keys (ops/17)
            o = ring_attention(q, kv_payload(k, v), self.ring, positions, partial(split_kv, dk=self.head_dim))
        elif docs is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif q.is_cuda:             # within documents, skipping the key blocks of other documents
            o = causal_attention(q, k, v, docs=docs)
        else:
            mask = attention_mask(S, S, q_doc=docs, k_doc=docs, device=q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))

# %% [markdown]
# Check against attention written out in float64: explicit scores, a lower-triangular mask, and each key/value
# head repeated for its query heads.

# %%
ca = Config(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
attn = Attention(ca).double()
xa, pa = torch.randn(2, 5, 16, dtype=torch.float64), torch.arange(5)
import math

with torch.no_grad():
    q = attn.q_norm(attn.q_proj(xa).view(2, 5, 4, 8)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(xa).view(2, 5, 2, 8)).transpose(1, 2).repeat_interleave(2, 1)
    v = attn.v_proj(xa).view(2, 5, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    cos, sin = rope_cos_sin(pa, 8, ca.rope_theta, torch.float64)
    scores = apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    ref = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(attn(xa, pa), ref, rtol=0, atol=1e-12)

# %% [markdown]
# ## Router and the MLPs
#
# The router is a bias-free linear map to E logits, a softmax in float32, and the top-k; with `norm_topk_prob`
# the k chosen probabilities are rescaled to sum to 1 (Qwen3-30B-A3B sets it). The full probabilities go into
# `Routing.probs` for the load-balance loss. Its weight is `mlp.gate.weight` (E, H), as in transformers.
# A dense layer's MLP is the same SwiGLU with three separate projections.
#
# Two things steer the choice without touching the weights (train/42 explains both):
# `e_score_correction_bias` (E,), DeepSeek-V3's name for it, is added to the probabilities for the top-k only;
# the chosen experts are weighted by their unbiased probabilities. It is a buffer, not a parameter: model state
# that checkpoints keep, moved by the trainer after each step (`train.lb_bias_rate`), never by a gradient; zero
# leaves the router as transformers has it. `route = "round_robin"` (`Options.route`, `train.route`) replaces the
# top-k by a fixed assignment, token t to experts t·k … t·k+k−1 mod E, so that every expert receives the same number
# of tokens while the router's matmul and softmax still run.

# %%
#| export
class Router(nn.Module):
    def __init__(self, c: Config, route: str = "learned"):
        super().__init__()
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts))
        self.route = route   # 'learned' or 'round_robin' (Options.route)

    def forward(self, x: Tensor) -> Routing:
        "x (T, H) -> Routing with ids, weights (in x's dtype) and probs (float32; float64 for a float64 model)."
        probs = F.linear(x, self.weight).to(compute_dtype(x.dtype)).softmax(-1)
        ids = route_ids(probs + self.e_score_correction_bias, self.top_k, self.route)
        weights = probs.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(ids, weights.to(x.dtype), probs)


class SparseMoE(nn.Module):
    "Holds the router (`gate`) and the routed experts under transformers' names; the stages call them."
    def __init__(self, c: Config, options: Options):
        super().__init__()
        self.gate = Router(c, options.route)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, options.fp8)
# %%
cr = Config(hidden_size=16, num_experts=6, num_experts_per_tok=3)
router = Router(cr)
nn.init.normal_(router.weight)
r = router(torch.randn(10, 16))
assert r.ids.shape == r.weights.shape == (10, 3) and r.probs.shape == (10, 6) and r.probs.dtype == torch.float32
assert torch.allclose(r.weights.sum(-1), torch.ones(10))
assert torch.equal(r.probs.gather(1, r.ids), r.probs.sort(-1, descending=True).values[:, :3])

# %% [markdown]
# With a bias, each token's experts are the three best by probability plus bias, found here by sorting each
# token's list in Python, and their weights are the unbiased probabilities; round-robin gives every expert
# T·k/E = 5 of the 30 assignments.

# %%
with torch.no_grad():
    router.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.3, 0.2]))
xb = torch.randn(10, 16)
rb, plain = router(xb), Router(cr)
plain.load_state_dict({"weight": router.weight, "e_score_correction_bias": torch.zeros(6)})
for t in range(10):
    p, b = rb.probs[t].tolist(), router.e_score_correction_bias.tolist()
    chosen = sorted(range(6), key=lambda e: -(p[e] + b[e]))[:3]
    assert rb.ids[t].tolist() == chosen
    assert torch.allclose(rb.weights[t], rb.probs[t, chosen] / rb.probs[t, chosen].sum())
assert torch.equal(rb.probs, plain(xb).probs) and (rb.ids != plain(xb).ids).any()
rrouter = Router(cr, route="round_robin")
rrouter.load_state_dict(router.state_dict())
rr = rrouter(xb)
assert rr.ids.flatten().tolist() == [i % 6 for i in range(30)] and torch.equal(rr.probs, rb.probs)
assert torch.bincount(rr.ids.flatten(), minlength=6).tolist() == [5] * 6
assert torch.allclose(rr.weights, rr.probs.gather(1, rr.ids) / rr.probs.gather(1, rr.ids).sum(-1, keepdim=True))

# %% [markdown]
# ## The decoder layer in five stages
#
# Stage 1 is everything before the experts: `h + attention(input_layernorm(h))`, then the post-attention norm
# and the router on the T = B·S flattened tokens (a dense layer finishes its MLP here and returns no routing).
# Stage 3 is the experts on grouped rows. Stage 5 adds, for each token, its k expert outputs weighted by the
# router to the residual; stages 3 and 5 are models/20's `RoutedLayer`, which `DecoderLayer` subclasses. Stages 1
# and 5 have no data-dependent shapes, no host synchronisation and no Python
# branch on tensor values, so `torch.compile(fullgraph=True)` can take them whole; everything data-dependent
# lives in dispatch and stage 3.

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
        "h (B, S, H) -> (h after attention, x (B·S, H) for the experts, routing); a dense layer: (h, None, None)."
        h = h + self.self_attn(self.input_layernorm(h), positions)
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MLP):
            return h + self.mlp(x), None, None
        x = x.flatten(0, 1)
        return h, x, self.mlp.gate(x)

# %% [markdown]
# ## The model
#
# The module tree follows transformers' `Qwen3MoeForCausalLM` (`model.embed_tokens`, `model.layers.{i}`,
# `model.norm`, `lm_head`) so that parameter names match. `layers` is a `ModuleDict` keyed by the absolute
# layer index, so a pipeline stage can hold any subset of layers under their original names.
#
# Initialisation: every matrix N(0, σ) with σ = `initializer_range`; the projections that write into the
# residual stream (attention `o_proj`, the experts' `down_proj`, a dense MLP's `down_proj`) get σ/√(2L), so the
# residual's variance does not grow with depth; norms start at 1, biases at 0. `init_weights` is separate from
# construction so a model built on the meta device can be materialised and initialised later.
#
# `reference_forward` is the check for everything the engine does: the same layers run sequentially with no
# protocol piece, every expert applied to every token and masked by whether the token chose it.
#
# `Qwen3MoeForCausalLM` subclasses models/20's `CausalLM`, which holds the head and gives `prolog`, `epilog`,
# `forward` and `num_params`; this notebook writes the inner model, the initialisation, `reference_forward` and
# the FLOP count.
#
# The constructor takes the run's `Options` (models/20) beside the config and hands each field to the module that
# reads it: `cp_group` to every attention, `route` to every router, `fp8` to every experts module and, through
# `CausalLM`, to the dense projections at least `fp8_dense_min` wide.

# %%
#| export
class Qwen3MoeForCausalLM(CausalLM):
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
            for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight): init.normal_(p, std)
            init.normal_(a.o_proj.weight, out_std)
            if isinstance(layer.mlp, MLP):
                init.normal_(layer.mlp.gate_proj.weight, std); init.normal_(layer.mlp.up_proj.weight, std)
                init.normal_(layer.mlp.down_proj.weight, out_std)
            else:
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
            probs = torch.softmax(x @ layer.mlp.gate.weight.T, -1, dtype=compute_dtype(x.dtype))
            top, ids = probs.topk(c.num_experts_per_tok, -1)
            if c.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            h = h + layer.mlp.experts.reference(x, top.to(x.dtype), ids)
        return self.lm_head(self.model.norm(h))

    def active_matmul_params(self) -> int:
        "Matmul parameters one token touches (for MFU): attention projections, router, k experts or dense MLP, head."
        k, n = self.config.num_experts_per_tok, self.lm_head.weight.numel()
        for layer in self.model.layers.values():
            a = layer.self_attn
            n += sum(p.weight.numel() for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
            if isinstance(layer.mlp, MLP):
                n += sum(p.weight.numel() for p in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))
            else:
                ex = layer.mlp.experts
                n += layer.mlp.gate.weight.numel() + k * (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel())
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 × active matmul parameters, plus attention's two products (QKᵀ and PV,
        2·2·S·heads·head_dim forward, ×3 with backward) counted at half for the causal mask."""
        c = self.config
        return 6 * self.active_matmul_params() + 6 * seq_len * c.num_attention_heads * c.head_dim * c.num_hidden_layers

# %% [markdown]
# ## Checks
#
# The five-stage forward and `reference_forward` must agree on logits and on every parameter's gradient:
# tightly in float32 and to rounding in float64. The tiny config has a dense layer (layer 1) between MoE layers.

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
torch.manual_seed(0)
c = Config(vocab_size=64, hidden_size=32, moe_intermediate_size=16, intermediate_size=48, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
           mlp_only_layers=[1])
model = Qwen3MoeForCausalLM(c)
ids = torch.randint(0, c.vocab_size, (2, 7))
routings, worst = compare(model, ids, atol=1e-6)
assert worst < 1e-5, worst
assert routings[1] is None and all(r.probs.shape == (14, 4) for r in (routings[0], routings[2]))
print(f"float32: logits within 1e-6, worst relative gradient difference {worst:.1e}")
routings, worst = compare(model.double(), ids, atol=1e-12)
assert worst < 1e-12, worst
print(f"float64: logits within 1e-12, worst relative gradient difference {worst:.1e}")

# %% [markdown]
# Under `Options.fp8`, the dense projections at least `fp8_dense_min` wide in and out run in FP8: at the default
# (4096) none of this small model's, at 0 all of them (q, k, v, o and the dense layer's MLP), and at 32 all but k
# and v (16 wide); the experts modules hold their FP8 copies in every case.

# %%
def fp8_projections(options):
    m = Qwen3MoeForCausalLM(c, options)
    assert all(layer.mlp.experts.fp8_copies is not None for k, layer in m.model.layers.items() if k != "1")
    return sorted({n.split(".", 3)[-1] for n, p in m.named_modules() if getattr(p, "fp8", None) == "rows"})

assert fp8_projections(Options(fp8="rows")) == []
assert fp8_projections(Options(fp8="rows", fp8_dense_min=0)) == [
    "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
    "self_attn.v_proj"]
assert fp8_projections(Options(fp8="rows", fp8_dense_min=32)) == [
    "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.o_proj", "self_attn.q_proj"], \
    fp8_projections(Options(fp8="rows", fp8_dense_min=32))
print("FP8 dense projections chosen by width")

# %% [markdown]
# Skewed routing: every token's first choice is expert 3 and its second expert 1; experts 0 and 2 get nothing.
# A router has no bias, so the skew needs a feature with the same sign for every token: a large constant in
# embedding channel 0 survives the small attention and MLP updates and makes normalised channel 0 positive.

# %%
with torch.no_grad():
    model.model.embed_tokens.weight[:, 0] = 10.0
    for i in ("0", "2"):
        gate = model.model.layers[i].mlp.gate.weight
        gate.zero_()
        gate[:, 0] = torch.tensor([-50.0, 50.0, 0.0, 100.0], dtype=gate.dtype)
routings, worst = compare(model, ids, atol=1e-12)
assert worst < 1e-12, worst
for r in (routings[0], routings[2]):
    assert (r.ids[:, 0] == 3).all() and r.counts.tolist() == [0, 14, 0, 14], r.counts
print("skewed routing, tokens per expert:", routings[0].counts.tolist())

# %% [markdown]
# Stages 1 and 5 compile as whole graphs. The `aot_eager` backend traces forward and backward the way
# `torch.compile` does but skips code generation, so the check is quick on a CPU.

# %%
from pith_lit.models.protocol import LocalDispatcher
model = model.float()
layer, h_in = model.model.layers["0"], torch.randn(2, 7, c.hidden_size)
h1, x1, r1 = torch.compile(layer.stage1, fullgraph=True, backend="aot_eager")(h_in, torch.arange(7))
h1e, x1e, r1e = layer.stage1(h_in, torch.arange(7))
assert torch.allclose(h1, h1e) and torch.allclose(x1, x1e) and torch.equal(r1.ids, r1e.ids)
d = LocalDispatcher(c.num_experts)
y = d.combine(d.reduce(layer.stage3(*d.expand(d.dispatch(x1, r1), r1)), r1), r1)
h5 = torch.compile(layer.stage5, fullgraph=True, backend="aot_eager")(h1, y)
assert torch.allclose(h5, layer.stage5(h1, y))
torch._dynamo.reset()  # drop the compiled graphs (and their teardown warnings at exit)

# %% [markdown]
# Parameter counts, against the formula from the config: per layer 2·H·(n_q + n_kv)·d attention weights,
# E·H for the router, 3·H·I per expert; the dense layer has 3·H·I_dense; plus embedding, head and norms.

# %%
H, d, L, E, k = c.hidden_size, c.head_dim, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok
I = c.moe_intermediate_size
attn_p = 2 * H * (c.num_attention_heads + c.num_key_value_heads) * d
norms = L * (2 * H + 2 * d) + H
total = 2 * c.vocab_size * H + norms + L * attn_p + 2 * (E * H + E * 3 * H * I) + 3 * H * c.intermediate_size
active = c.vocab_size * H + L * attn_p + 2 * (E * H + k * 3 * H * I) + 3 * H * c.intermediate_size
assert model.num_params() == total and model.active_matmul_params() == active
print(f"{total:,} parameters, {active:,} active matmul parameters per token")

# %% [markdown]
# On CUDA in bf16 the experts run through `F.grouped_mm`, and the permutations, SwiGLU and the weighted sum through
# Triton kernels. bf16 keeps 8 bits of mantissa, and a few tokens' top-k flips, so at a moderate size logits and
# gradients differ from float32 by a few percent whichever way bf16 is computed. The check: the five-stage bf16
# path is as close to the float32 reference as the plain sequential forward run in bf16 (measured on the H200:
# logits 2.9e-2 vs 2.8e-2, worst gradient, the first router's, 9.1e-2 vs 9.1e-2).

# %%
#| cuda
torch.manual_seed(0)
cg = Config(vocab_size=1024, hidden_size=512, moe_intermediate_size=256, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4)
ref_model = Qwen3MoeForCausalLM(cg).cuda()
bf_model = Qwen3MoeForCausalLM(cg).cuda().bfloat16()
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
Model = Qwen3MoeForCausalLM   # the model class, under the name every family gives it


def tiny_config(layers: int = 5, experts: int = 4, top_k: int = 2, dense: int = 2) -> Config:
    "The tiny model of the checks (engine/39 `tiny_model`): `experts` routed experts top-`top_k`, layer `dense` dense."
    return Config(vocab_size=64, hidden_size=32, moe_intermediate_size=16, intermediate_size=48,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  num_experts=experts, num_experts_per_tok=top_k, mlp_only_layers=[dense])

# %% [markdown]
# **config.json.** Plain RoPE only, and a sliding window only when `use_sliding_window` is set (then `sliding_window`
# and `max_window_layers` matter, and we refuse it); transformers 5.x renamed `num_experts` to `num_local_experts`.
# The published checkpoints store each routed expert on its own.

# %%
#| export
HF_MODEL_TYPES = ("qwen3_moe",)       # the config.json model_types this family reads
HF_EXPERTS_ONE_BY_ONE = True          # save_hf writes each routed expert on its own, as the hub's checkpoints do
HF_READ_EXPERTS_ONE_BY_ONE = True     # load_hf reads them one by one too (and stacked, as transformers 5.x saves)
HF_RENAME = {}                        # stored name prefix -> ours
HF_READ_PAST = {}                     # stored name prefix -> what load_hf reads past


def from_hf(hf: dict) -> tuple[dict, dict, dict, set]:
    """config.json `hf` -> (the keys to read, the fields computed from them, the keys that must hold one value, the
    keys read past), by train/46's rules; a ValueError for what this family does not model."""
    theta, kind, rest = hf_rope(hf)
    if kind != "default" or rest:
        raise ValueError(f"config.json: RoPE of type {kind!r} with {rest}: pith_lit's qwen3_moe has plain RoPE only")
    computed = {"rope_theta": theta, "num_experts": hf.get("num_experts", hf.get("num_local_experts")),
                "mlp_only_layers": hf_or(hf, "mlp_only_layers", [])}
    fixed = {"hidden_act": "silu", "attention_dropout": 0.0, "use_sliding_window": False}
    read = {"rope_theta", "rope_scaling", "rope_parameters", "num_local_experts", "sliding_window", "max_window_layers"}
    return hf, computed, fixed, read


def to_hf(c: Config) -> dict:
    "The config.json keys of `c` in the hub's spelling (without `architectures` and `torch_dtype`)."
    return asdict(c) | {"rope_scaling": None, "hidden_act": "silu", "attention_dropout": 0.0,
                        "use_sliding_window": False}

# %% [markdown]
# **The planner.** Stage 1 keeps, per token: the input norm and its output, q and k through their per-head norms,
# v, the attention's output and log-sum-exp, the post-attention norm; then a dense layer's MLP, or the residual and
# the router (with `norm_topk_prob`, the renormalised top-k and their sum in float32).

# %%
#| export
def kept_by_part(c: Config, i: int, b: int, f: int, compiled: bool) -> dict:
    "Bytes per token layer `i` keeps for backward in stage 1, by part (the planner adds stage 3 and the output)."
    H, hq, hkv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q, kv = hq * d, hkv * d
    s1 = {"input norm": norm_bytes(H, b, f, compiled) + b * H,
          "q": norm_bytes(q, b, f, compiled, groups=hq, keep_input=b * q) + b * q,
          "k, v": norm_bytes(kv, b, f, compiled, groups=hkv, keep_input=b * kv) + 2 * b * kv,
          "attention": b * q + 4 * hq,
          "post norm": norm_bytes(H, b, f, compiled) + b * H}
    if not c.is_moe_layer(i):
        return s1 | {"mlp": mlp_bytes(c.intermediate_size, b, compiled)}
    k = c.num_experts_per_tok
    return s1 | {"residual": b * H,
                 "router": router_bytes(c.num_experts, k, b, f, f * k + f if c.norm_topk_prob else 0)}


def kernel_attention_shape(c: Config, document_mask: bool, cp: int) -> tuple[int, int, int] | None:
    "(heads, q/k width, v width) where ops/14's kernels attend (documents, ring steps); None where SDPA does."
    return (c.num_attention_heads, c.head_dim, c.head_dim) if document_mask or cp > 1 else None


def expert_width(c: Config) -> int:
    "The FFN width of one routed expert."
    return c.moe_intermediate_size


def router_one_hot(c: Config) -> int:
    "Values per routed pair that stage 3 keeps for the router besides the rows: none."
    return 0


FP32_NORM_GAIN = False   # the RMSNorms multiply their gain in the compute dtype

# %%
c5 = tiny_config(layers=4, dense=1)
assert [c5.is_moe_layer(i) for i in range(4)] == [True, False, True, True] and Model is Qwen3MoeForCausalLM
hf = to_hf(c5)
assert hf["rope_scaling"] is None and hf["num_experts"] == 4 and from_hf(hf)[1]["num_experts"] == 4
try:
    from_hf(hf | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    raise AssertionError("linear RoPE accepted")
except ValueError as e:
    assert "RoPE of type 'linear'" in str(e)
parts = kept_by_part(c5, 1, 2, 4, False)
assert "mlp" in parts and "router" not in parts and "router" in kept_by_part(c5, 0, 2, 4, False)
