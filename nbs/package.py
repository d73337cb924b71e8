# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The package's top level
#
# `import pith_lit` gives two things: `__version__`, which nbdev writes from settings.ini (`put_version_in_init`)
# above what this notebook exports, and the names a user needs before knowing the layout:
#
# ```python
# from pith_lit import load_hf, save_hf   # Hugging Face checkpoints (train/hf)
# model = load_hf("path/to/Qwen3-30B-A3B", torch.bfloat16)
# ```
#
# They are looked up on first use (a module-level `__getattr__`, PEP 562), not imported here: train/hf imports
# the trainer and `torch.distributed.checkpoint`, about a second of start-up that every process importing any
# part of pith_lit (each torchrun worker, each kernel notebook) would otherwise pay.

# %%
#| default_exp __init__

# %%
#| export
_all_ = ["load_hf", "save_hf"]


def __getattr__(name: str):
    "`pith_lit.load_hf` and `pith_lit.save_hf`, imported from pith_lit.train.hf when first asked for."
    match name:
        case "load_hf" | "save_hf":
            from pith_lit.train import hf
            return getattr(hf, name)
    raise AttributeError(f"module 'pith_lit' has no attribute {name!r}")

# %% [markdown]
# Check, in a fresh process: importing a part of pith_lit leaves the trainer unimported; `from pith_lit import
# load_hf` is train/hf's function; an unknown name is still an AttributeError.

# %%
import subprocess
import sys

# %%
check = """
import sys
import pith_lit, pith_lit.models.qwen3_moe
assert pith_lit.__version__ and 'pith_lit.train.trainer' not in sys.modules
from pith_lit import load_hf, save_hf
import pith_lit.train.hf as hf
assert load_hf is hf.load_hf and save_hf is hf.save_hf and 'pith_lit.train.trainer' in sys.modules
try:
    pith_lit.nothing
    raise SystemExit('no AttributeError')
except AttributeError as e:
    print(e)
"""
done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
assert done.returncode == 0, done.stderr[-2000:]
done.stdout
