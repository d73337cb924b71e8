# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # v01 · Training validation
#
# Trains the configured model for `steps` steps and checks four things: the loss falls by at least `min_drop`
# (in nats, first step against the mean of the last `tail` steps); the loss on the held-out windows
# (`data.val_frac`, evaluated every `log.eval_every` steps) falls too; the load-balance metric stays within
# `max_balance` of perfect (1.0); and a run stopped halfway and resumed from its checkpoint repeats the straight
# run's losses (exactly on the CPU in float32; within `resume_rtol` on a GPU, where kernels need not be bitwise
# deterministic). It draws the training and validation losses and the load balance into
# `out_dir/v01_training.png` and ends with PASS or FAIL.
#
# CPU (the defaults), from the repository root with the venv active:
# `mkdir -p out && jupytext --to ipynb nbs/validate/v01_training.py -o - | papermill - out/v01.ipynb -p out_dir out`.
# On a GPU, the bench width with 2 layers (what `skills/validate-correctness/check.sh --gpu` runs): the same with
# `-p config configs/bench-qwen3-30b-a3b.toml -p steps 30 -p min_drop 1.0 -p resume_rtol 1e-2 -p max_balance 16
# -y 'overrides: ["model.num_hidden_layers=2", "train.warmup=5", "ckpt.every=0", "ckpt.keep=1"]'` added.

# %% tags=["parameters"]
config = "configs/tiny.toml"  # a path relative to the repository's root, or absolute
steps = 40
overrides = ["train.warmup=10", "log.sample_tokens=0", "log.tensorboard=false", "log.eval_every=10"]
min_drop = 1.0
max_balance = 1.5
tail = 5
resume_rtol = 0.0
out_dir = "."

# %%
import math
import shutil
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from pith_lit.testing import repo_path
from pith_lit.train.config import load_config
from pith_lit.train.trainer import train

matplotlib.use("Agg")
out = Path(out_dir)
runs = out / "v01_runs"
shutil.rmtree(runs, ignore_errors=True)

# %% [markdown]
# ## The straight run, then the same run stopped at half and resumed

# %%
config = Path(config) if Path(config).is_absolute() else repo_path(config)
common = [f"train.steps={steps}", *overrides]
straight = train(load_config(config, common + [f"run.dir={runs}/straight"]), quiet=True)["history"]
half = steps // 2
split_cfg = load_config(config, common + [f"run.dir={runs}/split"])
split = train(split_cfg, until=half, quiet=True)["history"] + train(split_cfg, quiet=True)["history"]
loss = [r["loss"] for r in straight]
bal = [r["balance"] for r in straight]
val = [(r["step"], r["val_loss"]) for r in straight if "val_loss" in r]
print(f"loss {loss[0]:.3f} -> {sum(loss[-tail:]) / tail:.3f}; balance last {bal[-1]:.3f}; "
      f"{sum(r['tokens_per_s'] for r in straight[1:]) / max(len(straight) - 1, 1):,.0f} tokens/s")

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
a.plot(range(1, steps + 1), loss, label="straight")
a.plot(range(1, steps + 1), [r["loss"] for r in split], "--", label=f"stopped at {half}, resumed")
a.plot(*zip(*val), "o-", label="held-out windows")
a.set(xlabel="step", ylabel="loss (nats/token)", title="loss"); a.legend()
b.plot(range(1, steps + 1), bal, label="straight run"); b.axhline(1.0, color="gray", lw=0.8, label="balanced")
b.set(xlabel="step", ylabel="E·Σ f·P (1 = balanced)", title="load balance"); b.legend()
fig.tight_layout(); fig.savefig(out / "v01_training.png", dpi=110)

# %% [markdown]
# ## Verdict

# %%
drop = loss[0] - sum(loss[-tail:]) / tail
checks = {
    f"loss falls by ≥ {min_drop} (fell {drop:.3f})": drop >= min_drop,
    f"balance ≤ {max_balance} at the end (is {bal[-1]:.3f})": bal[-1] <= max_balance,
    f"held-out loss falls ({val[0][1]:.3f} at step {val[0][0]} -> {val[-1][1]:.3f})": len(val) >= 2
        and val[-1][1] < val[0][1],
    "all losses finite": all(math.isfinite(l) for l in loss),
    f"resumed run repeats the straight run (rtol {resume_rtol})": all(
        abs(s["loss"] - r["loss"]) <= resume_rtol * abs(r["loss"]) for s, r in zip(split, straight))
        and len(split) == len(straight),
}
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
assert all(checks.values()), "FAIL"
print("PASS")
