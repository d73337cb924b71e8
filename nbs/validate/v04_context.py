# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # v04 · Context parallelism against one process
#
# Trains the configured model twice from the same initialisation on the same data: once on one process (cp 1),
# once with `parallel.cp = cp` on `cp` processes, where every sequence is cut into 2·cp zigzag chunks and
# attention runs as a ring (ops/17). Checks that the two loss curves agree within `rtol` at every step, that the
# gradient norms agree too, and that the loss falls by at least `min_drop`; draws both curves and their relative
# difference into `out_dir/v04_context.png` and ends with PASS or FAIL. The CPU default runs in float64: the two
# layouts add in different orders, and in float32 at the tiny config's learning rate the first loss spike (step 8)
# amplifies that rounding (1e-8 up to step 6) into diverging trajectories (1e-2 by step 19) through flipped
# expert choices; in float64 the curves stay equal to rounding.
#
# CPU (the defaults: the tiny Qwen3-MoE with packed documents, two gloo processes), from the repository root with
# the venv active: `mkdir -p out && jupytext --to ipynb nbs/validate/v04_context.py -o - | papermill - out/v04.ipynb
# -p out_dir out`. The other families: `-p config configs/tiny-gpt-oss.toml` or `configs/tiny-deepseek-v2.toml`.
# On two GPUs: `-p config configs/bench-qwen3-30b-a3b.toml -p steps 10 -p rtol 2e-2 -y 'overrides:
# ["model.num_hidden_layers=2", "train.seq_len=32768", "train.micro_batch=1", "train.global_batch=2", "train.warmup=2",
# "ckpt.every=-1"]'` (bf16: the curves agree to bf16 noise over the first steps; not run yet, two GPUs were not lent).

# %% tags=["parameters"]
config = "configs/tiny.toml"  # a path relative to the repository's root, or absolute
cp = 2
steps = 12
overrides = ["train.dtype=float64", "train.seq_len=64", "train.warmup=5", "data.document_mask=true"]
rtol = 1e-6       # float64: only the order of additions differs
min_drop = 1.0
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
out = Path(out_dir)
runs = out / "v04_runs"
shutil.rmtree(runs, ignore_errors=True)

# %% [markdown]
# ## The two runs
#
# Each is `python -m pith_lit.train`, the context-parallel one under torchrun, exactly as a user launches them.

# %%
config = Path(config) if Path(config).is_absolute() else repo_path(config)


def launch(nproc: int, extra: list[str], name: str) -> list[dict]:
    quiet = ["ckpt.every=-1", "log.sample_tokens=0", "log.tensorboard=false", "log.eval_every=0"]
    sets = [a for o in [f"train.steps={steps}", *quiet, *overrides, *extra, f"run.dir={runs / name}"]
            for a in ("--set", o)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "pith_lit.train", str(config), *sets]
    proc = subprocess.run(cmd, cwd=repo_path(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-3000:]}"
    return [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]


one = launch(1, [], "cp1")
ring = launch(cp, [f"parallel.cp={cp}"], f"cp{cp}")
diff = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ring, one)]
gdiff = [abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"]) for a, b in zip(ring, one)]
print(f"cp 1: loss {one[0]['loss']:.4f} -> {one[-1]['loss']:.4f}; cp {cp}: {ring[0]['loss']:.4f} -> "
      f"{ring[-1]['loss']:.4f}; worst relative difference: loss {max(diff):.1e}, gradient norm {max(gdiff):.1e}")

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
a.plot([r["step"] for r in one], [r["loss"] for r in one], label="cp 1 (one process)")
a.plot([r["step"] for r in ring], [r["loss"] for r in ring], "--", label=f"cp {cp} (ring attention)")
a.set(xlabel="step", ylabel="loss (nats/token)", title="training loss"); a.legend()
b.semilogy([r["step"] for r in ring], [max(d, 1e-17) for d in diff], label="loss")
b.semilogy([r["step"] for r in ring], [max(d, 1e-17) for d in gdiff], label="gradient norm")
b.axhline(rtol, color="gray", lw=0.8, label=f"rtol {rtol:g}")
b.set(xlabel="step", ylabel="relative difference", title=f"cp {cp} against cp 1"); b.legend()
fig.tight_layout(); fig.savefig(out / "v04_context.png", dpi=110)

# %% [markdown]
# ## Verdict

# %%
drop = one[0]["loss"] - one[-1]["loss"]
checks = {
    f"both runs took {steps} steps": len(one) == len(ring) == steps,
    f"losses agree within {rtol:g} at every step (worst {max(diff):.1e})": max(diff) <= rtol,
    f"gradient norms agree within {10 * rtol:g} (worst {max(gdiff):.1e})": max(gdiff) <= 10 * rtol,
    f"loss falls by ≥ {min_drop} (fell {drop:.3f})": drop >= min_drop,
    "all losses finite": all(math.isfinite(r["loss"]) for r in one + ring),
}
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
assert all(checks.values()), "FAIL"
print("PASS")
