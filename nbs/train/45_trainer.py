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
# steps, logs, and checkpoints. The micro-batches run one after the other, or, with `parallel.pp > 1` or
# `parallel.overlap`, through the DualPipeV schedule of `engine/33_dualpipev`, which computes the same gradients.
# Everything a step needs is a pure function of the step number (learning rate, data), which is why a resumed run
# repeats the straight one exactly.
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
import os
import resource
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from pith_lit.engine.dualpipev import DualPipeV, split_model
from pith_lit.engine.ep import EPDispatcher, all_reduce_grads, is_expert_param, shard_experts
from pith_lit.engine.mesh import Mesh, build_mesh, init_distributed, launch_env, twin_group
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
    "The model of the family `model_cfg.model_type` in float32 on the default device, initialised (not on meta)."
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
# `engine/31_ep` exchanges tokens; with `parallel.dp` alone it is plain data parallelism. With `parallel.pp > 1`
# the `pp` group links the pipeline ranks (below). Context parallelism is not wired into this trainer. The
# number of processes must be the product of the sizes; the command line checks it too, `train(cfg)` called from
# Python checks it here.
#
# Checkpoints work in every layout: pipeline ranks save their own parameters under their real names, expert
# slices are saved as slices of one tensor (train/44_checkpoint), and the optimizer is saved through the module
# it actually steps (the fp32 master weights when the model computes in bf16).

# %%
#| export
def setup_distributed(cfg: Config) -> tuple[int, torch.device, Mesh | None]:
    "Start the process group and mesh when launched with several processes; returns (rank, device, mesh or None)."
    p, world = cfg.parallel, launch_env()["world"]
    if p.cp > 1:
        raise ConfigError(f"parallel.cp = {p.cp}: context parallelism is not wired into this trainer; set cp = 1")
    if world != cfg.world_size:
        raise ConfigError(f"parallel: pp × dp × cp × ep = {p.pp} × {p.dp} × {p.cp} × {p.ep} = {cfg.world_size}, but "
                          f"{world} process(es) were launched; launch {cfg.world_size} (torchrun --nproc-per-node) "
                          "or choose sizes whose product is the number of processes")
    if world == 1:
        device = torch.device("cuda", 0) if cfg.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return 0, device, None
    rank, _, device = init_distributed(p.timeout_s, cfg.device_type)
    return rank, device, build_mesh(p.pp, p.dp, p.cp, p.ep, cfg.device_type, p.timeout_s, p.comm_priority)


def expandable_segments() -> bool:
    """Ask the CUDA caching allocator for expandable segments, unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF
    is set (the user's choice stands). Returns whether it was asked."""
    if any(v in os.environ for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:                                  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
    return True


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
def head_loss(model, h, labels) -> torch.Tensor:
    "Summed token loss of the final norm and the head on the last hidden states `h (B, S, H)`, `labels (B, S)`."
    h = model.model.norm(h).flatten(0, 1)
    if h.is_cuda:
        from pith_lit.ops.cross_entropy import linear_cross_entropy
        return linear_cross_entropy(h, model.lm_head.weight, labels.flatten())
    return token_loss_sum(model.lm_head(h), labels.flatten())


def micro_step(model, input_ids, labels, n_tokens, lb: LoadBalance, aux_div: int, dispatcher):
    "Forward and backward of one micro-batch; returns the summed token loss and the load-balance loss (detached)."
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    h = model.prolog(input_ids)
    h, routings = run_layers(model.model.layers.values(), h, positions, dispatcher)
    ce = head_loss(model, h, labels)
    moe = [(key, r) for key, r in zip(model.model.layers.keys(), routings) if r is not None]
    aux = sum(lb.loss(key, r.probs, r.ids) for key, r in moe) / max(len(moe), 1)
    (ce / n_tokens + aux / aux_div).backward()
    return ce.detach(), aux.detach() if torch.is_tensor(aux) else torch.tensor(0.0)

# %% [markdown]
# ## The same step through DualPipeV
#
# With `parallel.pp > 1`, or `parallel.overlap = true`, a step's micro-batches run through the DualPipeV schedule of
# `engine/33_dualpipev` instead of one after the other. `split_model` keeps this pipeline rank's two stages (rank 0
# also keeps the embedding, the final norm and the head, so it computes the loss); every pipeline rank of a dp × ep
# column reads the same micro-batches, since the data is divided over dp × ep only.
#
# The objective is `micro_step`'s, term by term. Pipeline rank 0's `loss_fn` is `head_loss`, which `step` scales by
# 1 / (tokens of the global batch). `aux_fn` is one MoE layer's load-balance loss divided by (MoE layers of the
# whole model × `aux_div`), the same as micro_step's mean over layers divided by `aux_div`; every rank divides by
# the whole model's count, so the terms of all pipeline ranks add up to micro_step's. Each layer sees the
# micro-batches in order (a stage runs its forwards in micro-batch order), so the running expert counts of
# `lb_level = "global"` are the plain loop's too: the loss is the same by construction, and only the order in
# which floating-point gradients are summed differs.
#
# `parallel.overlap = true` at `pp = 1` is this path with one pipeline rank: both stages live on it, and the
# forward of one micro-batch runs beside the backward of another, so that with `ep > 1` each one's all-to-alls
# can hide behind the other's compute (on CUDA; on the CPU the steps simply alternate).

# %%
#| export
def moe_layer_count(model) -> int:
    "Layers holding routed experts (a module named `experts`, which engine/31_ep shards)."
    return sum(any(is_expert_param(n) for n, _ in layer.named_parameters()) for layer in model.model.layers.values())


def build_pipeline(model, parts, group, dispatcher, lb: LoadBalance, n_moe: int, aux_div: int,
                   device, comm_priority: bool = False, pair_edges: bool = False, overlap_p2p: bool = False,
                   recv_ahead: int = 1) -> DualPipeV:
    """DualPipeV over this rank's `parts` (from `split_model(model, ...)`) with micro_step's objective; `n_moe` is
    the MoE layer count of the whole model, counted before the split."""
    loss_fn = (lambda h, labels: head_loss(model, h, labels)) if parts[0].index == 0 else None
    aux_fn = lambda key, routing: lb.loss(key, routing.probs, routing.ids) / (n_moe * aux_div)
    return DualPipeV(parts, group, dispatcher, loss_fn, aux_fn, device, comm_priority, pair_edges, overlap_p2p,
                     recv_ahead)

# %% [markdown]
# A check in float64, where the two ways of summing agree to rounding: three micro-batches of the tiny default
# model, with a global load-balance loss of weight 0.1, through `micro_step` one after the other and through
# DualPipeV with one pipeline rank (`parallel.overlap`). Losses, load-balance losses, balance statistics and every
# gradient agree. (The token loss itself is computed in float32 by `token_loss_sum`; `step` sums it in float64.)
# Two processes against one (`pp = 2`) are in tests/test_trainer.py.

# %%
import copy

from pith_lit.train.config import load_config

# %%
mc = load_config().model
torch.manual_seed(0)
plain = build_model(mc).double()
piped = copy.deepcopy(plain)
g = torch.Generator().manual_seed(0)
mbs = [tuple(torch.randint(0, mc.vocab_size, (2, 16), generator=g) for _ in range(2)) for _ in range(3)]
n_tok, E = torch.tensor(3 * 2 * 16.0, dtype=torch.float64), mc.routed_experts
lb_plain, lb_piped = LoadBalance(E, 0.1, "global"), LoadBalance(E, 0.1, "global")
outs = [micro_step(plain, x, y, n_tok, lb_plain, 3, LocalDispatcher(E)) for x, y in mbs]
pipe = build_pipeline(piped, split_model(piped, 0, 1), None, LocalDispatcher(E), lb_piped, moe_layer_count(piped),
                      3, torch.device("cpu"))
ce_piped, aux_piped = pipe.step(mbs, 1 / n_tok)
ce_plain, aux_plain = sum(c.double() for c, _ in outs), sum(a for _, a in outs) / 3   # summed as step does
worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
            for p, q in zip(piped.parameters(), plain.parameters()))
print(f"loss {ce_piped.item():.6f} vs {ce_plain.item():.6f}, load balance {aux_piped.item():.6f} vs "
      f"{aux_plain.item():.6f}, worst gradient difference {worst:.1e} (relative)")
assert abs(ce_piped - ce_plain) < 1e-12 * ce_plain and abs(aux_piped - aux_plain) < 1e-12 * aux_plain
assert worst < 1e-10, worst
assert all(abs(v - lb_plain.stats()[k]) < 1e-12 for k, v in lb_piped.stats().items())

# %% [markdown]
# ## The gradient norm of a split model
#
# Clipping needs the norm of the whole model's gradient. Within a pipeline rank, `clip_grad_norm` already adds
# the squared norms of the expert shards over the `ep` group. The pipeline ranks hold disjoint layers, so their
# squared norms add: this rank's norm (`clip_grad_norm` with `max_norm = 0` only measures), squared, summed over
# the `pp` group, and its square root is the whole model's norm, exact up to rounding. Every rank then clips its
# gradients by that one norm, as one process would.

# %%
#| export
def clip_grads(replicated: list, experts: list, max_norm: float, mesh: Mesh | None) -> torch.Tensor:
    """Clip by the whole model's gradient norm and return it. `replicated`: this rank's parameters that are the same
    on every rank of the `dense` group; `experts`: its expert shards (empty unless ep > 1)."""
    ep_group = mesh.ep if mesh is not None and mesh.ep.size() > 1 else None
    if mesh is None or mesh.pp.size() == 1:
        return clip_grad_norm(replicated, max_norm, experts, ep_group)
    sq = clip_grad_norm(replicated, 0, experts, ep_group).float() ** 2
    dist.all_reduce(sq, group=mesh.pp)
    norm = sq.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(replicated + experts, max_norm, norm)
    return norm

# %% [markdown]
# ## The loop
#
# What needs the whole model is computed before the split: the parameter count, the model FLOPs per token and the
# number of MoE layers. The optimizer (and the fp32 master weights) are built after it, over the parameters this
# rank keeps. After the step every statistic that is logged is summed over all ranks in one collective, so every
# rank agrees on the loss and on whether a signal asked to stop: the token loss (nonzero on pipeline rank 0 only),
# the load-balance terms as they entered the objective (their sum over all ranks is the mean load-balance loss over
# layers, micro-batches and data ranks), and each MoE layer's balance (`LoadBalance.stats`, already summed over
# the data ranks; a pipeline rank reports its own layers, and the logged balance is the mean over all of them).
#
# The model is built on the **meta device**: the whole model's shapes cost nothing, each rank cuts out its
# pipeline stages and expert slices, and only then are this rank's parameters allocated (`to_empty`) and
# initialised (`init_weights(run.seed)`). Every parameter draws from its own generator keyed by its name and, for
# experts, the global expert index (models/20_protocol `SeededInit`), so a rank holds exactly the values the same
# parameters have in the whole model: the layouts start from the same weights, and a 30B model never has to fit
# one GPU.
#
# Checkpoints work at every layout: each rank saves and loads its own stages and expert slices (train/44). A run
# can also start from a weights-only checkpoint (imported Hugging Face weights, train/47_convert): that holds no
# optimizer, and each rank reads its own parameters. The greedy sample at the end needs the whole model and is
# skipped when it is split.
#
# What a rank of the real Qwen3-30B-A3B holds at pp 2 × ep 4 (the paper's eight-GPU shape), counted on the meta
# device: with bf16 weights and gradients, fp32 masters and two fp32 AdamW moments (16 bytes a parameter) it is
# about 70 GiB, where building the whole model first would have needed 114 GiB of float32 on every GPU.

# %%
for r in range(2):
    with torch.device("meta"):
        big = build_model(load_config(Path("../../configs/qwen3-30b-a3b.toml")).model)
    n_all = sum(p.numel() for p in big.parameters())
    split_model(big, r, 2)
    shard_experts(big, 0, 4)
    n = sum(p.numel() for p in big.parameters())
    print(f"pp rank {r} of 2, ep 4: {n / 1e9:.2f}B of {n_all / 1e9:.2f}B parameters, {n * 16 / 2**30:.1f} GiB of "
          "weights, gradients and optimizer states")
    assert n * 16 / 2**30 < 80 and n_all * 4 / 2**30 > 110

# %%
#| export
def train(cfg: Config, until: int | None = None, quiet: bool = False) -> dict:
    """Train as `cfg` says; returns a summary dict. Resumes from the latest checkpoint in `run.dir`.

    `until` stops (with a checkpoint) after that many steps in total, as if the run were interrupted there; the
    schedule still follows `train.steps`. Tests and the validation notebook use it to split a run in two."""
    if cfg.train.expandable_segments and cfg.device_type == "cuda":
        expandable_segments()
    rank, device, mesh = setup_distributed(cfg)
    dense = mesh.dense if mesh is not None else None          # sum token counts, dense grads, lb counts over these
    everyone = dist.group.WORLD if mesh is not None else None  # sum the logged statistics over all ranks
    ep = mesh.ep.size() if mesh is not None else 1
    pp, pp_rank = (mesh.pp.size(), mesh.pp.rank()) if mesh is not None else (1, 0)
    pipelined = pp > 1 or cfg.parallel.overlap
    data_rank, data_world = (mesh.batch.rank(), mesh.batch.size()) if mesh is not None else (0, 1)
    t, run_dir = cfg.train, Path(cfg.run.dir)
    torch.manual_seed(cfg.run.seed)
    with torch.device("meta"):  # shapes only: the whole model costs no memory until this rank has cut out its share
        model = build_model(cfg.model)
    # what needs the whole model comes first
    n_params, active = sum(p.numel() for p in model.parameters()), model.active_matmul_params()
    fpt, n_moe = model.flops_per_token(t.seq_len), moe_layer_count(model)
    parts = (split_model(model, pp_rank, pp, cfg.parallel.pp_edge_layers, cfg.parallel.pp_stage_layers)
             if pipelined else None)   # this rank's stages
    if ep > 1:  # keep this rank's experts
        shard_experts(model, mesh.ep.rank(), ep)
    model.to_empty(device=device)
    model.init_weights(cfg.run.seed)   # per-parameter generators: the values of the whole model, whatever the cut
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
    # deferred: the forward does not wait for the global counts (train/42); their values are settled per step
    lb = LoadBalance(cfg.model.routed_experts, t.lb_coef, t.lb_level, group=dense, deferred=True)
    E = cfg.model.routed_experts
    p = cfg.parallel
    back = twin_group(mesh, "ep", p.timeout_s, p.comm_priority) if ep > 1 and p.ep_backward_group else None
    dispatcher = (EPDispatcher(mesh.ep, E, p.ep_combine, p.ep_sync_free, back, p.ep_permute_in_compute) if ep > 1
                  else LocalDispatcher(E))
    n_micro = cfg.num_micro_batches
    aux_div = n_micro * data_world    # the load-balance loss is a mean over micro-batches and data ranks
    pipe = None
    if pipelined and ep > 1 and p.comm_sms and device.type == "cuda":   # measured there; nothing to hide at ep 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if p.comm_sms >= sms:
            raise ConfigError(f"parallel.comm_sms = {p.comm_sms}, but this GPU has {sms} SMs; leave the matmuls "
                              f"some (e.g. comm_sms = {sms // 8})")
        if not hasattr(torch._C, "_set_sm_carveout_experimental"):
            raise ConfigError(f"parallel.comm_sms = {p.comm_sms} needs torch's SM carveout, which torch "
                              f"{torch.__version__} lacks; set parallel.comm_sms = 0 or install a newer torch")
        torch._C._set_sm_carveout_experimental(p.comm_sms)   # a process-wide setting, read at each matmul launch
    if pipelined:
        pipe = build_pipeline(model, parts, mesh.pp if mesh is not None else None, dispatcher, lb, n_moe, aux_div,
                              device, p.comm_priority, p.overlap_edges, p.pp_overlap_p2p, p.pp_recv_ahead)
    model_cfg = to_dict(cfg)["model"]
    extra = {"master": master} if master is not None else {}
    world = dist.get_world_size() if mesh is not None else 1

    start = 0
    last = checkpoint.latest(run_dir) if cfg.ckpt.resume else None
    ckpt_args = dict(model=model, optimizer=optimizer, extra=extra, model_config=model_cfg, optim_module=master,
                     ep_mesh=mesh.device_mesh["ep"] if ep > 1 else None)
    if last is not None:
        start = checkpoint.load(last, **ckpt_args)
        if start == 0 and master is not None:  # imported weights (weights-only checkpoint): masters follow the model
            master.model_to_master()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dump_toml(cfg))
    end = t.steps if until is None else min(until, t.steps)

    peak = peak_flops(device)
    writer = None
    if rank == 0 and cfg.log.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(run_dir / "tb")
    metrics_file = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    say = (lambda s: None) if quiet or rank != 0 else tqdm.write
    if rank == 0 and not quiet:
        how = f", DualPipeV over {pp} pipeline rank(s)" if pipelined else ""
        say(f"pith_lit: {cfg.model.model_type} {n_params/1e6:.2f}M params ({active/1e6:.2f}M active matmul), "
            f"{device.type} {str(dtype).removeprefix('torch.')}, {world} rank(s){how}, steps {start}->{end}, "
            f"{cfg.tokens_per_step} tokens/step, run dir {run_dir}")

    def retries() -> float:   # times the caching allocator ran out, freed its cache and synchronised, so far
        return float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else 0.0

    warned_retries = False
    bar = tqdm(range(start, end), initial=start, total=end, disable=quiet or rank != 0, desc="train",
               dynamic_ncols=True)
    history, step, stopped = [], start, False
    with StopFlag() as stop:
        for step in bar:
            prof = None
            if step + 1 == cfg.log.profile_step:   # one whole step, every rank: host ranges and GPU kernels
                cuda = device.type == "cuda"
                acts = ([torch.profiler.ProfilerActivity.CPU] if cfg.log.profile_host or not cuda else []) + (
                    [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                prof = torch.profiler.profile(activities=acts)
                prof.start()
            t0, retried = time.perf_counter(), retries()
            lr = lr_at(step, lr=t.lr, steps=t.steps, warmup=t.warmup, schedule=t.schedule,
                       decay_frac=t.decay_frac, min_lr_ratio=t.min_lr_ratio)
            for g in optimizer.param_groups:
                g["lr"] = lr
            lb.start_step()
            batches = [data.batch(step, m, t.micro_batch, n_micro) for m in range(n_micro)]
            n_tokens = all_reduce_(sum(count_tokens(y) for _, y in batches).to(device, torch.float32), dense)
            if pipe is not None:  # sums of this rank's stages: the token loss on pipeline rank 0 only
                ce_sum, aux_sum = pipe.step([(x.to(device), y.to(device)) for x, y in batches], 1 / n_tokens)
            else:
                ce_sum, aux_sum = torch.zeros((), device=device), torch.zeros((), device=device)
                for x, y in batches:
                    ce, aux = micro_step(model, x.to(device), y.to(device), n_tokens, lb, aux_div, dispatcher)
                    ce_sum += ce.float()
                    aux_sum += aux.float().to(device) / aux_div     # as it entered the objective
            aux_sum = aux_sum + lb.settle().to(aux_sum) / (max(n_moe, 1) * aux_div)   # the deferred terms' values
            if mesh is not None:  # sums: the token-weighted loss already divides by the global token count
                all_reduce_grads(model, mesh.dense, mesh.expert)
            if master is not None:
                master.grads_to_master()
            grad_norm = clip_grads(replicated, experts, t.grad_clip, mesh)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if master is not None:
                master.master_to_model()
            balance = [v for k, v in lb.stats().items() if k != "lb/mean"] if lb.counts else []  # this rank's layers
            stats = torch.cat([torch.stack([ce_sum, aux_sum]).double(), torch.tensor(
                [sum(balance), len(balance), float(stop.set), retries() - retried], dtype=torch.float64,
                device=device)])
            all_reduce_(stats, everyone)
            loss = (stats[0] / n_tokens.double()).item()
            stop_now = stats[4].item() > 0
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if prof is not None:   # after the timing, so writing the trace does not count against the step
                prof.stop()
                run_dir.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(run_dir / f"trace-rank{rank}.json"))
            rec = {"step": step + 1, "loss": loss, "lb_loss": stats[1].item(), "balance": (stats[2] / stats[3]).item(),
                   "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": cfg.tokens_per_step / dt,
                   "step_time_s": dt}
            if peak is not None:
                rec["mfu"] = rec["tokens_per_s"] * fpt / (peak * world)
            rec["peak_mem_gb"] = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else
                                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
            if device.type == "cuda":
                rec["peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
            if prof is not None and device.type == "cuda":   # which streams' pools hold the reserved memory
                pools, compute = {}, (0, torch.cuda.current_stream(device).cuda_stream)
                for seg in torch.cuda.memory_snapshot():
                    key = "compute" if seg["stream"] in compute else str(seg["stream"])
                    pools[key] = pools.get(key, 0.0) + seg["total_size"] / 2**30
                rec["reserved_gb_by_stream"] = pools
            rec["alloc_retries"] = int(stats[5].item())     # all ranks together, this step
            if rec["alloc_retries"] and not warned_retries:
                warned_retries = True
                say(f"step {step + 1}: the CUDA caching allocator ran out of cached blocks {rec['alloc_retries']} "
                    "time(s) on some rank (each time it frees its cache and synchronises, stalling every rank); "
                    f"peak allocated here {rec['peak_mem_gb']:.1f} GiB. Lower train.micro_batch; under DualPipeV "
                    "keep parallel.ep_permute_in_compute on and parallel.overlap_edges off (benchmarks/RESULTS.md)")
            history.append(rec)
            if rank == 0:
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
                if writer is not None:
                    for k, v in rec.items():
                        if k != "step" and isinstance(v, (int, float)):   # not the profiled step's pool sizes
                            writer.add_scalar(f"train/{k}", v, rec["step"])
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}")
                if (step + 1) % cfg.log.every == 0 or step == start:
                    mfu = f" mfu {rec['mfu']:.1%}" if "mfu" in rec else ""
                    say(f"step {step + 1:>6} loss {loss:.4f} balance {rec['balance']:.3f} lr {lr:.2e} "
                        f"grad {rec['grad_norm']:.3f} {rec['tokens_per_s']:,.0f} tok/s{mfu} "
                        f"peak {rec['peak_mem_gb']:.2f} GiB")
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss is {loss} at step {step + 1}; nothing was saved for this step, so the "
                                    f"latest checkpoint in {run_dir / 'ckpt'} is the last good one. Lower train.lr, "
                                    "raise train.warmup or check the data, then rerun to resume from it.")
            done = step + 1
            every = cfg.ckpt.every
            if every >= 0 and (stop_now or done == end or (every and done % every == 0)):
                checkpoint.save(run_dir, done, keep=cfg.ckpt.keep, **ckpt_args)
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
    if rank == 0 and cfg.log.sample_tokens and not stopped and history:
        if pp == 1 and ep == 1:
            sample = greedy_sample(model, load_tokenizer(cfg.data.tokenizer), data, cfg.log.sample_tokens, device)
            say("sample: " + repr(sample))
        else:
            say(f"no sample: greedy_sample needs the whole model, and pp = {pp}, ep = {ep} split it among the ranks")
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
# `metrics.jsonl` has one object per step with the fields the issue tracker and plots read. Besides the loss
# and its load-balance part (`lb_loss`, the deferred terms of train/42 settled at the end of the step), it counts
# `alloc_retries`: how many times, on any rank, the CUDA caching allocator ran out of cached blocks during the
# step. Each time it waits for every stream, frees its cache and allocates again, which stalls that rank and,
# through the next collective, all the others; the log says so the first time it happens. On a GPU the record
# also holds the peak reserved memory, and at the profiled step `reserved_gb_by_stream`, the memory held by
# each stream's pool of the allocator (engine/32_stages explains why that matters).

# %%
recs = [json.loads(l) for l in open(f"{tmp}/run/metrics.jsonl")]
assert [r["step"] for r in recs] == list(range(1, 21))
assert {"step", "loss", "lb_loss", "lr", "grad_norm", "tokens_per_s", "alloc_retries"} <= recs[0].keys()
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
