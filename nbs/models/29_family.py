# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A model family by its name
#
# Everything specific to a model family lives in its own notebook (models/21–24), under the same names in every
# family: `Config`, `Model`, `tiny_config`, the Hugging Face translation (`from_hf`, `to_hf`, `HF_MODEL_TYPES`,
# `HF_EXPERTS_ONE_BY_ONE`, `HF_READ_EXPERTS_ONE_BY_ONE`, `HF_RENAME`, `HF_READ_PAST`) and what the planner asks
# (`kept_by_part`, `kernel_attention_shape`, `expert_width`, `router_one_hot`, `FP32_NORM_GAIN`). A module is the
# interface. The config, the trainer, the planner, the conversion and the checks ask `family(model_type)` for the
# module and use those names, so adding a family is its notebook and one `case` here (and its name in
# `MODEL_TYPES`, which the error lists).

# %%
#| default_exp models.family

# %%
#| export
from types import ModuleType

MODEL_TYPES = ("qwen3_moe", "deepseek_v2", "gpt_oss", "qwen3_5_moe")   # the cases of `family`, for its error


def family(model_type: str) -> ModuleType:
    "The module of the model family named `model_type` (a `Config.model_type`)."
    match model_type:
        case "qwen3_moe":
            from pith_lit.models import qwen3_moe as module
        case "deepseek_v2":
            from pith_lit.models import deepseek_v2 as module
        case "gpt_oss":
            from pith_lit.models import gpt_oss as module
        case "qwen3_5_moe":
            from pith_lit.models import qwen3_5_moe as module
        case _:
            raise ValueError(f"model_type {model_type!r}: unknown model family; valid: "
                             f"{', '.join(map(repr, MODEL_TYPES))}")
    return module

# %% [markdown]
# Check: every listed name is a case, its module's `Config` says the same name, every family defines every name of
# the interface, and an unknown name is refused with the valid ones.

# %%
from torch import nn

# %%
NAMES = ("Config", "Model", "tiny_config", "from_hf", "to_hf", "HF_MODEL_TYPES", "HF_EXPERTS_ONE_BY_ONE",
         "HF_READ_EXPERTS_ONE_BY_ONE", "HF_RENAME", "HF_READ_PAST", "kept_by_part", "kernel_attention_shape",
         "expert_width", "router_one_hot", "FP32_NORM_GAIN")
for t in MODEL_TYPES:
    m = family(t)
    assert m.Config().model_type == t and m.tiny_config().model_type == t, t
    missing = [n for n in NAMES if not hasattr(m, n)]
    assert not missing, (t, missing)
    assert isinstance(m.Model(m.tiny_config(layers=2)), nn.Module)
try:
    family("llama")
    raise AssertionError("an unknown family was accepted")
except ValueError as e:
    assert "'qwen3_moe', 'deepseek_v2', 'gpt_oss', 'qwen3_5_moe'" in str(e)
    print(e)
