# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # v05 · FP8 training
#
# Trains the configured model from the same start for `steps` steps: as configured, and with `train.fp8 = true`
# once for each scaling in `scalings`, where the routed experts' matmuls run in E4M3 with power-of-two scales
# (ops/15_fp8; the Triton kernels on a GPU, their torch reference on a CPU): `block`, one scale per 1×128
# activation tile and per 128×128 weight block, and `rows`, one scale per row of each operand over the whole
# reduction (`train.fp8_scaling`). It checks that
#
# - each FP8 recipe's training loss, the mean of the last `tail` steps, is within `max_gap` (relative) of the
#   unquantized run's, and its held-out loss at the last step within `max_val_gap` (one evaluation on a few windows
#   varies more between runs than a mean of `tail` steps does);
# - every loss is finite, and the runs differ (the quantization was in the path);
#
# prints each run's tokens/s (mean after the first `warm` steps) and peak memory, draws the loss curves and each
# run's relative difference into `out_dir/v05_fp8.png`, and ends with PASS or FAIL. Each run is `python -m
# pith_lit.train` in a process of its own, as a user would start it.
#
# With `runs = n` it trains each recipe n times and compares means. On a GPU two identical runs are not bitwise
# equal (kernels that add with atomics sum in a varying order), and 300 steps turn a last-digit difference in the
# first steps into a difference of the per-step loss that can exceed a 1% margin (less with fp32 master weights and a
# smaller learning rate: benchmarks/RESULTS.md), so one run of each cannot resolve such a margin. Several runs of
# each measure that spread, and the verdict's margin becomes the larger of `max_gap` and twice the standard error of
# the difference of the means, printed beside it. A smaller learning rate slows the drift, which is why the GPU
# parameters below train at 1e-4. On the CPU a run repeats bitwise, and the default is one run of each.
# `fp8_first = True` starts with the FP8 runs, so that executions pooled together can give each recipe the first
# place in turn. `runs_from` pools the runs of earlier executions (their `out_dir`s) into this one's verdict and
# figure, for a machine whose jobs are too short for all the runs at once; with `runs = 0` the notebook only pools.
#
# The CPU margins are wide because there the FP8 run is sensitive to summation order: with one thread instead of
# two, or on another machine, its distance from the unquantized run changes by more than the
# unquantized run itself moves (rounding onto E4M3 turns a last-bit difference into a different rounding, and 300
# steps amplify it; benchmarks/RESULTS.md, "v05 on the CPU").
#
# CPU (the defaults: the tiny Qwen3-MoE cut to two layers, 300 steps of 8 × 64 tokens), from the repository root
# with the venv active: `mkdir -p out && jupytext --to ipynb nbs/validate/v05_fp8.py -o - | papermill - out/v05.ipynb
# -p out_dir out`. On one H200, the Qwen3 bench at full width cut to 6 layers (so that fp32 master weights and
# AdamW states fit), compiled, at lr 1e-4, on text that no step of the run repeats (8 MB of the installed packages'
# Python source through the byte tokenizer, 8.5M tokens against the run's 4.9M): `python3
# benchmarks/code_corpus.py /tmp/code.jsonl --mb 8 && python -m pith_lit.tokenize /tmp/code.jsonl --out /tmp/codec
# --tokenizer bytes`, then the notebook with `-p config configs/bench-qwen3-30b-a3b.toml -p max_gap 0.01 -p
# max_val_gap 0.01 -p warm 10 -p runs 2 -y 'scalings: ["rows"]' -y 'overrides: ["model.num_hidden_layers=6",
# "train.optim_dtype=float32", "train.lr=1e-4", "train.compile=true", "train.micro_batch=4",
# "train.global_batch=4", "train.warmup=20", "log.eval_every=0", "log.eval_windows=16", "data.corpus=/tmp/codec"]'`
# (about 7 minutes). Three such executions (the later two with `-p fp8_first True`), pooled by a fourth with `-p runs
# 0 -y 'runs_from: [out1, out2, out3]'`, give six runs of each recipe (benchmarks/RESULTS.md has the verdict).
# The wider widths of issue 43 run the same way with their width's overrides in front of those above and the model's
# bench config: Qwen3-235B-A22B's width with `configs/bench-qwen3-30b-a3b.toml` and `"model.hidden_size=4096",
# "model.moe_intermediate_size=1536", "model.num_attention_heads=64", "model.num_key_value_heads=4"`, DeepSeek-V3's
# with `configs/bench-deepseek-v2-lite.toml` and RESULTS' V3 cut ("FP8 end to end"), each with a layer count that fits
# fp32 states (one MoE layer on an 80 GB GPU: "v05 at the 235B and V3 widths" has the cuts, about 6 minutes for two
# runs of each recipe).

# %% tags=["parameters"]
config = "configs/tiny.toml"  # a path relative to the repository's root, or absolute
steps = 300
overrides = ["model.num_hidden_layers=2", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=8",
             "train.warmup=20", "log.eval_every=0"]
max_gap = 0.03
max_val_gap = 0.10
tail = 20
warm = 5
runs = 1  # runs of each recipe; with 2 or more the verdict compares means and measures identical runs' spread
fp8_first = False  # the first round trains the FP8 runs first (pooled executions then share the first place)
scalings = ["block", "rows"]  # train.fp8_scaling of each FP8 run
runs_from = []  # out_dir of earlier executions of this notebook (same parameters) whose runs join this verdict
out_dir = "."

# %%
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from pith_lit.testing import repo_path

matplotlib.use("Agg")
out = Path(out_dir).resolve()
runs_dir = out / "v05_runs"
assert all(Path(d).resolve() != out for d in runs_from), "runs_from must not name out_dir: its runs are replaced"
shutil.rmtree(runs_dir, ignore_errors=True)

# %% [markdown]
# ## Runs from the same start
#
# The same seed gives every run the same initial weights and the same batches; only the experts' arithmetic
# differs. Checkpoints and samples are off: the runs are compared by their `metrics.jsonl`. The runs go in rounds,
# one run of each recipe per round; each round reverses the previous round's order (unquantized, FP8, FP8,
# unquantized, …, or the FP8 runs first with `fp8_first`), so that over two rounds no recipe holds the earlier
# places.

# %%
config = Path(config) if Path(config).is_absolute() else repo_path(config)
common = [f"train.steps={steps}", "ckpt.every=-1", "log.sample_tokens=0", "log.tensorboard=false", *overrides]
RECIPES = {"unquantized": ("base", ["train.fp8=false"])}
RECIPES.update({{"block": "FP8, block scales", "rows": "FP8, row scales"}[s]: (s, ["train.fp8=true",
                f"train.fp8_scaling={s}"]) for s in scalings})
FP8_RUNS = [name for name in RECIPES if name != "unquantized"]
first = FP8_RUNS + ["unquantized"] if fp8_first else list(RECIPES)
records = {name: [] for name in RECIPES}       # name -> one list of metrics records per run
for r in range(runs):
    for name in (first if r % 2 == 0 else first[::-1]):
        sub, fp8_sets = RECIPES[name]
        run_dir = runs_dir / f"{sub}{r + 1}"
        sets = common + fp8_sets + [f"run.dir={run_dir}"]
        cmd = [sys.executable, "-m", "pith_lit.train", str(config), *[a for s in sets for a in ("--set", s)]]
        proc = subprocess.run(cmd, cwd=repo_path("."), capture_output=True, text=True)
        assert proc.returncode == 0, f"{name} run {r + 1} failed:\n{proc.stderr[-3000:]}"
        records[name].append([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
        print(f"round {r + 1}: {name} trained")
for d in runs_from:                            # runs of earlier calls, pooled with these
    for name, (sub, _) in RECIPES.items():
        for m in sorted(Path(d).glob(f"v05_runs/{sub}[0-9]*/metrics.jsonl")):
            records[name].append([json.loads(line) for line in m.read_text().splitlines()])
n_runs = min(len(v) for v in records.values())
assert n_runs >= 1, f"no runs of some recipe: {({k: len(v) for k, v in records.items()})}"

summary = {}                                   # name -> one summary per run
for name, per_run in records.items():
    summary[name] = []
    for r, recs in enumerate(per_run):
        loss = [x["loss"] for x in recs]
        speed = [x["tokens_per_s"] for x in recs[warm:]]
        s = dict(loss=loss, end=sum(loss[-tail:]) / tail, val=recs[-1].get("val_loss"),
                 tokens_per_s=sum(speed) / max(len(speed), 1), peak=max(x.get("peak_mem_gb", 0.0) for x in recs))
        summary[name].append(s)
        label = name + (f" {r + 1}" if len(per_run) > 1 else "")
        print(f"{label:>20}: loss {loss[0]:.4f} -> {s['end']:.4f} (mean of the last {tail}), held-out "
              f"{s['val'] or math.nan:.4f}, {s['tokens_per_s']:,.0f} tokens/s, peak {s['peak']:.2f} GiB")


def mean(name, key):
    "The mean over recipe `name`'s runs of summary `key` (nan when a run lacks it, as a held-out loss can)."
    values = [s[key] for s in summary[name]]
    return statistics.fmean(values) if all(v is not None for v in values) else math.nan


for name in FP8_RUNS:
    print(f"{name} / unquantized: tokens/s {mean(name, 'tokens_per_s') / mean('unquantized', 'tokens_per_s'):.3f}×")

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
x = range(1, steps + 1)
smooth = lambda v: [statistics.fmean(v[max(0, i - tail + 1):i + 1]) for i in range(len(v))]   # trailing means
ref = smooth([statistics.fmean(v) for v in zip(*(s["loss"] for s in summary["unquantized"]))])
colors = {"unquantized": "gray"} | {name: f"C{i}" for i, name in enumerate(FP8_RUNS)}
for name, per_run in summary.items():
    for r, s in enumerate(per_run):
        label = name if r == 0 else None
        a.plot(x, s["loss"], lw=1, color=colors[name], label=label)
        b.plot(x, [(v - u) / u for v, u in zip(smooth(s["loss"]), ref)], lw=1, color=colors[name], label=label)
a.set(xlabel="step", ylabel="loss (nats/token)", title="training loss"); a.legend()
b.axhline(0.0, color="black", lw=0.8); b.legend()
b.set(xlabel="step", ylabel="(run − unquantized) / unquantized",
      title=f"{tail}-step means against the unquantized " + ("runs' mean" if n_runs > 1 else "run"))
fig.tight_layout(); fig.savefig(out / "v05_fp8.png", dpi=110)

# %% [markdown]
# ## Verdict
#
# A recipe's training loss is the mean over its runs of each run's mean of the last `tail` steps, its held-out loss
# the mean of the runs' last evaluations. With several runs the margin of each check is the larger of `max_gap` (or
# `max_val_gap`) and twice the standard error of the difference of the two means, estimated from the runs' own
# spread: where identical runs scatter by more than the margin, that many runs cannot tell the recipes apart at the
# margin, and the check says so by printing the margin it used.

# %%
def relative(name, key):
    "Signed relative distance of recipe `name`'s mean from the unquantized mean, and twice its standard error."
    f, u = mean(name, key), mean("unquantized", key)
    if math.isnan(f) or math.isnan(u):
        return math.inf, 0.0
    xs, us = [s[key] for s in summary[name]], [s[key] for s in summary["unquantized"]]
    se = math.sqrt(statistics.variance(xs) / len(xs) + statistics.variance(us) / len(us)) / u if n_runs > 1 else 0.0
    return (f - u) / u, 2 * se


if n_runs > 1:
    for key, what in (("end", "training loss"), ("val", "held-out")):
        us = [s[key] for s in summary["unquantized"]]
        if all(us):
            print(f"{len(us)} unquantized runs, {what}: {min(us):.4f} to {max(us):.4f}, "
                  f"{(max(us) - min(us)) / statistics.fmean(us):.2%} apart")
checks = {}
for name in FP8_RUNS:
    for key, what, margin in (("end", f"loss (mean of the last {tail} steps)", max_gap),
                              ("val", "held-out loss at the last step", max_val_gap)):
        gap, two_se = relative(name, key)
        tol = max(margin, two_se)
        runs_text = f"over {len(summary[name])} and {len(summary['unquantized'])} runs, 2 s.e. {two_se:.2%}, " \
            if n_runs > 1 else ""
        checks[f"{name}: {what} {mean(name, key):.4f} against {mean('unquantized', key):.4f}, {gap:+.2%} "
               f"({runs_text}margin {tol:.2%})"] = abs(gap) <= tol
    checks[f"{name}: the runs differ from the unquantized ones (the FP8 path ran)"] = all(
        f["loss"] != u["loss"] for f in summary[name] for u in summary["unquantized"])
checks["all losses finite"] = all(math.isfinite(v) for per_run in summary.values() for s in per_run for v in s["loss"])
checks[f"every run ran {steps} steps"] = all(len(s["loss"]) == steps for per_run in summary.values() for s in per_run)
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
assert all(checks.values()), "FAIL"
print("PASS")
