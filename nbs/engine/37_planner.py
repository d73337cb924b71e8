# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The planner: memory of a layout before it runs
#
# A layout (pp × dp_replicate × dp × cp × ep, micro-batch, recomputation) either fits a GPU or dies minutes into
# the run, after the model was built and compiled. This notebook predicts, for every rank of a layout, the peak of
# `torch.cuda.max_memory_allocated`, from the model's config alone. The trainer refuses a layout predicted not to
# fit before it allocates anything (train/45), and `python -m pith_lit.plan` lists the layouts that fit a number of
# GPUs (train/50). The step time of a layout is the next notebook's (engine/38).
#
# A rank's memory is four things, each followed through the step:
#
# 1. **State**: this rank's share of the parameters, their optimizer states and gradients, computed exactly from
#    the model built on the meta device, cut and sharded as the trainer cuts and shards it (engine/33
#    `split_model`, engine/31 `shard_experts`, engine/36's FSDP units). During the step FSDP also holds each unit's
#    gathered weights in the compute dtype and its unsharded gradient in fp32, from the unit's first use until
#    `reduce_gradients` (engine/36 explains why).
# 2. **Activations**: what each layer keeps for its backward, per token, written out below per model family from
#    what its code saves (and checked against what the layers keep on the H200), times the tokens of a
#    micro-batch, times the micro-batches in flight: one in the plain loop, as many as the DualPipeV schedule has
#    between a stage's forward and its backward (walked action by action), plus what zero-bubble backwards leave
#    for their W.
# 3. **Transients**: the peaks inside one action: the fused head's fp32 weight-gradient accumulator and one chunk
#    of logits (ops/13), an expert weight's gradient while it is added into the existing one, a unit's flat
#    gradient buffer while FSDP reduce-scatters it.
# 4. **Slack**: the caching allocator reserves more than it hands out (fragmentation); the peak reserved was
#    1–13% above the peak allocated in the runs of `benchmarks/RESULTS.md`. A layout fits when the predicted
#    peak, plus this slack and the CUDA context, stays under the GPU's memory.

# %%
#| default_exp engine.planner

# %%
#| export
import math
from dataclasses import dataclass

import torch
from torch import nn

from pith_lit.engine.dualpipev import dualpipev_schedule, split_model
from pith_lit.engine.ep import shard_experts
from pith_lit.engine.mesh import stage_layers
from pith_lit.models.family import family
from pith_lit.models.protocol import norm_bytes
from pith_lit.ops.attention import ds_bytes
from pith_lit.ops.experts import fp8_copies_pay

# %% [markdown]
# ## What one step runs
#
# `Workload` holds what the planner needs of a run, in its own terms: the layout, the batch, the dtypes and the
# mechanisms that change memory. The trainer's config makes one (`train/40_config`'s `Config.workload`); the
# fields are named after the config fields they come from.

# %%
#| export
GiB = 2 ** 30


@dataclass(frozen=True)
class Workload:
    "One step of a run, as the planner sees it (from `Config.workload()`)."
    pp: int = 1
    dp_replicate: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1          # sequences per micro-batch on each data rank
    seq_len: int = 4096
    micro_batches: int = 1        # micro-batches per step on each data rank
    compute_bytes: int = 2        # train.dtype: 2 for bfloat16
    param_bytes: int = 2          # what the optimizer steps: 4 with fp32 master weights (train.optim_dtype)
    optimizer: str = "adamw"      # or "muon"
    recompute: str = "none"       # "attention" | "layer"
    compile: bool = False
    pipelined: bool = False       # DualPipeV runs the step (pp > 1 or parallel.overlap)
    sync_free: bool = False       # parallel.ep_sync_free
    stage_layers: tuple = ()      # parallel.pp_stage_layers (empty: even)
    fp8: bool = False             # train.fp8: FP8 copies of the expert weights, FP8 saved inputs (ops/15)
    fp8_keep: bool = False        # train.fp8_keep_copies: the experts' copies kept for the step where they pay
    document_mask: bool = False   # data.document_mask: attention within documents, by ops/14's kernels

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp * self.cp * self.ep

    @property
    def tokens(self) -> int:
        "Tokens of one micro-batch on one rank (a cp rank holds 1/cp of each sequence)."
        return self.micro_batch * self.seq_len // self.cp

# %% [markdown]
# ## Activations, per token and layer
#
# Each family's stage 1 and stage 3 keep, per token, what their operators save for backward. The terms follow the
# code of models/21–24 on the GPU path (the Triton kernels of ops/10–16, FlashAttention through SDPA or ops/14's
# kernel, the fused head of ops/13), with `b` the compute dtype's bytes and `f` the bytes of the norms' and router's
# float32 (wider for a float64 model). Stage 1 is the family's own: each family's notebook writes out what its
# layer keeps, by part (`kept_by_part`), from what models/20 counts for an RMSNorm (`norm_bytes`; its output is kept
# by the projection that reads it; compiled, `train.compile`, the rest is recomputed in backward), a SwiGLU MLP
# (`mlp_bytes`) and a router (`router_bytes`), and an attention kernel's q, k, v, output and log-sum-exp (one
# float32 per head and token). Here:
#
# - stage 3 keeps the expanded rows (k per token), the gate/up output the SwiGLU kernel reads back, the
#   activation the down projection reads back, the expert outputs the weighted sum reads back, two index maps, and
#   the summed rows.
#
# Every layer also keeps its output (the next layer's input). Recomputation keeps only a recomputed stage's inputs
# and outputs (engine/32 `recompute_layers`): `attention` drops stage 1's inside (a dense layer's stage 1 is the
# whole layer), `layer` stage 3's too. `LayerBytes` holds the kept bytes per token by part, and what a
# zero-bubble backward leaves for its W slot: the expert matmuls' inputs and output gradients
# (ops/12 `WeightGradQueue`), under `train.fp8` in their FP8 forms (ops/15).

# %%
#| export
@dataclass
class LayerBytes:
    """Bytes per token that one layer keeps from its forward to its backward, by part; `deferred`: kept until W.
    `spare`, `spare_deferred`: bytes per micro-batch whatever its tokens (FP8's spare column tiles, below)."""
    parts: dict
    deferred: float = 0.0
    moe: bool = False
    spare: float = 0.0
    spare_deferred: float = 0.0

    @property
    def kept(self) -> float:
        return sum(self.parts.values())

    def kept_at(self, T: int) -> float:
        "Bytes kept from forward to backward for a micro-batch of T tokens."
        return self.kept * T + self.spare

    def deferred_at(self, T: int) -> float:
        "Bytes kept until W for a micro-batch of T tokens."
        return self.deferred * T + self.spare_deferred


def _experts(k: int, H: int, inter: int, b: int, what: str, one_hot: int = 0, fp8: bool = False) -> float:
    """Stage 3 per token (k pairs): index maps, expanded rows, gate/up output, activation, expert outputs, summed
    rows; with stage 3 recomputed only its input, its output and the maps. `one_hot`: the family's `router_one_hot`.
    `fp8`: the experts' matmuls keep their inputs for the weight gradients as FP8 (ops/15: the expanded rows and the
    activation, 1 byte a value and a 4-byte scale a row; block scales keep 4 bytes per 128 values instead, within
    100 bytes a row of that) instead of the rows themselves."""
    maps = 2 * 8 * k
    if what == "layer":
        return maps + 2 * k * b * H + b * H
    if fp8:
        return maps + k * (b * (2 * inter + H + one_hot) + H + inter + 8) + b * H
    return maps + k * b * (H + 2 * inter + inter + H + one_hot) + b * H


def deferred_per_row(H: int, inter: int, b: int, fp8: bool = False) -> float:
    """Bytes a SwiGLU expert MLP keeps per routed row for its deferred weight gradients: the input, gate/up's output
    gradient, the activation, down's output gradient; under FP8 their quantized forms, 1 byte a value and a scale
    per row of the input and of the activation (the gradients' scales, per expert column, are not per row)."""
    return (2 * H + 3 * inter + 8) if fp8 else b * (2 * H + 3 * inter)

# %% [markdown]
# `layer_bytes` asks the family for stage 1's parts (`kept_by_part`) and the width and router term of its experts,
# adds stage 3 and the output, and applies recomputation. `attention_transient` asks the family for the shape of
# the attention ops/14's kernels run, if they run it.

# %%
#| export
def attention_transient(c, w: Workload) -> float:
    """Bytes that ops/14's backward holds for one attention layer's stored dSᵀ (`ds_bytes`; 0 where it recomputes
    dq or where SDPA attends: the family's `kernel_attention_shape` says where its kernels attend). A ring step
    attends a rank's tokens to one chunk of keys of the same length."""
    shape = family(c.model_type).kernel_attention_shape(c, w.document_mask, w.cp)
    if shape is None:
        return 0.0
    hq, dqk, dv = shape
    s = w.seq_len // w.cp
    return float(ds_bytes(w.micro_batch, hq, s, s, dqk, dv, w.compute_bytes))


def _moe_shape(c) -> tuple[int, int, int]:
    "(routed experts, top-k, expert width) of a model config."
    return c.routed_experts, c.num_experts_per_tok, family(c.model_type).expert_width(c)


def is_moe(c, i: int) -> bool:
    "Whether layer `i` of model config `c` routes to experts."
    return c.is_moe_layer(i) if hasattr(c, "is_moe_layer") else True

# %% [markdown]
# Expert parallelism changes stage 3's rows only through the dispatcher. With balanced routing a rank's experts
# receive about k rows per local token, as at ep 1, and the rows that travel are kept twice more: the received
# rows (once per token and destination rank, deduplicated, engine/31) and, after combine, the rows sent back. A
# token's rows go to `d` ranks on average, d = ep · (1 − C(E − E/ep, k) / C(E, k)), the chance that at least one of
# its k experts lives on a given rank. The sync-free dispatcher sizes every buffer by its bound: ep · T rows
# received and ep · T · k pairs, so stage 3 keeps ep times as much.

# %%
#| export
def ranks_per_token(E: int, k: int, ep: int) -> float:
    "Expected number of expert-parallel ranks a token's k experts (of E, uniform) live on."
    if ep == 1:
        return 1.0
    return ep * (1 - math.comb(E - E // ep, k) / math.comb(E, k))


def layer_bytes(c, i: int, w: Workload) -> LayerBytes:
    "What layer `i` of model config `c` keeps per token under workload `w`, by part (bytes)."
    b, comp = w.compute_bytes, w.compile
    f = max(4, b)
    H = c.hidden_size
    moe = is_moe(c, i)
    parts = family(c.model_type).kept_by_part(c, i, b, f, comp)
    if w.recompute in ("attention", "layer"):   # stage 1 keeps its outputs only
        k = c.num_experts_per_tok
        parts = ({"stage 1 outputs": 2 * b * H + f * _moe_shape(c)[0] + 8 * k + b * k} if moe else {})
    parts["output"] = b * H
    deferred = spare = spare_deferred = 0.0
    if moe:
        E, k, inter = _moe_shape(c)
        scale = w.ep if w.sync_free else 1
        one_hot = family(c.model_type).router_one_hot(c)
        parts["experts"] = scale * _experts(k, H, inter, b, w.recompute, one_hot, w.fp8)
        if w.ep > 1:   # received rows and their router weights, the summed rows sent back, the rows received back
            d = w.ep if w.sync_free else ranks_per_token(E, k, w.ep)
            parts["dispatch and combine"] = d * (3 * b * H + 8 * k) + 8 * w.ep
        deferred = scale * k * deferred_per_row(H, inter, b, w.fp8)
        if w.fp8:   # the FP8 column layouts hold the most 128-row tiles the rows can need: E_local - 1 spare tiles
            rows = 128 * (E // w.ep - 1)
            spare = 0 if w.recompute == "layer" else rows * (H + inter)
            spare_deferred = rows * (2 * H + 3 * inter)
    return LayerBytes(parts, deferred, moe, spare, spare_deferred)

# %% [markdown]
# **Checked against the H200.** `benchmarks/layer_probe.py` runs short cuts of the four bench models one layer at a
# time and reads how many bytes the allocator holds after each layer's forward (benchmarks/RESULTS.md, "The
# planner's accuracy"). The formulas above against those measurements, for a layer past the first (the first layer
# of each cut kept 4–6% less than the others, its stage-1 outputs; the model counts every layer like the later ones):

# %% [markdown]
# The bench configs are TOML files of train/40's schema; this notebook comes before the config, so it reads their
# `[model]` tables with `tomllib` into the model families' own `Config` classes. The measurements are
# `benchmarks/layer_bytes_h200.csv`, one row per (bench config, layer, compiled, recompute).

# %%
import csv
import tomllib
from dataclasses import replace
from pathlib import Path

import pith_lit
from pith_lit.models import qwen3_moe

ROOT = Path(pith_lit.__file__).resolve().parents[1]   # the repository the package is imported from


def config_model(name: str, **extra):
    "The [model] table of configs/NAME.toml as its family's Config."
    with open(ROOT / "configs" / f"{name}.toml", "rb") as fh:
        table = tomllib.load(fh)["model"] | extra
    return family(table["model_type"]).Config(**table)

# %%
rows = []
with open(ROOT / "benchmarks" / "layer_bytes_h200.csv") as fh:
    measured = list(csv.DictReader(fh))
assert len(measured) == 14
for m in measured:
    name, i, comp, rec, got = (m["config"], int(m["layer"]), m["compiled"] == "true", m["recompute"],
                               float(m["bytes_per_token"]))
    c = config_model(f"bench-{name}")
    want = layer_bytes(c, i, Workload(compile=comp, recompute=rec)).kept
    rows.append((name, i, comp, rec, want, got, want / got - 1))
    print(f"{name:17s} layer {i} {'compiled' if comp else 'eager   '} recompute {rec:9s} predicted {want:9,.0f} "
          f"measured {got:9,.0f} B/token  {want / got - 1:+.1%}")
worst = max(abs(r[-1]) for r in rows if r[1] > 0)
assert worst < 0.08, worst

# %% [markdown]
# The score gradients that ops/14 stores for `dq` count where its kernels attend with heads wider than 256
# together: at DeepSeek-V2-Lite's bench shape with documents (4 × 2,048 tokens, 16 heads of 192 + 128) each
# attention backward holds 512 MiB; without documents SDPA attends, and GPT-OSS's heads (64 + 64) recompute.

# %%
w = Workload(micro_batch=4, seq_len=2048, document_mask=True)
assert attention_transient(config_model("bench-deepseek-v2-lite"), w) == 512 * 2**20
assert attention_transient(config_model("bench-deepseek-v2-lite"), replace(w, document_mask=False)) == 0
assert attention_transient(config_model("bench-gpt-oss-20b"), w) == 0

# %% [markdown]
# Within 7% for every layer past the first; the two first (dense) layers of DeepSeek-V2 are off by up to 8% more (the
# compiled dense MLP's partitioning). What a layer keeps, by part, for the Qwen3 bench:

# %%
c = config_model("bench-qwen3-30b-a3b")
for comp in (False, True):
    lb = layer_bytes(c, 1, Workload(compile=comp))
    print("compiled" if comp else "eager   ", {k: round(v) for k, v in lb.parts.items()})

# %% [markdown]
# ## The head and the embedding
#
# The head (final norm, the fused linear cross-entropy of ops/13) computes both its gradients in its forward:
# afterwards it keeps the norm's tensors, the gradient of its input (per token) and the weight's gradient (a whole
# head in the compute dtype), not its input. While it runs it also holds an fp32 accumulator of the weight gradient, one chunk of
# 4096 tokens' logits, and the matmul's workspace for the fp32 accumulation, measured at about half a chunk of
# logits. The embedding keeps its output (the first layer's input) and the token ids. The final norm is never
# compiled.

# %%
#| export
CE_CHUNK = 4096   # ops/13's DEFAULT_CHUNK


def head_bytes(c, w: Workload) -> dict:
    """The head's bytes: `kept` after its forward (per micro-batch), `transient` above that while it runs, `weight`
    (the head's size in the compute dtype); the embedding's `embedding` per micro-batch."""
    b, f, H, V, T = w.compute_bytes, max(4, w.compute_bytes), c.hidden_size, c.vocab_size, w.tokens
    norm = norm_bytes(H, b, f, False, family(c.model_type).FP32_NORM_GAIN)   # its output: read by the head only
    weight = V * H * b
    chunk = min(CE_CHUNK, T) * V * b
    return dict(kept=T * (norm + b * H) + weight, transient=(f * V * H if b < f else 0) + 1.5 * chunk,
                weight=weight, embedding=T * (b * H + 8))

# %% [markdown]
# Against the H200 (the same probe; head kept and transient bytes at 8192 tokens):

# %%
MEASURED_HEAD = {"qwen3-30b-a3b": (92356.1, 384320.0), "deepseek-v2-lite": (67588.1, 260096.0),
                 "gpt-oss-20b": (170194.1, 549682.0), "qwen3-5-moe": (144645.1, 624896.0)}   # per token, 8192 tokens
for name, (kept, tr) in MEASURED_HEAD.items():
    hb = head_bytes(config_model(f"bench-{name}"), Workload(micro_batch=8192 // 4096 if name != "deepseek-v2-lite" else 4,
                                                 seq_len=4096 if name != "deepseek-v2-lite" else 2048))
    print(f"{name:17s} kept {hb['kept'] / 8192:9,.0f} vs {kept:9,.0f}   transient {hb['transient'] / 8192:9,.0f} "
          f"vs {tr:9,.0f} B/token")
    assert abs(hb["kept"] / 8192 / kept - 1) < 0.01 and abs(hb["transient"] / 8192 / tr - 1) < 0.12

# %% [markdown]
# ## State: what a rank holds of the model
#
# `rank_units` cuts a model built on the meta device as the trainer cuts it for one rank (its pipeline stages, its
# experts) and lists FSDP's units (engine/36): per MoE layer an experts unit sharded over dp × cp, per layer the rest
# sharded over dp × cp × ep, and the root (embedding, final norm, head). A unit whose mesh is one rank and whose
# parameters need no cast is left unwrapped, so it holds its parameters and gradients whole in the compute dtype.
# A wrapped unit holds the shards of its master weights (FSDP pads dimension 0, or 1 for experts under expert
# parallelism, to a multiple of the shard count), and during a step its gathered weights in the compute dtype and
# its unsharded gradient in fp32; after `reduce_gradients`, the gradient's shard. Each parameter has as many
# optimizer states as `states(name, param)` says (AdamW 2; Muon 1 for its matrices), in the parameter's dtype.
# The root's gradients come in two parts: the head's with the loss (ops/13 computes it in the forward), the
# embedding's (`late`, unless the head shares its weight) only from the embedding's backward, after every layer's.

# %%
#| export
@dataclass
class Unit:
    "One FSDP unit of a rank: its parameters' element counts whole and as this rank's shard."
    name: str
    numel: int                 # this rank's part of the model, unsharded (its experts, at ep > 1)
    shard: int                 # the elements this rank keeps after FSDP
    states: int                # optimizer-state elements this rank keeps
    shards: int                # ranks the unit is sharded over
    wrapped: bool              # FSDP wraps it (else its parameters and gradients stay whole)
    largest: int = 0           # its largest parameter (elements): a gradient added into an existing one
    layer: str | None = None   # the decoder layer it belongs to (None: the root)
    experts: bool = False
    late: int = 0              # elements whose gradient comes only at the embedding's backward (the root's embedding)


def _shard_numel(p: torch.Tensor, shards: int, dim: int) -> int:
    "Elements of FSDP's shard of `p` over `shards` ranks along `dim` (padded to a multiple of `shards`)."
    if p.dim() == 0:
        return 1
    size = list(p.shape)
    size[dim] = -(-size[dim] // shards)
    return math.prod(size)


def rank_units(model: nn.Module, w: Workload, pp_rank: int = 0, states=lambda name, p: 2) -> list[Unit]:
    """The FSDP units of pipeline rank `pp_rank` for `model`, a whole model on the meta device (cut here, in place).
    `states(name, param)`: optimizer states per element (AdamW: 2)."""
    if w.pipelined:
        split_model(model, pp_rank, w.pp, list(w.stage_layers) or None)
    if w.ep > 1:
        shard_experts(model, 0, w.ep)
    g_dense, g_expert = w.dp * w.cp * w.ep, w.dp * w.cp
    cast = w.param_bytes != w.compute_bytes
    names = {id(p): n for n, p in model.named_parameters()}
    units, done = [], set()

    def add(name, params, shards, dim, layer=None, experts=False, late=0):
        params = [p for p in params if id(p) not in done]
        done.update(id(p) for p in params)
        units.append(Unit(name, sum(p.numel() for p in params),
                          sum(_shard_numel(p, shards, dim) for p in params),
                          sum(_shard_numel(p, shards, dim) * states(names[id(p)], p) for p in params),
                          shards, shards > 1 or cast, max((p.numel() for p in params), default=0), layer, experts,
                          late))

    for key, layer in model.model.layers.items():
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            add(f"layer {key} experts", experts.parameters(), g_expert, 1 if w.ep > 1 else 0, key, True)
        add(f"layer {key}", layer.parameters(), g_dense, 0, key)
    embedding = getattr(model.model, "embed_tokens", None)   # a pipeline rank other than the first holds none
    head = getattr(model, "lm_head", None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    late = 0 if embedding is None or tied else embedding.weight.numel()
    add("root", model.parameters(), g_dense, 0, late=late)
    return units

# %% [markdown]
# **Checked against FSDP itself.** The shards `rank_units` predicts are the local tensors FSDP makes, for every rank
# of four layouts of four ranks: the `fake` process group of torch (engine/30 uses it too) lets one process play
# any rank of a larger job, and `fully_shard` lays out its shards the same way with it. The model is cut and
# sharded as the trainer does (engine/33, engine/31, engine/36), and a wrapped unit is an `FSDPModule`.

# %%
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from pith_lit.engine.fsdp import shard_model
from pith_lit.engine.mesh import build_mesh

tiny = qwen3_moe.Config(vocab_size=96, hidden_size=32, moe_intermediate_size=24, intermediate_size=40,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                        num_experts_per_tok=2, mlp_only_layers=[1])

def meta_tiny():
    with torch.device("meta"):
        return qwen3_moe.Qwen3MoeForCausalLM(tiny)

def describe(w: Workload) -> str:
    return (f"pp {w.pp} × dp_replicate {w.dp_replicate} × dp {w.dp} × cp {w.cp} × ep {w.ep}, "
            f"micro-batch {w.micro_batch} × {w.micro_batches}, recompute {w.recompute}")

for sizes in (dict(dp=4), dict(dp=2, ep=2), dict(ep=4), dict(dp_replicate=2, dp=2), dict(pp=2, ep=2)):
    w = Workload(**sizes, pipelined=sizes.get("pp", 1) > 1, micro_batches=4, param_bytes=4)
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        mesh = build_mesh(w.pp, w.dp, w.cp, w.ep, "cpu", 60, w.dp_replicate)
        model = meta_tiny()
        if w.pipelined:
            split_model(model, mesh.pp.rank(), w.pp)
        if w.ep > 1:
            shard_experts(model, mesh.ep.rank(), w.ep)
        model.to_empty(device="cpu")
        shard_model(model, mesh, torch.bfloat16)
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        wrapped = sum(isinstance(m, FSDPModule) for m in model.modules())
        units = rank_units(meta_tiny(), w, mesh.pp.rank())
        dist.destroy_process_group()
        if rank == 0:   # FSDP pads every shard to the first rank's size
            assert local == sum(u.shard for u in units), (sizes, rank, local, sum(u.shard for u in units))
        assert wrapped == sum(u.wrapped for u in units), (sizes, wrapped)
    print(f"{describe(w)}: rank 0 holds {local} elements in {wrapped} FSDP units, as predicted")

# %% [markdown]
# The root's `late` elements are the embedding's, on the rank that holds it, and none where the head shares its weight:

# %%
root = rank_units(meta_tiny(), Workload())[-1]
assert root.name == "root" and root.late == tiny.vocab_size * tiny.hidden_size, root
assert rank_units(meta_tiny(), Workload(pp=2, pipelined=True, micro_batches=4), 1)[-1].late == 0   # no embedding
with torch.device("meta"):
    tied = qwen3_moe.Qwen3MoeForCausalLM(replace(tiny, tie_word_embeddings=True))
assert rank_units(tied, Workload())[-1].late == 0

# %% [markdown]
# ## The FP8 experts' backward
#
# In the compute dtype the experts' backward is three autograd nodes (down, SwiGLU, gate/up), each freeing what it
# read before the next runs, and each weight gradient goes to autograd as soon as it is made. Under `train.fp8` it is
# two (ops/15 `_Fp8SwiGLUDown` and `_Fp8GateUp`, with SwiGLU's gradient inside the second's quantization), which free
# as they go. For `M` routed rows over `E` local experts, the FP8 column layouts are `C = 128 · (⌈M/128⌉ + E − 1)`
# tokens wide (each expert's rows padded to whole 128-row tiles, as `quantize_act` lays them out). On top of what the
# layer keeps (the output gradient `dy`, M × H, takes the place of the expert outputs, which the weighted sum's
# backward has freed), the highest moment is the largest of three:
#
# - in the down half, with `dh` (the SwiGLU output's gradient, M × I in the compute dtype) made or being made:
#   either `dy` quantized by rows (M × H in FP8) beside the down weight's transposed FP8 copy (E · H · I bytes,
#   where the copies are not kept for the step), or, once both are freed, `dy`'s column layout (H × C in FP8) beside
#   the down weight's gradient (E · H · I in the compute dtype) when the node makes it;
# - in the gate/up half, `dy` freed with the down half's node, with `dh` and what the down half left (its weight
#   gradient if made, else `dy`'s columns, which the queued closure keeps for W) and `dx`, the rows' gradient
#   (M × H in the compute dtype): either the SwiGLU gradient quantized by rows (M × 2I in FP8) beside the gate/up
#   weight's copy (E · 2I · H), or, once both are freed, the SwiGLU gradient's column layout (2I × C in FP8);
# - at the end, `dh` freed: the gate/up weight gradient being made (E · 2I · H in the compute dtype) beside those
#   columns, `dx` and what the down half left. A zero-bubble backward leaves both weight gradients to W, whose
#   closures `deferred_per_row` counts.
#
# Two of the layer's kept tensors go before the layer's backward ends, so those moments count them as negative:
# `h`'s FP8 rows (I × C), saved by the down half, once it returns, through the gate/up half and the end (not when W
# makes the down weight gradient: its closure reads them), and the saved `gate_up` output (M × 2I in the compute
# dtype) at the end (ops/15 `_release`).
#
# Scales are left out: 4 bytes a row, an expert's column or a tile's column (1/32 of a column layout, while
# `quantize_act` runs), a few percent of the total at the tiny shapes below, well under 1% at the real widths. In the
# compute dtype the walk counts at this point the gradient of the gate/up output and, while it is added into an
# existing one, the largest weight gradient (below); the bf16 peaks measured are within 2.1% of its predictions.
#
# The dense projections in FP8 (`fp8_linear`, under `train.fp8_dense_min`; models/20 `project`) keep what `F.linear`
# keeps, their input and weights (`_fp8_linear_setup`). Their backward's FP8 forms (the input's column layout, the
# output gradient quantized by rows and by columns, the weights' transposed copy and, for stacked weights, their
# concatenation) live within stage 1's backward, after the experts' node has returned. The walk counts none of them:
# at the 235B and V3 widths the measured peaks were the same whichever dense projections ran in FP8
# (`train.fp8_dense_min` 0 or 4096; benchmarks/RESULTS.md, "FP8 end to end"), and the predictions below match them
# without.

# %%
#| export
def fp8_backward_bytes(rows: int, E: int, H: int, inter: int, b: int, weight_grads: float, copy: float) -> float:
    """Bytes the FP8 SwiGLU experts' backward (ops/15) holds at its highest moment on top of what the layer keeps, for
    `rows` routed rows over `E` local experts of width `inter` (see above). `weight_grads`: the bytes of both weight
    gradients made before it returns (0 when W makes them); `copy`: the transposed FP8 copy of the gate/up weight
    made for this use (0 when the copies are kept for the step; the down weight's is half as large)."""
    cols = 128 * (-(-rows // 128) + E - 1)                 # the column layouts' width, in tokens
    dh, dx = rows * inter * b, rows * H * b
    dw_down = weight_grads / 3                              # E·H·I of the E·3·H·I
    down = dh + max(copy / 2 + rows * H, cols * H + dw_down)
    left = dw_down if weight_grads else cols * H            # the down half's weight gradient, or dy's columns for W
    h_rows = inter * cols if weight_grads else 0            # h's saved FP8 rows, freed with the down half (not for W)
    gone = rows * H * b + h_rows                            # dy and h's rows, gone with the down half's node
    up = dh + left + dx + max(copy + 2 * inter * rows, cols * 2 * inter) - gone
    end = left + dx + cols * 2 * inter + weight_grads - dw_down - gone - rows * 2 * inter * b   # gate_up emptied
    return max(down, up, end)

# %% [markdown]
# **Checked on the CPU.** Triton's interpreter runs the same kernels on CPU tensors, with the same allocations. A
# dispatch mode keeps a weak reference to the storage of every tensor an operator returns and sums the live ones after
# each operator; the highest sum during the backward, less the sum when it starts and the output gradient (made by a
# product's backward, as the experts' weighted sum makes it in a layer, and freed with the down half), is what the two
# nodes hold. The interpreter leaves a launch's arguments in reference cycles, so the probe collects garbage before each
# sum, with what existed before the backward frozen out of the collector's way (`gc.freeze`; a collection of the
# youngest generation only is faster and counts some of those cycles as live). Two shapes: one whose highest moment is
# the end (the gate/up weight gradient), and one with more rows per expert, where it is the gate/up half's rows and
# weight copy.

# %%
import json
import os
import subprocess
import sys

# %%
PROBE = r"""
import gc, json, sys, torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from pith_lit.ops.fp8 import fp8_swiglu_experts

class Live(TorchDispatchMode):
    "Bytes of the storages that operators returned and that are still alive; the highest sum so far."
    def __init__(self):
        super().__init__()
        self.refs, self.peak = {}, 0
    def now(self):
        gc.collect()
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                s = t.untyped_storage()
                if s.data_ptr() not in self.refs:
                    self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, self.now())
        return out

results = []
for E, H, I, counts in json.loads(sys.argv[1]):
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    M = int(counts.sum())
    w1 = (torch.randn(E, 2 * I, H) / 16).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I) / 16).bfloat16().requires_grad_()
    live = Live()
    with live:
        x = torch.randn(M, H).bfloat16().requires_grad_()   # the expanded rows: their gradient is made
        out = 2 * fp8_swiglu_experts(x, w1, w2, counts, impl="triton", scaling="rows")   # the product keeps no y
        dy = torch.randn(M, H).bfloat16()
        gc.collect()
        gc.freeze()    # what exists now is alive through the backward: the collections in now() skip it
        start = live.now()
        live.peak = 0
        out.backward(dy)
        gc.unfreeze()
    # the product's backward makes the experts' dY (M × H), in the place of their output, which the walk counts
    results.append(live.peak - start - M * H * 2)
print(json.dumps(results))
"""
cases = [(4, 256, 128, [60, 0, 40, 28]), (2, 128, 128, [700, 324])]
moments = ["the end", "the gate/up half"]
probe = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], capture_output=True, text=True, timeout=300,
                       env=os.environ | {"TRITON_INTERPRET": "1"})
assert probe.returncode == 0, probe.stderr[-3000:]
for (E, H, I, counts), moment, got in zip(cases, moments, json.loads(probe.stdout)):
    M = sum(counts)
    grads, copy = E * 3 * H * I * 2, E * 2 * I * H
    want = fp8_backward_bytes(M, E, H, I, 2, grads, copy)
    print(f"E {E}, H {H}, I {I}, {M} rows: measured {got:,} bytes, predicted {want:,.0f} ({want / got - 1:+.2%}; "
          f"the highest moment: {moment})")
    assert abs(want / got - 1) < 0.03, (E, H, I, got, want)

# %% [markdown]
# ## Following one step
#
# `rank_peak` walks one step of one rank, layer by layer, and keeps the largest total it reaches. Its actions are the
# plain loop's (every micro-batch: the layers forward, the loss, the layers backward) or the DualPipeV schedule of
# engine/33 (F, B, F&B, W of this rank's two stages). Along the way it tracks:
#
# - the units' state: shards, optimizer states, gathered weights (a layer unit from its first forward to the end of
#   the step; an experts unit during each forward, and from each backward to its next forward), gradients (from a
#   unit's first backward: fp32 and unsharded for a wrapped unit, whole in the compute dtype otherwise; the root's
#   embedding's from the embedding's backward);
# - activations: each layer's kept bytes from its forward to its backward, the head's kept bytes from the loss to
#   its backward, the stage input a pipeline rank received, what a zero-bubble backward leaves for W;
# - under `train.fp8`, a layer's FP8 expert weights and their transposed copy (ops/15: 1 byte per element each, made
#   by one pass) from its first forward of the step to the end of the step when the step runs several micro-batches
#   (ops/18 `Fp8Weights`); with one, only the copy of the largest expert weight in use, as a transient of its layer's
#   forward and backward (and `layer_bytes` counts the experts' saved inputs as FP8);
# - transients on top: the head while the loss runs, and in a layer's backward the gradient of its experts being
#   added into the gradient already there (a whole unit's, while FSDP's hook accumulates it into fp32) plus the
#   gradient of the gate/up output; under `train.fp8` instead what the experts' one backward node holds
#   (`fp8_backward_bytes`: both weight gradients, new or to be added, and the gradients and column layouts it keeps
#   until it returns); or, where more, the score gradients that ops/14's backward stores for `dq`
#   (`attention_transient`: only where the kernels attend, with heads as wide as MLA's);
# - at the end of the step, FSDP's flat fp32 buffer of the largest unit while `reduce_gradients` reduce-scatters it,
#   then the optimizer step (the fused AdamW adds nothing).
#
# An F&B interleaves its forward and backward a layer at a time, as `run_steps` issues them (engine/32): it switches
# task at each exchange, so a layer's stage 1 forward allocates before the other micro-batch's layer has freed its
# stage 1 (in its last backward step); the walk counts the forward's layer first.

# %%
#| export
@dataclass
class Peak:
    "The predicted peak of one rank: its total, where it happens, and its parts then (bytes)."
    total: float
    where: str
    parts: dict

    def gib(self) -> float:
        return self.total / GiB


class _Walk:
    "The running total of one rank's memory through a step (see above)."

    def __init__(self, c, w: Workload, units: list[Unit], head: dict, stages: list[list[str]]):
        self.c, self.w, self.head = c, w, head
        self.units = {u.name: u for u in units}
        self.layer_units = {}
        for u in units:
            self.layer_units.setdefault(u.layer, []).append(u)
        self.cost = {key: layer_bytes(c, int(key), w) for st in stages for key in st}
        self.static = sum(u.shard * w.param_bytes + u.states * w.param_bytes for u in units)
        # train.fp8: a layer's expert weights quantized both ways (1 byte each way) at its first forward of the step,
        # kept until the step ends where asked (train.fp8_keep_copies) and they pay (ops/18 `fp8_copies_pay`: several
        # micro-batches, experts whole on the rank); otherwise each use's copy is a transient
        self.fp8, self.fp8_made = 0.0, set()
        self.fp8_kept = w.fp8 and w.fp8_keep and fp8_copies_pay(w.micro_batches, w.dp * w.cp)
        self.attention = attention_transient(c, w)
        self.gathered, self.grads = set(), set()
        self.embedding_grad = False   # whether the embedding's backward has run (the root's `late` gradient)
        self.acts = self.deferred = self.buffers = 0.0
        self.T = w.tokens
        self.best = Peak(0.0, "", {})

    def _unit_bytes(self) -> tuple[float, float]:
        "Bytes of the gathered weights and of the gradients now (cached until either set changes)."
        key = (len(self.gathered), len(self.grads), frozenset(self.gathered), self.embedding_grad)
        if getattr(self, "_cached", (None,))[0] != key:
            w, g, gr = self.w, 0.0, 0.0
            for u in self.units.values():
                if u.wrapped and u.name in self.gathered:
                    g += u.numel * w.compute_bytes
                if u.name in self.grads:
                    numel = u.numel - (0 if self.embedding_grad else u.late)
                    gr += numel * (max(4, w.compute_bytes) if u.wrapped else w.compute_bytes)
            self._cached = (key, (g, gr))
        return self._cached[1]

    def note(self, where: str, transient: float = 0.0) -> None:
        gathered, grads = self._unit_bytes()
        parts = {"parameters and optimizer states": self.static, "FP8 weight copies": self.fp8,
                 "gathered weights": gathered, "gradients": grads, "activations": self.acts,
                 "deferred for W": self.deferred, "pipeline buffers": self.buffers, "transient": transient}
        total = sum(parts.values())
        if total > self.best.total:
            self.best = Peak(total, where, parts)

    def _gather(self, key: str, experts: bool) -> None:
        for u in self.layer_units.get(key, []):
            if u.experts == experts:
                self.gathered.add(u.name)

    def _fp8_copy(self, key: str) -> float:
        "Keep the layer's FP8 expert copies for the step, or return the bytes of the one in use (not kept)."
        experts = [u for u in self.layer_units.get(key, []) if u.experts]
        if not self.w.fp8 or not experts:
            return 0.0
        if not self.fp8_kept:
            return max(u.largest for u in experts)
        if key not in self.fp8_made:
            self.fp8_made.add(key)
            self.fp8 += 2 * sum(u.numel for u in experts)
        return 0.0

    def layer_forward(self, key: str, m) -> None:
        self._gather(key, False)
        self._gather(key, True)
        copy = self._fp8_copy(key)
        self.acts += self.cost[key].kept_at(self.T)
        self.note(f"forward of layer {key}, micro-batch {m}", copy)
        for u in self.layer_units.get(key, []):
            if u.experts:
                self.gathered.discard(u.name)   # freed after every forward, gathered again by its backward

    def layer_backward(self, key: str, m, zero_bubble: bool) -> None:
        self._gather(key, True)
        lb, w = self.cost[key], self.w
        transient = 0.0
        if lb.moe:
            E, k, inter = _moe_shape(self.c)
            rows = self.T * k * (w.ep if w.sync_free else 1)
            experts = [u for u in self.layer_units.get(key, []) if u.experts]
            if w.fp8:   # two nodes, both weight gradients made within them unless W makes them
                grads = 0 if zero_bubble or not experts else experts[0].numel * w.compute_bytes
                transient = fp8_backward_bytes(rows, E // w.ep, self.c.hidden_size, inter, w.compute_bytes, grads,
                                               self._fp8_copy(key))
            else:
                accumulating = experts and experts[0].name in self.grads
                if experts and (experts[0].wrapped or accumulating):
                    u = experts[0]
                    transient += (u.numel if u.wrapped else u.largest) * w.compute_bytes
                transient += rows * w.compute_bytes * 2 * inter
        transient = max(transient, self.attention)   # attention's backward runs after
        self.note(f"backward of layer {key}, micro-batch {m}", transient)
        self.acts -= lb.kept_at(self.T)
        if zero_bubble:
            self.deferred += lb.deferred_at(self.T)
        self.grads.update(u.name for u in self.layer_units.get(key, []))

    def loss_forward(self, m) -> None:
        self.gathered.add("root")
        self.acts += self.head["kept"]
        self.note(f"loss of micro-batch {m}", self.head["transient"])

    def loss_backward(self, m) -> None:
        self.note(f"loss backward of micro-batch {m}", self.head["weight"])
        self.acts -= self.head["kept"]
        self.grads.add("root")

    def embed(self, sign: int) -> None:
        self.gathered.add("root")
        self.acts += sign * self.head["embedding"]
        if sign < 0:
            self.grads.add("root")
            self.embedding_grad = True

    def end_of_step(self) -> None:
        wrapped = [u for u in self.units.values() if u.wrapped and u.name in self.grads and u.shards > 1]
        flat = max((u.numel * max(4, self.w.compute_bytes) for u in wrapped), default=0)
        self.note("reduce_gradients", flat)


def _stage_keys(model_layers: list[str], w: Workload, pp_rank: int) -> list[list[str]]:
    "The layer keys of this rank's stages, in order (one stage holding every layer for the plain loop)."
    if not w.pipelined:
        return [model_layers]
    cut = stage_layers(len(model_layers), w.pp, list(w.stage_layers) or None)
    return [[model_layers[i] for i in cut[s]] for s in (pp_rank, 2 * w.pp - 1 - pp_rank)]


def rank_peak(c, units: list[Unit], w: Workload, pp_rank: int = 0) -> Peak:
    """The predicted peak allocated memory of pipeline rank `pp_rank` under `w` for model config `c`, whose FSDP
    units on that rank are `units` (`rank_units`)."""
    stages = _stage_keys([str(i) for i in range(c.num_hidden_layers)], w, pp_rank)
    walk = _Walk(c, w, units, head_bytes(c, w), stages)
    b, T, H = w.compute_bytes, w.tokens, c.hidden_size
    walk.note("start of the step")
    last = 2 * w.pp - 1 if w.pipelined else 0   # the plain loop: one stage, both the first and the last

    def buffer(sign):   # a stage input received from the neighbour, kept until the stage's backward
        walk.buffers += sign * b * T * H

    def forward(p, m) -> list:
        stage = pp_rank if p == 0 else last - pp_rank
        steps = [lambda: walk.embed(+1)] if stage == 0 else [lambda: buffer(+1)]
        steps += [lambda key=key: walk.layer_forward(key, m) for key in stages[p]]
        return steps + ([lambda: walk.loss_forward(m)] if stage == last else [])

    def backward(p, m, zb) -> list:
        stage = pp_rank if p == 0 else last - pp_rank
        steps = [lambda: walk.loss_backward(m)] if stage == last else []
        steps += [lambda key=key: walk.layer_backward(key, m, zb) for key in reversed(stages[p])]
        return steps + ([lambda: walk.embed(-1)] if stage == 0 else [lambda: buffer(-1)])

    schedule = (dualpipev_schedule(pp_rank, w.pp, w.micro_batches) if w.pipelined else
                [a for m in range(w.micro_batches) for a in (("F", 0, m), ("B", 0, m, False))])
    for action in schedule:
        match action:
            case ("F", p, m):
                for step in forward(p, m):
                    step()
            case ("B", p, m, zb):
                for step in backward(p, m, zb):
                    step()
            case ("FB", (pf, mf), (pb, mb)):
                fs, bs = forward(pf, mf), backward(pb, mb, False)
                for i in range(max(len(fs), len(bs))):   # a layer's forward allocates before the other frees
                    for steps in (fs, bs):
                        if i < len(steps):
                            steps[i]()
            case ("W", p, m):
                walk.deferred -= sum(walk.cost[k].deferred_at(T) for k in stages[p])
    walk.end_of_step()
    return walk.best

# %% [markdown]
# ## The estimate of a layout
#
# `estimate` puts the parts together for every pipeline rank (the ranks of one pipeline stage hold the same shares
# of the model, whatever their dp, cp or ep coordinates, since experts divide evenly) and `fits` says whether the
# largest peak, with the allocator's slack (10%) and the CUDA context (1 GiB), stays under a GPU's memory. It keeps
# each rank's units, from which engine/38 times the optimizer step and FSDP's collectives.

# %%
#| export
SLACK, CONTEXT = 0.10, 1 * GiB   # the allocator's reserve above allocated (1-13% measured) and the CUDA context


@dataclass
class Estimate:
    "Predicted peaks of every pipeline rank and the largest; `units`: every pipeline rank's FSDP units."
    workload: Workload
    peaks: list[Peak]
    units: list[list[Unit]]

    @property
    def peak(self) -> Peak:
        return max(self.peaks, key=lambda p: p.total)

    def needs(self) -> float:
        "Bytes of GPU memory the busiest rank needs: its peak, the allocator's slack and the CUDA context."
        return self.peak.total * (1 + SLACK) + CONTEXT

    def fits(self, gpu_bytes: float) -> bool:
        return self.needs() <= gpu_bytes

    def summary(self) -> str:
        p = self.peak
        top = ", ".join(f"{k} {v / GiB:.1f}" for k, v in p.parts.items() if v >= 0.05 * GiB)
        return f"peak {p.gib():.1f} GiB per GPU ({top + '; ' if top else ''}at the {p.where})"


def estimate(c, make_model, w: Workload, states=lambda name, p: 2, cache: dict | None = None) -> Estimate:
    """The estimate of `w` for model config `c`; `make_model()` builds the whole model on the meta device (one per
    pipeline rank is consumed). `states(name, param)`: optimizer states per parameter element. `cache`: a dict that
    keeps each rank's units between estimates of layouts that share them."""
    if w.pipelined and w.micro_batches < 2 * w.pp:
        raise ValueError(f"DualPipeV with pp = {w.pp} needs at least {2 * w.pp} micro-batches per step, got "
                         f"{w.micro_batches}")
    cache = {} if cache is None else cache
    units = []
    for r in range(w.pp):
        key = (r, w.pp, w.pipelined, w.stage_layers, w.dp, w.cp, w.ep, w.param_bytes, w.compute_bytes)
        if key not in cache:
            cache[key] = rank_units(make_model(), w, r, states)
        units.append(cache[key])
    return Estimate(w, [rank_peak(c, u, w, r) for r, u in enumerate(units)], units)

# %% [markdown]
# ## Examples
#
# The bench configs as `benchmarks/RESULTS.md` ran them on one H200 ("The planner's accuracy" there compares each
# with its measured peak), and the real Qwen3-30B-A3B in the paper's eight-GPU layout, pp 2 × ep 4, where rank 0 also holds
# the embedding and the head:

# %%
def meta_of(c):
    def make():
        with torch.device("meta"):
            return family(c.model_type).Model(c)
    return make

bench = Workload(micro_batch=4, seq_len=4096, micro_batches=1, compile=True)
for name, w in [("bench-qwen3-30b-a3b", bench), ("bench-deepseek-v2-lite", replace(bench, seq_len=2048)),
                ("bench-gpt-oss-20b", replace(bench, micro_batch=2))]:
    c = config_model(name)
    print(f"{name}: {estimate(c, meta_of(c), w).summary()}")
c = config_model("qwen3-30b-a3b")
w = Workload(pp=2, ep=4, micro_batch=1, seq_len=4096, micro_batches=8, param_bytes=4, pipelined=True, compile=True)
e = estimate(c, meta_of(c), w)
for r, p in enumerate(e.peaks):
    print(f"Qwen3-30B-A3B, {describe(w)}, pipeline rank {r}: {p.gib():.1f} GiB at the {p.where}")
assert e.peaks[0].total > e.peaks[1].total   # rank 0 holds the embedding and the head

# %% [markdown]
# The Qwen3 bench with and without `train.fp8` (row scales), one and four micro-batches per step, against the peaks
# the H200 measured (benchmarks/RESULTS.md, "The planner's accuracy"). FP8 keeps the experts' saved inputs in FP8
# instead of bf16, in column layouts sized for the most 128-row tiles a micro-batch's rows can need (E − 1 spare
# tiles a layer, 45 MB at Qwen3's width), and the four-micro-batch FP8 run kept the expert weights' two FP8 copies
# for the step (`train.fp8_keep_copies`); with one micro-batch a step no copies are kept (ops/18), and FP8's peak
# falls below bf16's.

# %%
MEASURED_BENCH_PEAKS = {(False, 1): 76.18, (True, 1): 72.61, (False, 4): 91.27, (True, 4): 101.20}   # GiB
c = config_model("bench-qwen3-30b-a3b")
for (fp8, m), got in MEASURED_BENCH_PEAKS.items():
    want = estimate(c, meta_of(c), replace(bench, fp8=fp8, fp8_keep=True, micro_batches=m)).peaks[0].gib()
    print(f"{'FP8 ' if fp8 else 'bf16'}, {m} micro-batch(es): predicted {want:6.2f} GiB, measured {got:6.2f} "
          f"({want / got - 1:+.1%})")
    assert abs(want / got - 1) < 0.01, (fp8, m, want, got)

# %% [markdown]
# Where FSDP shards the experts (dp 2 here) the copies are not kept even when asked (ops/18 `fp8_copies_pay`): whole,
# they would hold 2 bytes an expert weight element for the step where the rank keeps 1 (its half of the bf16
# weights). Each use's copy is then a transient of its layer, as it is by default (not asked), which keeps FP8's peak
# under bf16's with four micro-batches too.

# %%
four = replace(bench, fp8=True, fp8_keep=True, micro_batches=4)
kept, sharded, each_use = (estimate(c, meta_of(c), w).peak for w in
                           (four, replace(four, dp=2), replace(four, fp8_keep=False)))
bf16_four = estimate(c, meta_of(c), replace(four, fp8=False)).peak
experts = sum(p.numel() for n, p in meta_of(c)().named_parameters() if ".experts." in n)
assert kept.parts["FP8 weight copies"] == 2 * experts and sharded.parts["FP8 weight copies"] == 0
assert each_use.parts["FP8 weight copies"] < experts / 64 and each_use.total < bf16_four.total < kept.total
print(f"FP8, 4 micro-batches: dp 1 keeps {kept.parts['FP8 weight copies'] / GiB:.1f} GiB of copies when asked "
      f"(peak {kept.gib():.1f} GiB), none by default (peak {each_use.gib():.1f} GiB; bf16 {bf16_four.gib():.1f}); "
      f"dp 2 keeps none (peak {sharded.gib():.1f} GiB)")

# %% [markdown]
# The two wider widths of "FP8 end to end" (benchmarks/RESULTS.md), compiled, one micro-batch of 4 sequences:
# Qwen3-235B-A22B's (hidden 4096, 128 experts of 1536, top 8, 64/4 heads) and DeepSeek-V3's (hidden 7168, MLA with
# V3's ranks, 64 experts of 2048, top 8, a dense first layer), cut to 3 layers and to 2, in bf16 and in FP8 (row
# scales, the dense projections 4096 wide both ways in FP8). FP8's peak is in the backward of the first layer with
# experts, the last to run its backward, where the experts' gate/up half makes its weight gradient: every gradient of
# the step but the embedding's is there, with the activations of the layers before. With a few wide layers the
# gradients outweigh the activations, so that moment lies above the loss, where the walk puts bf16's peak (and both
# peaks of the Qwen3 bench above, with its 12 narrower layers). The experts' FP8 backward runs as two nodes, so the
# output gradient goes with the down half, as bf16's nodes free it, and FP8's peak lies under bf16's at each of these
# cuts (benchmarks/RESULTS.md, "The FP8 experts' backward as two nodes"). The walk counts bf16's peak at the V3 width
# less closely than the others, so bf16's bound is the wider one.

# %%
WIDE = {   # the bench config, its sequence length, the [model] overrides
    "235B": ("bench-qwen3-30b-a3b", 4096, dict(hidden_size=4096, moe_intermediate_size=1536, num_attention_heads=64,
                                               num_key_value_heads=4)),
    "V3": ("bench-deepseek-v2-lite", 2048, dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                                num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                                                n_routed_experts=64, num_experts_per_tok=8, q_lora_rank=1536))}
MEASURED_WIDE_PEAKS = {("235B", 3, False): 67.99, ("235B", 3, True): 67.22, ("V3", 3, False): 66.10,
                       ("V3", 3, True): 65.55, ("235B", 2, False): 49.44, ("235B", 2, True): 48.68,
                       ("V3", 2, False): 43.37, ("V3", 2, True): 42.82}   # GiB; bf16 at 3 layers on an H200, the rest on an H100
for (width, layers, fp8), got in MEASURED_WIDE_PEAKS.items():
    name, seq, extra = WIDE[width]
    c = config_model(name, **extra, num_hidden_layers=layers)
    p = estimate(c, meta_of(c), replace(bench, seq_len=seq, fp8=fp8)).peak
    print(f"{width:4s} {layers} layers, {'FP8 ' if fp8 else 'bf16'}: predicted {p.gib():6.2f} GiB, measured {got:6.2f} "
          f"({p.gib() / got - 1:+.1%}), at the {p.where}")
    assert abs(p.gib() / got - 1) < (0.01 if fp8 else 0.025), (width, layers, fp8, p.gib(), got)
    assert p.where.startswith("backward" if fp8 else "loss"), (width, layers, fp8, p.where)
