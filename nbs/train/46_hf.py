# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Hugging Face checkpoints
#
# Pretrained MoE models are published as Hugging Face checkpoints: a directory with `config.json` and the
# weights in `*.safetensors` files, split into shards of a few GB with a `model.safetensors.index.json` that
# says which file holds which tensor. `load_hf` reads such a directory into one of our models; `save_hf`
# writes one of our models as such a directory, which `transformers` loads with
# `AutoModelForCausalLM.from_pretrained`.
#
# The mapping is short because our models were written for it: every `Config` field is named as in the
# Hugging Face config, and every parameter is named and shaped as in transformers 5.x. Three things are left, and
# what is particular to a family is written in its own notebook (models/21–24: `from_hf`, `to_hf` and the `HF_*`
# names, found by models/29 `family`); this notebook holds the rules they share:
#
# 1. **The config.** config.json has keys we do not model (token ids, cache settings) and keys whose null
#    means something (`q_lora_rank: null` is no low-rank query path, our 0), and RoPE comes in two spellings:
#    `rope_theta` + `rope_scaling` (the published checkpoints, transformers 4.x) or one `rope_parameters` dict
#    (transformers 5.x). A key is read past only when it cannot change what the model computes; a key that
#    would (another activation, dropout, sliding windows on Qwen3, a quantized checkpoint) is refused.
# 2. **The experts' layout.** transformers 5.x stacks a layer's routed experts into 3-D tensors
#    (`mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj` (E, H, I)), as we do, but the published
#    Qwen3-MoE and DeepSeek-V2 checkpoints store each expert on its own
#    (`mlp.experts.{e}.gate_proj.weight` (I, H), `up_proj`, `down_proj`), and transformers converts them when
#    it loads. We read both layouts and write the per-expert one, as the hub has it. Each family says which
#    layout it writes and whether it reads experts one by one (`HF_EXPERTS_ONE_BY_ONE`,
#    `HF_READ_EXPERTS_ONE_BY_ONE`): GPT-OSS's are stacked everywhere; Qwen3.5-MoE's published checkpoints stack
#    them, and transformers' `save_pretrained` writes them one by one, so we read both and write them stacked.
# 3. **Sharding.** Reading follows the index; writing cuts shards at about 5 GB.
#
# One more tensor per MoE layer has no parameter behind it: the routers' selection bias of aux-loss-free
# balancing (train/42), a buffer named as DeepSeek-V3's checkpoints name it, `…mlp.gate.e_score_correction_bias`
# (`…mlp.router.…` for GPT-OSS). None of the formats converted here has a place for it: transformers'
# Qwen3-MoE, DeepSeek-V2, GPT-OSS and Qwen3.5-MoE routers take the plain top-k (its DeepSeek-V3 is the one that
# reads the tensor). `save_hf` therefore writes it only when it is not zero, and then warns that transformers reads past it
# and routes without it, so its top-k may differ from ours; `load_hf` reads it back when it is there (our own round
# trip keeps it) and sets it to zero when it is not.
#
# The tensors are read with the `safetensors` package; transformers is not needed here (tests/test_hf.py uses
# it as the reference: same logits and gradients as `transformers`' own models, and its `from_pretrained` of
# what `save_hf` writes).

# %%
#| default_exp train.hf

# %%
#| export
import json
from contextlib import ExitStack
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pith_lit.models.family import MODEL_TYPES, family
from pith_lit.train.config import ExistingFile, InvalidInput, MissingFile, from_dict, model_class
from pith_lit.train.trainer import build_model

# %%
import dataclasses
import tempfile

from pith_lit.testing import repo_path
from pith_lit.train.config import load_config

# %% [markdown]
# ## config.json → Config
#
# Each family has its `from_hf`. It computes the fields that need more than copying (RoPE, the nulls, a renamed
# key) and names the keys it must see with one value (`fixed`) and the keys it reads past (`read`); every
# other key must be one of the family's `Config` fields and is copied. The family whose `HF_MODEL_TYPES` holds
# config.json's `model_type` reads it. `_to_config` applies those rules:
# a key that is none of these is refused, because we cannot know that it does not change the model, and a
# field that config.json does not give is an error rather than a default, because transformers' default and
# ours differ (ours are tiny). `from_dict` (train/config) then checks the types and the family's own rules.

# %%
#| export
# Keys that do not change what the model computes: bookkeeping, token ids, generation and loss settings.
HARMLESS = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
            "auto_map", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits",
            "router_aux_loss_coef"}


def _to_config(hf: dict, model_type: str, computed: dict, fixed: dict, read: set):
    "The family's Config from config.json `hf`, by the rules above."
    names = [f.name for f in fields(model_class(model_type)) if f.name != "model_type"]
    values = dict(computed)
    for key, value in hf.items():
        if key in fixed:
            if value != fixed[key]:
                raise InvalidInput(f"config.json: {key} = {value!r}, but pith_lit's {model_type} computes with "
                                 f"{key} = {fixed[key]!r}; this checkpoint is another model")
        elif key in names:
            values.setdefault(key, value)
        elif key not in HARMLESS | read:
            raise InvalidInput(f"config.json: {key} = {value!r} is not part of pith_lit's {model_type}, and it may "
                             f"change what the model computes; if it does not, delete it from config.json")
    missing = [n for n in names if values.get(n) is None]
    if missing:
        raise InvalidInput(f"config.json lacks {', '.join(missing)}; add them (transformers' defaults for absent keys "
                         "are not pith_lit's)")
    return from_dict({"model": {"model_type": model_type, **values}}).model


def config_from_hf(hf: dict):
    "Our model `Config` for the Hugging Face config.json `hf` (a dict); a clear error for what we do not model."
    if "quantization_config" in hf:
        raise InvalidInput(f"config.json has quantization_config {hf['quantization_config']}: pith_lit reads "
                         "unquantized weights only; dequantize the checkpoint first (transformers: load it with "
                         "quantization_config=Mxfp4Config(dequantize=True) and save_pretrained)")
    names = [t for t in MODEL_TYPES if hf.get("model_type") in family(t).HF_MODEL_TYPES]
    if not names:
        raise InvalidInput(f"config.json: model_type {hf.get('model_type')!r} is not supported; pith_lit reads "
                           f"{', '.join(t for name in MODEL_TYPES for t in family(name).HF_MODEL_TYPES)}")
    try:
        keys, computed, fixed, read = family(names[0]).from_hf(hf)
    except ValueError as e:   # the family's refusal, as the user's error it is
        raise InvalidInput(str(e)) from e
    return _to_config(keys, names[0], computed, fixed, read)

# %% [markdown]
# The other direction writes the hub's spelling, each family's `to_hf`: e.g. `rope_theta` and `rope_scaling` (null
# for plain RoPE), `q_lora_rank: null` for no low-rank query path, and the keys that fix the math written out, so
# that transformers (4.x or 5.x) does not fall back on a default of its own.

# %%
#| export
def config_to_hf(cfg) -> dict:
    "The config.json keys of our model config `cfg` (without `architectures` and `torch_dtype`)."
    return family(cfg.model_type).to_hf(cfg)

# %% [markdown]
# Check with DeepSeek-V2-Lite's published config.json (deepseek-ai/DeepSeek-V2-Lite): its nulls and YaRN
# become our conventions, the result is the model section of `configs/deepseek-v2-lite.toml` (written by hand
# from the paper and the model card), and writing the config back and reading it again gives the same config.

# %%
lite_json = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400}
lite = config_from_hf(lite_json)
assert lite.q_lora_rank == 0 and lite.rope_theta == 10000.0 and lite.rope_scaling["factor"] == 40
assert lite.rope_scaling["type"] == "yarn" and lite.n_routed_experts == 64 and lite.first_k_dense_replace == 1
assert lite == load_config(repo_path("configs/deepseek-v2-lite.toml")).model
assert config_from_hf(config_to_hf(lite)) == lite
lite

# %% [markdown]
# The transformers 5.x spelling of the same model (one `rope_parameters` dict that keeps both type keys, nulls
# for the unused groups, the derived head widths) reads to the same config; so does Qwen3-MoE with 5.x's
# `num_local_experts`.

# %%
five = {k: v for k, v in lite_json.items() if k not in ("rope_scaling", "rope_theta", "auto_map", "scoring_func",
                                                        "moe_layer_freq", "aux_loss_alpha", "seq_aux", "ep_size")}
five |= {"rope_parameters": {**lite_json["rope_scaling"], "rope_type": "yarn", "rope_theta": 10000.0},
         "n_group": None, "topk_group": None, "head_dim": 64, "qk_head_dim": 192, "mlp_bias": False,
         "dtype": "bfloat16"}
assert config_from_hf(five) == lite

qwen = model_class("qwen3_moe")(num_hidden_layers=2, mlp_only_layers=[1])
qwen_five = {k: v for k, v in config_to_hf(qwen).items() if k not in ("rope_theta", "rope_scaling", "num_experts")}
qwen_five |= {"rope_parameters": {"rope_type": "default", "rope_theta": qwen.rope_theta},
              "num_local_experts": qwen.num_experts}
assert config_from_hf(qwen_five) == qwen == config_from_hf(config_to_hf(qwen))
gpt = model_class("gpt_oss")(num_hidden_layers=2)
assert config_from_hf(config_to_hf(gpt)) == gpt

# %% [markdown]
# GPT-OSS-20B's published config.json (openai/gpt-oss-20b) describes MXFP4 experts, which are refused; without
# its `quantization_config` (a dequantized copy) it reads to `configs/gpt-oss-20b.toml`'s model, whose
# load-balance weight is ours rather than the published 0.9, with `swiglu_alpha` at transformers' 1.702.

# %%
gpt_json = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
    "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}
try:
    config_from_hf(gpt_json)
    raise AssertionError("a quantized checkpoint was accepted")
except ValueError as e:
    assert "quantization_config" in str(e) and "dequantize" in str(e)
gpt20b = config_from_hf({k: v for k, v in gpt_json.items() if k != "quantization_config"})
assert gpt20b.swiglu_alpha == 1.702 and gpt20b.rope_parameters["rope_theta"] == 150000.0
assert dataclasses.replace(gpt20b, router_aux_loss_coef=0.001) == load_config(repo_path("configs/gpt-oss-20b.toml")).model

# %% [markdown]
# Qwen3.5-MoE in the published layout (Qwen/Qwen3.5-35B-A3B's config.json, shortened: the vision tower's keys and
# the token ids left out): its `text_config` reads to `configs/qwen3-5-moe.toml`'s model, multimodal RoPE's keys
# and the multi-token-prediction keys read past; without `layer_types`, `full_attention_interval` places the
# full layers. The text model's config.json that we write reads back to the same config.

# %%
q35_text = {
    "model_type": "qwen3_5_moe_text", "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
    "dtype": "bfloat16", "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "moe_intermediate_size": 512,
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16, "num_experts": 256,
    "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "use_cache": True, "vocab_size": 248320}
q35_text["layer_types"] = q35_text["layer_types"] * 10
q35_json = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": q35_text, "vision_config": {"depth": 27, "hidden_size": 1152}, "image_token_id": 248056,
            "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0"}
q35 = config_from_hf(q35_json)
assert q35 == load_config(repo_path("configs/qwen3-5-moe.toml")).model
assert config_from_hf({k: v for k, v in q35_text.items() if k != "layer_types"} | {"tie_word_embeddings": False}) == q35
assert config_from_hf(config_to_hf(q35)) == q35 and config_to_hf(q35)["model_type"] == "qwen3_5_moe_text"

# %% [markdown]
# What is refused, and how it is said:

# %%
def refusal(hf: dict) -> str:
    try:
        config_from_hf(hf)
    except ValueError as e:
        return str(e)
    raise AssertionError("accepted")

assert "pith_lit's deepseek_v2 computes with hidden_act = 'silu'" in refusal(lite_json | {"hidden_act": "gelu"})
assert "attention_dropout = 0.1" in refusal(lite_json | {"attention_dropout": 0.1})
assert "sparse_step_mode = 2 is not part of pith_lit's deepseek_v2" in refusal(lite_json | {"sparse_step_mode": 2})
assert "lacks kv_lora_rank, v_head_dim" in refusal({k: v for k, v in lite_json.items()
                                                    if k not in ("kv_lora_rank", "v_head_dim")})
assert "use_sliding_window = True" in refusal(config_to_hf(qwen) | {"use_sliding_window": True})
assert "RoPE of type 'linear'" in refusal(config_to_hf(qwen) | {"rope_scaling": {"type": "linear", "factor": 2.0}})
assert "tie_word_embeddings = True but text_config.tie_word_embeddings = False" in refusal(
    q35_json | {"tie_word_embeddings": True, "text_config": q35_text | {"tie_word_embeddings": False}})
assert "attn_output_gate = False" in refusal(q35_json | {"text_config": q35_text | {"attn_output_gate": False}})
assert "RoPE of type 'yarn'" in refusal(q35_text | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7,
                                                                         "partial_rotary_factor": 0.25, "factor": 4.0}})
refusal({"model_type": "llama"})

# %% [markdown]
# ## Tensor names
#
# Our parameter names are transformers 5.x's, so a tensor is mapped by name, except the stacked experts of the
# families whose hub checkpoints store experts one by one (the family's `HF_EXPERTS_ONE_BY_ONE`). `_pieces` lists, for one of our stacked expert
# tensors, the hub's per-expert tensors and where each sits in ours: expert e's `gate_proj` is rows 0..I of
# `gate_up_proj[e]`, its `up_proj` rows I..2I, its `down_proj` all of `down_proj[e]`. `hub_tensors` is the
# whole checkpoint in the hub's layout: name → (our parameter, index into it). A tied output head is the
# embedding, listed once, as transformers writes it.

# %%
#| export
def _pieces(name: str, param: torch.Tensor) -> dict[str, tuple]:
    "The hub's per-expert tensors of our stacked expert tensor `name`: hub name -> index into `param`; {} for others."
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".mlp.experts"):
        return {}
    if leaf == "gate_up_proj":
        inter = param.shape[1] // 2
        return {f"{prefix}.{e}.{proj}.weight": (e, slice(j * inter, (j + 1) * inter))
                for e in range(param.shape[0]) for j, proj in enumerate(("gate_proj", "up_proj"))}
    if leaf == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": (e,) for e in range(param.shape[0])}
    return {}


def hub_tensors(model: nn.Module) -> dict[str, tuple[nn.Parameter, tuple]]:
    "Every tensor of the model's Hugging Face checkpoint, in the hub's layout: name -> (our parameter, index)."
    split = family(model.config.model_type).HF_EXPERTS_ONE_BY_ONE
    out = {}
    for name, p in model.named_parameters():  # a tied head is the embedding's parameter, listed once
        pieces = _pieces(name, p) if split else {}
        out.update({hub: (p, index) for hub, index in pieces.items()} or {name: (p, ())})
    return out

# %%
cq = model_class("qwen3_moe")(vocab_size=40, hidden_size=16, moe_intermediate_size=8, intermediate_size=24,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
torch.manual_seed(0)
mq = build_model(cq)
hub = hub_tensors(mq)
p, index = hub["model.layers.0.mlp.experts.3.up_proj.weight"]
assert p is mq.model.layers["0"].mlp.experts.gate_up_proj and index == (3, slice(8, 16))
assert "model.layers.0.mlp.experts.gate_up_proj" not in hub and "model.layers.1.mlp.down_proj.weight" in hub
assert len(hub) == len(list(mq.parameters())) - 2 + 3 * cq.num_experts  # layer 0: 2 stacked -> 3 per expert
assert sum(p[i].numel() for p, i in hub.values()) == sum(p.numel() for p in mq.parameters())
len(hub)

# %% [markdown]
# ## Reading
#
# `_tensor_files` finds where each tensor lives: from the index when there is one, else by listing the
# `*.safetensors` files. `empty_model` builds the model on the meta device (no memory, no initialisation) and
# gives it empty storage in the asked dtype, tying a tied head again (`to_empty` unties it). `load_hf` then
# fills each parameter from the files, one tensor at a time, so a large checkpoint never sits in memory twice.
# A parameter is read under its own name (transformers 5.x's stacked layout) or, failing that, from the hub's
# per-expert pieces. Then every tensor of the files must have been used (a tied head may also be stored, as a
# copy of the embedding, and is read past). Each problem names the tensor.
#
# A family may store tensors under other names, or beside tensors we do not read (Qwen3.5-MoE's multimodal
# checkpoints: its language model under `model.language_model.`, the vision tower, the multi-token-prediction head).
# `_our_names` renames what the family's `HF_RENAME` says and leaves out what its `HF_READ_PAST` says, in one printed
# line.

# %%
#| export
def read_hf_config(path) -> dict:
    "The config.json of the Hugging Face checkpoint directory `path`."
    f = Path(path) / "config.json"
    if not f.is_file():
        raise MissingFile(f"{f} not found: a Hugging Face checkpoint directory holds config.json and the "
                                "weights in *.safetensors")
    return json.loads(f.read_text())


def _tensor_files(path: Path) -> dict[str, Path]:
    "Tensor name -> the safetensors file holding it."
    index = path / "model.safetensors.index.json"
    if index.is_file():
        where = {name: path / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        for f in sorted(set(where.values())):
            if not f.is_file():
                raise MissingFile(f"{index} lists {f.name}, which is missing from {path}")
        return where
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MissingFile(f"{path} holds no *.safetensors file: a Hugging Face checkpoint directory holds "
                                "config.json and the weights")
    where = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for name in h.keys():
                if name in where:
                    raise InvalidInput(f"tensor {name} is in both {where[name]} and {f}; keep one of them")
                where[name] = f
    return where


def _routing_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    "The routers' selection biases (aux-loss-free balancing, train/42) by their checkpoint names."
    return {name: b for name, b in model.named_buffers() if name.endswith(".e_score_correction_bias")}


def _our_names(where: dict[str, Path], path: Path, fam) -> tuple[dict[str, Path], dict[str, str]]:
    """The tensors of `where` under our names, and the name each is stored under, by the family `fam`'s `HF_RENAME`
    (stored prefix -> ours); what its `HF_READ_PAST` names is left out, with one line that says so."""
    kept, stored, past = {}, {}, {}
    for name, f in where.items():
        part = next((what for prefix, what in fam.HF_READ_PAST.items() if name.startswith(prefix)), None)
        if part is not None:
            past[part] = past.get(part, 0) + 1
            continue
        ours = next((new + name.removeprefix(old) for old, new in fam.HF_RENAME.items() if name.startswith(old)), name)
        kept[ours], stored[ours] = f, name
    if past:
        print(f"load_hf: {path}: read past " + " and ".join(f"{part}, {n} tensors" for part, n in past.items()))
    return kept, stored


@torch.no_grad()
def _fill(model: nn.Module, path: Path):
    "Copy every parameter of `model` from the checkpoint files in `path`."
    fam = family(model.config.model_type)
    (where, stored), used, missing = _our_names(_tensor_files(path), path, fam), set(), []
    split = fam.HF_READ_EXPERTS_ONE_BY_ONE
    with ExitStack() as stack:
        handles = {}
        def read(name):
            f = where[name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(f, "pt"))
            return handles[f].get_tensor(stored.get(name, name))
        for name, p in model.named_parameters():
            pieces = _pieces(name, p) if split and name not in where else {}
            sources = pieces or {name: ()}  # hub name -> index into p
            absent = [n for n in sources if n not in where]
            if absent:  # the pieces that are there belong here all the same: not unexpected
                missing += absent
                used.update(n for n in sources if n in where)
                continue
            for n, index in sources.items():
                t = read(n)
                if t.shape != p[index].shape:
                    raise InvalidInput(f"{where[n]}: tensor {stored.get(n, n)} has shape {list(t.shape)}, but the model that "
                                     f"config.json describes needs {list(p[index].shape)}")
                p[index].copy_(t)
                used.add(n)
        for name, b in _routing_biases(model).items():   # absent: zero, the format's plain top-k
            if name in where:
                b.copy_(read(name))
                used.add(name)
            else:
                b.zero_()
    if model.config.tie_word_embeddings:
        used.add("lm_head.weight")  # a stored copy of the tied head is not needed
    unexpected = sorted(stored.get(n, n) for n in where.keys() - used)
    if missing or unexpected:
        show = lambda names: f"{len(names)}: " + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise InvalidInput(f"{path} does not hold the tensors of the model its config.json describes:"
                         + (f"\n  missing {show(missing)}" if missing else "")
                         + (f"\n  unexpected {show(unexpected)}" if unexpected else ""))


def empty_model(cfg, dtype: torch.dtype) -> nn.Module:
    "The model of `cfg` on the CPU in `dtype`, with storage that is allocated but not initialised, for a load to fill."
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to(dtype).to_empty(device="cpu")
    if cfg.tie_word_embeddings:  # to_empty gave the tied head storage of its own: tie it again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_hf(path, dtype: torch.dtype = torch.float32) -> nn.Module:
    "Our model with the weights of the Hugging Face checkpoint directory `path`, on the CPU in `dtype`."
    path = Path(path)
    model = empty_model(config_from_hf(read_hf_config(path)), dtype)
    _fill(model, path)
    return model

# %% [markdown]
# ## Writing
#
# `save_hf` writes config.json (our config in the hub's spelling, the architecture, which is our class's name,
# and the dtype) and the tensors in the hub's layout, in the model's dtype. Tensors go into shards in order until
# one would pass `max_shard_bytes` (5 GB, about the shard size of the published checkpoints); one shard is
# `model.safetensors`, several are `model-0000k-of-0000n.safetensors` with the index. A directory that already
# holds files is refused rather than mixed with them.

# %%
#| export
def save_hf(model: nn.Module, path, max_shard_bytes: int = 5_000_000_000) -> Path:
    "Write `model` as a Hugging Face checkpoint directory `path` (created; it must not hold files). Returns `path`."
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise ExistingFile(f"{path} already holds files; write the checkpoint to a new directory")
    tensors = hub_tensors(model)
    biased = {name: (b, ()) for name, b in _routing_biases(model).items() if b.any()}
    if biased:
        print(f"save_hf: {len(biased)} router(s) have a selection bias (train.lb_bias_rate); it is written as "
              f"{next(iter(biased))} and so on, which pith_lit reads back, but transformers' {model.config.model_type} "
              "has no place for it: it reads past the tensor and routes on the plain top-k")
        tensors |= biased
    shards, size = [[]], 0
    for name, (p, index) in tensors.items():
        nbytes = p[index].numel() * p.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    path.mkdir(parents=True, exist_ok=True)
    for f, names in zip(files, shards):  # copies: the pieces of one stacked tensor must not share memory in a file
        save_file({name: tensors[name][0][tensors[name][1]].detach().to("cpu", copy=True) for name in names},
                  path / f, metadata={"format": "pt"})
    if n > 1:
        total = sum(p[index].numel() * p.element_size() for p, index in tensors.values())
        weight_map = {name: f for f, names in zip(files, shards) for name in names}
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    dtype = next(model.parameters()).dtype
    hf = {"architectures": [type(model).__name__]} | config_to_hf(model.config)
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return path

# %% [markdown]
# Check: the tiny Qwen3-MoE above, written and read back. The per-expert tensors in the file are the slices of
# ours; the model read back has every parameter equal and computes the same logits. Then the same in bf16 over
# shards of at most 4 KB.

# %%
with tempfile.TemporaryDirectory() as d:
    save_hf(mq, d)
    assert sorted(p.name for p in Path(d).iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(f"{d}/model.safetensors", "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    experts = mq.model.layers["0"].mlp.experts
    assert torch.equal(stored["model.layers.0.mlp.experts.2.gate_proj.weight"], experts.gate_up_proj[2, :8])
    assert torch.equal(stored["model.layers.0.mlp.experts.2.up_proj.weight"], experts.gate_up_proj[2, 8:])
    assert torch.equal(stored["model.layers.0.mlp.experts.2.down_proj.weight"], experts.down_proj[2])
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored and len(stored) == len(hub)
    back = load_hf(d)
    assert back.config == cq and back.state_dict().keys() == mq.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), mq.state_dict().values()))
    ids = torch.randint(0, cq.vocab_size, (2, 5))
    assert torch.equal(back(ids)[0], mq(ids)[0])
    hf_json = json.loads(Path(d, "config.json").read_text())
hf_json["architectures"], hf_json["torch_dtype"], hf_json["rope_scaling"], hf_json["num_experts"]

# %%
with tempfile.TemporaryDirectory() as d:
    save_hf(mq.bfloat16(), d, max_shard_bytes=4096)
    index = json.loads(Path(d, "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in Path(d).glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert all(Path(d, f).stat().st_size < 4096 + 2048 for f in files)  # a shard's tensors, plus its header
    back = load_hf(d, dtype=torch.bfloat16)
    assert next(back.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), mq.state_dict().values()))
    assert json.loads(Path(d, "config.json").read_text())["torch_dtype"] == "bfloat16"
mq = mq.float()
len(files), index["metadata"]

# %% [markdown]
# A selection bias: zero, it is not written; set, it is written and read back, and a checkpoint without it loads
# with a zero bias.

# %%
bias_name = "model.layers.0.mlp.gate.e_score_correction_bias"
with tempfile.TemporaryDirectory() as d:
    save_hf(mq, f"{d}/zero")
    with safe_open(f"{d}/zero/model.safetensors", "pt") as f:
        assert bias_name not in f.keys()
    with torch.no_grad():
        mq.model.layers["0"].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.01, -0.02, 0.0, 0.01]))
    save_hf(mq, f"{d}/biased")
    with safe_open(f"{d}/biased/model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor(bias_name), mq.model.layers["0"].mlp.gate.e_score_correction_bias)
    assert torch.equal(load_hf(f"{d}/biased").get_buffer(bias_name), mq.get_buffer(bias_name))
    assert not load_hf(f"{d}/zero").get_buffer(bias_name).any()
    with torch.no_grad():
        mq.model.layers["0"].mlp.gate.e_score_correction_bias.zero_()

# %% [markdown]
# transformers 5.x's own layout reads too: the stacked expert tensors under our names, here a DeepSeek-V2 with
# a tied head written the way `save_file` of its state dict writes it (the head included).

# %%
cd = model_class("deepseek_v2")(vocab_size=40, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                n_routed_experts=4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                v_head_dim=4, q_lora_rank=6, tie_word_embeddings=True)
md = build_model(cd)
with tempfile.TemporaryDirectory() as d:
    sd = {k: v.clone() for k, v in md.state_dict().items()}  # both names of the tied weight, separate copies
    save_file(sd, f"{d}/model.safetensors")
    Path(d, "config.json").write_text(json.dumps(config_to_hf(cd)))
    back = load_hf(d, dtype=torch.float64)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert all(torch.equal(a, b.double()) for a, b in zip(back.state_dict().values(), md.state_dict().values()))

# %% [markdown]
# A checkpoint that does not fit its config.json is refused with the tensors named: one with an expert
# missing and a stray tensor, and one whose experts are wider than config.json says.

# %%
def load_refusal(path) -> str:
    try:
        load_hf(path)
    except ValueError as e:
        return str(e)
    raise AssertionError("loaded")

with tempfile.TemporaryDirectory() as d:
    save_hf(mq, d)
    Path(d, "config.json").write_text(json.dumps(config_to_hf(cq) | {"moe_intermediate_size": 6}))
    msg2 = load_refusal(d)
    assert "tensor model.layers.0.mlp.experts.0.gate_proj.weight has shape [8, 16], but the model that " \
           "config.json describes needs [6, 16]" in msg2
    with safe_open(f"{d}/model.safetensors", "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    del stored["model.layers.0.mlp.experts.1.up_proj.weight"]
    stored["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(2)
    save_file(stored, f"{d}/model.safetensors")
    Path(d, "config.json").write_text(json.dumps(config_to_hf(cq)))
    msg = load_refusal(d)
    assert "missing 1: model.layers.0.mlp.experts.1.up_proj.weight" in msg
    assert "unexpected 1: model.layers.0.mlp.shared_expert.weight" in msg
print(msg, msg2, sep="\n")
