# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The layer protocol
#
# (Work in progress: the prose, routing info and local dispatch/combine are being written.)

# %%
#| default_exp models.protocol

# %%
#| export
from dataclasses import field

# %%
#| export
def cfg(default, help: str):
    "A dataclass field that carries its documentation; `--help` prints it. Lists and dicts get a factory."
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
