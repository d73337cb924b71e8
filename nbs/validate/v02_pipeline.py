# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # v02 · Pipeline validation
#
# Runs DualPipeV (engine/33_dualpipev, through the checks of engine/39_testing) on `nproc` processes, `nproc / ep` pipeline ranks times `ep` expert-parallel
# ranks, and checks two things: one step per micro-batch count in `micro` gives the loss and gradients of a single
# process running the whole model (float32 on the CPU to 1e-6 / 1e-5 relative; bf16 on GPUs, to rounding); and a
# measured step of a wider model runs every rank's schedule, action by action. It draws the measured timeline
# above the one `simulate` predicts from the measured durations into `out_dir/v02_pipeline.png`, prints both bubble
# fractions, and ends with PASS or FAIL.
#
# CPU (the defaults), from the repository root with the venv active:
# `mkdir -p out && jupytext --to ipynb nbs/validate/v02_pipeline.py -o - | papermill - out/v02.ipynb -p out_dir out`.
# Two GPUs, pipeline only, then four with expert parallelism: the same with `-p nproc 2 -p device cuda
# -p timeline_hidden 2048 -p timeline_seq 4096`, and with `-p nproc 4 -p ep 2 -p device cuda -p micro "[4, 5]"
# -p timeline_hidden 2048 -p timeline_seq 4096` added.

# %% tags=["parameters"]
nproc = 2
ep = 1
device = "cpu"
micro = [4, 6]
timeline_micro = 8
timeline_hidden = 128
timeline_seq = 64
out_dir = "."

# %%
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from pith_lit.engine.dualpipev import COMPUTE_ACTIONS, action_kind, bubble_fraction, dualpipev_schedule, simulate

matplotlib.use("Agg")
out = Path(out_dir)
timeline_file = out / "v02_timeline.json"
failures = []

# %% [markdown]
# `draw_timeline` draws a step one row per rank: F in blue (light: phase 0, dark: phase 1), B in green, an
# overlapped F&B pair as a half-blue half-green box, W in orange, and waiting for transfers in grey; numbers are
# micro-batches.

# %%
COLORS = {"F0": "#9ecae1", "F1": "#3182bd", "B0": "#a1d99b", "B1": "#31a354", "W": "#fdae6b", "comm": "#d9d9d9"}


def draw_timeline(ax, events: list[list[tuple]], title: str = "") -> None:
    "Draw per-rank events `(kind, micro, start, end)` on a matplotlib axis, rank 0 at the top, with a legend."
    from matplotlib.patches import Patch
    for r, ev in enumerate(events):
        for kind, micro, start, end in ev:
            parts = kind.split("&")
            h = 0.8 / len(parts)
            for i, part in enumerate(parts):          # F&B: upper half forward, lower half backward
                ax.broken_barh([(start, end - start)], (r - 0.4 + i * h, h), color=COLORS[part],
                               edgecolor="white", linewidth=0.5)
            if micro is not None and kind != "comm":
                label = "|".join(map(str, micro)) if isinstance(micro, (list, tuple)) else str(micro)
                ax.text((start + end) / 2, r, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(events)), [f"rank {r}" for r in range(len(events))])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=c, label="wait" if k == "comm" else k) for k, c in COLORS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=6, frameon=False)


# %% [markdown]
# ## Against one process, then a measured step

# %%
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
       "-m", "pith_lit.testing", "pipeline", "--micro", *map(str, micro), "--ep", str(ep), "--device", device,
       "--timeline", str(timeline_file), "--timeline-micro", str(timeline_micro),
       "--timeline-hidden", str(timeline_hidden), "--timeline-seq", str(timeline_seq)]
env = {**os.environ, "OMP_NUM_THREADS": "1"}
proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
ok = [line for line in proc.stdout.splitlines() if line.endswith(")") and " OK " in line]
print("\n".join(ok))
if proc.returncode != 0 or len(ok) != nproc * len(micro):
    failures.append(f"checks: exit code {proc.returncode}, {len(ok)} of {nproc * len(micro)} passed")
    print(proc.stdout[-3000:], proc.stderr[-5000:])

# %% [markdown]
# ## The measured schedule and the predicted one
#
# Every rank's recorded actions must be its schedule's F, B, F&B and W actions in order. The prediction replays
# the schedule with each kind of action taking its measured median duration and transfers taking no time.

# %%
P = M = None
if timeline_file.exists():
    run = json.loads(timeline_file.read_text())
    P, M = run["P"], run["M"]
    measured = [[tuple(e) for e in ev] for ev in run["events"]]
    durations = {}
    for r, ev in enumerate(measured):
        actions = [a for a in dualpipev_schedule(r, P, M) if a[0] in COMPUTE_ACTIONS]
        spans = [e for e in ev if e[0] != "comm"]
        if [action_kind(a) for a in actions] != [(e[0], tuple(e[1]) if isinstance(e[1], list) else e[1]) for e in spans]:
            failures.append(f"rank {r}: the recorded actions are not the schedule's")
        for a, e in zip(actions, spans):
            durations.setdefault(("B", a[3]) if a[0] == "B" else a[0], []).append(e[3] - e[2])
    median = {k: sorted(v)[len(v) // 2] for k, v in durations.items()}
    predicted = simulate(P, M, lambda a, rank: median[("B", a[3]) if a[0] == "B" else a[0]])
    fig, axes = plt.subplots(2, 1, figsize=(11, 1.2 + 1.1 * P), sharex=True)
    draw_timeline(axes[0], measured, f"measured on {device}, P = {P}, ep = {ep}, M = {M}: "
                                     f"bubble {bubble_fraction(measured):.1%}")
    draw_timeline(axes[1], predicted, f"predicted from the measured durations: bubble {bubble_fraction(predicted):.1%}")
    axes[1].set_xlabel("seconds")
    plt.tight_layout()
    fig.savefig(out / "v02_pipeline.png", dpi=110)
    print({k if isinstance(k, str) else f"B (zero bubble: {k[1]})": f"{v * 1e3:.2f} ms" for k, v in median.items()})
    print(f"bubble fraction: measured {bubble_fraction(measured):.3f}, predicted {bubble_fraction(predicted):.3f}")
else:
    failures.append("no timeline was written")

# %%
print("FAIL: " + "; ".join(failures) if failures else f"PASS: pp={nproc // ep} ep={ep} on {device}, M in {micro}")
assert not failures
