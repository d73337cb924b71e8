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
# (Work in progress: attention, router, experts and the five stages are being written.)

# %%
#| default_exp models.qwen3_moe

# %%
#| export
from dataclasses import dataclass

from pith_lit.models.protocol import cfg

# %%
#| export
@dataclass
class Config:
    "Qwen3-MoE hyper-parameters. Field names are those of Hugging Face's `Qwen3MoeConfig`."
    model_type: str = cfg("qwen3_moe", "model family; selects the model module")
    vocab_size: int = cfg(384, "vocabulary size (the byte tokenizer needs at least 259)")
    hidden_size: int = cfg(128, "model width")
    moe_intermediate_size: int = cfg(128, "FFN width of one routed expert")
    intermediate_size: int = cfg(512, "FFN width of a dense MLP layer (layers listed in mlp_only_layers)")
    num_hidden_layers: int = cfg(4, "number of decoder layers")
    num_attention_heads: int = cfg(4, "query heads")
    num_key_value_heads: int = cfg(2, "key/value heads (grouped-query attention); divides num_attention_heads")
    head_dim: int = cfg(32, "width of one attention head")
    num_experts: int = cfg(8, "routed experts per MoE layer")
    num_experts_per_tok: int = cfg(2, "experts chosen per token (top-k)")
    norm_topk_prob: bool = cfg(True, "renormalise the top-k router probabilities to sum to 1")
    decoder_sparse_step: int = cfg(1, "every n-th layer is MoE (1 = all layers)")
    mlp_only_layers: list = cfg([], "layer indices that use a dense MLP instead of experts")
    rms_norm_eps: float = cfg(1e-6, "epsilon of every RMSNorm")
    rope_theta: float = cfg(1_000_000.0, "RoPE base frequency")
    max_position_embeddings: int = cfg(4096, "longest sequence the RoPE tables cover")
    attention_bias: bool = cfg(False, "bias on the q/k/v/o projections")
    tie_word_embeddings: bool = cfg(False, "share the embedding and output head weights")
    initializer_range: float = cfg(0.02, "standard deviation of the N(0, σ) initialisation")
