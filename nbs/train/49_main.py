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
# `--help` listing every field), train, and turn every error the user can fix (`UserError`: an invalid config, a
# missing or corrupt data file, a checkpoint that does not fit, a diverged loss) into one line that says what to
# change, and exit status 2. `--debug` (or `PITH_DEBUG=1` in the environment) shows the whole traceback instead.
# Any other exception is a bug and keeps its traceback. The same module runs under torchrun:
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

from pith_lit.train.config import parse_args, run_command
from pith_lit.train.trainer import train

# %%
#| export
def main(argv: list[str] | None = None) -> int:
    """Run the trainer from command-line arguments; returns the process exit code (130 when a signal stopped the
    run). Under torchrun the process group is taken down before returning: left to the interpreter's exit, gloo's
    threads can abort the process."""
    out = {}
    try:
        code = run_command(lambda: out.update(train(parse_args(argv))), argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 130 if code == 0 and out.get("stopped") else code


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

# %% [markdown]
# A corpus that does not exist is the user's to fix: one line, exit status 2, no traceback; `--debug` shows it.

# %%
missing = [sys.executable, "-m", "pith_lit.train", "--set", f"run.dir={run_dir}/m", "--set", "data.corpus=no/such"]
short = subprocess.run(missing, capture_output=True, text=True)
print(short.stderr)
assert short.returncode == 2 and len(short.stderr.strip().splitlines()) == 1 and "Traceback" not in short.stderr
assert short.stderr.startswith("error: no packed corpus at no/such")
long = subprocess.run(missing + ["--debug"], capture_output=True, text=True)
assert long.returncode != 0 and "Traceback" in long.stderr and "MissingFile" in long.stderr
