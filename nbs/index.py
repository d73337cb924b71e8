# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # pith_lit: a tour
#
# pith_lit is a compact mixture-of-experts pretraining system. This notebook walks through it in the order the
# pieces meet during a training step, on a model small enough for a laptop CPU:
#
# 1. a tiny Qwen3-MoE, and the **five-stage layer protocol** every model follows;
# 2. the **embedded corpus** (the Python standard library's source) and the byte tokenizer;
# 3. a short **training run** with load balancing, AdamW and checkpoints, and its loss curve.
#
# Each step links to the notebook that builds it. The notebooks are numbered in reading order:
# `ops/1x` (Triton kernels), `models/2x`, `engine/3x` (parallelism), `train/4x`, and `validate/` (papermill
# validations that end in PASS or FAIL).

# %%
import math
import tempfile

import matplotlib.pyplot as plt
import torch

from pith_lit.models.protocol import LocalDispatcher, run_layers
from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM
from pith_lit.testing import repo_path
from pith_lit.train.config import load_config
from pith_lit.train.data import build_dataset
from pith_lit.train.trainer import train

# %% [markdown]
# ## 1 · A tiny MoE and its five stages
#
# Each decoder layer is cut where communication would happen once experts live on other GPUs:
# `stage1` (attention, norm, router) → **dispatch** → `stage3` (experts on rows grouped by expert, then each
# token's router-weighted sum) → **combine** → `stage5` (residual). Dispatch and combine belong to the engine; on
# one device nothing travels (`LocalDispatcher`); across GPUs they are all-to-alls, and the weighted sum on the
# experts' rank means one row per token and rank returns (`engine/31_ep`). Cutting layers this way is what later
# lets one micro-batch's all-to-all run while another computes (`models/20_protocol`, `engine/32_stages`).

# %%
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(Config())
ids = torch.randint(0, 256, (2, 16))
h = model.prolog(ids)
layer = model.model.layers["0"]
h1, x, routing = layer.stage1(h, torch.arange(16))
print("tokens × top-k expert ids of layer 0:", tuple(routing.ids.shape), "router probs:", tuple(routing.probs.shape))
d = LocalDispatcher(Config().num_experts)
x_grouped, counts = d.expand(d.dispatch(x, routing), routing)
print("rows per expert after dispatch:", counts.tolist())

# %% [markdown]
# The five stages, run for every layer, give the same logits as `reference_forward`, a plain forward that loops
# over experts with masks and shares no code with the engine:

# %%
staged, _ = run_layers(model.model.layers.values(), model.prolog(ids), torch.arange(16), LocalDispatcher(8))
torch.testing.assert_close(model.epilog(staged), model.reference_forward(ids))
print("five-stage forward == reference forward")

# %% [markdown]
# ## 2 · Data that needs no download
#
# The default corpus is the standard library's own `.py` files, found from the running interpreter, tokenized
# once into a packed, memory-mapped file. Windows of `seq_len + 1` tokens are shuffled from the seed, and the
# batch of any step is a pure function of the step number, which makes resuming exact (`train/41_data`).

# %%
tmp = tempfile.mkdtemp()
data, _ = build_dataset("stdlib", "bytes", f"{tmp}/cache", seq_len=64, seed=0, rank=0, world=1, model_vocab_size=384)
inputs, labels = data.batch(step=0, micro_index=0, micro_batch=2, num_micro=1)
print(len(data), "windows;", bytes(inputs[0, :60].tolist()).decode(errors="replace"))

# %% [markdown]
# ## 3 · Training
#
# `train(cfg)` is the whole loop (`train/45_trainer`); `python -m pith_lit.train` runs it from the command line
# with the same config (`train/40_config`). Forty steps of the tiny model take well under a minute here.

# %%
cfg = load_config(repo_path("configs/tiny.toml"), [f"run.dir={tmp}/run", "train.steps=40", "train.warmup=8",
                                                  "log.tensorboard=false", "log.sample_tokens=0"])
out = train(cfg, quiet=True)
loss = [r["loss"] for r in out["history"]]
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(range(1, len(loss) + 1), loss, label="training loss")
ax.axhline(math.log(cfg.model.vocab_size), color="gray", lw=0.8, ls="--", label="ln(vocab): uniform guess")
ax.set(xlabel="step", ylabel="loss (nats/token)"); ax.legend()
assert loss[-1] < loss[0] - 1.0

# %% [markdown]
# Where to go next: `train/45_trainer` for the loop in full, `ops/` for the kernels that make it fast on a GPU,
# and `validate/v01_training` for the validation that the skills run (`skills/README.md`).
