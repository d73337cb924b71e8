# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # v06 · Optimizers and load balancing
#
# Trains the configured model (by default the tiny Qwen3-MoE on the embedded corpus through the BPE tokenizer
# trained from it) four ways from the same start for `steps` steps: AdamW with the auxiliary load-balance loss (the
# default), Muon with the same loss, AdamW with aux-loss-free balancing instead (the per-expert selection bias of
# train/42, `lb_bias_rate`, no loss term), and AdamW with no balancing at all, the baseline the two balancing
# methods are judged against. It checks that
#
# - aux-loss-free balancing keeps the load balance at or below `max_balance_free` over the last `tail` steps, and
#   below the unbalanced run's;
# - Muon's loss (mean of the last `tail` steps) is no worse than AdamW's by more than `muon_margin` nats, and says
#   by how much it differs either way;
#
# draws the loss and balance curves into `out_dir/v06_optim_balance.png` and ends with PASS or FAIL.
#
# CPU (the defaults), from the repository root with the venv active:
# `mkdir -p out && jupytext --to ipynb nbs/validate/v06_optim_balance.py -o - | papermill - out/v06.ipynb -p out_dir out`.

# %% tags=["parameters"]
config = "configs/tiny.toml"  # a path relative to the repository's root, or absolute
steps = 30
overrides = ["train.warmup=10", "log.sample_tokens=0", "log.tensorboard=false", "ckpt.every=-1"]
bias_rate = 0.03
max_balance_free = 1.3
muon_margin = 0.05
tail = 10
out_dir = "."

# %%
import shutil
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from pith_lit.testing import repo_path
from pith_lit.train.config import load_config
from pith_lit.train.trainer import train

matplotlib.use("Agg")
out = Path(out_dir)
runs = out / "v06_runs"
shutil.rmtree(runs, ignore_errors=True)

# %% [markdown]
# ## Four runs from the same start

# %%
config = Path(config) if Path(config).is_absolute() else repo_path(config)
kinds = {
    "AdamW, aux loss": [],
    "Muon, aux loss": ["train.optimizer=muon"],
    "AdamW, aux-loss-free": ["train.lb_coef=0", f"train.lb_bias_rate={bias_rate}"],
    "AdamW, no balancing": ["train.lb_coef=0"],
}
hist = {}
for name, extra in kinds.items():
    where = runs / name.replace(", ", "_").replace(" ", "-")
    hist[name] = train(load_config(config, [f"train.steps={steps}", *overrides, *extra, f"run.dir={where}"]),
                       quiet=True)["history"]
last = lambda name, key: sum(r[key] for r in hist[name][-tail:]) / tail
for name in kinds:
    print(f"{name:22s} loss {hist[name][0]['loss']:.3f} -> {last(name, 'loss'):.3f}   "
          f"balance (last {tail}) {last(name, 'balance'):.3f}, max {max(r['balance'] for r in hist[name]):.3f}")

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
for name in kinds:
    a.plot([r["loss"] for r in hist[name]], label=name)
    b.plot([r["balance"] for r in hist[name]], label=name)
a.set(xlabel="step", ylabel="loss (nats/token)", title="loss"); a.legend()
b.axhline(1.0, color="gray", lw=0.8)
b.set(xlabel="step", ylabel="E·Σ f·P (1 = balanced)", title="load balance"); b.legend()
fig.tight_layout(); fig.savefig(out / "v06_optim_balance.png", dpi=110)

# %% [markdown]
# ## Verdict

# %%
free, none = last("AdamW, aux-loss-free", "balance"), last("AdamW, no balancing", "balance")
muon_gap = last("Muon, aux loss", "loss") - last("AdamW, aux loss", "loss")
checks = {
    f"aux-loss-free balance {free:.3f} <= {max_balance_free} and below no balancing ({none:.3f})":
        free <= max_balance_free and free < none,
    f"Muon's loss minus AdamW's {muon_gap:+.3f} nats <= {muon_margin}": muon_gap <= muon_margin,
}
for what, ok in checks.items():
    print(("PASS " if ok else "FAIL ") + what)
assert all(checks.values()), "v06 FAIL"
print("PASS")
