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
# - each FP8 run's training loss, the mean of the last `tail` steps, is within `max_gap` (relative) of the
#   unquantized run's, and its held-out loss at the last step within `max_val_gap` (one evaluation on a few windows
#   varies more between runs than a mean of `tail` steps does);
# - every loss is finite, and the two runs differ (the quantization was in the path);
#
# prints each run's tokens/s (mean after the first `warm` steps) and peak memory, draws the loss curves and each FP8
# run's relative difference into `out_dir/v05_fp8.png`, and ends with PASS or FAIL. Each run is `python -m
# pith_lit.train` in a process of its own, as a user would start it.
#
# With `repeat = True` it trains the unquantized configuration a second time. On a GPU two identical runs are not
# bitwise equal (kernels that add with atomics sum in a varying order), and 300 steps of a 12-layer model turn a
# last-digit difference in the first steps into a few percent of the per-step loss (on the Qwen3 bench, bf16 runs
# of one setting end several percent apart at step 300, less with fp32 master weights and a smaller learning rate:
# benchmarks/RESULTS.md), so that run measures how far the metrics move without any change in arithmetic; each
# margin is then the larger of `max_gap` (or `max_val_gap`) and that spread, and both are printed. A smaller
# learning rate slows the drift, which is why the GPU parameters below train at 1e-4. On the CPU a run repeats
# bitwise, and the default leaves it off. `fp8_first = True` trains the FP8 runs before both unquantized runs, to
# tell a run's place in the call from the FP8 arithmetic.
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
# max_val_gap 0.01 -p warm 10 -p repeat True -y 'scalings: ["rows"]' -y 'overrides: ["model.num_hidden_layers=6",
# "train.optim_dtype=float32", "train.lr=1e-4", "train.compile=true", "train.micro_batch=4",
# "train.global_batch=4", "train.warmup=20", "log.eval_every=0", "log.eval_windows=16", "data.corpus=/tmp/codec"]'`
# (about 6 minutes).

# %% tags=["parameters"]
config = "configs/tiny.toml"  # a path relative to the repository's root, or absolute
steps = 300
overrides = ["model.num_hidden_layers=2", "train.seq_len=64", "train.global_batch=8", "train.micro_batch=8",
             "train.warmup=20", "log.eval_every=0"]
max_gap = 0.03
max_val_gap = 0.10
tail = 20
warm = 5
repeat = False  # also train the unquantized configuration a second time, to measure the runs' own spread
fp8_first = False  # train the FP8 runs before the unquantized ones (does a run's place in the call matter?)
scalings = ["block", "rows"]  # train.fp8_scaling of each FP8 run
out_dir = "."

# %%
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from pith_lit.testing import repo_path

matplotlib.use("Agg")
out = Path(out_dir).resolve()
runs = out / "v05_runs"
shutil.rmtree(runs, ignore_errors=True)

# %% [markdown]
# ## Runs from the same start
#
# The same seed gives every run the same initial weights and the same batches; only the experts' arithmetic
# differs. Checkpoints and samples are off: the runs are compared by their `metrics.jsonl`. They run unquantized,
# FP8, and with `repeat` unquantized again; `fp8_first` puts the FP8 runs first.

# %%
config = Path(config) if Path(config).is_absolute() else repo_path(config)
common = [f"train.steps={steps}", "ckpt.every=-1", "log.sample_tokens=0", "log.tensorboard=false", *overrides]
records = {}
FP8_RUNS = {{"block": "FP8, block scales", "rows": "FP8, row scales"}[s]: s for s in scalings}
fp8_plan = [(name, ["train.fp8=true", f"train.fp8_scaling={s}"], s) for name, s in FP8_RUNS.items()]
plan = (fp8_plan if fp8_first else []) + [("unquantized", ["train.fp8=false"], "base")] + \
    ([] if fp8_first else fp8_plan) + ([("unquantized, again", ["train.fp8=false"], "again")] if repeat else [])
for name, fp8_sets, sub in plan:
    run_dir = runs / sub
    sets = common + fp8_sets + [f"run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "pith_lit.train", str(config), *[a for s in sets for a in ("--set", s)]],
                          cwd=repo_path("."), capture_output=True, text=True)
    assert proc.returncode == 0, f"{name} run failed:\n{proc.stderr[-3000:]}"
    records[name] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

summary = {}
for name, recs in records.items():
    loss = [r["loss"] for r in recs]
    speed = [r["tokens_per_s"] for r in recs[warm:]]
    summary[name] = dict(loss=loss, end=sum(loss[-tail:]) / tail, val=recs[-1].get("val_loss"),
                         tokens_per_s=sum(speed) / max(len(speed), 1),
                         peak=max(r.get("peak_mem_gb", 0.0) for r in recs))
    s = summary[name]
    print(f"{name:>18}: loss {loss[0]:.4f} -> {s['end']:.4f} (mean of the last {tail}), held-out {s['val']}, "
          f"{s['tokens_per_s']:,.0f} tokens/s, peak {s['peak']:.2f} GiB")
base = summary["unquantized"]
for name in FP8_RUNS:
    print(f"{name} / unquantized: tokens/s {summary[name]['tokens_per_s'] / base['tokens_per_s']:.3f}×")

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
x = range(1, steps + 1)
for name, s in summary.items():
    a.plot(x, s["loss"], label=name, lw=1)
a.set(xlabel="step", ylabel="loss (nats/token)", title="training loss"); a.legend()
if repeat:
    again = summary["unquantized, again"]
    b.plot(x, [(r - u) / u for r, u in zip(again["loss"], base["loss"])], lw=1, color="gray",
           label="unquantized, again")
for name in FP8_RUNS:
    b.plot(x, [(f - u) / u for f, u in zip(summary[name]["loss"], base["loss"])], lw=1, label=name)
b.legend()
b.axhline(0.0, color="gray", lw=0.8)
b.set(xlabel="step", ylabel="(run − unquantized) / unquantized", title="relative difference")
fig.tight_layout(); fig.savefig(out / "v05_fp8.png", dpi=110)

# %% [markdown]
# ## Verdict

# %%
def gaps(s):
    "Relative distance of run s from the unquantized run: (training loss at the end, held-out loss)."
    val = abs(s["val"] - base["val"]) / base["val"] if base["val"] and s["val"] else math.inf
    return abs(s["end"] - base["end"]) / base["end"], val


tol, val_tol = max_gap, max_val_gap
if repeat:
    spread, val_spread = gaps(again)   # `again`: the repeat's summary, from the figure's cell
    print(f"two unquantized runs end {spread:.2%} apart (training loss) and {val_spread:.2%} (held-out)")
    tol, val_tol = max(tol, spread), max(val_tol, val_spread)
    signed = lambda a, b: f"{(a - b) / b:+.2%}" if a and b else "n/a"
    for name in FP8_RUNS:      # signed distances, for the reader: from each unquantized run and from their mean
        for key, what in (("end", "training loss"), ("val", "held-out")):
            x, refs = summary[name][key], (base[key], again[key])
            mean = sum(refs) / 2 if all(refs) else None
            print(f"{name}, {what}: {signed(x, refs[0])} from the unquantized run, {signed(x, refs[1])} from its "
                  f"repeat, {signed(x, mean)} from their mean")
checks = {}
for name in FP8_RUNS:
    fp8 = summary[name]
    gap, val_gap = gaps(fp8)
    checks[f"{name}: loss within {tol:.2%} of the unquantized run's at the end ({fp8['end']:.4f} vs "
           f"{base['end']:.4f}: {gap:.2%})"] = gap <= tol
    checks[f"{name}: held-out loss within {val_tol:.2%} at the last step ({fp8['val']:.4f} vs {base['val']:.4f}: "
           f"{val_gap:.2%})"] = val_gap <= val_tol
    checks[f"{name}: the run differs from the unquantized one (the FP8 path ran)"] = fp8["loss"] != base["loss"]
checks["all losses finite"] = all(math.isfinite(v) for s in summary.values() for v in s["loss"])
checks[f"every run ran {steps} steps"] = all(len(s["loss"]) == steps for s in summary.values())
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
assert all(checks.values()), "FAIL"
print("PASS")
