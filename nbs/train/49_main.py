# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # `python -m pith_lit.train`
#
# The command line around `train()`: parse the config (a TOML path, `--set section.field=value` overrides,
# `--help` listing every field), train, and turn the two errors that are about the run rather than the code (an
# invalid config, a diverged loss) into one clear line and a non-zero exit code. Everything else (a missing or
# corrupt data file, a checkpoint of another model) keeps its traceback, whose last line says what to change. The same module runs under torchrun:
#
# ```bash
# python -m pith_lit.train                                   # tiny default on the embedded corpus
# python -m pith_lit.train configs/tiny.toml --set train.steps=1000
# torchrun --standalone --nproc-per-node 2 -m pith_lit.train --set parallel.dp=2
# ```

# %%
#| default_exp train.__main__

# %%
#| export
import sys

import torch.distributed as dist

from pith_lit.train.config import ConfigError, parse_args
from pith_lit.train.trainer import NonFiniteLoss, train

# %%
#| export
def main(argv: list[str] | None = None) -> int:
    """Run the trainer from command-line arguments; returns the process exit code. Under torchrun the process
    group is taken down before returning: left to the interpreter's exit, gloo's threads can abort the process."""
    try:
        cfg = parse_args(argv)
        out = train(cfg)
    except (ConfigError, NonFiniteLoss) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if not out["stopped"] else 130


if __name__ == "__main__" and __spec__ is not None:
    sys.exit(main())

# %% [markdown]
# ## Trying it
#
# The module runs as a real process here, the way a user starts it: a bad key fails before anything runs and
# says what would be valid; a short run writes its metrics.

# %%
import json
import subprocess
import tempfile

# %%
bad = subprocess.run([sys.executable, "-m", "pith_lit.train", "--set", "train.stepz=5"], capture_output=True,
                     text=True)
print(bad.stderr)
assert bad.returncode == 2 and "train.stepz" in bad.stderr and "train.steps" in bad.stderr

# %%
run_dir = tempfile.mkdtemp()
ok = subprocess.run([sys.executable, "-m", "pith_lit.train", "--set", f"run.dir={run_dir}", "--set", "train.steps=3",
                     "--set", "train.warmup=1",
                     "--set", "log.sample_tokens=0", "--set", "log.tensorboard=false"], capture_output=True, text=True)
assert ok.returncode == 0, ok.stderr[-3000:]
print([json.loads(l)["loss"] for l in open(f"{run_dir}/metrics.jsonl")])
