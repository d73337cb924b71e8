# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # GPT-OSS
#
# GPT-OSS (gpt-oss-20b and gpt-oss-120b) is a decoder-only mixture-of-experts transformer. Next to Qwen3-MoE it
# differs in five places, and each gets its own section below.

# %% [markdown]
# - **attention sinks**: every query head has one learned logit that joins the softmax denominator but brings
#   no value, so a head can attend to "nothing";
# - **sliding windows**: the layers marked `sliding_attention` (every other one) see only the last
#   `sliding_window` tokens (128 in the released models);
# - **YaRN RoPE**: rotary embeddings stretched to a 32× longer context, with a matching attention temperature;
# - **biases** on the attention projections, the router and the experts;
# - **a clamped SwiGLU** on interleaved gate/up columns, and a router that takes the top-k *logits* first and
#   softmaxes over only those k.
#
# The notebook is self-contained: it defines every piece it uses, then cuts each decoder layer into the five
# stages of the layer protocol (models/protocol). Parameter names, shapes and layouts are those of Hugging Face
# transformers 5.x `GptOssForCausalLM`, so its state_dict loads into this model as it is. The checks compare the
# five-stage forward with a plain sequential one; tests/test_gpt_oss.py also compares against transformers itself.

# %%
#| default_exp models.gpt_oss

# %%
#| export
import math
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pith_lit.models.protocol import (CausalLM, Options, Routing, RoutedLayer, cfg, compute_dtype, cos_sin, hf_or,
                                      hf_rope, init_shared, local, norm_bytes, project, projection, route_ids,
                                      router_bytes)
from pith_lit.ops.attention import attention_mask, causal_attention, documents
from pith_lit.ops.ring_attention import kv_payload, ring_attention, split_kv
from pith_lit.ops.experts import Fp8Weights, expert_linear
from pith_lit.ops.swiglu import clamped_swiglu

# %%
import os

# %% [markdown]
# ## Config
#
# Field names are those of transformers 5.x `GptOssConfig`. Two of them differ from older checkpoints'
# `config.json`: transformers 5 folds `rope_theta` and `rope_scaling` into one `rope_parameters` dict, and calls the
# expert count `num_local_experts`. The property `routed_experts` gives that count under the name every model
# family's Config shares, which the engine and trainer read. The defaults are tiny, so the checks run in seconds,
# but keep GPT-OSS's RoPE, norm epsilon, SwiGLU constants and alternating layer types.

# %%
#| export
LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_KEYS = ("rope_type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate",
             "original_max_position_embeddings")


@dataclass
class Config:
    "GPT-OSS hyper-parameters. Field names are those of Hugging Face's `GptOssConfig` (transformers 5.x)."
    model_type: str = cfg("gpt_oss", "model family; selects the model module")
    vocab_size: int = cfg(4096, "vocabulary size (the default tokenizer, stdlib-bpe-4096, needs at least 4096; the byte "
                                 "tokenizer 259)", gt=0)
    hidden_size: int = cfg(128, "model width", gt=0)
    intermediate_size: int = cfg(128, "FFN width of one routed expert", gt=0)
    num_hidden_layers: int = cfg(4, "number of decoder layers", gt=0)
    num_attention_heads: int = cfg(4, "query heads", gt=0)
    num_key_value_heads: int = cfg(2, "key/value heads (grouped-query attention); divides num_attention_heads", gt=0)
    head_dim: int = cfg(32, "width of one attention head", gt=0)
    num_local_experts: int = cfg(8, "routed experts per layer (every layer is MoE)", gt=0)
    num_experts_per_tok: int = cfg(2, "experts chosen per token (top-k)", gt=0)
    sliding_window: int = cfg(16, "keys a sliding-attention layer sees: the query's own and the window - 1 before it",
                                  gt=0)
    layer_types: list = cfg([], "per layer 'sliding_attention' or 'full_attention'; [] = alternate, sliding first")
    rope_parameters: dict = cfg(
        {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 4096},
        "YaRN RoPE: base rope_theta, context stretched `factor` times beyond original_max_position_embeddings")
    max_position_embeddings: int = cfg(131072, "longest sequence meant (factor × original length); RoPE has no table",
                                               gt=0)
    rms_norm_eps: float = cfg(1e-5, "epsilon of every RMSNorm", gt=0)
    attention_bias: bool = cfg(True, "bias on the q/k/v/o projections")
    swiglu_limit: float = cfg(7.0, "experts' SwiGLU clamps the gate above and the up projection on both sides here",
                                   gt=0)
    swiglu_alpha: float = cfg(1.702, "sigmoid gain of the experts' SwiGLU: gate · sigmoid(alpha · gate)", gt=0)
    router_aux_loss_coef: float = cfg(0.001, "Hugging Face's load-balance weight, kept for conversion; "
                                             "the trainer's weight is train.lb_coef", ge=0)
    tie_word_embeddings: bool = cfg(False, "share the embedding and output head weights")
    initializer_range: float = cfg(0.02, "standard deviation of the N(0, σ) initialisation", gt=0)

    def __post_init__(self):
        if not self.layer_types:  # Hugging Face's default: sliding, full, sliding, full, ...
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}; change one of them")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of channels)")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                             f"num_local_experts={self.num_local_experts}")
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types={self.layer_types} must hold one of {LAYER_TYPES} for each of the "
                             f"num_hidden_layers={self.num_hidden_layers} layers; or [] to alternate them")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (a query always sees itself)")
        rp = self.rope_parameters
        if sorted(rp) != sorted(ROPE_KEYS):
            raise ValueError(f"rope_parameters has keys {sorted(rp)}; it needs exactly {sorted(ROPE_KEYS)}")
        if rp["rope_type"] != "yarn" or rp["factor"] < 1:
            raise ValueError(f"rope_parameters: rope_type={rp['rope_type']!r}, factor={rp['factor']}: GPT-OSS uses "
                             f"rope_type 'yarn' with factor >= 1 (factor 1 is plain RoPE)")

    @property
    def routed_experts(self) -> int:
        "Routed experts per MoE layer, under the name every model family's Config shares (the engine reads it)."
        return self.num_local_experts

# %% [markdown]
# `layer_types` left empty alternates, sliding first, as transformers does; anything else must name every layer.

# %%
assert Config().layer_types == ["sliding_attention", "full_attention"] * 2
assert Config(num_hidden_layers=3).layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
assert Config().routed_experts == 8

# %% [markdown]
# ## RMSNorm
#
# `weight · x / sqrt(mean(x²) + ε)`, normalised in float32 (float64 for a float64 model). GPT-OSS multiplies by
# the weight *before* casting back to the input's dtype (Qwen3 casts first); in bf16 that rounds once instead of
# twice, and it is what transformers does.

# %%
#| export
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(compute_dtype(x.dtype))
        return (self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)

# %%
torch.manual_seed(0)
norm = RMSNorm(6, 1e-5)
with torch.no_grad(): norm.weight.uniform_()
xn = torch.randn(3, 6)
ref = norm.weight.double() * xn.double() / (xn.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
assert torch.allclose(norm(xn).double(), ref, rtol=1e-6, atol=0)
out_bf16 = norm.bfloat16()(xn.bfloat16())
assert out_bf16.dtype == torch.bfloat16 and torch.allclose(out_bf16.double(), ref, rtol=1e-2, atol=0)

# %% [markdown]
# ## YaRN rotary embedding
#
# Plain RoPE rotates channel pair i of a head (channels i and i + d/2) by `position · θ^(-2i/d)`. A model trained
# on sequences of length L (here `original_max_position_embeddings` = 4096) has seen every pair turn through the
# angles that L positions give. YaRN stretches the context `factor` times by changing the pairs' frequencies
# unevenly:
#
# - a pair that turns many times over L (more than `beta_fast` = 32 turns) keeps its frequency: its angles at
#   longer distances look like ones it has seen;
# - a pair that turns less than once over L (`beta_slow` = 1) is divided by `factor`, so positions up to
#   factor · L map into the angles it was trained on (interpolation);
# - the pairs in between blend the two linearly in the pair index.
#
# The pair index where a pair makes r turns over L is `d · ln(L / (2π r)) / (2 ln θ)`; with `truncate` the two
# bounds are rounded outwards to whole pairs. Stretching flattens the attention logits, which YaRN corrects by
# scaling cos and sin, and so both q and k, by `1 + 0.1 · ln(factor)`. That is transformers'
# `_compute_yarn_parameters` for the keys GPT-OSS uses (no `mscale`), rewritten here.
#
# The frequencies cost d/2 numbers, so they are computed on every call, in float32 (float64 for a float64 model),
# from the config's constants: no buffer to keep in sync with the model's dtype or device, and nothing for
# `torch.compile` to guard on. Positions are an explicit argument, (S,) or (B, S), because context parallelism gives
# each rank pieces of a sequence that are not contiguous.

# %%
#| export
def yarn_inv_freq(head_dim: int, rope: dict, dtype: torch.dtype, device=None) -> tuple[Tensor, float]:
    "YaRN's inverse frequency of each of the head_dim/2 channel pairs, in `dtype`, and its attention factor."
    base, factor, L = rope["rope_theta"], rope["factor"], rope["original_max_position_embeddings"]
    pair_at = lambda turns: head_dim * math.log(L / (2 * math.pi * turns)) / (2 * math.log(base))
    low, high = pair_at(rope["beta_fast"]), pair_at(rope["beta_slow"])
    if rope["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    i = torch.arange(head_dim // 2, device=device, dtype=dtype)
    inv_freq = 1.0 / base ** (2 * i / head_dim)
    ramp = ((i - low) / (high - low)).clamp(0, 1)  # 0: keep the frequency, 1: divide it by factor
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp, (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)


def rope_cos_sin(positions: Tensor, head_dim: int, rope: dict, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    "cos and sin of the rotation angles times YaRN's attention factor, shape `positions.shape + (head_dim/2,)`."
    ct = compute_dtype(dtype)
    inv_freq, scale = yarn_inv_freq(head_dim, rope, ct, positions.device)
    cos, sin = cos_sin(positions, inv_freq, scale)   # models/20: once per call, not per head
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    "Rotate pairs (i, i + d/2) of `x` (B, heads, S, d) by angles for (S,) or (B, S) positions."
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

# %% [markdown]
# Checks against the definition: with GPT-OSS's numbers and d = 32, pairs below index 4.05 keep θ^(-2i/d), pairs
# above 8.70 are divided by 32, and one in between is the stated blend; the attention factor is 1 + 0.1 ln 32.
# `factor = 1` is plain RoPE. The rotated dot product depends only on the distance between the two positions.

# %%
rope = Config().rope_parameters
inv, att = yarn_inv_freq(32, rope, torch.float64)
plain = 150_000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)
low = 32 * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(150_000))
high = 32 * math.log(4096 / (2 * math.pi)) / (2 * math.log(150_000))
assert 4 < low < 5 and 8 < high < 9, (low, high)
assert torch.allclose(inv[:5], plain[:5], rtol=1e-15) and torch.allclose(inv[9:], plain[9:] / 32, rtol=1e-15)
t = (6 - low) / (high - low)
assert math.isclose(inv[6].item(), (1 - t) * plain[6].item() + t * plain[6].item() / 32, rel_tol=1e-14)
assert math.isclose(att, 1 + 0.1 * math.log(32), rel_tol=1e-15)
inv1, att1 = yarn_inv_freq(32, {**rope, "factor": 1.0}, torch.float64)
assert torch.allclose(inv1, plain, rtol=1e-15) and att1 == 1.0

q1, k1 = torch.randn(2, 1, 1, 32, dtype=torch.float64)
def rotated_dot(pq, pk):
    cq, sq = rope_cos_sin(torch.tensor([pq]), 32, rope, torch.float64)
    ck, sk = rope_cos_sin(torch.tensor([pk]), 32, rope, torch.float64)
    return (apply_rope(q1, cq, sq) * apply_rope(k1, ck, sk)).sum()
assert torch.allclose(rotated_dot(7, 3), rotated_dot(1007, 1003))  # same distance, same product
assert not torch.allclose(rotated_dot(7, 3), rotated_dot(7, 4))
assert torch.allclose(rotated_dot(5, 5), att**2 * (q1 * k1).sum())  # distance 0: only the attention factor
xr = torch.randn(2, 3, 5, 32)
cs1 = rope_cos_sin(torch.arange(5), 32, rope, xr.dtype)
cs2 = rope_cos_sin(torch.arange(5).expand(2, 5), 32, rope, xr.dtype)
assert torch.equal(apply_rope(xr, *cs1), apply_rope(xr, *cs2))

# %% [markdown]
# ## Attention with sinks: our kernel on the GPU, SDPA on the CPU
#
# Head h's attention of query i is `softmax([s_i1, …, s_iS, sink_h])` without its last entry: the sink is one more
# logit in the denominator that brings no value, so the weights over the real keys sum to less than 1. The keys
# allowed are the causal ones, and on a sliding layer only those with `i - j < sliding_window`.
#
# Built with a context-parallel group (`Options.cp_group`, ops/17), each rank holds zigzag chunks of the sequence
# and attends through the ring: a sliding layer skips every chunk that lies wholly outside the window, and the sink
# rescales each row once, after the ring has merged all keys (`o · σ(lse − sink)`).
#
# `F.scaled_dot_product_attention` (SDPA) has no sink input, and computing the scores explicitly costs S² memory
# per head. But a sink is exactly an extra key whose score is `sink_h` for every query of head h and whose value
# is zero. Give every head one extra channel: query h carries `sink_h / scale` there, the sink key carries 1 and
# every real key 0. Then the sink key's scaled score is `sink_h`, the real keys' scores are unchanged, and the
# sink's gradient flows back through the query channel, all inside one SDPA call. The extra channel is padded to
# 8 so the head dim stays a multiple of 8 for the fused GPU kernels, and `scale` is passed explicitly (SDPA would
# otherwise take it from the padded width).
#
# The fused kernels also want as many key/value heads as query heads, so k and v are repeated for their query
# heads in the same copy that pads them (`enable_gqa` would save that memory but leaves only the slow math kernel
# when cuDNN's is unavailable).
#
# The cost: q, k and v are copied once, k and v at the query head count and q and k with 8 more channels (d = 64 →
# 72: 12% more QK flops); every query has one more key; and the mask must be given explicitly (S × (S+1) booleans,
# shared by batch and heads), so SDPA cannot use FlashAttention, which skips the blocks above the diagonal, and a
# sliding layer computes all its S² scores and masks most of them. Measured on the H200 (2026-11-29, torch 2.11,
# bf16, GPT-OSS-20B heads: 64 query and 8 key/value heads of 64, batch 2 × 4096 tokens): SDPA picks cuDNN's masked
# kernel, 6.3 ms forward and 17.6 ms forward + backward, window or not; plain causal FlashAttention without sinks
# takes 0.64 and 2.5 ms, the explicit-score reference 29 and 63 ms, and SDPA's memory-efficient kernel 9.3 and 32 ms.
# So sinks by SDPA cost 7 to 10× FlashAttention without sinks, but 3.6 to 4.6× less than explicit scores, and no S²
# memory per head.
#
# On CUDA the layers therefore call ops/14's `causal_attention` instead: a flash-attention kernel with the sinks in
# its softmax and a window that skips whole key blocks, as one custom operator that `torch.compile` keeps whole. At
# the shape above it takes 5.1 ms forward + backward on a full layer and 1.0 ms on a sliding one
# (benchmarks/RESULTS.md, "GPT-OSS's sinks against the masked SDPA path"), against 17.6 ms for either by SDPA. On the
# CPU the SDPA form stays (the Triton kernels run there only under the interpreter, for tests); the two are checked
# against each other in ops/14.

# %%
#| export
SINK_PAD = 8  # channels added to q and k: one carries the sink, the rest keep the head dim a multiple of 8


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, window: int | None, docs=None) -> Tensor:
    """Causal attention with one sink logit per query head, by one SDPA call over an extra key.

    q (B, n_q, S, d), k and v (B, n_kv, S, d) with n_kv dividing n_q, sinks (n_q,), docs (B, S) document ids or
    None -> (B, n_q, S, d)."""
    (B, nq, S, d), rep, scale = q.shape, q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    sink_q = (sinks.to(q.dtype) / scale).view(1, nq, 1, 1).expand(B, nq, S, 1)
    q = torch.cat((q, sink_q, q.new_zeros(B, nq, S, SINK_PAD - 1)), -1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # the fused kernels want equal head counts
    sink_k = F.pad(k.new_ones(B, nq, 1, 1), (d, SINK_PAD - 1))   # 1 in channel d, 0 elsewhere
    k = torch.cat((sink_k, F.pad(k, (0, SINK_PAD))), 2)           # the sink is key 0, real keys have 0 in its channel
    v = torch.cat((v.new_zeros(B, nq, 1, d), v), 2)
    keep = attention_mask(S, S, window=window, q_doc=docs, k_doc=docs, device=q.device)   # ops/14's rules
    mask = torch.cat((keep.new_ones(keep.shape[:-1] + (1,)), keep), -1)                  # and the sink key
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

# %% [markdown]
# The definition written out, which `reference_forward` uses: explicit scores, the window as a band of a
# triangular matrix, the sink logit appended as a last column and dropped after the softmax.

# %%
#| export
def sink_attention_reference(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, window: int | None) -> Tensor:
    "The same as `sink_attention`, with explicit (B, n_q, S, S) scores: for tests."
    (B, nq, S, d), rep = q.shape, q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    keep = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        keep = keep.triu(1 - window)
    scores = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~keep, float("-inf"))
    logits = torch.cat((scores, sinks.to(q.dtype).view(1, nq, 1, 1).expand(B, nq, S, 1)), -1)
    return logits.softmax(-1)[..., :-1] @ v

# %% [markdown]
# Three checks in float64, with grouped queries and a window shorter than the sequence. The SDPA form equals the
# explicit one, outputs and gradients (the sinks' included). A third formula: a sink only rescales plain attention,
# `out = out_plain · σ(lse - sink)` with `lse` the log-sum-exp of the allowed scores, since the weights over real
# keys sum to `e^lse / (e^lse + e^sink)`. And a very negative sink gives plain windowed attention.

# %%
torch.manual_seed(0)
B, nq, nkv, S, d, W = 2, 4, 2, 11, 8, 4
q, k, v = (torch.randn(B, n, S, d, dtype=torch.float64, requires_grad=True) for n in (nq, nkv, nkv))
sinks = torch.randn(nq, dtype=torch.float64, requires_grad=True)
for window in (W, None):
    out, ref = sink_attention(q, k, v, sinks, window), sink_attention_reference(q, k, v, sinks, window)
    assert torch.allclose(out, ref, rtol=0, atol=1e-14), (out - ref).abs().max()
    g = torch.autograd.grad(out.sin().sum(), (q, k, v, sinks))
    g_ref = torch.autograd.grad(ref.sin().sum(), (q, k, v, sinks))
    for a, b in zip(g, g_ref): assert torch.allclose(a, b, rtol=0, atol=1e-13), (a - b).abs().max()

with torch.no_grad():
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    keep = attention_mask(S, S, window=W)[0, 0]
    scores = (q @ kr.transpose(-1, -2) / math.sqrt(d)).masked_fill(~keep, float("-inf"))
    plain_out = scores.softmax(-1) @ vr
    lse = scores.logsumexp(-1, keepdim=True)
    rescaled = plain_out * torch.sigmoid(lse - sinks.view(1, nq, 1, 1))
    assert torch.allclose(sink_attention(q, k, v, sinks, W), rescaled, rtol=0, atol=1e-14)
    no_sink = sink_attention(q, k, v, torch.full_like(sinks, -1e4), W)
    assert torch.allclose(no_sink, plain_out, rtol=0, atol=1e-14)
assert keep.sum(1).tolist() == [1, 2, 3] + [W] * (S - 3)  # each query sees itself and at most W - 1 before it

# %% [markdown]
# The kernel the GPU runs, `causal_attention` (ops/14), gives the SDPA form's outputs and gradients. Its Triton
# kernels run on the CPU only under the interpreter (`TRITON_INTERPRET=1`, which the tests set), in float32.

# %%
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    dev, tol = ("cuda", 1e-3) if torch.cuda.is_available() else ("cpu", 1e-5)   # fp32 on the GPU: tf32x3 products
    q32, k32, v32, s32 = (t.detach().float().to(dev).requires_grad_() for t in (q, k, v, sinks))
    for window in (W, None):
        out = causal_attention(q32, k32, v32, s32, window)
        ref = sink_attention(q, k, v, sinks, window)
        assert torch.allclose(out.double().cpu(), ref, rtol=0, atol=tol), (out.cpu() - ref).abs().max()
        g = torch.autograd.grad(out.sin().sum(), (q32, k32, v32, s32))
        g_ref = torch.autograd.grad(ref.sin().sum(), (q, k, v, sinks))
        for a, b in zip(g, g_ref): assert torch.allclose(a.double().cpu(), b, rtol=0, atol=tol), (a.cpu() - b).abs().max()

# %% [markdown]
# ## The projections and the experts
#
# Every matrix a token's activations pass through in bulk is made in one place: `projection` (models/20, the
# constructor of every family's dense projections) builds the attention projections, `Experts` holds the routed
# experts' stacked weights, and its `forward` is their only use. The router and the output head stay in the model's
# dtype.
#
# transformers stores GPT-OSS's experts as `(E, in, out)`, the transpose of Qwen3's: `gate_up_proj` (E, H, 2I) with
# the gate in the even columns and the up projection in the odd ones (interleaved), `down_proj` (E, I, H), and biases
# `gate_up_proj_bias` (E, 2I) and `down_proj_bias` (E, H). They are kept in that layout, so checkpoints load
# unchanged, and `grouped_linear`, which wants `(E, out, in)`, gets the transposed *view* `.mT`, not a copy (its
# forward hands `F.grouped_mm` the transpose back, which is the stored tensor; built with `fp8` (`Options.fp8`,
# `train.fp8`), the module holds an `Fp8Weights` and `expert_linear` (ops/experts) quantizes the stored tensor as it
# is). The rows arrive grouped by expert,
# `counts[e]` rows for expert e. Each row's bias is added as `one_hot @ bias`, with `one_hot` (N, E) marking the
# row's expert (built by `repeat_interleave` with the known output size, so no host synchronisation): the forward
# picks each bias exactly, and autograd's backward, `one_hotᵀ @ dy`, sums each expert's rows in a matmul, which
# accumulates in float32. Indexing `bias[expert]` gives the same forward, but its backward adds thousands of bf16
# rows per expert in bf16: on the H200 check at the end that made the bias gradients about 5 to 8 times less accurate
# than the plain bf16 path's. `clamped_swiglu` (ops/swiglu) is `(up + 1) · gate · σ(α · gate)` with the gate clamped
# above and the up projection on both sides at `swiglu_limit`, a Triton kernel on CUDA, checked against PyTorch in
# its own notebook.

# %%
#| export
class Experts(nn.Module):
    "E clamped-SwiGLU experts with biases, stacked (E, in, out) as in transformers; rows grouped by expert."
    MUON_PARTS = {"gate_up_proj": (-1, True)}   # two matrices, gate's and up's columns interleaved (train/43)

    def __init__(self, c: Config, fp8: str | None = None):
        super().__init__()
        E, H, I = c.num_local_experts, c.hidden_size, c.intermediate_size
        self.limit, self.alpha = c.swiglu_limit, c.swiglu_alpha
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))
        self.fp8_copies = Fp8Weights(fp8) if fp8 else None   # with an FP8 scaling: the step's FP8 weight copies

    def forward(self, x: Tensor, counts: Tensor, wgrad_queue=None) -> Tensor:
        """x (N, H) grouped by expert, counts (E,) -> (N, H). `wgrad_queue` defers the expert weight gradients
        (not the biases') to the pipeline schedule's W slots; it reaches the parameters through the `.mT` views."""
        experts = torch.arange(counts.numel(), device=x.device)
        one_hot = (torch.repeat_interleave(experts, counts, output_size=x.shape[0])[:, None] == experts).to(x.dtype)
        gate_up = (expert_linear(x, local(self.gate_up_proj).mT, counts, wgrad_queue, self.fp8_copies, "gate_up")
                   + one_hot @ local(self.gate_up_proj_bias))
        act = clamped_swiglu(gate_up, self.limit, self.alpha)
        return (expert_linear(act, local(self.down_proj).mT, counts, wgrad_queue, self.fp8_copies, "down")
                + one_hot @ local(self.down_proj_bias))

# %% [markdown]
# Check: grouped rows through `Experts` equal each expert's formula written out (`x @ W + b`, the activation on
# even/odd columns), including an expert that gets no rows.

# %%
ce = Config(hidden_size=16, intermediate_size=8, num_local_experts=3)
ex = Experts(ce).double()
for p in ex.parameters(): nn.init.normal_(p, std=0.5)
counts = torch.tensor([4, 0, 3])
xe = torch.randn(7, 16, dtype=torch.float64)
ref = []
for e, rows in zip(range(3), xe.split(counts.tolist())):
    gu = rows @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
    gate, up = gu[:, 0::2].clamp(max=7.0), gu[:, 1::2].clamp(-7.0, 7.0)
    ref.append(((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ ex.down_proj[e] + ex.down_proj_bias[e])
with torch.no_grad():
    assert torch.allclose(ex(xe, counts), torch.cat(ref), rtol=0, atol=1e-12)

# %% [markdown]
# ## Attention module, router
#
# The attention projections have biases (`attention_bias`, true for GPT-OSS), there is no norm on queries or keys,
# and each head's sink is `self_attn.sinks[h]`. Which layers slide is `layer_types`. `qkv` is shared by the SDPA
# forward and the reference.
#
# The router is a linear map with bias to E logits. It takes the top-k *logits* and softmaxes over those k only,
# so the k weights always sum to 1; the full softmax over all E logits (float32) goes into `Routing.probs` for the
# load-balance loss. Its parameters are `mlp.router.weight` (E, H) and `mlp.router.bias` (E,), as in transformers.

# %%
#| export
class Attention(nn.Module):
    def __init__(self, c: Config, layer_idx: int, cp_group=None):
        super().__init__()
        self.head_dim, self.rope_parameters = c.head_dim, c.rope_parameters
        self.sliding_window = c.sliding_window if c.layer_types[layer_idx] == "sliding_attention" else None
        self.q_proj = projection(c.hidden_size, c.num_attention_heads * c.head_dim, c.attention_bias)
        self.k_proj = projection(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.v_proj = projection(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.o_proj = projection(c.num_attention_heads * c.head_dim, c.hidden_size, c.attention_bias)
        self.sinks = nn.Parameter(torch.empty(c.num_attention_heads))
        self.ring = cp_group   # context parallelism: the ring's process group, or None (ops/17)

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        "x (B, S, H) -> rotated q (B, n_q, S, d), rotated k and v (B, n_kv, S, d)."
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, -1, self.head_dim).transpose(1, 2)
                   for t in project(x, self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_parameters, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        "x (B, S, H), positions (S,) or (B, S) -> (B, S, H)."
        q, k, v = self.qkv(x, positions)
        docs = documents(positions)   # packed documents: positions restart at each one (ops/14)
        if self.ring is not None:  # the ring skips the chunks outside the window; the sinks enter once (ops/17)
            o = ring_attention(q, kv_payload(k, v), self.ring, positions, partial(split_kv, dk=self.head_dim),
                               sinks=self.sinks, window=self.sliding_window)
        elif q.is_cuda:   # ops/14's kernel: sinks in the softmax, whole blocks outside the window skipped
            o = causal_attention(q, k, v, self.sinks, self.sliding_window, docs=docs)
        else:
            o = sink_attention(q, k, v, self.sinks, self.sliding_window, docs)
        return self.o_proj(o.transpose(1, 2).flatten(2))


class Router(nn.Module):
    def __init__(self, c: Config, route: str = "learned"):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(c.num_local_experts, c.hidden_size))
        self.bias = nn.Parameter(torch.empty(c.num_local_experts))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.num_local_experts))
        self.route = route   # 'learned' or 'round_robin' (Options.route)

    def forward(self, x: Tensor) -> Routing:
        "x (T, H) -> Routing: softmax over the top-k logits (x's dtype), softmax over all logits (float32 or 64)."
        logits = F.linear(x, self.weight, self.bias).to(compute_dtype(x.dtype))
        ids = route_ids(logits + self.e_score_correction_bias, self.top_k, self.route)
        return Routing(ids, logits.gather(-1, ids).softmax(-1).to(x.dtype), logits.softmax(-1))


class MLP(nn.Module):
    "Holds the router and the routed experts under transformers' names (`mlp.router`, `mlp.experts`)."
    def __init__(self, c: Config, options: Options):
        super().__init__()
        self.router = Router(c, options.route)
        self.experts = Experts(c, options.fp8)

# %%
cr = Config(hidden_size=16, num_local_experts=6, num_experts_per_tok=3)
router = Router(cr)
nn.init.normal_(router.weight); nn.init.normal_(router.bias)
xr = torch.randn(10, 16)
r = router(xr)
logits = xr @ router.weight.T + router.bias
assert r.ids.shape == r.weights.shape == (10, 3) and r.probs.shape == (10, 6) and r.probs.dtype == torch.float32
assert torch.equal(r.ids, logits.sort(-1, descending=True).indices[:, :3])
assert torch.allclose(r.weights, logits.gather(1, r.ids).softmax(-1)) and torch.allclose(r.probs, logits.softmax(-1))

# %% [markdown]
# With a selection bias (`e_score_correction_bias`, train/42), the experts are the top-k of logits plus bias, and
# the weights the softmax of their unbiased logits. This bias is not the router's own `bias`, a trained
# parameter inside the logits that shifts the weights too: it only moves the choice. Round-robin (`Options.route`,
# `train.route`) assigns token t the experts t·k … t·k+k−1 mod E.

# %%
with torch.no_grad():
    router.e_score_correction_bias.copy_(torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 0.2]))
rb = router(xr)
biased = logits + router.e_score_correction_bias
assert torch.equal(rb.ids, biased.sort(-1, descending=True).indices[:, :3]) and not torch.equal(rb.ids, r.ids)
assert torch.allclose(rb.weights, logits.gather(1, rb.ids).softmax(-1)) and torch.allclose(rb.probs, r.probs)
rrouter = Router(cr, route="round_robin")
rrouter.load_state_dict(router.state_dict())
rr = rrouter(xr)
assert rr.ids.flatten().tolist() == [i % 6 for i in range(30)]
assert torch.allclose(rr.weights, logits.gather(1, rr.ids).softmax(-1))

# %% [markdown]
# ## The decoder layer in five stages
#
# Stage 1 is everything before the experts: `h + attention(input_layernorm(h))`, then the post-attention norm and the
# router on the T = B·S flattened tokens. Stage 3 is the experts on grouped rows. Stage 5 adds, for each token, its k
# expert outputs weighted by the router to the residual; stages 3 and 5 are models/20's `RoutedLayer`, which
# `DecoderLayer` subclasses. Stages 1 and 5 have no data-dependent shapes, no host synchronisation and no Python
# branch on tensor values, so `torch.compile(fullgraph=True)` can take them whole; the window is a Python constant per
# layer.

# %%
#| export
class DecoderLayer(RoutedLayer):
    def __init__(self, c: Config, layer_idx: int, options: Options):
        super().__init__()
        self.self_attn = Attention(c, layer_idx, options.cp_group)
        self.mlp = MLP(c, options)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def stage1(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Routing]:
        "h (B, S, H) -> (h after attention, x (B·S, H) for the experts, routing)."
        h = h + self.self_attn(self.input_layernorm(h), positions)
        x = self.post_attention_layernorm(h).flatten(0, 1)
        return h, x, self.mlp.router(x)

# %% [markdown]
# ## The model
#
# The module tree follows transformers' `GptOssForCausalLM` (`model.embed_tokens`, `model.layers.{i}`, `model.norm`,
# `lm_head`), so parameter names match; transformers' RoPE buffers are not persistent, so the two state_dicts hold
# the same keys. `layers` is a `ModuleDict` keyed by the absolute layer index, so a pipeline stage can hold any
# subset of layers under their original names.
#
# Initialisation, as for Qwen3: every matrix N(0, σ) with σ = `initializer_range`; the projections that write into
# the residual stream (attention `o_proj`, the experts' `down_proj`) get σ/√(2L), so the residual's variance does
# not grow with depth; norms start at 1 and every bias (attention, router, experts) at 0. The sinks start
# N(0, σ) as in transformers: near 0, so at first each head gives the sink the weight of one average key.
# `init_weights` is separate from construction so a model built on the meta device can be initialised later.
#
# `reference_forward` is the check for everything the engine does: the same parameters run sequentially with no
# protocol piece, explicit-score attention, and every expert applied to every token, masked by whether the token
# chose it, with the activation written out.
#
# `GptOssForCausalLM` subclasses models/20's `CausalLM`, which holds the head and gives `prolog`, `epilog`,
# `forward` and `num_params`; this notebook writes the inner model, the initialisation, `reference_forward` and
# the FLOP count.
#
# The constructor takes the run's `Options` (models/20) beside the config and hands each field to the module that
# reads it: `cp_group` to every attention, `route` to every router, `fp8` to every experts module.

# %%
#| export
class GptOssForCausalLM(CausalLM):
    def __init__(self, config: Config, options: Options = Options()):
        super().__init__(config, lambda i: DecoderLayer(config, i, options),
                         RMSNorm(config.hidden_size, config.rms_norm_eps), options)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """Norms to 1, biases to 0, matrices N(0, σ) through `SeededInit` (the same values however the model was
        cut into stages and expert shards); `seed` defaults to torch's initial seed (`torch.manual_seed`)."""
        init, std, out_std = init_shared(self, seed, RMSNorm)
        for layer in self.model.layers.values():
            a, router, ex = layer.self_attn, layer.mlp.router, layer.mlp.experts
            for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.sinks, router.weight, ex.gate_up_proj):
                init.normal_(p, std)
            init.normal_(a.o_proj.weight, out_std)
            init.normal_(ex.down_proj, out_std)
            for p in (router.bias, router.e_score_correction_bias, ex.gate_up_proj_bias, ex.down_proj_bias):
                p.zero_()

    def reference_forward(self, input_ids: Tensor) -> Tensor:
        "Plain sequential forward for tests: explicit attention, each expert on all tokens, masked; no protocol."
        c = self.config
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers.values():
            a, router, ex = layer.self_attn, layer.mlp.router, layer.mlp.experts
            o = sink_attention_reference(*a.qkv(layer.input_layernorm(h), positions), a.sinks, a.sliding_window)
            h = h + a.o_proj(o.transpose(1, 2).flatten(2))
            x = layer.post_attention_layernorm(h)
            logits = (x @ router.weight.T + router.bias).to(compute_dtype(x.dtype))
            top, ids = logits.topk(c.num_experts_per_tok, -1)
            top = top.softmax(-1).to(x.dtype)
            out = torch.zeros_like(x)
            for e in range(c.num_local_experts):
                w_e = (top * (ids == e)).sum(-1, keepdim=True)  # 0 for tokens that did not choose expert e
                gate_up = x @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
                gate = gate_up[..., 0::2].clamp(max=c.swiglu_limit)
                up = gate_up[..., 1::2].clamp(-c.swiglu_limit, c.swiglu_limit)
                act = (up + 1) * gate * torch.sigmoid(c.swiglu_alpha * gate)
                out = out + w_e * (act @ ex.down_proj[e] + ex.down_proj_bias[e])
            h = h + out
        return self.lm_head(self.model.norm(h))

    def active_matmul_params(self) -> int:
        "Matmul weights one token touches (for MFU): attention projections, router, k experts, head. No biases."
        k, n = self.config.num_experts_per_tok, self.lm_head.weight.numel()
        for layer in self.model.layers.values():
            a, ex = layer.self_attn, layer.mlp.experts
            n += sum(p.weight.numel() for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
            n += layer.mlp.router.weight.numel() + k * (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel())
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 × active matmul parameters, plus attention's QKᵀ and PV products
        (2·2·heads·head_dim per key seen, ×3 with backward) over the keys a query sees on average: S/2 on a full
        (causal) layer, as for every model, and W - W²/(2S) on a sliding layer when S > W = sliding_window."""
        c, S, W = self.config, seq_len, self.config.sliding_window
        keys = sum(S / 2 if kind == "full_attention" or S <= W else W - W * W / (2 * S) for kind in c.layer_types)
        return 6 * self.active_matmul_params() + 12 * c.num_attention_heads * c.head_dim * keys

# %% [markdown]
# ## Checks
#
# The five-stage forward and `reference_forward` must agree on logits and on every parameter's gradient: tightly
# in float32 and to rounding in float64. The sequence (13 tokens) is longer than the window (5), so the sliding
# layers (0 and 2) really cut keys off. Biases start at zero and the sinks near it, so they are set to random
# values first; otherwise a wrong bias or sink would go unseen.

# %%
def compare(model, ids, atol):
    logits, routings = model(ids)
    ref = model.reference_forward(ids)
    assert torch.allclose(logits, ref, rtol=0, atol=atol), (logits - ref).abs().max()
    g = torch.autograd.grad(logits.square().sum(), list(model.parameters()))
    g_ref = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(g, g_ref))
    return routings, worst, dict(zip([n for n, _ in model.named_parameters()], g))

# %%
torch.manual_seed(0)
c = Config(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5)
model = GptOssForCausalLM(c)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith(("bias", "sinks")):
            p.normal_(0, 0.5)
ids = torch.randint(0, c.vocab_size, (2, 13))
routings, worst, grads = compare(model, ids, atol=1e-5)
assert worst < 1e-4, worst
assert all(r.probs.shape == (26, 4) and r.counts.sum() == 26 * 2 for r in routings)
print(f"float32: logits within 1e-5, worst relative gradient difference {worst:.1e}")
routings, worst, grads = compare(model.double(), ids, atol=1e-12)
assert worst < 1e-12, worst
print(f"float64: logits within 1e-12, worst relative gradient difference {worst:.1e}")

# %% [markdown]
# Every sink learns: each head's sink gets a nonzero gradient in every layer. The window is in effect: the same
# model with the window widened to the whole sequence gives different logits, but only from position 5 on, the
# first query whose window leaves a key out.

# %%
sink_grads = torch.stack([grads[f"model.layers.{i}.self_attn.sinks"] for i in range(4)])
assert (sink_grads.abs() > 1e-8).all(), sink_grads
wide = GptOssForCausalLM(Config(**{**c.__dict__, "sliding_window": 13})).double()
wide.load_state_dict(model.state_dict())
with torch.no_grad():
    narrow_logits, wide_logits = model(ids)[0], wide(ids)[0]
assert torch.allclose(narrow_logits[:, :5], wide_logits[:, :5], rtol=0, atol=1e-12)
assert (narrow_logits[:, 5:] - wide_logits[:, 5:]).abs().amax(-1).min() > 1e-6
print("sink gradients, smallest |g|:", f"{sink_grads.abs().min().item():.1e}")

# %% [markdown]
# Stages 1 and 5 compile as whole graphs. The `aot_eager` backend traces forward and backward the way
# `torch.compile` does but skips code generation, so the check is quick on a CPU. Layer 0 slides, layer 1 does not.

# %%
from pith_lit.models.protocol import LocalDispatcher
model = model.float()
h_in = torch.randn(2, 13, c.hidden_size)
for i in ("0", "1"):
    layer = model.model.layers[i]
    h1, x1, r1 = torch.compile(layer.stage1, fullgraph=True, backend="aot_eager")(h_in, torch.arange(13))
    h1e, x1e, r1e = layer.stage1(h_in, torch.arange(13))
    assert torch.allclose(h1, h1e) and torch.allclose(x1, x1e) and torch.equal(r1.ids, r1e.ids)
    d = LocalDispatcher(c.num_local_experts)
    y = d.combine(d.reduce(layer.stage3(*d.expand(d.dispatch(x1, r1), r1)), r1), r1)
    h5 = torch.compile(layer.stage5, fullgraph=True, backend="aot_eager")(h1, y)
    assert torch.allclose(h5, layer.stage5(h1, y))
torch._dynamo.reset()  # drop the compiled graphs (and their teardown warnings at exit)

# %% [markdown]
# Parameter counts, against the formula from the config: per layer 2·H·(n_q + n_kv)·d attention weights plus
# their (n_q + 2·n_kv)·d + H biases, n_q sinks, E·(H + 1) for the router, and per expert 3·H·I weights plus 2I + H
# biases; plus embedding, head and norms. Active matmul parameters count weights only: attention, router, k experts,
# head.

# %%
H, d, L, I = c.hidden_size, c.head_dim, c.num_hidden_layers, c.intermediate_size
E, k = c.num_local_experts, c.num_experts_per_tok
nq, nkv = c.num_attention_heads, c.num_key_value_heads
attn_w = 2 * H * (nq + nkv) * d
per_layer = attn_w + (nq + 2 * nkv) * d + H + nq + E * (H + 1) + E * (3 * H * I + 2 * I + H) + 2 * H
total = 2 * c.vocab_size * H + H + L * per_layer
active = c.vocab_size * H + L * (attn_w + E * H + k * 3 * H * I)
assert model.num_params() == total and model.active_matmul_params() == active
print(f"{total:,} parameters, {active:,} active matmul parameters per token")

# %% [markdown]
# FLOPs per token for MFU count the attention products only over keys a query may see. The usual causal
# convention, S/2 keys per query, is the causal mask's count with each query's own key at half weight; the same
# count on a sliding layer's mask gives its average. Check against the masks, for sequences shorter and longer than
# the window.

# %%
for S in (3, 5, 13, 64):
    keys = sum((attention_mask(S, S, window=a.sliding_window).sum().item() - min(S, a.sliding_window or S) / 2) / S
               for a in (l.self_attn for l in model.model.layers.values()))
    assert math.isclose(model.flops_per_token(S), 6 * active + 12 * nq * d * keys, rel_tol=1e-12), S

# %% [markdown]
# On CUDA in bf16 the experts run through `F.grouped_mm`, and the attention (ops/14), the permutations, the clamped
# SwiGLU and the weighted sum through Triton kernels. bf16 keeps 8 bits of mantissa and a few tokens' top-k flip,
# so logits and gradients differ from float32 by a few percent whichever way bf16 is computed. The check: the
# five-stage bf16 path is as close to the float32 reference as the plain sequential forward run in bf16 (measured
# on the H200: logits 5.3e-2 vs 5.8e-2, worst gradient 6.9e-2 vs 6.6e-2).

# %%
#| cuda
torch.manual_seed(0)
cg = Config(vocab_size=1024, hidden_size=512, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, num_local_experts=16, num_experts_per_tok=4, sliding_window=128)
ref_model = GptOssForCausalLM(cg).cuda()
bf_model = GptOssForCausalLM(cg).cuda().bfloat16()
bf_model.load_state_dict(ref_model.state_dict())
ids = torch.randint(0, cg.vocab_size, (4, 512), device="cuda")
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
Model = GptOssForCausalLM   # the model class, under the name every family gives it


def tiny_config(layers: int = 5, experts: int = 4, top_k: int = 2, dense: int = 2) -> Config:
    """The tiny model of the checks (engine/39 `tiny_model`): `experts` routed experts top-`top_k`, every layer MoE
    (`dense` is not used), a window of 3: shorter than the context-parallel checks' chunks."""
    return Config(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=experts,
                  num_experts_per_tok=top_k, sliding_window=3)

# %% [markdown]
# **config.json.** YaRN in `rope_parameters` as our config holds it (the hub writes `rope_theta` and `rope_scaling`),
# `swiglu_alpha`, which the published config.json lacks (it was a constant before transformers made it a field),
# and two older keys transformers ignores. Its published checkpoint stores the experts in MXFP4
# (`quantization_config`), which train/46 refuses: dequantize it first, e.g. with transformers'
# `Mxfp4Config(dequantize=True)` and `save_pretrained`. The experts are stacked everywhere.

# %%
#| export
HF_MODEL_TYPES = ("gpt_oss",)         # the config.json model_types this family reads
HF_EXPERTS_ONE_BY_ONE = False         # save_hf writes the routed experts stacked, as GPT-OSS checkpoints hold them
HF_READ_EXPERTS_ONE_BY_ONE = False    # and load_hf reads them stacked only
HF_RENAME = {}                        # stored name prefix -> ours
HF_READ_PAST = {}                     # stored name prefix -> what load_hf reads past


def from_hf(hf: dict) -> tuple[dict, dict, dict, set]:
    """config.json `hf` -> (the keys to read, the fields computed from them, the keys that must hold one value, the
    keys read past), by train/46's rules; a ValueError for what this family does not model."""
    theta, kind, rest = hf_rope(hf)
    computed = {"rope_parameters": {"rope_type": kind, "rope_theta": theta, **rest},
                "swiglu_alpha": hf.get("swiglu_alpha", 1.702), "layer_types": hf_or(hf, "layer_types", [])}
    fixed = {"attention_dropout": 0.0}
    read = {"rope_theta", "rope_scaling", "rope_parameters", "hidden_act", "experts_per_token",
            "initial_context_length"}
    return hf, computed, fixed, read


def to_hf(c: Config) -> dict:
    "The config.json keys of `c` in the hub's spelling (without `architectures` and `torch_dtype`)."
    hf = asdict(c)
    rope = dict(hf.pop("rope_parameters"))
    return hf | {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope, "attention_dropout": 0.0}

# %% [markdown]
# **The planner.** Stage 1 keeps, per token: the input norm (its gain in float32) and its output, q, k and v, the
# attention's output and log-sum-exp, the post-attention norm, the residual and the router, whose logits the
# top-k's gather keeps too. Stage 3 also keeps, per routed pair, the one-hot selector of the experts' biases.

# %%
#| export
def kept_by_part(c: Config, i: int, b: int, f: int, compiled: bool) -> dict:
    "Bytes per token layer `i` keeps for backward in stage 1, by part (the planner adds stage 3 and the output)."
    H, hq, hkv, d, E, k = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                           c.num_local_experts, c.num_experts_per_tok)
    return {"input norm": norm_bytes(H, b, f, compiled, fp32_gain=True) + b * H,
            "q, k, v": b * (hq + 2 * hkv) * d,
            "attention": b * hq * d + 4 * hq,
            "post norm": norm_bytes(H, b, f, compiled, fp32_gain=True) + b * H,
            "residual": b * H,
            "router": router_bytes(E, k, b, f, f * E + f * k)}   # the logits too (gather keeps them)


def kernel_attention_shape(c: Config, document_mask: bool, cp: int) -> tuple[int, int, int] | None:
    "(heads, q/k width, v width) of the attention, which ops/14's kernels always run (the sinks)."
    return c.num_attention_heads, c.head_dim, c.head_dim


def expert_width(c: Config) -> int:
    "The FFN width of one routed expert."
    return c.intermediate_size


def router_one_hot(c: Config) -> int:
    "Values per routed pair that stage 3 keeps for the router besides the rows: the experts' bias selector, one of E."
    return c.num_local_experts


FP32_NORM_GAIN = True    # the RMSNorms multiply their gain in float32

# %%
c5 = tiny_config(layers=2)
assert c5.layer_types == ["sliding_attention", "full_attention"] and Model is GptOssForCausalLM
hf = to_hf(c5)
assert "rope_parameters" not in hf and hf["rope_scaling"]["rope_type"] == "yarn"
assert from_hf(hf)[1]["rope_parameters"] == c5.rope_parameters
assert kernel_attention_shape(c5, False, 1) == (4, 8, 8) and router_one_hot(c5) == 4 and expert_width(c5) == 16
