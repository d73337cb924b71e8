# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The run config
#
# A training run is described by one tree of dataclasses: `run` (where and how), `model` (the model family's
# own `Config`), `parallel`, `train`, `data`, `ckpt` and `log`. It is filled in three layers: the dataclass
# defaults, then a TOML file, then `--set section.field=value` on the command line. The result is checked in
# full before anything starts, so that a typo or an impossible combination of sizes fails in the first second
# with a message that names the field, the value and what would be valid, and not twenty minutes into a
# multi-GPU launch as a shape error inside a collective.
#
# Every field carries its documentation (`cfg(default, help)` from the layer protocol notebook), so `--help`
# can list the whole tree, and the section dataclasses are the only place a default is defined.
# Values that follow from others (the number of micro-batches, the device that "auto" means) are properties,
# never fields, so they cannot disagree with what they are derived from.

# %%
#| default_exp train.config

# %%
#| export
import argparse
import dataclasses
import difflib
import os
import sys
import tomllib
import types
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, Sequence, Union, get_args, get_origin, get_type_hints

import torch

from pith_lit.engine.mesh import stage_layers
from pith_lit.engine.planner import Workload
from pith_lit.models import qwen3_moe
from pith_lit.models.family import MODEL_TYPES, family
from pith_lit.models.protocol import cfg

# %%
import contextlib
import io
import math
import tempfile

from pith_lit.testing import repo_path

# %% [markdown]
# ## The sections
#
# A field whose value is one of a few words is typed `Literal[...]`: the type is the list of choices, so
# the check and `--help` read the choices from the same place.

# %%
#| export
@dataclass
class RunConfig:
    "Where the run lives and what it runs on."
    dir: str = cfg("runs/tiny", "run directory: checkpoints, metrics.jsonl and TensorBoard logs; "
                                "a second run with the same dir resumes")
    seed: int = cfg(0, "random seed for initialisation and data order")
    device: Literal["auto", "cpu", "cuda"] = cfg("auto", "auto = cuda if available, else cpu")
    memory_check: bool = cfg(True, "on GPUs, refuse before allocating anything a layout the planner predicts not to "
                                   "fit (engine/37; python -m pith_lit.plan); false tries it anyway")


@dataclass
class ParallelConfig:
    "How the processes divide the work. pp × dp_replicate × dp × cp × ep must equal the number of processes."
    pp: int = cfg(1, "pipeline-parallel ranks (DualPipeV: rank r holds stages r and 2·pp−1−r)", gt=0)
    dp: int = cfg(1, "data-parallel ranks that shard parameters, gradients and optimizer states among themselves "
                     "(FSDP2)", gt=0)
    dp_replicate: int = cfg(1, "HSDP: groups of dp ranks that hold the same shards (replicated across groups, "
                               "sharded within: the all-gathers stay inside a group, e.g. one node)", gt=0)
    cp: int = cfg(1, "context-parallel ranks: each sequence is cut into 2·cp zigzag chunks, attention runs as a ring "
                     "(ops/17); for sequences too long for one GPU's activations", gt=0)
    ep: int = cfg(1, "expert-parallel ranks (the routed experts are divided among them)", gt=0)
    overlap: bool = cfg(False, "use DualPipeV's overlapped schedule at pp = 1 (the forward of one micro-batch beside "
                               "the backward of another); faster than the plain loop at ep > 1 with several "
                               "micro-batches per rank, slower at ep = 1 (benchmarks/RESULTS.md)")
    pp_stage_layers: list | Literal["auto"] = cfg(
        [], "at pp > 1, the layers of each of the 2·pp stages, e.g. [3, 4, 3, 2] (stage 0 and the last, on rank 0 "
            "with the embedding and the head, may have 0); [] = even; \"auto\" = the cut that the layers' and the "
            "head's times, measured at start-up, simulate as fastest (engine/38), for a rank 0 whose embedding, "
            "head and loss cost time besides its layers")
    ep_sync_free: bool = cfg(False, "at ep > 1, size the all-to-alls by bounds instead of exchanging counts: no "
                                    "host synchronisation per layer (faster where the host limits the step), but "
                                    "the expert buffers hold ep·T·top_k rows (more memory)")
    comm_sms: int = cfg(16, "with DualPipeV (pp > 1 or overlap) at ep > 1 on GPUs, SMs that grouped GEMMs and "
                            "cuBLAS matmuls leave free so the all-to-alls run beside them (torch's SM carveout); "
                            "0 gives the matmuls every SM, better with few micro-batches per rank "
                            "(benchmarks/RESULTS.md)", ge=0)
    timeout_s: int = cfg(600, "timeout of a collective, in seconds", gt=0)


@dataclass
class TrainConfig:
    "The optimisation: batch, schedule, AdamW, load balance, precision."
    steps: int = cfg(300, "optimizer steps", gt=0)
    global_batch: int = cfg(16, "sequences per optimizer step, all ranks together", gt=0)
    micro_batch: int = cfg(4, "sequences per micro-batch per data-parallel rank", gt=0)
    seq_len: int = cfg(128, "tokens per sequence", gt=0)
    lr: float = cfg(3e-3, "peak learning rate", gt=0)
    min_lr_ratio: float = cfg(0.1, "final learning rate as a fraction of lr (wsd and cosine)", ge=0, le=1)
    warmup: int = cfg(30, "steps of linear warmup from 0 to lr", ge=0)
    schedule: Literal["wsd", "cosine", "constant"] = cfg(
        "wsd", "learning-rate schedule after warmup: warmup-stable-decay, cosine, or constant")
    decay_frac: float = cfg(0.2, "last fraction of the steps that wsd decays over", ge=0, le=1)
    weight_decay: float = cfg(0.1, "AdamW weight decay", ge=0)
    beta1: float = cfg(0.9, "AdamW β1", ge=0, lt=1)
    beta2: float = cfg(0.95, "AdamW β2", ge=0, lt=1)
    eps: float = cfg(1e-8, "AdamW ε", gt=0)
    optimizer: Literal["adamw", "muon"] = cfg(
        "adamw", "adamw, or muon: orthogonalised momentum for the matrices inside the layers (experts each on their "
        "own), AdamW for the embedding, head, router, norms and biases, one lr for both (train/43_optim)")
    muon_momentum: float = cfg(0.95, "Muon's momentum (Nesterov)", ge=0, lt=1)
    grad_clip: float = cfg(1.0, "clip the global gradient norm to this (0 disables)", ge=0)
    lb_coef: float = cfg(0.01, "load-balance loss coefficient (0 disables)", ge=0)
    lb_level: Literal["micro", "global", "sequence"] = cfg(
        "global", "load-balance loss with expert counts per micro-batch, over the whole step on all ranks, or per "
        "sequence (averaged over the sequences; train/42)")
    lb_bias_rate: float = cfg(0.0, "aux-loss-free balancing: after each step every router's per-expert selection bias "
                                   "moves by this much toward the experts that received fewer than the mean "
                                   "(DeepSeek-V3); 0 disables (train/42)", ge=0)
    route: Literal["learned", "round_robin"] = cfg(
        "learned", "learned = the router's top-k; round_robin = token t of a micro-batch goes to experts t·k..t·k+k-1 "
        "mod E, for benchmarks that state the perfectly balanced case (the router still runs; train/42)")
    dtype: Literal["auto", "bfloat16", "float32", "float64"] = cfg(
        "auto", "compute dtype: auto = bfloat16 on CUDA, float32 on CPU; float64 is for exact checks on a CPU")
    optim_dtype: Literal["float32", "bfloat16"] = cfg(
        "float32", "when computing in bfloat16: float32 = fp32 master weights and AdamW states; bfloat16 = "
        "update the bf16 weights in place with bf16 states (half the optimizer memory, less exact)")
    compile: bool = cfg(False, "torch.compile stages 1 and 5 of every layer")
    cuda_graphs: bool = cfg(False, "with train.compile on CUDA: replay the compiled stages as CUDA graphs (mode "
                                   "'reduce-overhead'), for steps whose host cannot launch kernels fast enough")
    recompute: Literal["none", "attention", "layer"] = cfg(
        "none", "recompute activations in backward instead of keeping them: attention = stage 1 of every layer (the "
        "attention block, norms, router), layer = stages 1 and 3 (the routed experts too); the exchanges are never "
        "repeated. Less memory for more compute (engine/32_stages)")
    fp8: bool = cfg(False, "the routed experts' matmuls, and the dense projections' (attention's q/k/v/o, MLA's, "
                           "shared experts, dense MLPs) where both their widths are train.fp8_dense_min or more, in "
                           "FP8: E4M3 values with power-of-two scales (train.fp8_scaling); each use of an expert weight "
                           "quantizes the layout it needs (train.fp8_keep_copies: once a step); "
                           "Triton kernels on CUDA (sm89 or newer), their torch reference on a CPU. Attention's "
                           "softmax, router, norms, embedding and head stay in train.dtype (ops/15_fp8). The FP8 "
                           "products are faster than bf16's but the quantization passes cost time, so it pays only "
                           "where the matmuls are wide against them; a run says so at start-up where it measured "
                           "slower (README, FP8)")
    fp8_scaling: Literal["block", "rows"] = cfg(
        "rows", "with train.fp8, how the experts' FP8 values are scaled: rows = one scale per row of each operand "
        "over the whole reduction, so the GEMMs chain their FP8 products and scale once at the end (ops/15_fp8, "
        "\"One scale per row\"), the fewer passes; block = 1×128 activation tiles and 128×128 weight blocks "
        "(DeepSeek-V3's recipe), which confine an outlier to its block")
    fp8_dense_min: int = cfg(4096, "with train.fp8, the narrowest dense projection in FP8: one whose input or output "
                                   "is narrower stays in train.dtype (0: every dense projection in FP8). The "
                                   "default is the width where FP8 measured ahead of bf16 (benchmarks/RESULTS.md, "
                                   "FP8 dense projections)", ge=0)
    fp8_keep_copies: bool = cfg(False, "with train.fp8 and several micro-batches a step: quantize each expert weight "
                                       "once a step, both layouts, and keep them until the optimizer step, instead of "
                                       "twice a micro-batch. Faster, but the copies hold 2 bytes an expert weight "
                                       "element, as much as a bf16 copy of the experts, which takes FP8's peak above "
                                       "bf16's (ops/18_experts; `python -m pith_lit.plan` counts them). No effect with "
                                       "one micro-batch or where FSDP shards the experts (dp × cp > 1)")


@dataclass
class DataConfig:
    "What the model reads."
    corpus: str = cfg("stdlib", "stdlib = the embedded corpus (the Python standard library's source), "
                                "or the path of a packed token file made by `python -m pith_lit.tokenize`")
    tokenizer: str = cfg("stdlib-bpe-4096", "stdlib-bpe-N = a byte-level BPE of N ids trained on the embedded corpus "
                                            "(cached, see cache_dir), bytes = the byte-level tokenizer, or the path "
                                            "of a Hugging Face tokenizer.json")
    cache_dir: str = cfg("", "folder for what is built from the embedded corpus (the stdlib-bpe tokenizers, the "
                             "tokenized corpus), named by hashes of their content, so runs can share it; empty: "
                             "$PITH_LIT_CACHE if set, else run.dir/cache")
    val_frac: float = cfg(0.01, "fraction of the corpus held out for validation", ge=0, lt=1)
    document_mask: bool = cfg(False, "attend within documents: in a window of packed text, positions restart after "
                                     "each end-of-document token and no token attends to another document "
                                     "(block-causal); false: a window is one sequence")


@dataclass
class CkptConfig:
    "When to save, and what to keep."
    every: int = cfg(100, "steps between checkpoints (0 = only at the end; -1 = never, for benchmarks)", ge=-1)
    keep: int = cfg(2, "most recent checkpoints kept", gt=0)
    resume: bool = cfg(True, "continue from the newest checkpoint in run.dir if there is one")


@dataclass
class LogConfig:
    "What the run reports."
    every: int = cfg(10, "steps between log lines", gt=0)
    eval_every: int = cfg(100, "steps between validation losses on the held-out windows (data.val_frac); the last "
                               "step is always evaluated; 0: only the last", ge=0)
    eval_windows: int = cfg(64, "held-out windows per validation loss, all data ranks together", gt=0)
    tensorboard: bool = cfg(True, "write TensorBoard event files to run.dir")
    sample_tokens: int = cfg(64, "length of the greedy sample printed at the end (0 disables)", ge=0)
    profile_step: int = cfg(0, "step (counted from 1) to record with torch.profiler into run.dir/trace-rank<R>.json, "
                            "for `python benchmarks/overlap.py` (0 disables)", ge=0)
    profile_host: bool = cfg(True, "record host-side operators too (their ranges give the per-slot rows of the "
                                   "report); false records GPU kernels only, so the profiler does not slow the "
                                   "host that feeds the GPU (CUDA only)")

# %% [markdown]
# ## The model section
#
# `[model]` holds the `Config` dataclass of one model family, whose field names are those of the Hugging Face
# config. Which dataclass is decided by its `model_type` field: `model_class` is the `Config` of the family's module
# (models/29 `family`, whose `MODEL_TYPES` lists the valid names), and a name that is not a family is a config
# error.

# %%
#| export
class UserError(Exception):
    """An error the user can fix: its message alone says what to change. The command lines print it as one line
    and exit with status 2 (the traceback with `--debug` or PITH_DEBUG=1); any other exception is a bug and keeps
    its traceback."""


class ConfigError(UserError, ValueError):
    "An invalid run config. The message names the field, the value, and what would be valid."


class InvalidInput(UserError, ValueError):
    "Input that cannot be used as it is (a corpus, a tokenizer, a checkpoint); the message says what to change."


class MissingFile(UserError, FileNotFoundError):
    "A file the run needs that does not exist; the message says how to make it or where to point instead."


class ExistingFile(UserError, FileExistsError):
    "A file that would be overwritten; the message says where to write instead."


def model_class(model_type: str) -> type:
    "The `Config` dataclass of the model family named `model_type`."
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model.model_type = {model_type!r}: unknown model family; "
                          f"valid: {', '.join(map(repr, MODEL_TYPES))}")
    return family(model_type).Config

# %% [markdown]
# The checks in this notebook use one helper: the message of the `ConfigError` a call must raise.

# %%
def raises(fn, *args) -> str:
    "The message of the ConfigError that fn(*args) must raise."
    try:
        fn(*args)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"{fn.__name__}{args} should have raised ConfigError")

# %%
for t in MODEL_TYPES:
    assert model_class(t)().model_type == t, t
print(raises(model_class, "llama"))

# %% [markdown]
# ## The tree
#
# `Config` holds one instance of each section. The derived values live here as properties.
# "auto" resolves at the point of use, so a config file written on a laptop still means "the GPU" on
# the GPU machine. `workload()` is what the planner (engine/37) needs of a run.

# %%
#| export
@dataclass
class Config:
    "A whole run: defaults ← TOML file ← `--set` overrides. Build it with `load_config` or `parse_args`."
    run: RunConfig = field(default_factory=RunConfig, metadata={"help": RunConfig.__doc__})
    model: object = field(default_factory=qwen3_moe.Config,   # a family's Config: model_class(model_type)
                          metadata={"help": "the model family's own config, chosen by model_type"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": ParallelConfig.__doc__})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": TrainConfig.__doc__})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": DataConfig.__doc__})
    ckpt: CkptConfig = field(default_factory=CkptConfig, metadata={"help": CkptConfig.__doc__})
    log: LogConfig = field(default_factory=LogConfig, metadata={"help": LogConfig.__doc__})

    @property
    def world_size(self) -> int:
        "Processes the parallel sizes call for: pp × dp_replicate × dp × cp × ep."
        p = self.parallel
        return p.pp * p.dp_replicate * p.dp * p.cp * p.ep

    @property
    def layout(self) -> dict:
        "The parallel sizes, {pp, dp_replicate, dp, cp, ep} (checkpoints record them; `layout_text` for messages)."
        p = self.parallel
        return dict(pp=p.pp, dp_replicate=p.dp_replicate, dp=p.dp, cp=p.cp, ep=p.ep)

    @property
    def layout_text(self) -> str:
        "The parallel sizes as 'pp × dp_replicate × dp × cp × ep' values, e.g. '1 × 1 × 2 × 1 × 1'."
        return " × ".join(map(str, self.layout.values()))

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data: dp_replicate × dp × ep (expert-parallel ranks share experts, not tokens,
        so each reads a different part of the batch; cp ranks split one sequence)."""
        p = self.parallel
        return p.dp_replicate * p.dp * p.ep

    @property
    def num_micro_batches(self) -> int:
        "Micro-batches per optimizer step on each rank that reads its own data."
        return self.train.global_batch // (self.train.micro_batch * self.data_ranks)

    @property
    def pipelined(self) -> bool:
        "Whether DualPipeV runs the step: pp > 1, or parallel.overlap at pp = 1."
        return self.parallel.pp > 1 or self.parallel.overlap

    @property
    def comm_sms(self) -> int:
        "SMs the matmuls leave to communication: parallel.comm_sms where it applies (DualPipeV at ep > 1 on CUDA)."
        p = self.parallel
        return p.comm_sms if self.pipelined and p.ep > 1 and self.device_type == "cuda" else 0

    @property
    def tokens_per_step(self) -> int:
        "Tokens one optimizer step trains on, all ranks together."
        return self.train.global_batch * self.train.seq_len

    @property
    def cache_dir(self) -> Path:
        "Where the embedded corpus's tokenizer and tokens are built: data.cache_dir, $PITH_LIT_CACHE or run.dir/cache."
        return Path(self.data.cache_dir or os.environ.get("PITH_LIT_CACHE") or Path(self.run.dir) / "cache")

    @property
    def device_type(self) -> str:
        "'cuda' or 'cpu': run.device with auto resolved."
        if self.run.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.run.device

    def workload(self) -> Workload:
        "What the planner (engine/37) needs of this run."
        p, t = self.parallel, self.train
        return Workload(pp=p.pp, dp_replicate=p.dp_replicate, dp=p.dp, cp=p.cp, ep=p.ep, micro_batch=t.micro_batch,
                        seq_len=t.seq_len, micro_batches=self.num_micro_batches,
                        compute_bytes=self.torch_dtype.itemsize, param_bytes=self.param_dtype.itemsize,
                        optimizer=t.optimizer, recompute=t.recompute, compile=t.compile, pipelined=self.pipelined,
                        sync_free=p.ep_sync_free,
                        stage_layers=tuple(p.pp_stage_layers) if isinstance(p.pp_stage_layers, list) else (),
                        fp8=t.fp8, fp8_keep=t.fp8_keep_copies, document_mask=self.data.document_mask)

    @property
    def torch_dtype(self) -> torch.dtype:
        "The compute dtype: train.dtype with auto resolved (bfloat16 on CUDA, float32 on CPU)."
        if self.train.dtype == "auto":
            return torch.bfloat16 if self.device_type == "cuda" else torch.float32
        return getattr(torch, self.train.dtype)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the parameters the optimizer steps: fp32 masters of a bf16 compute (train.optim_dtype =
        float32), else the compute dtype itself."""
        low = self.torch_dtype == torch.bfloat16 and self.train.optim_dtype == "float32"
        return torch.float32 if low else self.torch_dtype

# %%
c = Config()
assert c.num_micro_batches == 16 // (4 * 1) == 4 and c.world_size == 1 and c.tokens_per_step == 16 * 128
assert c.workload().micro_batches == 4 and c.workload().tokens == 4 * 128
auto = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
assert (c.device_type, c.torch_dtype) == auto
undocumented = [f"{s.name}.{f.name}" for s in fields(Config) for f in fields(getattr(c, s.name))
                if not f.metadata.get("help")]
assert not undocumented, undocumented
print(sum(len(fields(getattr(c, s.name))) for s in fields(Config)), "fields, all documented")

# %% [markdown]
# ## Types
#
# A TOML file and the command line can only produce bool, int, float, str and lists, so these are the types a
# field may have (a `Literal` of strings for choices). bool is a subclass of int in Python, and `true` must not
# pass as a layer count, so int and float checks exclude it. An int is accepted where a float is expected
# (`lr = 1` is fine) and widened when the tree is built.

# %%
#| export
def _type_name(t) -> str:
    "How --help and the error messages show a field's type."
    if get_origin(t) is Literal:
        return "|".join(get_args(t))
    if get_origin(t) in (Union, types.UnionType):
        return "|".join(map(_type_name, get_args(t)))
    return (get_origin(t) or t).__name__


def _accepts(t, v) -> bool:
    "Whether value `v` fits field type `t` (bool, int, float, str, list, a Literal of strings, or a union of them)."
    if get_origin(t) is Literal:
        return isinstance(v, str) and v in get_args(t)
    if get_origin(t) in (Union, types.UnionType):
        return any(_accepts(a, v) for a in get_args(t))
    if t in (int, float):
        return isinstance(v, t) and not isinstance(v, bool)
    return isinstance(v, get_origin(t) or t)


def _check_types(section: str, types: dict, values: dict):
    "Raise ConfigError for the first value in `values` that does not fit its field's type in `types`."
    for name, v in values.items():
        t = types[name]
        if get_origin(t) is Literal and not _accepts(t, v):
            raise ConfigError(f"{section}.{name} = {v!r}: expected one of {', '.join(map(repr, get_args(t)))}")
        if not _accepts(t, v):
            raise ConfigError(f"{section}.{name} = {v!r}: expected {_type_name(t)}, got {type(v).__name__}")

# %%
assert _accepts(int, 3) and not _accepts(int, True) and not _accepts(int, 3.0)
assert _accepts(float, 3.0) and not _accepts(float, "3") and _accepts(bool, False) and _accepts(list, [1])
assert _accepts(Literal["a", "b"], "a") and not _accepts(Literal["a", "b"], "c")
assert _accepts(list | Literal["auto"], [3, 4]) and _accepts(list | Literal["auto"], "auto")
assert not _accepts(list | Literal["auto"], "even") and _type_name(list | Literal["auto"]) == "list|auto"
print(raises(_check_types, "train", get_type_hints(TrainConfig), {"lr": "fast"}))
print(raises(_check_types, "run", get_type_hints(RunConfig), {"device": "tpu"}))

# %% [markdown]
# ## From dictionaries to the tree
#
# `from_dict` turns nested dicts (a parsed TOML file) into a `Config`. Unknown names are errors, with the closest
# valid name suggested: a misspelt `lr` that silently fell back to its default would train with the wrong
# learning rate and say nothing.
#
# An override `section.field=value` is parsed as a TOML literal when it is one (`3`, `1e-3`, `true`, `[1, 2]`,
# `"quoted"`), and otherwise taken as the text itself, so paths need no quotes. A field of type str always takes
# the text, so `--set run.dir=2024` is the directory "2024" and not a type error. Overrides are parsed here,
# where the field's type is known, rather than when the command line is read; `model.model_type` is resolved
# first because it decides which dataclass `[model]` is.
#
# Types are checked before a section is constructed, because a model `Config` checks its own values in
# `__post_init__` (Qwen3's: heads per key/value head, even head_dim, top-k) and would otherwise meet a string
# where it does arithmetic. Its `ValueError` becomes a `ConfigError` naming the section.

# %%
#| export
def _closest(name: str, valid: Sequence[str], show: str) -> str:
    "'; did you mean X?' (X written as `show` formats it) when a valid name is close to `name`, else all of them."
    near = difflib.get_close_matches(name, valid, n=1)
    return f"; did you mean {show.format(near[0])}?" if near else f"; valid: {', '.join(valid)}"


def _split_override(item: str) -> tuple[tuple[str, str], str]:
    "'section.field=value' -> ((section, field), 'value')."
    key, eq, text = item.partition("=")
    parts = key.strip().split(".")
    if not eq or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: expected section.field=value, e.g. --set train.lr=1e-3")
    return (parts[0], parts[1]), text.strip()


def _parse_override(text: str, t):
    "An override's value for a field of type `t` (None if unknown): a TOML literal, else the text; str takes the text."
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:  # not a TOML literal: the text is the value (a path, a word)
        return text
    textual = t is str or get_origin(t) is Literal
    return text if textual and not isinstance(value, str) else value


def from_dict(data: dict, overrides: Sequence[str] = ()) -> Config:
    "Build a `Config` from nested dicts (a parsed TOML file) and `section.field=value` overrides. Not validated."
    texts = dict(_split_override(item) for item in overrides)  # a later --set of the same field wins
    sections = [f.name for f in fields(Config)]
    for name in [*data, *(s for s, _ in texts)]:
        if name not in sections:
            raise ConfigError(f"[{name}]: no such section{_closest(name, sections, '[{}]')}")
    for name, table in data.items():
        if not isinstance(table, dict):  # `train = 3` instead of a [train] table
            raise ConfigError(f"{name} = {table!r}: expected a table [{name}] of fields")
    if ("model", "model_type") in texts:
        model_type = _parse_override(texts["model", "model_type"], str)
    else:
        model_type = data.get("model", {}).get("model_type", qwen3_moe.Config.model_type)
    hints = get_type_hints(Config)
    parts = {}
    for section in sections:
        cls = model_class(model_type) if section == "model" else hints[section]
        types = get_type_hints(cls)
        values = dict(data.get(section, {}))
        for (s, name), text in texts.items():
            if s == section:
                values[name] = _parse_override(text, types.get(name))
        for name, v in values.items():
            if name not in types:
                raise ConfigError(f"{section}.{name} = {v!r}: no such field in [{section}]"
                                  f"{_closest(name, list(types), section + '.{}')}")
            if types[name] is float and _accepts(int, v):
                values[name] = float(v)
        _check_types(section, types, values)
        try:
            parts[section] = cls(**values)
        except ValueError as e:  # the section's own __post_init__ check, re-raised as a config error
            raise ConfigError(f"[{section}] {e}") from e
    return Config(**parts)

# %%
c = from_dict({"train": {"lr": 1, "steps": 5}}, ["run.dir=out/2024", "train.compile=true", 'run.seed=7',
                                                "model.num_experts=16", "data.tokenizer=tok/tokenizer.json"])
assert c.train.lr == 1.0 and type(c.train.lr) is float and c.train.steps == 5 and c.train.compile is True
assert c.run.dir == "out/2024" and c.run.seed == 7 and c.model.num_experts == 16
assert c.data.tokenizer == "tok/tokenizer.json" and c.train.beta2 == 0.95  # untouched fields keep defaults
assert from_dict({}, ["run.dir=1", "run.dir=2"]).run.dir == "2" and from_dict({}, ['run.dir="3"']).run.dir == "3"
assert from_dict({}, ["model.mlp_only_layers=[0, 3]"]).model.mlp_only_layers == [0, 3]
assert from_dict({}) == Config()
for data, over in [({"trian": {}}, []), ({"train": {"lrr": 1.0}}, []), ({}, ["model.num_expert=4"]),
                   ({}, ["train.lr"]), ({"train": 3}, []), ({}, ["model.model_type=llama"])]:
    print(raises(from_dict, data, over))
print(raises(from_dict, {}, ["model.num_key_value_heads=three"]))
print(raises(from_dict, {}, ["model.num_key_value_heads=3"]))

# %% [markdown]
# ## Validation
#
# `validate` checks the finished tree: types (again, since a `Config` can also be built or changed in Python),
# the ranges declared on the fields (`cfg(..., gt=0)`, models/protocol: every number a field may hold is stated
# where the field is, for the model families too, so no list of names lives here), and the combinations that make
# a run impossible. It raises at the first problem with one message. The combinations:
#
# - the parallel sizes multiply to the number of processes (`world_size`; `None` skips this when unknown);
# - context parallelism cuts each sequence into 2·cp equal chunks, so `seq_len` must be divisible by 2·cp; its
#   ranks hold pieces of one sequence, so the per-sequence load-balance loss (`lb_level = "sequence"`) and
#   Qwen3.5's linear-attention layers (whose recurrent state the ring does not pass) are refused with it;
# - `run.device = cuda` needs a GPU that torch can see, and `parallel.comm_sms` needs torch's SM carveout where it
#   applies (DualPipeV at ep > 1 on CUDA);
# - expert parallelism divides the experts evenly among its ranks;
# - `global_batch` is a whole number of micro-batches on every data-parallel rank;
# - DualPipeV feeds micro-batches in from both ends of the pipeline and needs at least 2·pp of them per step
#   (also at pp = 1 with `overlap`, where it pairs two micro-batches), and 2·pp stages of layers
#   (`stage_layers`, engine/30_mesh, with its own rules for `pp_stage_layers`);
# - top-k cannot exceed the number of experts; query heads come in equal groups per key/value head; a sequence
#   is no longer than the model's `max_position_embeddings`;
# - the byte tokenizer uses ids 0..255 for bytes and three more for special tokens, so it needs a vocabulary of
#   at least `BYTE_VOCAB = 259` (`ByteTokenizer.vocab_size` in `train.data`, a later notebook that this one may
#   not import; tests/test_config.py checks that the two agree), and `stdlib-bpe-N`, a BPE trained on the embedded
#   corpus, needs `vocab_size` ≥ N.
#
# Every model family names its expert count differently; `routed_experts`, a property each family's `Config`
# has, gives it under one name.

# %%
#| export
BYTE_VOCAB = 259  # the byte tokenizer: 256 byte values + 3 special tokens
STDLIB_BPE = "stdlib-bpe-"   # data.tokenizer = "stdlib-bpe-N": a BPE of N ids trained on the embedded corpus


def stdlib_bpe_vocab(spec: str) -> int | None:
    "N for the tokenizer spec 'stdlib-bpe-N' (N ≥ 257: the 256 bytes and the end-of-document token), else None."
    n = spec.removeprefix(STDLIB_BPE)
    if n == spec:
        return None
    if not (n.isdigit() and int(n) >= 257):
        raise ConfigError(f"data.tokenizer = {spec!r}: the number of ids of a trained BPE must be an integer >= 257 "
                          "(256 bytes + the end-of-document token), e.g. 'stdlib-bpe-4096'")
    return int(n)


def _need(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


_BOUNDS = {"gt": (lambda v, b: v > b, ">"), "ge": (lambda v, b: v >= b, ">="), "lt": (lambda v, b: v < b, "<"),
           "le": (lambda v, b: v <= b, "<=")}


def _check_bounds(name: str, value, metadata) -> None:
    "Raise ConfigError when `value` breaks a bound declared on its field (`cfg(..., gt=0)` and the like)."
    if all(ok(value, metadata[k]) for k, (ok, _) in _BOUNDS.items() if k in metadata):
        return
    lo = next((k for k in ("gt", "ge") if k in metadata), None)
    hi = next((k for k in ("lt", "le") if k in metadata), None)
    if lo and hi:
        want = f"in {'(' if lo == 'gt' else '['}{metadata[lo]!r}, {metadata[hi]!r}{')' if hi == 'lt' else ']'}"
    else:
        want = f"{_BOUNDS[lo or hi][1]} {metadata[lo or hi]!r}"
    raise ConfigError(f"{name} = {value!r}: must be {want}")


def _check_fields(cfg: Config) -> None:
    "Every field's type, and every range declared on a field."
    for s in fields(Config):
        section = getattr(cfg, s.name)
        if s.name == "model":
            _need(type(section) is model_class(section.model_type),
                  f"model.model_type = {section.model_type!r}, but [model] is a {type(section).__qualname__} "
                  f"from {type(section).__module__}; build the model section with model_class(model_type)")
        _check_types(s.name, get_type_hints(type(section)), {f.name: getattr(section, f.name) for f in fields(section)})
        for f in fields(section):
            _check_bounds(f"{s.name}.{f.name}", getattr(section, f.name), f.metadata)


def _check_layout(cfg: Config, world_size: int | None) -> None:
    "The parallel sizes against the world, the model and the batch; the device and what it must offer."
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _need(not t.cuda_graphs or (t.compile and p.pp == 1 and not p.overlap and p.cp == 1 and t.recompute == "none"),
          "train.cuda_graphs = true: it needs train.compile=true and runs only at parallel.pp=1, parallel.overlap="
          "false, parallel.cp=1 and train.recompute=none (the layouts it was measured in); set train.cuda_graphs=false")
    _need(p.cp == 1 or m.model_type != "qwen3_5_moe",
          f"parallel.cp = {p.cp}: model.model_type = 'qwen3_5_moe' has linear-attention layers whose recurrent state "
          "would have to pass from each rank's piece of a sequence to the next, which the ring does not do; set "
          "parallel.cp = 1 (use dp or ep for more GPUs)")
    _need(p.cp == 1 or t.seq_len % (2 * p.cp) == 0,
          f"train.seq_len = {t.seq_len}: context parallelism cuts each sequence into 2·cp = {2 * p.cp} equal chunks; "
          f"use a multiple of {2 * p.cp} (e.g. {t.seq_len - t.seq_len % (2 * p.cp) or 2 * p.cp}) or another parallel.cp")
    _need(p.cp == 1 or t.lb_level != "sequence",
          f"parallel.cp = {p.cp} with train.lb_level = 'sequence': each rank holds only pieces of a sequence; use "
          "lb_level = 'global' or 'micro' with context parallelism")
    _need(cfg.run.device != "cuda" or torch.cuda.is_available(),
          "run.device = 'cuda', but torch sees no CUDA GPU here; set run.device = cpu (or auto)")
    if world_size is not None:
        _need(cfg.world_size == world_size,
              f"parallel: pp × dp_replicate × dp × cp × ep = {cfg.layout_text} = {cfg.world_size}, "
              f"but the world size is {world_size}; choose sizes whose product is {world_size}")
    _need(m.routed_experts % p.ep == 0,  # 0 experts (dense) also passes
          f"parallel.ep = {p.ep}: the model's {m.routed_experts} routed experts are not divisible by it; use one of "
          f"{[k for k in range(1, m.routed_experts + 1) if m.routed_experts % k == 0]}")
    per_step = t.micro_batch * cfg.data_ranks
    _need(t.global_batch % per_step == 0,
          f"train.global_batch = {t.global_batch}: not divisible by train.micro_batch × parallel.dp_replicate × dp × "
          f"ep = {t.micro_batch} × {p.dp_replicate} × {p.dp} × {p.ep} = {per_step}; use a multiple of {per_step}")
    if cfg.pipelined:
        why = f"parallel.pp = {p.pp}" if p.pp > 1 else "parallel.overlap = true"
        _need(cfg.num_micro_batches >= 2 * p.pp,
              f"train.global_batch = {t.global_batch}: gives {cfg.num_micro_batches} micro-batches per step "
              f"(global_batch / (micro_batch × dp_replicate × dp × ep)), but DualPipeV with {why} needs at least 2·pp = {2 * p.pp}; "
              f"use global_batch >= {2 * p.pp * per_step} or a smaller micro_batch")
        try:        # the split's own rules (engine/30_mesh), checked before anything is built
            stage_layers(m.num_hidden_layers, p.pp, None if p.pp_stage_layers == "auto" else p.pp_stage_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.comm_sms:
        _need(hasattr(torch._C, "_set_sm_carveout_experimental"),
              f"parallel.comm_sms = {p.comm_sms} needs torch's SM carveout, which torch {torch.__version__} lacks; "
              "set parallel.comm_sms = 0 or install a newer torch")


def _check_schedule(cfg: Config) -> None:
    "The learning-rate schedule and the profiled step against the number of steps."
    t = cfg.train
    _need(cfg.log.profile_step <= t.steps,
          f"log.profile_step = {cfg.log.profile_step}: not a step of this run; use 1..{t.steps} (train.steps), or 0 "
          "for no trace")
    decay = round(t.decay_frac * t.steps) if t.schedule == "wsd" else 0
    most = t.steps - decay
    _need(t.warmup <= most,
          f"train.warmup = {t.warmup}: longer than the {most} steps before the decay (train.steps = {t.steps}"
          + (f", the wsd decay the last {decay})" if decay else ")")
          + f"; add --set train.warmup={max(0, min(most, t.steps // 10))} (or any value up to {most})")


def _check_model(cfg: Config) -> None:
    "The model's own cross-field rules, and what the data asks of it."
    m, t = cfg.model, cfg.train
    if t.fp8 and cfg.device_type == "cuda":
        cc = torch.cuda.get_device_capability()
        _need(cc >= (8, 9), f"train.fp8 = true: FP8 matmuls need a GPU of compute capability 8.9 or newer (Ada, "
                            f"Hopper), this one is {cc[0]}.{cc[1]}; set train.fp8=false")
    _need(m.routed_experts == 0 or m.num_experts_per_tok <= m.routed_experts,
          f"model.num_experts_per_tok = {m.num_experts_per_tok}: more than the model's {m.routed_experts} routed "
          f"experts; use at most {m.routed_experts}")
    _need(m.num_attention_heads % m.num_key_value_heads == 0,
          f"model.num_attention_heads = {m.num_attention_heads}: not divisible by model.num_key_value_heads = "
          f"{m.num_key_value_heads}; use a multiple of {m.num_key_value_heads}")
    _need(t.seq_len <= m.max_position_embeddings,
          f"train.seq_len = {t.seq_len}: longer than model.max_position_embeddings = {m.max_position_embeddings}; "
          f"use seq_len <= {m.max_position_embeddings} (or raise max_position_embeddings where the model's RoPE "
          "scaling supports it)")
    if cfg.data.tokenizer == "bytes":
        _need(m.vocab_size >= BYTE_VOCAB,
              f"model.vocab_size = {m.vocab_size}: the byte tokenizer needs at least {BYTE_VOCAB} ids (256 bytes + "
              f"3 special tokens); use vocab_size >= {BYTE_VOCAB} or set data.tokenizer to a tokenizer.json")
    bpe = stdlib_bpe_vocab(cfg.data.tokenizer)
    if bpe is not None:
        _need(m.vocab_size >= bpe,
              f"model.vocab_size = {m.vocab_size}: data.tokenizer = {cfg.data.tokenizer!r} has {bpe} ids; use "
              f"vocab_size >= {bpe}, or a smaller tokenizer (e.g. data.tokenizer = '{STDLIB_BPE}{m.vocab_size}' if "
              f"{m.vocab_size} >= 257, or 'bytes')")


def validate(cfg: Config, world_size: int | None = None) -> Config:
    "Raise `ConfigError` naming the field, the value and what would be valid, at the first problem; else return `cfg`."
    _check_fields(cfg)
    _check_layout(cfg, world_size)
    _check_schedule(cfg)
    _check_model(cfg)
    return cfg

# %% [markdown]
# Each error, printed. Every case starts from the valid default config and changes one thing; each must raise.
# A type error, and Qwen3's own checks, stop it in `from_dict`; the rest in `validate`.

# %%
def check(overrides: list[str], world_size: int | None = 1) -> Config:
    return validate(from_dict({}, overrides), world_size)


cases = {
    "wrong type": ["train.steps=1.5"],
    "bool for an int": ["model.num_hidden_layers=true"],
    "bad choice": ["train.schedule=linear"],
    "non-positive size": ["train.micro_batch=0"],
    "out of range": ["train.beta2=1.0"],
    "world size": ["parallel.dp=2"],
    "ep vs experts": ["parallel.ep=3"],
    "global batch": ["train.global_batch=10"],
    "DualPipeV micro-batches": ["parallel.pp=2", "train.global_batch=8"],
    "overlap at pp 1": ["parallel.overlap=true", "train.global_batch=4"],
    "cp vs seq_len": ["parallel.cp=3", "train.seq_len=32"],
    "cp with sequence balance": ["parallel.cp=2", "train.lb_level=sequence"],
    "cp with linear attention": ["parallel.cp=2", "model.model_type=qwen3_5_moe"],
    "seq_len vs positions": ["train.seq_len=5000"],
    "top-k": ["model.num_experts_per_tok=9"],
    "heads": ["model.num_attention_heads=6", "model.num_key_value_heads=4"],
    "byte vocab": ["model.vocab_size=256", "data.tokenizer=bytes"],
    "trained BPE vocab": ["model.vocab_size=1000"],
    "trained BPE size": ["data.tokenizer=stdlib-bpe-100"],
    "warmup vs steps": ["train.steps=10", "train.warmup=20"],
    "warmup vs wsd decay": ["train.steps=100", "train.warmup=90"],
    "unknown model family": ["model.model_type=llama"],
    "profile step": ["train.steps=10", "log.profile_step=11"],
    "pipeline vs layers": ["parallel.pp=2", "model.num_hidden_layers=3", "train.global_batch=16"],
    "CUDA graphs without compile": ["train.cuda_graphs=true"],
}
worlds = {"ep vs experts": 3, "DualPipeV micro-batches": 2, "cp vs seq_len": 3, "cp with sequence balance": 2,
          "cp with linear attention": 2,
          "pipeline vs layers": 2}
for name, over in cases.items():
    print(f"{name:>24}: {raises(check, over, worlds.get(name, 1))}")
for name, value in [("num_experts_per_tok", 9), ("num_attention_heads", 5), ("num_hidden_layers", True)]:
    c = Config()
    setattr(c.model, name, value)  # changed after construction: only validate sees it
    print(f"{'model.' + name + ' (validate)':>24}: {raises(validate, c)}")
assert validate(Config(), 1) == Config() and check(["data.tokenizer=t.json", "model.vocab_size=100"])
assert check(["parallel.pp=2", "train.global_batch=16"], 2)  # 4 micro-batches = 2·pp: enough
assert check(["model.num_experts=0", "parallel.ep=2"], 2)  # a dense Qwen3
assert check(["parallel.cp=2"], 2)  # the tiny default's 128 tokens in 4 chunks

# %% [markdown]
# ## Writing the config a run used
#
# A run saves the exact config it ran with next to its checkpoints, so it can be repeated and resumed.
# `to_dict` is the tree as nested dicts; `dump_toml` writes it as TOML. The TOML here is only flat tables of
# scalars and lists, so a writer is a dozen lines and no new dependency. Python's float `repr` is both the
# shortest exact decimal and valid TOML (`1e-08`, `inf`, `nan`), so floats survive the round trip bit for bit.

# %%
#| export
def to_dict(cfg: Config) -> dict:
    "The config as nested dicts {section: {field: value}}, TOML-compatible."
    return dataclasses.asdict(cfg)


def _toml_value(v) -> str:
    "A TOML literal for a bool, int, float, str, or a list or table (dict with bare-word keys) of them."
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # a basic string: quote and backslash escaped, control characters as \uXXXX
        return '"' + "".join("\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7f
                             else c for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml_value, v)) + "]"
    if isinstance(v, dict):  # an inline table, e.g. DeepSeek-V2's rope_scaling
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} ({type(v).__name__}) as TOML: only bool, int, float, str, lists, tables")


def dump_toml(cfg: Config) -> str:
    "The config as a TOML document that `load_config` reads back to an equal `Config`."
    lines = []
    for section, values in to_dict(cfg).items():
        lines += [f"[{section}]", *(f"{k} = {_toml_value(v)}" for k, v in values.items()), ""]
    return "\n".join(lines)

# %%
for v in [True, 0, -3, 3e-3, 1e-8, 1e300, 0.1 + 0.2, float("inf"), "", 'a "b" \\ c\n\t\x00\x7f é', [1, [2.5, "x"]],
          {"type": "yarn", "factor": 4.0}, {}]:
    back = tomllib.loads(f"v = {_toml_value(v)}")["v"]
    assert back == v and type(back) is type(v), (v, back)
assert math.isnan(tomllib.loads(f"v = {_toml_value(float('nan'))}")["v"])
print(dump_toml(Config()))

# %% [markdown]
# ## Loading
#
# `load_config` puts the layers together: defaults ← TOML file ← overrides, then `validate`. A missing file
# names the path it looked for, relative to where the command runs. The default config file,
# `configs/tiny.toml`, writes out every default, so loading it must give exactly `Config()`.

# %%
#| export
def read_toml(path: str | None) -> dict:
    "The parsed TOML file at `path` ({} for None)."
    if path is None:
        return {}
    if not Path(path).is_file():
        raise ConfigError(f"config file {str(path)!r} not found (relative to {os.getcwd()}); "
                          f"pass the path of a TOML file, e.g. configs/tiny.toml")
    try:
        return tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:  # re-raised with the file's name
        raise ConfigError(f"{path}: not valid TOML: {e}") from e


def load_config(path: str | None = None, overrides: Sequence[str] = (), world_size: int | None = None) -> Config:
    "Defaults ← the TOML file at `path` ← `section.field=value` overrides, then `validate(cfg, world_size)`."
    return validate(from_dict(read_toml(path), overrides), world_size)

# %%
CONFIGS = repo_path("configs")
tiny = load_config(CONFIGS / "tiny.toml", world_size=1)
assert tiny == Config(), "configs/tiny.toml must spell out exactly the defaults"
c = load_config(CONFIGS / "tiny.toml", ["train.lr=1e-3", "parallel.dp=2", "train.global_batch=32"], world_size=2)
assert (c.train.lr, c.parallel.dp, c.num_micro_batches) == (1e-3, 2, 4) and c.train.steps == 300
with tempfile.TemporaryDirectory() as tmp:  # round trip: what a run saves, it loads back unchanged
    (Path(tmp) / "used.toml").write_text(dump_toml(c))
    assert load_config(Path(tmp) / "used.toml", world_size=2) == c
    (Path(tmp) / "bad.toml").write_text("[train]\nlr = \n")
    print(raises(load_config, Path(tmp) / "bad.toml").replace(tmp, "TMP"))
print(raises(load_config, "configs/tiyn.toml"))
for f in sorted(CONFIGS.glob("*.toml")):
    cf = load_config(f)
    print(f"{f.name:28} world size {cf.world_size}, {cf.num_micro_batches} micro-batches, "
          f"{cf.tokens_per_step} tokens/step, {cf.model.num_hidden_layers} layers of width {cf.model.hidden_size}")
    validate(cf, cf.world_size)

# %% [markdown]
# ## The command line
#
# `parse_args` reads `[config.toml] [--set section.field=value ...]` and the world size from torchrun's
# `WORLD_SIZE` (1 without torchrun). `--help` lists every field of every section, `[model]` included, for the
# model family in force (the config file and overrides are read first to find it). An invalid config ends the
# program with argparse's usage line and the validation message (exit status 2).
#
# `python -m pith_lit.train.config [config.toml] [--set ...]` prints the resolved config as TOML, which is a
# quick way to check a config file before launching it.

# %%
#| export
def _field_lines(cfg: Config) -> list[str]:
    "One line per field: `section.field  (type, default X)  doc`, aligned."
    rows = []
    for s in fields(Config):
        section = getattr(cfg, s.name)
        types = get_type_hints(type(section))
        for f in fields(section):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            rows.append((f"{s.name}.{f.name}", f"({_type_name(types[f.name])}, default {_toml_value(default)})",
                         f.metadata.get("help", "")))
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    return [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]


def arg_parser() -> argparse.ArgumentParser:
    "The command line: an optional config file, repeatable --set, and a --help that lists the fields."
    parser = argparse.ArgumentParser(prog="python -m pith_lit.train", add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Run config: defaults <- TOML file <- --set overrides, validated.")
    parser.add_argument("config", nargs="?", help="TOML config file (default: the built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one field; the value is a TOML literal or plain text; repeatable")
    parser.add_argument("-h", "--help", action="store_true", help="show this help, with every field, and exit")
    parser.add_argument("--debug", action="store_true",
                        help="show the whole traceback of an error the message already explains (also PITH_DEBUG=1)")
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    "The validated `Config` from the command line (`argv`, default sys.argv[1:]) and WORLD_SIZE."
    parser = arg_parser()
    args = parser.parse_args(argv)
    try:
        if args.help:  # list the fields of the model family that the file and overrides select
            model_type = [s for s in args.set if s.partition("=")[0].strip() == "model.model_type"]
            fields_of = from_dict(read_toml(args.config), model_type)
            parser.epilog = "fields (set with --set section.field=value):\n" + "\n".join(_field_lines(fields_of))
            parser.print_help()
            parser.exit()
        return load_config(args.config, args.set, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:  # argparse's way out: usage line, the message, exit status 2
        parser.error(str(e))


def debugging(argv: list[str] | None = None) -> bool:
    "Whether the user asked for whole tracebacks: `--debug` among the arguments, or PITH_DEBUG set (not 0)."
    return "--debug" in (sys.argv[1:] if argv is None else argv) or os.environ.get("PITH_DEBUG", "0") not in ("", "0")


def run_command(fn, argv: list[str] | None = None) -> int:
    """Call `fn()` as a command line does: exit status 0 when it returns; an error the user can fix (`UserError`)
    printed as one line, `error: ...`, with status 2, its traceback only when `debugging(argv)`."""
    try:
        fn()
    except UserError as e:
        if debugging(argv):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main():
    "Print the resolved config as TOML."
    print(dump_toml(parse_args()), end="")


if __name__ == "__main__" and __spec__ is not None:
    main()

# %%
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    parse_args(["--help"])
print(out.getvalue())
for s in fields(Config):
    for f in fields(getattr(Config(), s.name)):
        assert f"  {s.name}.{f.name} " in out.getvalue(), f"{s.name}.{f.name} missing from --help"
assert parse_args([str(CONFIGS / "tiny.toml"), "--set", "train.steps=50", "--set", "log.every=1"]).train.steps == 50
