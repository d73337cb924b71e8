# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The trainer
#
# One function, `train(cfg)`, that a reader can follow top to bottom: set up the device and process group,
# build the model, optimizer and data, resume from the latest checkpoint, then loop over optimizer steps. Each
# step runs its micro-batches through the five-stage layer protocol, adds the load-balance loss, divides the
# summed token loss by the token count of the whole global batch (so gradient accumulation is exact), clips,
# steps, logs, and checkpoints. Everything a step needs is a pure function of the step number (learning rate,
# data), which is why a resumed run repeats the straight one exactly.
#
# What it guards against: a NaN or infinite loss stops the run naming the step, *before* anything is saved, so
# the last good checkpoint stays the latest; SIGINT or SIGTERM finishes the current step, saves, and exits
# cleanly; a run directory holding a checkpoint of another model is refused by the checkpoint loader.
#
# The command line (`python -m pith_lit.train`) is the next notebook, `49_main`.

# %%
#| default_exp train.trainer

# %%
#| export
import json
import math
import resource
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from pith_lit.engine.ep import EPDispatcher, all_reduce_grads, is_expert_param, shard_experts
from pith_lit.engine.mesh import Mesh, build_mesh, init_distributed, launch_env
from pith_lit.models.protocol import LocalDispatcher, run_layers
from pith_lit.train import checkpoint
from pith_lit.train.config import Config, ConfigError, dump_toml, to_dict
from pith_lit.train.data import build_dataset, load_tokenizer
from pith_lit.train.load_balance import LoadBalance
from pith_lit.train.optim import MasterWeights, build_optimizer, clip_grad_norm, count_tokens, lr_at, token_loss_sum

# %% [markdown]
# ## Building the model
#
# The model family is chosen by `model.model_type` with a plain `match`: adding a family means adding a case
# here and in `config.model_class`.

# %%
#| export
def build_model(model_cfg) -> torch.nn.Module:
    "The model of the family `model_cfg.model_type`, freshly initialised, in float32 on the CPU."
    match model_cfg.model_type:
        case "qwen3_moe":
            from pith_lit.models.qwen3_moe import Qwen3MoeForCausalLM
            return Qwen3MoeForCausalLM(model_cfg)
        case "deepseek_v2":
            from pith_lit.models.deepseek_v2 import DeepseekV2ForCausalLM
            return DeepseekV2ForCausalLM(model_cfg)
        case "gpt_oss":
            from pith_lit.models.gpt_oss import GptOssForCausalLM
            return GptOssForCausalLM(model_cfg)
        case other:
            raise ConfigError(f"model.model_type = {other!r}: no model class for it")

# %% [markdown]
# ## Model FLOPs and MFU
#
# Model FLOPs per token are 6 × the active matmul parameters (2 for the forward multiply-add, 4 for the two
# backward products), plus attention's score and value products: 12 · S · heads · head_dim per layer for full
# attention, counted as half of that for a causal mask. Each model computes this (`model.flops_per_token`),
# since attention's widths differ between families. MFU divides achieved model FLOP/s by the dense bf16 peak
# of the GPU (989 TFLOP/s for an H100/H200 SXM). The convention is stated wherever MFU is shown.

# %%
#| export
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12}  # dense bf16 peaks by GPU name


def peak_flops(device: torch.device) -> float | None:
    "The dense bf16 peak of this GPU, or None on CPU or an unknown GPU (then MFU is not shown)."
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)

# %% [markdown]
# ## Setup: device, process group, mesh
#
# A single process needs no process group: everything below then reduces over nothing. Launched by torchrun
# (or SLURM), the default group is started and the device mesh of `engine/30_mesh` gives the groups the step
# needs: `batch` (dp × ep: ranks that read different data), `dense` (ranks holding the same non-expert weights;
# gradients, token counts and losses are summed over it) and `expert` (ranks holding the same experts). With
# `parallel.ep > 1` each rank keeps its share of every layer's experts and the expert-parallel dispatcher of
# `engine/31_ep` exchanges tokens; with `parallel.dp` alone it is plain data parallelism. The pipeline schedule
# and context parallelism are not wired into this trainer.

# %%
#| export
def setup_distributed(cfg: Config) -> tuple[int, torch.device, Mesh | None]:
    "Start the process group and mesh when launched with several processes; returns (rank, device, mesh or None)."
    p = cfg.parallel
    if p.pp > 1 or p.cp > 1 or p.overlap:
        raise ConfigError(f"parallel: pp={p.pp}, cp={p.cp}, overlap={p.overlap}: this trainer runs data and expert "
                          "parallelism (dp, ep); set pp=1, cp=1, overlap=false")
    if launch_env()["world"] == 1:
        device = torch.device("cuda", 0) if cfg.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return 0, device, None
    rank, _, device = init_distributed(p.timeout_s, cfg.device_type)
    return rank, device, build_mesh(p.pp, p.dp, p.cp, p.ep, cfg.device_type, p.timeout_s)


def all_reduce_(t: torch.Tensor, group) -> torch.Tensor:
    "Sum a tensor over `group` in place (a no-op without one)."
    if group is not None:
        dist.all_reduce(t, group=group)
    return t

# %% [markdown]
# ## Stopping cleanly
#
# A signal only sets a flag; the loop checks it between steps, so a checkpoint is never written from inside a
# half-finished step. Under torchrun every rank gets the signal, but they must agree on the step at which they
# stop: the flag is all-reduced with the step's statistics.

# %%
#| export
class StopFlag:
    "Set by SIGINT/SIGTERM; installed for the duration of a `with` block, previous handlers restored after."
    def __init__(self): self.set = False

    def _handler(self, signum, frame):
        self.set = True

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


class NonFiniteLoss(RuntimeError):
    "The loss became NaN or infinite; nothing was saved at or after that step."

# %% [markdown]
# ## One optimizer step
#
# The micro-batches of a step are fetched first so the number of tokens that count toward the loss (labels not
# equal to -100) is known for the whole global batch before any backward; each micro-batch's summed loss is
# divided by it. The load-balance loss is averaged over MoE layers, micro-batches and data-parallel ranks (the
# gradients are summed over ranks, as the token-weighted loss needs). On CUDA the head and the
# loss are fused (`linear_cross_entropy`), which never holds the fp32 logits of the whole micro-batch; on the CPU
# the torch reference runs.

# %%
#| export
def micro_step(model, input_ids, labels, n_tokens, lb: LoadBalance, aux_div: int, dispatcher):
    "Forward and backward of one micro-batch; returns the summed token loss and the load-balance loss (detached)."
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    h = model.prolog(input_ids)
    h, routings = run_layers(model.model.layers.values(), h, positions, dispatcher)
    h = model.model.norm(h).flatten(0, 1)
    if h.is_cuda:
        from pith_lit.ops.cross_entropy import linear_cross_entropy
        ce = linear_cross_entropy(h, model.lm_head.weight, labels.flatten())
    else:
        ce = token_loss_sum(model.lm_head(h), labels.flatten())
    moe = [(key, r) for key, r in zip(model.model.layers.keys(), routings) if r is not None]
    aux = sum(lb.loss(key, r.probs, r.ids) for key, r in moe) / max(len(moe), 1)
    (ce / n_tokens + aux / aux_div).backward()
    return ce.detach(), aux.detach() if torch.is_tensor(aux) else torch.tensor(0.0)

# %% [markdown]
# ## The loop

# %%
#| export
def train(cfg: Config, until: int | None = None, quiet: bool = False) -> dict:
    """Train as `cfg` says; returns a summary dict. Resumes from the latest checkpoint in `run.dir`.

    `until` stops (with a checkpoint) after that many steps in total, as if the run were interrupted there; the
    schedule still follows `train.steps`. Tests and the validation notebook use it to split a run in two."""
    rank, device, mesh = setup_distributed(cfg)
    dense = mesh.dense if mesh is not None else None          # sum losses, counts, dense grads over these
    ep = mesh.ep.size() if mesh is not None else 1
    data_rank, data_world = (mesh.batch.rank(), mesh.batch.size()) if mesh is not None else (0, 1)
    t, run_dir = cfg.train, Path(cfg.run.dir)
    torch.manual_seed(cfg.run.seed)
    with device:  # parameters are created and initialised where they will live
        model = build_model(cfg.model)
    if ep > 1:  # every rank built the same full model from the seed; keep this rank's experts
        shard_experts(model, mesh.ep.rank(), ep)
    if t.compile:  # stages 1 and 5 have static shapes and no host syncs by design; 2-4 stay eager
        for layer in model.model.layers.values():
            layer.stage1 = torch.compile(layer.stage1, fullgraph=True)
            layer.stage5 = torch.compile(layer.stage5, fullgraph=True)
    dtype = cfg.torch_dtype
    master = None
    if dtype != torch.float32:
        model.to(dtype)
        if t.optim_dtype == "float32":
            master = MasterWeights(model)
    stepped = master if master is not None else model   # what the optimizer updates: fp32 masters or the model
    optimizer = build_optimizer(stepped, lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2), eps=t.eps)
    replicated = [p for n, p in stepped.named_parameters() if not (ep > 1 and is_expert_param(n))]
    experts = [p for n, p in stepped.named_parameters() if ep > 1 and is_expert_param(n)]
    data, _ = build_dataset(cfg.data.corpus, cfg.data.tokenizer, run_dir.parent / "cache", t.seq_len, cfg.run.seed,
                            data_rank, data_world, cfg.model.vocab_size, cfg.data.val_frac)
    lb = LoadBalance(cfg.model.routed_experts, t.lb_coef, t.lb_level, group=dense)
    dispatcher = EPDispatcher(mesh.ep, cfg.model.routed_experts) if ep > 1 else LocalDispatcher(cfg.model.routed_experts)
    model_cfg = to_dict(cfg)["model"]
    extra = {"master": master} if master is not None else {}
    world = dist.get_world_size() if mesh is not None else 1

    if ep > 1 and cfg.ckpt.every >= 0:
        raise ConfigError(f"parallel.ep = {ep}: checkpoints of expert-sharded models are not written yet (each rank "
                          "holds different experts under the same names); set ckpt.every = -1 for this run")
    start = 0
    last = checkpoint.latest(run_dir) if cfg.ckpt.resume else None
    if last is not None:
        start = checkpoint.load(last, model=model, optimizer=optimizer, extra=extra, model_config=model_cfg)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dump_toml(cfg))
    end = t.steps if until is None else min(until, t.steps)

    fpt, peak = model.flops_per_token(t.seq_len), peak_flops(device)
    writer = None
    if rank == 0 and cfg.log.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(run_dir / "tb")
    metrics_file = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    say = (lambda s: None) if quiet or rank != 0 else tqdm.write
    if rank == 0 and not quiet:
        n = sum(p.numel() for p in model.parameters())
        say(f"pith_lit: {cfg.model.model_type} {n/1e6:.2f}M params ({model.active_matmul_params()/1e6:.2f}M active "
            f"matmul), {device.type} {str(dtype).removeprefix('torch.')}, {world} rank(s), steps {start}->{end}, "
            f"{cfg.tokens_per_step} tokens/step, run dir {run_dir}")

    bar = tqdm(range(start, end), initial=start, total=end, disable=quiet or rank != 0, desc="train",
               dynamic_ncols=True)
    history, step, stopped = [], start, False
    with StopFlag() as stop:
        for step in bar:
            t0 = time.perf_counter()
            lr = lr_at(step, lr=t.lr, steps=t.steps, warmup=t.warmup, schedule=t.schedule,
                       decay_frac=t.decay_frac, min_lr_ratio=t.min_lr_ratio)
            for g in optimizer.param_groups:
                g["lr"] = lr
            lb.start_step()
            n_micro = cfg.num_micro_batches
            batches = [data.batch(step, m, t.micro_batch, n_micro) for m in range(n_micro)]
            n_tokens = all_reduce_(sum(count_tokens(y) for _, y in batches).to(device, torch.float32), dense)
            ce_sum, aux_sum = torch.zeros((), device=device), torch.zeros((), device=device)
            for x, y in batches:
                ce, aux = micro_step(model, x.to(device), y.to(device), n_tokens, lb, n_micro * data_world,
                                     dispatcher)
                ce_sum += ce.float()
                aux_sum += aux.float().to(device)
            if mesh is not None:  # sums: the token-weighted loss already divides by the global token count
                all_reduce_grads(model, mesh.dense, mesh.expert)
            if master is not None:
                master.grads_to_master()
            grad_norm = clip_grad_norm(replicated, t.grad_clip, experts, mesh.ep if ep > 1 else None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if master is not None:
                master.master_to_model()
            stats = all_reduce_(torch.stack([ce_sum, torch.tensor(float(stop.set), device=device)]), dense)
            loss = (stats[0] / n_tokens).item()
            stop_now = stats[1].item() > 0
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            bal = lb.stats()
            rec = {"step": step + 1, "loss": loss, "lb_loss": aux_sum.item() / n_micro, "balance": bal['lb/mean'],
                   "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": cfg.tokens_per_step / dt,
                   "step_time_s": dt}
            if peak is not None:
                rec["mfu"] = rec["tokens_per_s"] * fpt / (peak * world)
            rec["peak_mem_gb"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else
                                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
            history.append(rec)
            if rank == 0:
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
                if writer is not None:
                    for k, v in rec.items():
                        if k != "step":
                            writer.add_scalar(f"train/{k}", v, rec["step"])
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}")
                if (step + 1) % cfg.log.every == 0 or step == start:
                    mfu = f" mfu {rec['mfu']:.1%}" if "mfu" in rec else ""
                    say(f"step {step + 1:>6} loss {loss:.4f} balance {bal['lb/mean']:.3f} lr {lr:.2e} "
                        f"grad {rec['grad_norm']:.3f} {rec['tokens_per_s']:,.0f} tok/s{mfu} "
                        f"peak {rec['peak_mem_gb']:.2f} GiB")
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss is {loss} at step {step + 1}; nothing was saved for this step, so the "
                                    f"latest checkpoint in {run_dir / 'ckpt'} is the last good one. Lower train.lr, "
                                    "raise train.warmup or check the data, then rerun to resume from it.")
            done = step + 1
            every = cfg.ckpt.every
            if every >= 0 and (stop_now or done == end or (every and done % every == 0)):
                checkpoint.save(run_dir, done, model=model, optimizer=optimizer, extra=extra, model_config=model_cfg,
                                keep=cfg.ckpt.keep)
            if stop_now:
                say(f"stopped by signal after step {done}; checkpoint saved, rerun to resume")
                stopped = True
                break
    bar.close()
    if writer is not None:
        writer.close()
    if metrics_file is not None:
        metrics_file.close()
    sample = ""
    if rank == 0 and cfg.log.sample_tokens and not stopped and history and ep == 1:  # sampling needs every expert
        sample = greedy_sample(model, load_tokenizer(cfg.data.tokenizer), data, cfg.log.sample_tokens, device)
        say("sample: " + repr(sample))
    return {"history": history, "start": start, "end": step + 1 if history else start, "stopped": stopped,
            "sample": sample, "model": model}

# %% [markdown]
# ## A greedy sample
#
# The run ends by continuing a piece of the training data for a few tokens, greedily. It uses
# `reference_forward` (no cache; the tiny model makes this instant) and shows whether the model has picked up
# the corpus's shape.

# %%
#| export
@torch.no_grad()
def greedy_sample(model, tokenizer, data, n_tokens: int, device, prompt_len: int = 32) -> str:
    "Decode `n_tokens` greedy tokens after the first `prompt_len` tokens of the first training window."
    x, _ = data.batch(0, 0, 1, 1)
    ids = x[:1, :prompt_len].to(device)
    for _ in range(n_tokens):
        logits = model.reference_forward(ids)
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return tokenizer.decode(ids[0, prompt_len:].tolist())

# %% [markdown]
# ## A short run
#
# Twenty steps of the tiny default model on the embedded corpus, in a scratch directory. The loss starts near
# ln(vocab) and falls.

# %%
import tempfile

from pith_lit.train.config import load_config

# %%
tmp = tempfile.mkdtemp()
cfg = load_config(overrides=[f"run.dir={tmp}/run", "train.steps=20", "train.warmup=5", "log.every=5",
                             "log.sample_tokens=16", "log.tensorboard=false"])
out = train(cfg)
losses = [r["loss"] for r in out["history"]]
print([round(l, 3) for l in losses])
assert abs(losses[0] - math.log(cfg.model.vocab_size)) < 0.5, "the first loss should be near ln(vocab)"
assert min(losses[-5:]) < losses[0] - 0.5, "the loss should fall within 20 steps"

# %% [markdown]
# `metrics.jsonl` has one object per step with the fields the issue tracker and plots read:

# %%
recs = [json.loads(l) for l in open(f"{tmp}/run/metrics.jsonl")]
assert [r["step"] for r in recs] == list(range(1, 21))
assert {"step", "loss", "lb_loss", "lr", "grad_norm", "tokens_per_s"} <= recs[0].keys()
recs[-1]

# %% [markdown]
# ## Resuming repeats the straight run
#
# Ten steps, stop (with a checkpoint), then a fresh `train` call on the same run directory: the second half's
# losses equal the straight run's, bit for bit, because model, optimizer, RNG and data position all come back.

# %%
cfg2 = load_config(overrides=[f"run.dir={tmp}/split", "train.steps=20", "train.warmup=5", "log.sample_tokens=0",
                              "log.tensorboard=false"])
first = train(cfg2, until=10, quiet=True)
second = train(cfg2, quiet=True)
assert second["start"] == 10
split = [r["loss"] for r in first["history"] + second["history"]]
assert split == losses, (split, losses)
print("resumed run repeats the straight run exactly")

# %% [markdown]
# ## A NaN stops the run and keeps the last good checkpoint
#
# Four good steps with a checkpoint every two, then the same run directory resumed with an infinite learning
# rate, which turns every weight into NaN at the first update: the next loss is NaN, the run stops naming that
# step, and the latest checkpoint is still the good one from step 4.

# %%
over = [f"run.dir={tmp}/nan", "train.steps=40", "train.warmup=0", "ckpt.every=2", "log.sample_tokens=0",
        "log.tensorboard=false"]
train(load_config(overrides=over), until=4, quiet=True)
try:
    train(load_config(overrides=over + ["train.lr=inf"]), quiet=True)
    raise AssertionError("expected the run to stop on a non-finite loss")
except NonFiniteLoss as e:
    print(e)
    assert "at step 6;" in str(e)
assert checkpoint.latest(f"{tmp}/nan").name.endswith("04")
