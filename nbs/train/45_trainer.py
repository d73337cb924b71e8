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
# Three parts a reader can hold at once:
#
# 1. **Building a run** (`build_run`): the process group and mesh, the model on the meta device cut to this rank's
#    share, the optimizer, the data, the dispatcher and the pipeline, and the resume from the latest checkpoint,
#    gathered in one plain object, `Run`.
# 2. **One step** (`train_step(run, step)`): its micro-batches through the five-stage layer protocol, the
#    load-balance loss, the summed token loss divided by the token count of the whole global batch (so gradient
#    accumulation is exact), the gradient sums across ranks, clipping and the optimizer. The micro-batches run one
#    after the other, or, with `parallel.pp > 1` or `parallel.overlap`, through the DualPipeV schedule of
#    `engine/33_dualpipev`, which computes the same gradients.
# 3. **Reporting** (`Reporter`): the log line, `metrics.jsonl`, TensorBoard, the profiler and the allocator's
#    statistics.
#
# `train(cfg)` ties them together: build, then step, report and checkpoint until the last step. Everything a step
# needs is a pure function of the step number (learning rate, data), which is why a resumed run repeats the
# straight one exactly. One process is a mesh of size one, so the same code runs on one CPU and on many GPUs.
#
# What it guards against: a NaN or infinite loss stops the run naming the step, *before* anything is saved, so
# the last good checkpoint stays the latest; SIGINT or SIGTERM finishes the current step, saves, and exits
# cleanly; a run directory holding a checkpoint of another model is refused by the checkpoint loader.
#
# The command line (`python -m pith_lit.train`) is the notebook `49_main`.

# %%
#| default_exp train.trainer

# %%
#| export
import dataclasses
import json
import math
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from pith_lit.engine.dualpipev import DualPipeV, split_model
from pith_lit.engine.ep import EPDispatcher, SyncFreeEPDispatcher, is_expert_param, shard_experts
from pith_lit.engine.fsdp import begin_step, clip_factor, grad_norm, reduce_gradients, shard_model, whole
from pith_lit.engine.mesh import Mesh, build_mesh, init_distributed, launch_env
from pith_lit.engine.planner import GiB, Estimate, estimate
from pith_lit.engine.stages import recompute_layers
from pith_lit.engine.steptime import choose_stage_layers, profile_layers
from pith_lit.models.family import family
from pith_lit.models.protocol import LocalDispatcher, Options, head_loss, run_layers
from pith_lit.ops.attention import doc_positions
from pith_lit.ops.experts import fp8_copies_pay, keep_fp8_copies
from pith_lit.ops.ring_attention import ring_group, zigzag_shard
from pith_lit.train import checkpoint
from pith_lit.train.config import (Config, ConfigError, UserError, dump_toml, from_dict, read_toml, to_dict,
                                   validate)
from pith_lit.train.data import build_dataset, load_tokenizer
from pith_lit.train.load_balance import LoadBalance, routers, update_bias
from pith_lit.train.optim import build_optimizer, count_tokens, lr_at, optimizer_states

# %% [markdown]
# ## Building the model
#
# The model family is chosen by `model.model_type`: its module (models/29 `family`) holds the model class,
# `Model`. The model is built with the run's `Options` (models/20), which `model_options` reads from the config and
# the mesh: `train.fp8` and `train.fp8_scaling` give the FP8 scaling of the experts and the dense projections
# (ops/15, ops/18), `parallel.cp > 1` the ring's group (`ring_group(mesh.cp)`, ops/17), `train.route` the routing
# (train/42). The experts' FP8 weight copies are kept for the step only when `train.fp8_keep_copies` asks, a step
# runs several micro-batches through each layer and FSDP does not shard the experts (`fp8_copies_kept`; ops/18 says
# what they cost and save). By default each use quantizes its own, so that FP8's peak stays under bf16's. Whatever is
# kept, copies or row scales, is dropped by the optimizer's step itself (a hook ops/18 registers), so nothing here
# has to remember to.

# %%
#| export
def build_model(model_cfg, options: Options = Options()) -> torch.nn.Module:
    """The model of the family `model_cfg.model_type` in float32 on the default device, initialised (not on meta),
    running with `options`."""
    return family(model_cfg.model_type).Model(model_cfg, options)


def model_options(cfg: Config, mesh: Mesh | None) -> Options:
    """The run's `Options`: FP8 under `train.fp8` (the dense projections from `train.fp8_dense_min` wide), the ring
    over `mesh.cp` at cp > 1, `train.route`; without a mesh no ring (a model on the meta device, for the planner)."""
    t = cfg.train
    return Options(fp8=t.fp8_scaling if t.fp8 else None, fp8_dense_min=t.fp8_dense_min,
                   cp_group=None if mesh is None else ring_group(mesh.cp), route=t.route)


def fp8_copies_kept(cfg: Config) -> bool:
    """Whether the experts keep their FP8 weight copies for the step: when `train.fp8_keep_copies` asks and they pay
    (ops/18 `fp8_copies_pay`: each layer runs several micro-batches and FSDP does not shard the experts)."""
    return cfg.train.fp8_keep_copies and fp8_copies_pay(cfg.num_micro_batches, cfg.parallel.dp * cfg.parallel.cp)

# %% [markdown]
# ### Where FP8 pays
#
# FP8's speed against bf16 depends on the model's width and on the tokens a micro-batch carries: the FP8 products
# gain in proportion to the matmuls, the quantization passes cost in proportion to the activations and weights they
# read, and at one micro-batch a step each weight is quantized at each use whatever the micro-batch's size, so larger
# micro-batches spread that cost over more rows. `FP8_MEASURED` holds what one GPU measured side by side with the
# default `train.fp8_dense_min` (benchmarks/RESULTS.md, "FP8 end to end"). A run with `train.fp8` on a GPU is matched
# to the measured width nearest its hidden size, then to the measured micro-batch nearest its tokens per micro-batch
# (`train.micro_batch` × `train.seq_len`); where FP8 was slower there it says so in one line at start-up (`fp8_note`),
# with what was measured, a larger micro-batch of that width that measured faster if there is one, and the setting to
# change. It does not refuse: the loss and memory are the user's call too.

# %%
#| export
# FP8 (row scales) tokens/s over bf16's in the same call, compiled, one micro-batch a step, the default 4096 gate on
# the dense projections: (hidden size, routed expert width, tokens per micro-batch, ratio, the run)
FP8_MEASURED = ((2048, 768, 4 * 4096, 0.97, "the Qwen3-30B-A3B bench cut to 6 layers, micro-batch 4, one H100"),
                (2048, 768, 8 * 4096, 1.00, "the Qwen3-30B-A3B bench cut to 6 layers, micro-batch 8, one H100"),
                (4096, 1536, 4 * 4096, 1.03, "Qwen3-235B-A22B's width, 2 layers, micro-batch 4, one H100"),
                (4096, 1536, 8 * 4096, 1.08, "Qwen3-235B-A22B's width, 2 layers, micro-batch 8, one H100"),
                (7168, 2048, 4 * 2048, 1.05, "DeepSeek-V3's width, 2 layers, micro-batch 4, one H100"))


def fp8_note(cfg: Config, device: torch.device) -> str | None:
    """One line when `train.fp8` is on a GPU at a width and micro-batch nearest ones where FP8 measured slower than
    bf16; else None."""
    if not cfg.train.fp8 or device.type != "cuda":
        return None
    hidden, tokens = cfg.model.hidden_size, cfg.train.micro_batch * cfg.train.seq_len
    width = min(FP8_MEASURED, key=lambda m: abs(math.log(m[0] / hidden)))[0]
    same = [m for m in FP8_MEASURED if m[0] == width]
    h, inter, t, ratio, what = min(same, key=lambda m: (abs(math.log(m[2] / tokens)), m[2]))
    if ratio >= 1:
        return None
    larger = max((m for m in same if m[2] > t and m[3] > ratio), key=lambda m: m[2], default=None)
    hint = (f"; at {larger[2]:,} tokens a micro-batch it ran at {larger[3]:.2f}× (a larger train.micro_batch)"
            if larger else "")
    return (f"pith_lit: train.fp8 = true is likely slower than bf16 here: at the nearest measured width (hidden {h}, "
            f"experts {inter} wide; this model's hidden is {hidden}) and {t:,} tokens a micro-batch (this run's: "
            f"{tokens:,}) FP8 ran at {ratio:.2f}× bf16's tokens/s ({what}, benchmarks/RESULTS.md \"FP8 end to "
            f"end\"){hint}; set train.fp8=false for speed")

# %% [markdown]
# The note reads only the device's type, so the check asks for it on a CPU too: FP8 on at the Qwen3 bench's width
# gets the line, FP8 off or on a CPU gets none, and at each measured width and micro-batch the line appears exactly
# where the measured ratio is below 1, naming the larger micro-batch that measured faster where there is one.
# `train.fp8_dense_min` reaches the model through `model_options` (models/21 checks what the gate then puts in FP8).

# %%
from pith_lit.train.config import load_config as _cfg

gpu = torch.device("cuda")   # only its type is read: nothing is allocated
at = lambda hidden, tokens=16384, *more: _cfg(overrides=[  # micro-batches of `tokens` as sequences of 1024
    f"model.hidden_size={hidden}", "train.fp8=true", "train.seq_len=1024", f"train.micro_batch={tokens // 1024}",
    f"train.global_batch={tokens // 1024}", *more])
line = fp8_note(at(2048), gpu)
assert "set train.fp8=false" in line and "0.97×" in line and "32,768 tokens a micro-batch it ran at 1.00×" in line
assert fp8_note(at(2048, 16384, "train.fp8=false"), gpu) is None and fp8_note(at(2048), torch.device("cpu")) is None
for hidden, _, tokens, ratio, _ in FP8_MEASURED:
    for t in (tokens, tokens * 5 // 4, tokens * 3 // 4):          # the measured size and sizes nearest it
        assert (fp8_note(at(hidden, t), gpu) is not None) == (ratio < 1), (hidden, t)
assert fp8_note(at(2048, 32768), gpu) is None                       # 1.00× at micro-batch 8
saved, FP8_MEASURED = FP8_MEASURED, FP8_MEASURED[:1]                # with no larger micro-batch measured, none named
assert "set train.fp8=false" in fp8_note(at(2048), gpu) and "a larger" not in fp8_note(at(2048), gpu)
FP8_MEASURED = saved
assert fp8_note(at(4096, 16384), gpu) is None and fp8_note(at(7168, 8192), gpu) is None  # 1.03× and 1.05×
print(fp8_note(at(2048), gpu))
assert model_options(at(2048), None).fp8_dense_min == 4096                       # the default gate
assert model_options(at(2048, 16384, "train.fp8_dense_min=0"), None) == Options(fp8="rows", fp8_dense_min=0)

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
# Every run has a process group and a device mesh, one process being a mesh of size one: launched by torchrun
# (or SLURM) the default group joins the other processes, and a single process starts a group of its own (and
# closes it at the end). The device mesh of `engine/30_mesh` gives the groups the step needs: `batch` (ranks that
# read different data), `dense` (ranks holding the same non-expert weights; token counts and losses are summed over
# it) and `expert` (ranks holding the same experts), and FSDP's meshes. With `parallel.ep > 1` each rank keeps its
# share of every layer's experts and an expert-parallel dispatcher of `engine/31_ep` exchanges tokens; `parallel.dp`
# ranks shard parameters, gradients and optimizer states (engine/36_fsdp), and `parallel.dp_replicate` groups of
# them hold the same shards (HSDP). With `parallel.pp > 1` the `pp` group links the pipeline ranks (below). The
# number of processes must be the product of the sizes; the command line checks it too, `train(cfg)` called from
# Python checks it here. A sum over a group of one rank is skipped (`_sum`).
#
# Checkpoints work in every layout and load in any other: every parameter and optimizer state is a DTensor that
# knows its global shape and which part this rank holds, and DCP reshards on load (train/44_checkpoint).

# %%
#| export
def start_distributed(cfg: Config) -> tuple[torch.device, Mesh, bool]:
    "(device, mesh, whether this call started the process group), for the processes the launcher started."
    p, world = cfg.parallel, launch_env()["world"]
    if world != cfg.world_size:
        raise ConfigError(f"parallel: pp × dp_replicate × dp × cp × ep = {cfg.layout_text} = {cfg.world_size}, but "
                          f"{world} process(es) were launched; launch {cfg.world_size} (torchrun --nproc-per-node) "
                          "or choose sizes whose product is the number of processes")
    started = not dist.is_initialized()
    if started:
        _, _, device = init_distributed(p.timeout_s, cfg.device_type)
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if cfg.device_type == "cuda" else torch.device("cpu")
    return device, build_mesh(p.pp, p.dp, p.cp, p.ep, cfg.device_type, p.timeout_s, p.dp_replicate), started


def _sum(t: torch.Tensor, group) -> torch.Tensor:
    "Sum a tensor over `group` in place (nothing to do for a group of one)."
    if group.size() > 1:
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


class NonFiniteLoss(UserError, RuntimeError):
    "The loss became NaN or infinite; nothing was saved at or after that step."

# %% [markdown]
# ## Before anything is allocated: the pipeline cut and the memory
#
# Two decisions use the planner of engine/37 and 38 before the model is built. With `parallel.pp_stage_layers =
# "auto"`, the first rank times one layer of each kind, the embedding, the head and the optimizer on its device (eager,
# one micro-batch; engine/38 `profile_layers`) and every rank takes the cut whose simulated step is shortest
# (`choose_stage_layers`); the run's `config.toml` then records the cut. On GPUs, the layout's predicted peak memory per GPU, with the
# allocator's slack and the CUDA context, must fit the GPU: a layout predicted not to fit is refused with the
# first change of recomputation, micro-batch or optimizer dtype that is predicted to fit (`run.memory_check =
# false` tries it anyway). The opening line of the log shows the prediction, and every step's log line the
# measured peak beside it.

# %%
#| export
def meta_model(cfg: Config):
    "A builder of the whole model on the meta device (shapes only), with the run's `Options` but no ring."
    def make():
        with torch.device("meta"):
            return build_model(cfg.model, model_options(cfg, None))
    return make


def optimizer_for(cfg: Config):
    "The run's optimizer over a module's parameters, as a function of the module (train/43 `build_optimizer`)."
    t = cfg.train
    return lambda module: build_optimizer(module, lr=t.lr, weight_decay=t.weight_decay, betas=(t.beta1, t.beta2),
                                          eps=t.eps, kind=t.optimizer, momentum=t.muon_momentum)


def cut_pipeline(cfg: Config, device: torch.device) -> list[int]:
    "`parallel.pp_stage_layers = \"auto\"`: the cut the first rank's measured times say is fastest, on every rank."
    cut = [None]
    if dist.get_rank() == 0:
        w = cfg.workload()
        profile = profile_layers(meta_model(cfg)(), dataclasses.replace(w, compile=False), device,
                                 LocalDispatcher(cfg.model.routed_experts), optimizer_for(cfg))
        cut = [choose_stage_layers(cfg.model, w, profile)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(cut, src=0)
    return cut[0]


def _memory_fix(cfg: Config, gpu: float) -> str:
    "The first single change of recompute, micro_batch or optim_dtype predicted to fit `gpu` bytes, as advice."
    t = cfg.train
    tries = [f"train.recompute={r}" for r in ("attention", "layer") if r != t.recompute]
    tries += [f"train.micro_batch={m}" for m in (t.micro_batch // 2, t.micro_batch // 4) if m >= 1]
    tries += ["train.optim_dtype=bfloat16"] if cfg.param_dtype == torch.float32 and t.dtype != "float32" else []
    for change in tries:
        try:
            other = validate(from_dict(to_dict(cfg), [change]))
        except ConfigError:
            continue
        e = estimate(other.model, meta_model(other), other.workload(), optimizer_states(other.train.optimizer))
        if e.fits(gpu):
            return f"--set {change} is predicted to fit ({e.needs() / GiB:.1f} GiB)"
    return "no single change of recompute, micro_batch or optim_dtype is predicted to fit: use more GPUs"


def memory_verdict(cfg: Config, gpu: float) -> Estimate:
    "The planner's estimate of this layout; a ConfigError naming a fix when it does not fit `gpu` bytes per GPU."
    e = estimate(cfg.model, meta_model(cfg), cfg.workload(), optimizer_states(cfg.train.optimizer))
    if cfg.run.memory_check and not e.fits(gpu):
        raise ConfigError(f"{cfg.layout_text} with train.micro_batch = {cfg.train.micro_batch} needs about "
                          f"{e.needs() / GiB:.1f} GiB per GPU ({e.summary()}), more than this GPU's {gpu / GiB:.1f} "
                          f"GiB; {_memory_fix(cfg, gpu)} (python -m pith_lit.plan lists the layouts that fit; "
                          "run.memory_check = false tries it anyway)")
    return e


def check_memory(cfg: Config, device: torch.device) -> Estimate | None:
    "On a GPU, `memory_verdict` for its memory; nothing to check on the CPU."
    if device.type != "cuda":
        return None
    return memory_verdict(cfg, torch.cuda.get_device_properties(device).total_memory)

# %% [markdown]
# The tiny default at micro-batch 16, on a GPU one byte smaller than it needs by the planner's account, is refused,
# and the refusal names a change predicted to fit:

# %%
from pith_lit.train.config import load_config as _load

small = _load(overrides=["run.device=cpu", "train.micro_batch=16", "train.global_batch=16"])
need = memory_verdict(dataclasses.replace(small, run=dataclasses.replace(small.run, memory_check=False)), 0).needs()
try:
    memory_verdict(small, need - 1)
    raise AssertionError("expected a refusal")
except ConfigError as e:
    print(e)
    assert "is predicted to fit" in str(e) and "GiB per GPU" in str(e)

# %% [markdown]
# ## The run: everything a step needs
#
# `build_run` makes one `Run`. What needs the whole model is computed before the split: the parameter count, the
# model FLOPs per token and the number of MoE layers. The model is built on the **meta device**: the whole model's
# shapes cost nothing, each rank cuts out its pipeline stages and expert slices, and only then are this rank's
# parameters allocated (`to_empty`) and initialised (`init_weights(run.seed)`). Every parameter draws from its own
# generator keyed by its name and, for experts, the global expert index (models/20_protocol `SeededInit`), so a
# rank holds exactly the values the same parameters have in the whole model: the layouts start from the same
# weights, and a 30B model never has to fit one GPU. `train.recompute` wraps the stages it names for
# recomputation (engine/32_stages); with `train.compile` stages 1 and 5 of every layer are then compiled (they have
# static shapes and no host syncs by design; stages 2–4 stay eager), and with `train.cuda_graphs` each compiled stage
# replays as a CUDA graph, one launch for its kernels where the host would otherwise fall behind them.
#
# Then FSDP2 shards what the rank holds (engine/36_fsdp), always, a mesh of size one included. The parameters keep
# the optimizer's dtype (`train.optim_dtype`): fp32 master weights that FSDP gathers in the compute dtype
# (`train.dtype`), or bf16 weights updated in place. The optimizer is built over these sharded parameters. The
# dispatcher is `LocalDispatcher` at ep 1, else the counted or the sync-free expert-parallel one
# (`parallel.ep_sync_free`). Under DualPipeV at ep > 1 on CUDA the matmuls leave `parallel.comm_sms` SMs to the
# all-to-alls (engine/32_stages says why).
#
# Checkpoints work at every layout (train/44). A run can also start from a weights-only checkpoint (imported
# Hugging Face weights, train/47_convert): that holds no optimizer state, and each rank reads its own shards.

# %%
#| export
@dataclass(eq=False)
class Run:
    "One training run on this rank, as `build_run` made it: what `train_step` and the checkpoints need."
    cfg: Config
    device: torch.device
    mesh: Mesh
    started_group: bool            # this process started the process group (and closes it at the end)
    model: torch.nn.Module         # this rank's stages and expert slices, sharded by FSDP2 (DTensor parameters)
    optimizer: torch.optim.Optimizer
    data: object
    lb: LoadBalance
    dispatcher: object
    pipe: DualPipeV | None         # the DualPipeV schedule at pp > 1 or with parallel.overlap
    sizes: dict                    # the whole model's parameters, active matmul parameters, FLOPs/token, MoE layers
    val: object = None             # the held-out windows (data.val_frac), or None
    eos: int | None = None         # with data.document_mask, the end-of-document token: positions restart after it
    start: int = 0                 # the step this run resumed from
    resumed_from: Path | None = None   # the checkpoint it resumed from
    resharded_from: dict | None = None   # the parallel sizes that checkpoint was saved at, where they differ
    memory: Estimate | None = None   # the planner's estimate of this layout (on GPUs)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.dir)

    def ckpt_args(self) -> dict:
        "The keyword arguments of `checkpoint.save` and `checkpoint.load` for this run."
        return dict(model=self.model, optimizer=self.optimizer, model_config=to_dict(self.cfg)["model"])


def _place_model(cfg: Config, mesh: Mesh, device: torch.device) -> tuple[torch.nn.Module, tuple | None, dict]:
    "This rank's share of the model, initialised, compiled and sharded; its pipeline parts; the whole model's sizes."
    torch.manual_seed(cfg.run.seed)
    options = model_options(cfg, mesh)
    with torch.device("meta"):  # shapes only: the whole model costs no memory until this rank has cut out its share
        model = build_model(cfg.model, options)
    sizes = dict(params=sum(p.numel() for p in model.parameters()), active=model.active_matmul_params(),
                 flops_per_token=model.flops_per_token(cfg.train.seq_len),
                 moe_layers=sum(any(is_expert_param(n) for n, _ in layer.named_parameters())
                                for layer in model.model.layers.values()))
    parts = split_model(model, mesh.pp.rank(), mesh.pp.size(), cfg.parallel.pp_stage_layers) if cfg.pipelined else None
    if mesh.ep.size() > 1:
        shard_experts(model, mesh.ep.rank(), mesh.ep.size())
    model.to_empty(device=device)
    model.init_weights(cfg.run.seed)   # per-parameter generators: the values of the whole model, whatever the cut
    recompute_layers(model.model.layers.values(), cfg.train.recompute)
    keep_fp8_copies(model, fp8_copies_kept(cfg))
    if cfg.train.compile:   # the ring's transfers stay outside the graph: stage 1 compiles around them
        mode = "reduce-overhead" if cfg.train.cuda_graphs and device.type == "cuda" else None
        for layer in model.model.layers.values():
            layer.stage1 = torch.compile(layer.stage1, fullgraph=mesh.cp.size() == 1, mode=mode)
            layer.stage5 = torch.compile(layer.stage5, fullgraph=True, mode=mode)
    kept = cfg.param_dtype   # what the optimizer steps: fp32 masters, or the compute dtype itself
    model.to(kept)
    for router in routers(model).values():   # the selection bias adds up small steps: never below fp32 (train/42)
        bias = router.e_score_correction_bias
        bias.data = bias.data.to(torch.promote_types(bias.dtype, torch.float32))
    shard_model(model, mesh, cfg.torch_dtype if cfg.torch_dtype != kept else None)
    return model, parts, sizes


def _dispatcher(cfg: Config, mesh: Mesh, device: torch.device):
    "Stages 2 and 4 for this layout; at ep > 1 under DualPipeV on CUDA, the SMs the matmuls leave free."
    E, p = cfg.model.routed_experts, cfg.parallel
    if mesh.ep.size() == 1:
        return LocalDispatcher(E)
    if cfg.comm_sms:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if cfg.comm_sms >= sms:
            raise ConfigError(f"parallel.comm_sms = {p.comm_sms}, but this GPU has {sms} SMs; leave the matmuls "
                              f"some (e.g. comm_sms = {sms // 8})")
        torch._C._set_sm_carveout_experimental(cfg.comm_sms)   # process-wide, read at each matmul launch
    return (SyncFreeEPDispatcher if p.ep_sync_free else EPDispatcher)(mesh.ep, E)


def build_run(cfg: Config) -> Run:
    """Everything a step needs on this rank, resumed from the latest checkpoint in `run.dir` when there is one. A
    process group this call started is closed again if building fails."""
    device, mesh, started = start_distributed(cfg)
    try:
        return _build(cfg, device, mesh, started)
    except BaseException:
        if started:
            dist.destroy_process_group()
        raise


def _build(cfg: Config, device: torch.device, mesh: Mesh, started: bool) -> Run:
    "`build_run` once the process group is up: model, optimizer, data, dispatcher, pipeline, resume."
    if cfg.parallel.pp_stage_layers == "auto":
        cfg.parallel.pp_stage_layers = cut_pipeline(cfg, device) if cfg.pipelined else []
    memory = check_memory(cfg, device)
    model, parts, sizes = _place_model(cfg, mesh, device)
    t = cfg.train
    optimizer = optimizer_for(cfg)(model)
    data, val = build_dataset(cfg.data.corpus, cfg.data.tokenizer, cfg.cache_dir, t.seq_len,
                              cfg.run.seed, mesh.batch.rank(), mesh.batch.size(), cfg.model.vocab_size,
                              cfg.data.val_frac)
    # deferred: the forward does not wait for the global counts (train/42); their values are settled per step
    lb = LoadBalance(cfg.model.routed_experts, t.lb_coef, t.lb_level, group=mesh.dense, deferred=True,
                     seq_len=t.seq_len)
    eos = load_tokenizer(cfg.data.tokenizer, cfg.cache_dir).eos_id if cfg.data.document_mask else None
    run = Run(cfg, device, mesh, started, model, optimizer, data, lb, _dispatcher(cfg, mesh, device), None, sizes,
              val, eos, memory=memory)
    if parts is not None:
        run.pipe = build_pipeline(run, parts)
    last = checkpoint.latest(run.run_dir) if cfg.ckpt.resume else None
    if last is not None:
        run.start, run.resumed_from = checkpoint.load(last, **run.ckpt_args()), last
        saved = checkpoint.saved_layout(last)
        run.resharded_from = saved if saved not in (None, cfg.layout) else None
    return run

# %% [markdown]
# What a rank of the real Qwen3-30B-A3B holds at pp 2 × ep 4 (the paper's eight-GPU shape), counted on the meta
# device: with bf16 weights and gradients, fp32 masters and two fp32 AdamW moments (16 bytes a parameter) it is
# about 70 GiB, where building the whole model first would have needed 114 GiB of float32 on every GPU.

# %%
import copy

from pith_lit.testing import repo_path
from pith_lit.train.config import load_config

# %%
for r in range(2):
    with torch.device("meta"):
        big = build_model(load_config(repo_path("configs/qwen3-30b-a3b.toml")).model)
    n_all = sum(p.numel() for p in big.parameters())
    split_model(big, r, 2)
    shard_experts(big, 0, 4)
    n = sum(p.numel() for p in big.parameters())
    print(f"pp rank {r} of 2, ep 4: {n / 1e9:.2f}B of {n_all / 1e9:.2f}B parameters, {n * 16 / 2**30:.1f} GiB of "
          "weights, gradients and optimizer states")
    assert n * 16 / 2**30 < 80 and n_all * 4 / 2**30 > 110

# %% [markdown]
# ## One optimizer step
#
# The micro-batches of a step are fetched first so the number of tokens that count toward the loss (labels not
# equal to -100) is known for the whole global batch before any backward; each micro-batch's summed loss is
# divided by it. The load-balance loss is averaged over MoE layers, micro-batches and data-parallel ranks
# (`aux_div`; the gradients are summed over ranks, as the token-weighted loss needs). The loss of a micro-batch is
# the layer protocol's `head_loss`: on CUDA the head and the loss are fused (`linear_cross_entropy`), which never
# holds the fp32 logits of the whole micro-batch.
#
# A window of the corpus is a slice of packed text, so it usually holds the end of one document and the start of
# the next. By default it is one sequence, positions 0..S-1, and a token attends to every token before it. With
# `data.document_mask` the positions restart after each end-of-document token (`positions_of`), and the models
# attend within documents (a block-causal mask, ops/14 `documents`), as if each document had its own row.
#
# With context parallelism the `cp` ranks of a data rank read the same micro-batches and each keeps its two
# zigzag chunks of every sequence (`rank_tokens`, ops/17), positions included: they are computed on the whole
# sequence first, so documents crossing a chunk keep their positions. The cp ranks are data ranks for everything
# but attention: the tokens that count are summed over them with the others, and so is the load-balance term, so
# `aux_div` counts them too (each rank's router probabilities are a mean over its share of the tokens).

# %%
#| export
def aux_div(run: Run) -> int:
    "What the summed load-balance terms are divided by: micro-batches per step × data ranks × context ranks."
    return run.cfg.num_micro_batches * run.mesh.batch.size() * run.mesh.cp.size()


def positions_of(run: Run, ids: torch.Tensor) -> torch.Tensor:
    """RoPE positions of a micro-batch: (S,) 0..S-1, or with `data.document_mask` (B, S) positions that restart
    after each end-of-document token (the models then attend within documents, ops/14 `documents`)."""
    if run.eos is None:
        return torch.arange(ids.shape[1], device=ids.device)
    ends = (ids == run.eos).to(torch.int32)
    return doc_positions(ends.cumsum(1) - ends)   # an end token belongs to the document it ends


def rank_tokens(run: Run, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    "This rank's (input ids, labels, positions) of a micro-batch: all of it, or its zigzag chunks at cp > 1."
    positions, cp = positions_of(run, x), run.mesh.cp
    if cp.size() == 1:
        return x, y, positions
    return tuple(zigzag_shard(t, cp.size(), cp.rank(), dim=t.dim() - 1) for t in (x, y, positions))


def micro_step(run: Run, input_ids, labels, n_tokens, positions=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of one micro-batch, one after the other; returns the summed token loss and the
    load-balance loss as it entered the objective (both detached; a deferred `LoadBalance` gives its values at
    `settle`). `positions`: default `positions_of(run, input_ids)`."""
    model = run.model
    positions = positions_of(run, input_ids) if positions is None else positions
    h, routings = run_layers(model.model.layers.values(), model.prolog(input_ids), positions, run.dispatcher)
    ce = head_loss(model, h, labels)
    moe = [(key, r) for key, r in zip(model.model.layers.keys(), routings) if r is not None]
    aux = sum(run.lb.loss(key, r.probs, r.ids) for key, r in moe) / (max(len(moe), 1) * aux_div(run))
    (ce / n_tokens + aux).backward()
    return ce.detach(), aux.detach() if torch.is_tensor(aux) else torch.zeros(())

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
def build_pipeline(run: Run, parts) -> DualPipeV:
    "DualPipeV over this rank's `parts` (from `split_model`) with `micro_step`'s objective."
    model, lb, div = run.model, run.lb, max(run.sizes["moe_layers"], 1) * aux_div(run)
    loss_fn = (lambda h, labels: head_loss(model, h, labels)) if parts[0].index == 0 else None
    aux_fn = lambda key, routing: lb.loss(key, routing.probs, routing.ids) / div
    return DualPipeV(parts, run.mesh.pp, run.dispatcher, loss_fn, aux_fn, run.device)

# %% [markdown]
# A check in float64, where the two ways of summing agree to rounding: three micro-batches of the tiny default
# model, with a global load-balance loss of weight 0.1, through `micro_step` one after the other and through
# DualPipeV with one pipeline rank (`parallel.overlap`), each run built by `build_run` in a scratch directory.
# Losses, load-balance losses, balance statistics and every gradient agree. Two processes against one (`pp = 2`)
# are in tests/test_trainer.py.

# %%
import tempfile

# %%
tmp = tempfile.mkdtemp()
over = ["train.dtype=float64", "train.lb_coef=0.1", "train.global_batch=6", "train.micro_batch=2",
        "train.seq_len=16", "train.warmup=0", "log.tensorboard=false"]
runs = []
for overlap in (False, True):
    flag = f"parallel.overlap={str(overlap).lower()}"
    runs.append(build_run(load_config(overrides=over + [f"run.dir={tmp}/chk{overlap}", flag])))
plain, piped = runs
g = torch.Generator().manual_seed(0)
mbs = [tuple(torch.randint(0, 384, (2, 16), generator=g) for _ in range(2)) for _ in range(3)]
n_tok = torch.tensor(3 * 2 * 16.0, dtype=torch.float64)
begin_step(plain.model), begin_step(piped.model)       # what `train_step` does around the micro-batches
outs = [micro_step(plain, x, y, n_tok) for x, y in mbs]
ce_piped, _ = piped.pipe.step(mbs, 1 / n_tok)
reduce_gradients(plain.model), reduce_gradients(piped.model)
ce_plain = sum(c.double() for c, _ in outs)
aux_plain, aux_piped = plain.lb.settle(), piped.lb.settle()   # the deferred load-balance terms' values (train/42)
worst = max(((whole(p.grad) - whole(q.grad)).abs().max() / whole(q.grad).abs().max()).item()
            for p, q in zip(piped.model.parameters(), plain.model.parameters()))
print(f"loss {ce_piped.item():.6f} vs {ce_plain.item():.6f}, load balance {aux_piped.item():.6f} vs "
      f"{aux_plain.item():.6f}, worst gradient difference {worst:.1e} (relative)")
assert abs(ce_piped - ce_plain) < 1e-12 * ce_plain and abs(aux_piped - aux_plain) < 1e-12 * aux_plain
assert worst < 1e-10, worst
assert all(abs(v - plain.lb.stats()[k]) < 1e-12 for k, v in piped.lb.stats().items())
dist.destroy_process_group()

# %% [markdown]
# ## The step
#
# `train_step(run, step)` is one optimizer step as a function of the run and the step number. Gradients stay
# unreduced until the step's last backward; `reduce_gradients` then sums them over the data ranks into this rank's
# shards, and clipping takes the whole model's norm from the shards of every rank (engine/36). After it, every
# statistic that is logged is summed over all ranks in one collective, so every rank agrees on the loss and on
# whether a signal asked to stop: the token loss (nonzero on pipeline rank 0 only), the load-balance terms as they
# entered the objective (their sum over all ranks is the mean load-balance loss over layers, micro-batches and data
# ranks), and each MoE layer's balance (`LoadBalance.stats`, already summed over the data ranks; a pipeline rank
# reports its own layers, and the logged balance is the mean over all of them). With `train.lb_bias_rate` the same
# summed counts move each router's selection bias once, after the optimizer step (train/42): every rank that holds
# a layer sees the same counts and applies the same update.

# %%
#| export
def _forward_backward(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    "All micro-batches of `step`, forward and backward: (summed token loss, load-balance loss, global tokens)."
    t, dev, n_micro = run.cfg.train, run.device, run.cfg.num_micro_batches
    run.lb.start_step()
    batches = [rank_tokens(run, x.to(dev), y.to(dev))
               for x, y in (run.data.batch(step, m, t.micro_batch, n_micro) for m in range(n_micro))]
    n_tokens = _sum(sum(count_tokens(y) for _, y, _ in batches).to(dev, torch.float32), run.mesh.dense)
    begin_step(run.model)     # gradients are summed over the data ranks once, after the last backward (engine/36)
    if run.pipe is not None:  # sums of this rank's stages: the token loss on pipeline rank 0 only
        ce_sum, aux_sum = run.pipe.step(batches, 1 / n_tokens)
    else:
        ce_sum = aux_sum = torch.zeros((), device=dev, dtype=torch.float64)
        for x, y, positions in batches:
            ce, aux = micro_step(run, x, y, n_tokens, positions)
            ce_sum, aux_sum = ce_sum + ce.double(), aux_sum + aux.double().to(dev)
    reduce_gradients(run.model)   # sums: the loss divides by the global tokens
    settled = run.lb.settle().to(aux_sum) / (max(run.sizes["moe_layers"], 1) * aux_div(run))  # the deferred terms
    return ce_sum, aux_sum + settled, n_tokens


def train_step(run: Run, step: int, stop: StopFlag | None = None) -> dict:
    """Optimizer step `step` (0-based) of the run; returns its record, the same on every rank. The record's `stop`
    says whether any rank's `stop` flag was set by the end of the step."""
    t = run.cfg.train
    lr = lr_at(step, lr=t.lr, steps=t.steps, warmup=t.warmup, schedule=t.schedule, decay_frac=t.decay_frac,
               min_lr_ratio=t.min_lr_ratio)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    ce_sum, aux_sum, n_tokens = _forward_backward(run, step)
    norm = grad_norm(list(run.model.parameters()), run.mesh.replicate.size())
    run.optimizer.step(grad_scale=clip_factor(norm, t.grad_clip))   # clipping inside the update (ops/19)
    run.optimizer.zero_grad(set_to_none=True)   # with train.fp8 the step dropped the FP8 weight copies (ops/18)
    totals = run.lb.totals()   # this rank's MoE layers: the step's expert counts, summed over the dense group
    if t.lb_bias_rate:         # aux-loss-free balancing: every rank holding a layer applies the same update
        update_bias(routers(run.model), totals, t.lb_bias_rate)
    balance = [v for k, v in run.lb.stats(totals).items() if k != "lb/mean"] if totals else []
    stats = torch.cat([torch.stack([ce_sum, aux_sum]).double(), torch.tensor(
        [sum(balance), len(balance), float(stop is not None and stop.set)], dtype=torch.float64, device=run.device)])
    _sum(stats, dist.group.WORLD)
    return {"step": step + 1, "loss": (stats[0] / n_tokens.double()).item(), "lb_loss": stats[1].item(),
            "balance": (stats[2] / stats[3]).item(), "lr": lr, "grad_norm": float(norm),
            "stop": stats[4].item() > 0}

# %% [markdown]
# ## Validation loss
#
# `evaluate` is the mean token loss on the held-out windows (the last `data.val_frac` of the corpus's windows,
# which training never reads): `log.eval_windows` of them, shared among the data ranks, through the plain five
# calls. It runs with autograd on and drops the graph, so that compiled stages meet the same guards as in
# training and are not compiled a second time. At pp > 1 the layers live on several ranks and there is no
# forward-only schedule, so no validation loss is computed there (the run says so once).

# %%
#| export
def evaluate(run: Run) -> float | None:
    "Mean token loss on the held-out windows; None without any, or when the layers are split among pipeline ranks."
    if run.val is None or run.mesh.pp.size() > 1:
        return None
    t, model = run.cfg.train, run.model
    windows = max(1, min(run.cfg.log.eval_windows // run.mesh.batch.size(), len(run.val)))
    n_micro = math.ceil(windows / t.micro_batch)
    sums = torch.zeros(2, dtype=torch.float64, device=run.device)
    for m in range(n_micro):
        x, y, positions = rank_tokens(run, *(b.to(run.device) for b in run.val.batch(0, m, t.micro_batch, n_micro)))
        h, _ = run_layers(model.model.layers.values(), model.prolog(x), positions, run.dispatcher)
        sums += torch.stack([head_loss(model, h, y).detach().double(), count_tokens(y).double()])
    _sum(sums, run.mesh.dense)
    return (sums[0] / sums[1]).item()

# %% [markdown]
# ## Reporting
#
# `Reporter` is everything the run tells: the progress bar and the log line every `log.every` steps,
# `metrics.jsonl` (one JSON object per step), TensorBoard, the profiled step (`log.profile_step`, every rank
# writes `trace-rank<R>.json` into the run directory) and the allocator's statistics. Only rank 0 writes. The
# record of a step gains its timing (`tokens_per_s`, `step_time_s`, MFU on a known GPU) and memory (peak
# allocated, and on CUDA the peak reserved and the planner's predicted peak for this rank, `predicted_peak_gb`);
# a validation loss, when one was computed after the step, joins it
# without counting against its time. `alloc_retries` counts how many times, on any rank, the CUDA caching
# allocator ran out of cached blocks during the step: each time it waits for every stream, frees its cache and
# allocates again, which stalls that rank and, through the next collective, all the others; the log says so the
# first time it happens. At the profiled step `reserved_gb_by_stream` holds the memory of each stream's pool of
# the allocator (engine/32_stages explains why that matters).
#
# `metrics.jsonl` says what happened, once per step: a resumed run first drops the lines of steps after the
# checkpoint it resumed from (a killed run may have logged steps that the checkpoint does not hold, and they are
# trained again), and so does a run that starts from scratch in a directory that has a log. A value that is not
# finite is written as `null` and named in the record's `nonfinite` list, since JSON has no NaN.

# %%
#| export
def json_record(rec: dict) -> str:
    "One line of metrics.jsonl: non-finite numbers become null and are listed under `nonfinite`."
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    out = {k: None if k in bad else v for k, v in rec.items()}
    return json.dumps(out | ({"nonfinite": bad} if bad else {}))


def keep_metrics_until(path: Path, step: int) -> int:
    "Drop the lines of `path` for steps after `step` (and any that do not parse); returns how many went."
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):   # a line cut short by a hard kill
            pass
    if len(keep) < len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return len(lines) - len(keep)

# %%
#| export
class Reporter:
    "What a run tells: log lines, metrics.jsonl, TensorBoard, the profiled step, allocator statistics (rank 0)."

    def __init__(self, run: Run, end: int, quiet: bool = False):
        self.run, self.cfg, self.dev = run, run.cfg, run.device
        self.main = run.rank == 0
        self.say = tqdm.write if self.main and not quiet else (lambda s: None)
        self.peak = peak_flops(run.device)
        self.writer = self.metrics = None
        if self.main:
            run.run_dir.mkdir(parents=True, exist_ok=True)
            dropped = keep_metrics_until(run.run_dir / "metrics.jsonl", run.start)
            if dropped:
                self.say(f"metrics.jsonl: dropped {dropped} line(s) after step {run.start}, where this run starts")
            self.metrics = open(run.run_dir / "metrics.jsonl", "a")
            if self.cfg.log.tensorboard:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(run.run_dir / "tb", purge_step=run.start + 1)
        self.bar = tqdm(range(run.start, end), initial=run.start, total=end, disable=quiet or not self.main,
                        desc="train", dynamic_ncols=True)
        self.prof, self.warned = None, False

    def _retries(self) -> float:   # times the caching allocator ran out, freed its cache and synchronised, so far
        return float(torch.cuda.memory_stats(self.dev).get("num_alloc_retries", 0)) if self.dev.type == "cuda" else 0.0

    def begin(self, step: int) -> None:
        "Before step `step` (0-based): start the clock, and the profiler at the profiled step."
        if step + 1 == self.cfg.log.profile_step:   # one whole step, every rank: host ranges and GPU kernels
            cuda, acts = self.dev.type == "cuda", torch.profiler.ProfilerActivity
            self.prof = torch.profiler.profile(activities=([acts.CPU] if self.cfg.log.profile_host or not cuda
                                                           else []) + ([acts.CUDA] if cuda else []))
            self.prof.start()
        self.t0, self.retried = time.perf_counter(), self._retries()

    def end(self, rec: dict) -> None:
        "After a step: its time and memory into its record, and the trace of the profiled step."
        retries = _sum(torch.tensor([self._retries() - self.retried], device=self.dev), dist.group.WORLD)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - self.t0
        rec.update(tokens_per_s=self.cfg.tokens_per_step / dt, step_time_s=dt, alloc_retries=int(retries.item()))
        if self.peak is not None:
            rec["mfu"] = rec["tokens_per_s"] * self.run.sizes["flops_per_token"] / (self.peak * dist.get_world_size())
        rec.update(self._memory())
        if self.prof is not None:   # after the timing, so writing the trace does not count against the step
            self.prof.stop()
            self.prof.export_chrome_trace(str(self.run.run_dir / f"trace-rank{self.run.rank}.json"))
            self.prof = None
        if rec["alloc_retries"] and not self.warned:
            self.warned = True
            self.say(f"step {rec['step']}: the CUDA caching allocator ran out of cached blocks {rec['alloc_retries']} "
                     "time(s) on some rank (each time it frees its cache and synchronises, stalling every rank); "
                     f"peak allocated here {rec['peak_mem_gb']:.1f} GiB. Lower train.micro_batch "
                     "(benchmarks/RESULTS.md, 'Throughput on two H200s: expert parallelism and DualPipeV')")

    def _memory(self) -> dict:
        if self.dev.type != "cuda":
            return {"peak_mem_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}
        out = {"peak_mem_gb": torch.cuda.max_memory_allocated(self.dev) / 2**30,
               "peak_reserved_gb": torch.cuda.max_memory_reserved(self.dev) / 2**30}
        if self.run.memory is not None:   # the planner's prediction for this rank's pipeline stage
            out["predicted_peak_gb"] = self.run.memory.peaks[self.run.mesh.pp.rank()].total / 2**30
        if self.prof is not None:   # which streams' pools hold the reserved memory
            pools, compute = {}, (0, torch.cuda.current_stream(self.dev).cuda_stream)
            for seg in torch.cuda.memory_snapshot():
                key = "compute" if seg["stream"] in compute else str(seg["stream"])
                pools[key] = pools.get(key, 0.0) + seg["total_size"] / 2**30
            out["reserved_gb_by_stream"] = pools
        return out

    def write(self, rec: dict) -> None:
        "The record to metrics.jsonl, TensorBoard, the bar and (every log.every steps) the log line."
        if not self.main:
            return
        self.metrics.write(json_record(rec) + "\n")
        self.metrics.flush()
        if self.writer is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):   # not the profiled step's pool sizes
                    self.writer.add_scalar("val/loss" if k == "val_loss" else f"train/{k}", v, rec["step"])
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.1e}")
        if rec["step"] % self.cfg.log.every == 0 or rec["step"] == self.run.start + 1 or "val_loss" in rec:
            mfu = f" mfu {rec['mfu']:.1%}" if "mfu" in rec else ""
            val = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
            self.say(f"step {rec['step']:>6} loss {rec['loss']:.4f}{val} balance {rec['balance']:.3f} lr "
                     f"{rec['lr']:.2e} grad {rec['grad_norm']:.3f} {rec['tokens_per_s']:,.0f} tok/s{mfu} "
                     f"peak {rec['peak_mem_gb']:.2f} GiB")

    def close(self) -> None:
        "Close the bar and the files (again: a no-op)."
        self.bar.close()
        for f in (self.writer, self.metrics):
            if f is not None:
                f.close()
        self.writer = self.metrics = None

# %% [markdown]
# ## The loop
#
# `train` builds the run and says where it starts: from scratch, or resumed from a checkpoint at step N. A
# checkpoint beyond `train.steps` is refused (the run would train nothing and rewrite nothing), one at
# `train.steps` leaves nothing to do, and a `train.steps` other than the one the run directory's `config.toml`
# records means the learning-rate schedule is planned anew over the new length (warmup-stable-decay's decay moves
# to the new end), which the run says. Then it steps, reports and checkpoints: every `ckpt.every` steps, at the
# last step and when a signal asked to stop; it writes the config it runs with once the first step has run, and
# evaluates the held-out windows every `log.eval_every` steps and at the end. A non-finite loss stops it before
# anything is saved for that step. It ends by saying where its checkpoint, metrics and logs are. The greedy
# sample at the end needs the whole model and is skipped when it is split.

# %%
#| export
def _planned(run: Run, end: int, say) -> bool:
    "Check where the run starts against `train.steps` and say it; False when there is nothing to do."
    cfg, start = run.cfg, run.start
    if start > cfg.train.steps:
        raise ConfigError(f"train.steps = {cfg.train.steps}: below step {start} of the checkpoint {run.resumed_from}; "
                          f"set train.steps >= {start} to continue it, or another run.dir (or ckpt.resume = false) "
                          "to start anew")
    if start and start >= end:
        say(f"pith_lit: {run.run_dir} is already at step {start} of {cfg.train.steps}: nothing to do (raise "
            "train.steps to train further)")
        return False
    old = run.run_dir / "config.toml"
    if start and old.exists():
        steps = read_toml(old).get("train", {}).get("steps", cfg.train.steps)
        if steps != cfg.train.steps:
            say(f"pith_lit: train.steps is {cfg.train.steps}, the run was planned for {steps}: the learning-rate "
                f"schedule is planned anew over {cfg.train.steps} steps from step {start} (set train.steps = {steps} "
                "to keep the old one)")
    return True


def train(cfg: Config, until: int | None = None, quiet: bool = False) -> dict:
    """Train as `cfg` says; returns a summary dict. Resumes from the latest checkpoint in `run.dir`.

    `until` stops (with a checkpoint) after that many steps in total, as if the run were interrupted there; the
    schedule still follows `train.steps`. Tests and the validation notebook use it to split a run in two."""
    run = build_run(cfg)
    end, history, stopped, sample = cfg.train.steps if until is None else min(until, cfg.train.steps), [], False, ""
    try:
        if _planned(run, end, tqdm.write if run.rank == 0 and not quiet else lambda s: None):
            report = Reporter(run, end, quiet)
            try:
                report.say(_opening(run, end))
                note = fp8_note(cfg, run.device)
                if note:
                    report.say(note)
                history, stopped = _loop(run, report, end)
                report.close()
                sample = _sample(run, report) if history and not stopped else ""
                report.say(_closing(run))
            finally:
                report.close()
    finally:
        if run.started_group:
            dist.destroy_process_group()
    return {"history": history, "start": run.start, "end": history[-1]["step"] if history else run.start,
            "stopped": stopped, "sample": sample, "model": run.model}


def _opening(run: Run, end: int) -> str:
    cfg, sz = run.cfg, run.sizes
    where = (f"resumed from step {run.start} ({run.resumed_from})" if run.start else
             f"from the weights of {run.resumed_from}" if run.resumed_from else "from scratch")
    if run.resharded_from:
        sizes = lambda d: " × ".join(f"{k} {v}" for k, v in d.items())
        where += f", resharded from {sizes(run.resharded_from)} to {sizes(cfg.layout)}"
    pipe = f", DualPipeV over {run.mesh.pp.size()} pipeline rank(s)" if run.pipe else ""
    if run.pipe and cfg.parallel.pp > 1:
        pipe += f", stages of {cfg.parallel.pp_stage_layers or 'even'} layers"
    val = "" if run.val is not None and run.mesh.pp.size() == 1 else (
        ", no validation loss (pp > 1 splits the layers)" if run.val is not None else ", no held-out data")
    mem = f", predicted peak {run.memory.peak.gib():.1f} GiB per GPU" if run.memory is not None else ""
    return (f"pith_lit: {cfg.model.model_type} {sz['params']/1e6:.2f}M params ({sz['active']/1e6:.2f}M active "
            f"matmul), {run.device.type} {str(cfg.torch_dtype).removeprefix('torch.')}, {dist.get_world_size()} "
            f"rank(s){pipe}, {where}, steps {run.start}->{end}, {cfg.tokens_per_step} tokens/step{val}{mem}")


def _closing(run: Run) -> str:
    "Where the run's checkpoint, metrics and logs are."
    ckpt = checkpoint.latest(run.run_dir, verify=False)
    tb = f", TensorBoard {run.run_dir / 'tb'}" if run.cfg.log.tensorboard else ""
    return (f"pith_lit: checkpoint {ckpt if ckpt is not None else 'none (ckpt.every = -1)'}, metrics "
            f"{run.run_dir / 'metrics.jsonl'}{tb}, config {run.run_dir / 'config.toml'}")


def _loop(run: Run, report: Reporter, end: int) -> tuple[list[dict], bool]:
    "Steps until `end`, a signal or a non-finite loss: report each, checkpoint as `ckpt` says; (records, stopped)."
    cfg, history, every = run.cfg, [], run.cfg.log.eval_every
    with StopFlag() as stop:
        for step in report.bar:
            report.begin(step)
            rec = train_step(run, step, stop)
            stopped = rec.pop("stop")
            report.end(rec)
            if step == run.start and run.rank == 0:   # a step ran: this config is the run's now
                (run.run_dir / "config.toml").write_text(dump_toml(cfg))
            last = stopped or step + 1 == end
            if math.isfinite(rec["loss"]) and (last or (every and (step + 1) % every == 0)):
                val = evaluate(run)
                if val is not None:
                    rec["val_loss"] = val
            report.write(rec)
            history.append(rec)
            if not math.isfinite(rec["loss"]):
                raise NonFiniteLoss(f"loss is {rec['loss']} at step {step + 1}; nothing was saved for this step, so "
                                    f"the latest checkpoint in {run.run_dir / 'ckpt'} is the last good one. Lower "
                                    "train.lr, raise train.warmup or check the data, then rerun to resume from it.")
            if cfg.ckpt.every >= 0 and (last or (cfg.ckpt.every and (step + 1) % cfg.ckpt.every == 0)):
                checkpoint.save(run.run_dir, step + 1, keep=cfg.ckpt.keep, layout=cfg.layout, **run.ckpt_args())
            if stopped:
                report.say(f"stopped by signal after step {step + 1}; checkpoint saved, rerun to resume")
                return history, True
    return history, False


def _sample(run: Run, report: Reporter) -> str:
    """The greedy sample at the end of a run of an unsplit model, shown by rank 0; '' otherwise. Every data rank
    (context ranks included) decodes it, since each forward gathers the sharded weights from all of them."""
    n, pp, ep = run.cfg.log.sample_tokens, run.mesh.pp.size(), run.mesh.ep.size()
    if not n:
        return ""
    if pp > 1 or ep > 1:
        if run.rank == 0:
            report.say(f"no sample: greedy_sample needs the whole model, and pp = {pp}, ep = {ep} split it among "
                       "the ranks")
        return ""
    sample = greedy_sample(run.model, load_tokenizer(run.cfg.data.tokenizer, run.cfg.cache_dir), run.data, n,
                           run.device, cp=run.mesh.cp)
    if run.rank != 0:
        return ""
    report.say("sample: " + repr(sample))
    return sample

# %% [markdown]
# ## A greedy sample
#
# The run ends by continuing a piece of the training data for a few tokens, greedily. It uses the model's own
# five-stage `forward` (no cache; the tiny model makes this instant), through which FSDP gathers the weights, and
# shows whether the model has picked up the corpus's shape.
#
# At cp > 1 the model's attention rings over `mesh.cp` in every forward, so the context ranks decode the text
# together, as they train: each runs its zigzag chunks of it (ops/17), padded at the end to 2·cp equal chunks (a
# causal model's logits for the text do not depend on what follows it), and the rank holding the last token's
# logits gives them to the others.

# %%
#| export
@torch.no_grad()
def greedy_sample(model, tokenizer, data, n_tokens: int, device, prompt_len: int = 32, cp=None) -> str:
    """Decode `n_tokens` greedy tokens after the first `prompt_len` tokens of the first training window. `cp`: the
    context-parallel group the model rings over (every rank of it calls this), or None."""
    x, _ = data.batch(0, 0, 1, 1)
    ids = x[:1, :prompt_len].to(device)
    for _ in range(n_tokens):
        ids = torch.cat([ids, _last_logits(model, ids, cp).argmax(-1, keepdim=True)], dim=1)
    return tokenizer.decode(ids[0, prompt_len:].tolist())


def _last_logits(model, ids: torch.Tensor, cp) -> torch.Tensor:
    "The logits (1, vocab) after the last token of `ids` (1, n): the model's forward, over the ring at cp > 1."
    if cp is None or cp.size() == 1:
        return model(ids)[0][:, -1]
    n, size, rank = ids.shape[1], cp.size(), cp.rank()
    ids = torch.cat([ids, ids.new_zeros(1, -n % (2 * size))], dim=1)
    mine = zigzag_shard(torch.arange(ids.shape[1], device=ids.device), size, rank, dim=0)   # their places
    logits, _ = model(zigzag_shard(ids, size, rank), mine)
    last = logits[0, mine == n - 1].sum(0, keepdim=True)   # zeros on the ranks without the last token
    dist.all_reduce(last, group=cp)
    return last

# %% [markdown]
# ## A short run
#
# Twenty steps of the tiny default model on the embedded corpus, in a scratch directory. The loss starts near
# ln(vocab) and falls.

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
