# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The planner: memory and time of a layout before it runs
#
# A layout (pp × dp_replicate × dp × cp × ep, micro-batch, recomputation) either fits a GPU or dies minutes into
# the run, after the model was built and compiled. This notebook predicts, for every rank of a layout, the peak of
# `torch.cuda.max_memory_allocated` and the step time, from the model's config alone. The trainer refuses a layout
# predicted not to fit before it allocates anything (train/45), `python -m pith_lit.plan` lists the layouts that
# fit a number of GPUs (train/50), and `parallel.pp_stage_layers = "auto"` cuts the pipeline from measured stage
# times (below).
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
#
# Step time comes from a **profile**: the forward, backward and deferred weight-gradient time of one layer of each
# kind and of the head, measured on one GPU at the run's micro-batch (`profile_layers`), plus a stated link model
# for the all-to-alls, FSDP's collectives and the pipeline's transfers. The DualPipeV schedule is simulated with
# those durations (engine/33 `simulate`).

# %%
#| default_exp engine.planner

# %%
#| export
import math
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from pith_lit.engine.dualpipev import dualpipev_schedule, simulate, split_model
from pith_lit.engine.ep import shard_experts
from pith_lit.engine.mesh import stage_layers
from pith_lit.models.family import family
from pith_lit.models.protocol import norm_bytes
from pith_lit.ops.attention import ds_bytes

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
    document_mask: bool = False   # data.document_mask: attention within documents, by ops/14's kernels

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp * self.cp * self.ep

    @property
    def tokens(self) -> int:
        "Tokens of one micro-batch on one rank (a cp rank holds 1/cp of each sequence)."
        return self.micro_batch * self.seq_len // self.cp

    def describe(self) -> str:
        return (f"pp {self.pp} × dp_replicate {self.dp_replicate} × dp {self.dp} × cp {self.cp} × ep {self.ep}, "
                f"micro-batch {self.micro_batch} × {self.micro_batches}, recompute {self.recompute}")

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
# planner"). The formulas above against those measurements, for a layer past the first (the first layer of each
# cut kept 4–6% less than the others, its stage-1 outputs; the model counts every layer like the later ones):

# %%
#| export
MEASURED_LAYER_BYTES = {   # bytes per token the H200 kept after one layer's forward (benchmarks/layer_probe.py)
    # (bench config, layer, compiled, recompute): bytes per token
    ("qwen3-30b-a3b", 1, False, "none"): 194828.4, ("qwen3-30b-a3b", 1, True, "none"): 151566.4,
    ("qwen3-30b-a3b", 1, False, "attention"): 119504.2, ("qwen3-30b-a3b", 1, False, "layer"): 82640.2,
    ("deepseek-v2-lite", 0, False, "none"): 145164.1, ("deepseek-v2-lite", 0, True, "none"): 100685.1,
    ("deepseek-v2-lite", 2, False, "none"): 209256.3, ("deepseek-v2-lite", 2, True, "none"): 180905.3,
    ("gpt-oss-20b", 1, False, "none"): 209528.2, ("gpt-oss-20b", 1, True, "none"): 163202.2,
    ("qwen3-5-moe", 2, False, "none"): 432080.6, ("qwen3-5-moe", 2, True, "none"): 287486.5,
    ("qwen3-5-moe", 3, False, "none"): 232968.9, ("qwen3-5-moe", 3, True, "none"): 167304.6,
}

# %% [markdown]
# The bench configs are TOML files of train/40's schema; this notebook comes before the config, so it reads their
# `[model]` tables with `tomllib` into the model families' own `Config` classes.

# %%
import tomllib

from pith_lit.models import deepseek_v2, gpt_oss, qwen3_5_moe, qwen3_moe


def config_model(name: str, **extra):
    "The [model] table of configs/NAME.toml as its family's Config."
    from pith_lit.testing import repo_path
    with open(repo_path(f"configs/{name}.toml"), "rb") as fh:
        table = tomllib.load(fh)["model"] | extra
    return family(table["model_type"]).Config(**table)

# %%
rows = []
for (name, i, comp, rec), got in MEASURED_LAYER_BYTES.items():
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

    def add(name, params, shards, dim, layer=None, experts=False):
        params = [p for p in params if id(p) not in done]
        done.update(id(p) for p in params)
        units.append(Unit(name, sum(p.numel() for p in params),
                          sum(_shard_numel(p, shards, dim) for p in params),
                          sum(_shard_numel(p, shards, dim) * states(names[id(p)], p) for p in params),
                          shards, shards > 1 or cast, max((p.numel() for p in params), default=0), layer, experts))

    for key, layer in model.model.layers.items():
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            add(f"layer {key} experts", experts.parameters(), g_expert, 1 if w.ep > 1 else 0, key, True)
        add(f"layer {key}", layer.parameters(), g_dense, 0, key)
    add("root", model.parameters(), g_dense, 0)
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
    print(f"{w.describe()}: rank 0 holds {local} elements in {wrapped} FSDP units, as predicted")

# %% [markdown]
# ## Following one step
#
# `rank_peak` walks one step of one rank, layer by layer, and keeps the largest total it reaches. Its actions are the
# plain loop's (every micro-batch: the layers forward, the loss, the layers backward) or the DualPipeV schedule of
# engine/33 (F, B, F&B, W of this rank's two stages). Along the way it tracks:
#
# - the units' state: shards, optimizer states, gathered weights (a layer unit from its first forward to the end of
#   the step; an experts unit during each forward, and from each backward to its next forward), gradients (from a
#   unit's first backward: fp32 and unsharded for a wrapped unit, whole in the compute dtype otherwise);
# - activations: each layer's kept bytes from its forward to its backward, the head's kept bytes from the loss to
#   its backward, the stage input a pipeline rank received, what a zero-bubble backward leaves for W;
# - under `train.fp8`, a layer's FP8 expert weights and their transposed copy (ops/15: 1 byte per element each, made
#   by one pass) from its first forward of the step to the end of the step (and `layer_bytes` counts the experts'
#   saved inputs as FP8);
# - transients on top: the head while the loss runs, and in a layer's backward the gradient of its experts being
#   added into the gradient already there (a whole unit's, while FSDP's hook accumulates it into fp32) plus the
#   gradients of the expanded rows, or, where more, the score gradients that ops/14's backward stores for `dq`
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
        b, T = w.compute_bytes, w.tokens
        self.units = {u.name: u for u in units}
        self.layer_units = {}
        for u in units:
            self.layer_units.setdefault(u.layer, []).append(u)
        self.stages = stages
        self.cost = {key: layer_bytes(c, int(key), w) for st in stages for key in st}
        self.static = sum(u.shard * w.param_bytes + u.states * w.param_bytes for u in units)
        # train.fp8: a layer's expert weights quantized both ways (1 byte each way) at its first forward of the step,
        # kept until the step ends
        self.fp8, self.fp8_made = 0.0, set()
        self.attention = attention_transient(c, w)
        self.gathered, self.grads = set(), set()
        self.acts = self.deferred = self.buffers = 0.0
        self.T, self.b = T, b
        self.best = Peak(0.0, "", {})

    def _unit_bytes(self) -> tuple[float, float]:
        "Bytes of the gathered weights and of the gradients now (cached until either set changes)."
        key = (len(self.gathered), len(self.grads), frozenset(self.gathered))
        if getattr(self, "_cached", (None,))[0] != key:
            w, g, gr = self.w, 0.0, 0.0
            for u in self.units.values():
                if u.wrapped and u.name in self.gathered:
                    g += u.numel * w.compute_bytes
                if u.name in self.grads:
                    gr += u.numel * (max(4, w.compute_bytes) if u.wrapped else w.compute_bytes)
            self._cached = (key, (g, gr))
        return self._cached[1]

    def note(self, where: str, transient: float = 0.0) -> None:
        gathered, grads = self._unit_bytes()
        parts = {"parameters and optimizer states": self.static, "FP8 weight copies": self.fp8,
                 "gathered weights": gathered,
                 "gradients": grads, "activations": self.acts, "deferred for W": self.deferred,
                 "pipeline buffers": self.buffers, "transient": transient}
        total = sum(parts.values())
        if total > self.best.total:
            self.best = Peak(total, where, parts)

    def _gather(self, key: str, experts: bool) -> None:
        for u in self.layer_units.get(key, []):
            if u.experts == experts:
                self.gathered.add(u.name)

    def _fp8_copy(self, key: str) -> None:
        if self.w.fp8 and key not in self.fp8_made:
            self.fp8_made.add(key)
            self.fp8 += 2 * sum(u.numel for u in self.layer_units.get(key, []) if u.experts)

    def layer_forward(self, key: str, m) -> None:
        self._gather(key, False)
        self._gather(key, True)
        self._fp8_copy(key)
        self.acts += self.cost[key].kept_at(self.T)
        self.note(f"forward of layer {key}, micro-batch {m}")
        for u in self.layer_units.get(key, []):
            if u.experts:
                self.gathered.discard(u.name)   # freed after every forward, gathered again by its backward

    def layer_backward(self, key: str, m, zero_bubble: bool) -> None:
        self._gather(key, True)
        lb, w = self.cost[key], self.w
        transient = 0.0
        if lb.moe:
            E, k, inter = _moe_shape(self.c)
            experts = [u for u in self.layer_units.get(key, []) if u.experts]
            accumulating = experts and experts[0].name in self.grads
            if experts and (experts[0].wrapped or accumulating):
                u = experts[0]
                transient += (u.numel if u.wrapped else u.largest) * w.compute_bytes
            transient += self.T * k * w.compute_bytes * 2 * inter * (w.ep if w.sync_free else 1)
        transient = max(transient, self.attention)   # the attention's backward runs after the experts'
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
    keys = [str(i) for i in range(c.num_hidden_layers)]
    stages = _stage_keys(keys, w, pp_rank)
    head = head_bytes(c, w)
    walk = _Walk(c, w, units, head, stages)
    b, T, H = w.compute_bytes, w.tokens, c.hidden_size
    walk.note("start of the step")
    if not w.pipelined:
        for m in range(w.micro_batches):
            walk.embed(+1)
            for key in stages[0]:
                walk.layer_forward(key, m)
            walk.loss_forward(m)
            walk.loss_backward(m)
            for key in reversed(stages[0]):
                walk.layer_backward(key, m, False)
            walk.embed(-1)
        walk.end_of_step()
        return walk.best
    last = 2 * w.pp - 1

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

    for action in dualpipev_schedule(pp_rank, w.pp, w.micro_batches):
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
# ## Time: a measured profile and a link model
#
# A layer's time on the GPU is measured, not modelled: `profile_layers` builds one layer of each kind of the model
# (dense or MoE, and the attention kind: full, sliding, linear) at full width on one GPU, runs a micro-batch through
# it stage by stage with the local dispatcher (engine/32 `LayerRun`) and times its forward, its backward with the
# expert weight gradients deferred, and their W (ops/12's queue), then the head's loss and its backward, the
# embedding, and the gradient clipping and fused AdamW step per parameter; for a MoE layer also the forward of its
# stage 3 alone, which `train.recompute = "layer"` runs again in backward (`"attention"` the rest of the forward).
# Compiled stages are compiled first (`w.compile`). Times scale with a rank's tokens per micro-batch (the sequence
# length stays the profile's).

# %%
#| export
def layer_kind(c, i: int) -> str:
    "A layer's kind for the profile: dense or MoE, and its attention (full, sliding, linear)."
    kinds = getattr(c, "layer_types", None) or []
    attention = kinds[i].removesuffix("_attention") if kinds else "full"
    return f"{'moe' if is_moe(c, i) else 'dense'} {attention}"


@dataclass
class Profile:
    "Times in ms of one micro-batch of `tokens` tokens on one GPU, per layer kind and for the ends of the model."
    tokens: int
    device: str
    compile: bool
    layers: dict                 # kind -> {"F": ms, "B": ms (its W deferred), "W": ms, "F3": ms of F in stage 3}
    head: dict                   # {"F": ms (the loss, gradients included), "B": ms}
    embed: dict                  # {"F": ms, "B": ms}
    adamw_ms_per_billion: float  # clipping and a fused AdamW step over 1e9 parameters of the optimizer's dtype
    param_bytes: int = 2         # the bytes of that dtype

    def scaled(self, tokens: int) -> "Profile":
        "The same profile for `tokens` tokens per micro-batch (times proportional to tokens)."
        s = tokens / self.tokens
        sc = lambda d: {k: v * s for k, v in d.items()}
        return replace(self, tokens=tokens, layers={k: sc(v) for k, v in self.layers.items()}, head=sc(self.head),
                       embed=sc(self.embed))


def _time(fn, device, reps: int, warm: bool = True) -> float:
    "Median ms of `fn()` over `reps` runs after one warm-up (CUDA events on a GPU, the host clock elsewhere)."
    if warm:
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e3)
    return sorted(out)[len(out) // 2]


@torch.no_grad()
def _materialise(module: nn.Module, device, dtype) -> nn.Module:
    "A meta module on `device` in `dtype`, with N(0, 0.02) weights (norm gains 1): for timing only."
    module.to_empty(device=device)
    for name, p in module.named_parameters():
        p.normal_(0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    return module.to(dtype)


def profile_layers(model: nn.Module, w: Workload, device, dispatcher, reps: int = 3) -> Profile:
    """Measure `model` (a whole model on the meta device, left as it is) on `device`: one layer of each kind,
    the head and the embedding, for one micro-batch of `w.micro_batch` × `w.seq_len` tokens in `w`'s compute
    dtype; `dispatcher`: the local one (models/20 `LocalDispatcher`)."""
    from pith_lit.engine.stages import LayerRun
    from pith_lit.models.protocol import head_loss
    from pith_lit.ops.grouped_linear import WeightGradQueue
    device = torch.device(device)
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[w.compute_bytes]
    c, B, S = model.config, w.micro_batch, w.seq_len
    positions = torch.arange(S, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (B, S), device=device, generator=g)
    x = torch.randn(B, S, c.hidden_size, device=device, generator=g, dtype=dtype)
    layers = {}
    for i, (key, meta_layer) in enumerate(model.model.layers.items()):
        kind = layer_kind(c, i)
        if kind in layers:
            continue
        import copy
        layer = _materialise(copy.deepcopy(meta_layer), device, dtype)
        if w.compile:
            layer.stage1, layer.stage5 = torch.compile(layer.stage1), torch.compile(layer.stage5, fullgraph=True)
        queue = WeightGradQueue()
        state = {}

        def fwd():
            run = LayerRun(layer, key, dispatcher, None, queue)
            for _, fn in run.forward(x.detach().requires_grad_(), positions):
                fn()
            state["run"] = run

        def bwd():
            fwd_run = state.pop("run")
            for _, fn in fwd_run.backward(torch.ones_like(fwd_run.h_out)):
                fn()

        def experts_time() -> float:   # ms of stage 3 inside whole forwards (median after a warm-up)
            out = []
            for _ in range(reps + 1):
                run = LayerRun(layer, key, dispatcher, None, queue)
                for _, fn in run.forward(x.detach().requires_grad_(), positions):
                    if fn.__name__ != "_stage3":
                        fn()
                        continue
                    out.append(_time(fn, device, 1, warm=False))
            return sorted(out[1:])[len(out[1:]) // 2]

        with torch.enable_grad():
            t_f = _time(fwd, device, reps)
            t_fb = _time(lambda: (fwd(), bwd()), device, reps)
            t_w = _time(lambda: (fwd(), bwd(), queue.drain()), device, reps)
            t_3 = experts_time() if is_moe(c, i) else 0.0
        layers[kind] = {"F": t_f, "B": max(t_fb - t_f, 0.0), "W": max(t_w - t_fb, 0.0), "F3": t_3}
        del layer
    import copy
    ends = copy.deepcopy(model)
    ends.model.layers = nn.ModuleDict()
    _materialise(ends, device, dtype)
    labels = ids.clone()
    with torch.enable_grad():
        h = x.detach().requires_grad_()
        t_loss = _time(lambda: head_loss(ends, h, labels), device, reps)
        t_lossb = _time(lambda: head_loss(ends, h, labels).backward(), device, reps) - t_loss
        t_emb = _time(lambda: ends.prolog(ids), device, reps)
        t_embb = _time(lambda: ends.prolog(ids).backward(x), device, reps) - t_emb
    n = 2 ** 25 if device.type == "cuda" else 2 ** 18       # 8 tensors: 512 MB of bf16 parameters on a GPU
    params = [torch.zeros(n, device=device, dtype=torch.float32 if w.param_bytes == 4 else dtype, requires_grad=True)
              for _ in range(8)]
    grads = [torch.randn_like(p) for p in params]
    for p, gr in zip(params, grads):
        p.grad = gr
    opt = torch.optim.AdamW(params, fused=device.type in ("cuda", "cpu"))

    def clip_and_step():   # engine/36's clip_sharded_grads without its all-reduce, then the step
        norm = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum().sqrt()
        torch._foreach_mul_(grads, (1 / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
        opt.step()

    t_opt = _time(clip_and_step, device, reps)
    return Profile(w.tokens, str(device), w.compile, layers, {"F": t_loss, "B": max(t_lossb, 0.0)},
                   {"F": t_emb, "B": max(t_embb, 0.0)}, t_opt * 1e9 / (8 * n), params[0].element_size())

# %% [markdown]
# **The link model.** What moves between GPUs takes bytes ÷ bandwidth, with one bandwidth inside a node and another
# between nodes, stated and overridable: NVLink 200 GB/s per GPU and direction for NCCL's all-to-all and collectives
# inside an H100/H200 node (nominal 450 GB/s; NCCL reaches well under it), 40 GB/s between nodes (400 Gb/s
# InfiniBand per GPU). Ranks are laid out with ep innermost, then cp, dp, dp_replicate and pp (engine/30), so a
# group spans nodes when its ranks' stride times its size exceeds the node.
#
# - **Expert parallelism**: per MoE layer and micro-batch, dispatch sends each token's row once to each of the
#   other ranks holding one of its experts, combine returns as many, and backward does both again; exposed in the
#   plain loop and in an F or B that runs alone, hidden beside the other task of an F&B.
# - **FSDP**: the all-gathers run ahead of compute (FSDP2 prefetches) and count as hidden; `reduce_gradients`
#   reduce-scatters every unit's fp32 gradient after the last backward, exposed; HSDP then all-reduces the shards
#   across replicas. A wrapped unit also costs copies on its own GPU, at the GPU's copy bandwidth (4.3 TB/s read
#   plus written on the H200, DESIGN.md): each gather writes the weights in the compute dtype (an experts unit is
#   gathered in every backward and in the first forward), each backward adds the unit's gradient into its fp32
#   accumulator. The optimizer's time scales with the bytes of its dtype against the profile's.
# - **Pipeline transfers** of activations between ranks are small beside these (0.4% of a two-GPU step,
#   benchmarks/RESULTS.md) and are left out.

# %%
#| export
@dataclass(frozen=True)
class Link:
    """Bandwidths (bytes/s per GPU and direction) inside a node and between nodes; GPUs per node; and the GPU's own
    copy bandwidth (bytes read plus written) for FSDP's casts."""
    node: float = 200e9
    network: float = 40e9
    gpus_per_node: int = 8
    copy: float = 4.3e12

    def bandwidth(self, stride: int, size: int) -> float:
        "The bandwidth of a group of `size` ranks `stride` apart."
        return self.node if stride * size <= self.gpus_per_node else self.network


@dataclass
class StepTime:
    "A predicted step: its time (s), tokens/s for all ranks, and where the time goes (s)."
    seconds: float
    tokens_per_s: float
    parts: dict


def step_time(c, w: Workload, profile: Profile, units: list[Unit] | None = None, link: Link = Link(),
              layer_keys: list[str] | None = None) -> StepTime:
    """The predicted time of one step of `w` for model config `c`, from `profile` (measured at another micro-batch
    is fine) and `link`; `units`: pipeline rank 0's FSDP units (`rank_units`), for the optimizer and the
    reductions."""
    prof = profile.scaled(w.tokens)
    L = c.num_hidden_layers
    keys = layer_keys or [str(i) for i in range(L)]
    b, T, H = w.compute_bytes, w.tokens, c.hidden_size
    kind = {key: layer_kind(c, int(key)) for key in keys}
    def t(key, x):   # seconds; a recomputed stage's forward runs again in its backward
        ms = prof.layers[kind[key]]
        if x == "B" and w.recompute != "none":
            return (ms["B"] + ms["F"] - (ms.get("F3", 0.0) if w.recompute == "attention" else 0.0)) / 1e3
        return ms[x] / 1e3
    comm = {}
    for key in keys:   # seconds of one exchange (dispatch or combine) of one micro-batch
        if is_moe(c, int(key)) and w.ep > 1:
            E, k, _ = _moe_shape(c)
            d = w.ep if w.sync_free else ranks_per_token(E, k, w.ep)
            comm[key] = T * H * b * d * (w.ep - 1) / w.ep / link.bandwidth(1, w.ep)
        else:
            comm[key] = 0.0
    ends_f = (prof.head["F"] + prof.embed["F"]) / 1e3
    ends_b = (prof.head["B"] + prof.embed["B"]) / 1e3
    if not w.pipelined:
        per_micro = sum(t(k, "F") + t(k, "B") + t(k, "W") + 4 * comm[k] for k in keys) + ends_f + ends_b
        compute, exposed_ep = w.micro_batches * per_micro, w.micro_batches * 4 * sum(comm.values())
    else:
        stages = stage_layers(L, w.pp, list(w.stage_layers) or None)
        last = 2 * w.pp - 1
        stage_of = lambda r, p: r if p == 0 else last - r

        sums = {}   # (stage, "F" | "B" | "W" | "comm") -> seconds of one micro-batch
        for s, layers in enumerate(stages):
            for what in ("F", "B", "W"):
                sums[s, what] = sum(t(keys[i], what) for i in layers)
            sums[s, "comm"] = 2 * sum(comm[keys[i]] for i in layers)
            for what in ("F", "B"):   # the embedding on the first stage, the head and the loss on the last
                sums[s, what] += (prof.embed[what] if s == 0 else 0) / 1e3 + (prof.head[what] if s == last else 0) / 1e3
        work = lambda r, p, what: sums[stage_of(r, p), what]
        ex = lambda r, p: sums[stage_of(r, p), "comm"]
        exposed = {"ep": 0.0}

        def duration(action, r):
            match action:
                case ("F", p, m):
                    exposed["ep"] += ex(r, p)
                    return work(r, p, "F") + ex(r, p)
                case ("B", p, m, zb):
                    exposed["ep"] += ex(r, p)
                    return work(r, p, "B") + (0 if zb else work(r, p, "W")) + ex(r, p)
                case ("FB", (pf, _), (pb, _)):
                    compute = work(r, pf, "F") + work(r, pb, "B") + work(r, pb, "W")
                    hidden = max(ex(r, pf) + ex(r, pb) - compute, 0.0)
                    exposed["ep"] += hidden
                    return compute + hidden
                case ("W", p, m):
                    return work(r, p, "W")

        events = simulate(w.pp, w.micro_batches, duration)
        compute = max(e[3] for ev in events for e in ev) - min(e[2] for ev in events for e in ev)
        exposed_ep = exposed["ep"] / w.pp
    parts = {"compute and exposed all-to-alls": compute, "of which all-to-alls": exposed_ep}
    if units is not None:
        local = sum(u.shard for u in units)
        parts["optimizer"] = profile.adamw_ms_per_billion * local / 1e9 / 1e3 * w.param_bytes / profile.param_bytes
        moved = 0.0   # a wrapped unit's casts: each gather reads the shard and writes the compute dtype, each
        for u in units:   # backward adds its gradient into the fp32 accumulator
            if u.wrapped:
                gathers = w.micro_batches + 1 if u.experts else 1
                moved += u.numel * (gathers * (w.param_bytes / u.shards + w.compute_bytes)
                                    + w.micro_batches * (w.compute_bytes + 2 * max(4, w.compute_bytes)))
        parts["FSDP casts"] = moved / link.copy
        dense = [u for u in units if u.wrapped and u.shards > 1]
        parts["gradient reduce-scatter"] = sum(
            u.numel * max(4, b) * (u.shards - 1) / u.shards
            / link.bandwidth(1 if not u.experts else w.ep, u.shards) for u in dense)
        if w.dp_replicate > 1:
            parts["replica all-reduce"] = sum(2 * u.shard * max(4, b) * (w.dp_replicate - 1) / w.dp_replicate
                                              for u in units) / link.bandwidth(w.dp * w.cp * w.ep, w.dp_replicate)
    seconds = sum(v for k, v in parts.items() if not k.startswith("of which"))
    tokens = w.micro_batch * w.seq_len * w.micro_batches * w.dp_replicate * w.dp * w.ep
    return StepTime(seconds, tokens / seconds, parts)


# %% [markdown]
# ## Cutting the pipeline from measured times
#
# At pp > 1 rank 0 holds the first and the last stage, the embedding, the final norm and the head, so layers cut
# evenly leave the other ranks waiting for it (benchmarks/RESULTS.md: 3-4-3-2 beat 3-3-3-3 on the Qwen3 bench).
# `choose_stage_layers` starts from the even cut and moves one layer at a time to a neighbouring stage while the
# busiest rank's work on a micro-batch (its two stages, with the embedding or the head) gets smaller; from the better
# of that cut and the even one it makes up to three more such moves judged by the simulated step (the profile's times
# through `simulate`, with at most 4·pp micro-batches: more only repeat the steady state). `parallel.pp_stage_layers = "auto"` runs
# it at start-up on a profile measured there (train/45).

# %%
#| export
def choose_stage_layers(c, w: Workload, profile: Profile) -> list[int]:
    "The layers of each of the 2·pp stages that the profile's times say make the shortest step."
    L, P = c.num_hidden_layers, w.pp
    n, prof = 2 * P, profile.scaled(w.tokens)
    per = [sum(prof.layers[layer_kind(c, i)][x] for x in ("F", "B", "W")) for i in range(L)]
    ends = {0: prof.embed["F"] + prof.embed["B"], n - 1: prof.head["F"] + prof.head["B"]}

    def load(sizes):   # the busiest rank's work on one micro-batch (rank r runs stages r and n-1-r)
        starts = [sum(sizes[:s]) for s in range(n)]
        stage = [sum(per[a:a + k]) + ends.get(s, 0.0) for s, (a, k) in enumerate(zip(starts, sizes))]
        return max(stage[r] + stage[n - 1 - r] for r in range(P)), stage

    sizes = [len(s) for s in stage_layers(L, P)]
    best = load(sizes)
    while True:   # move one layer to a neighbouring stage while the busiest rank gets less work
        moves = [(load(cand), cand) for cand in _neighbours(sizes)]
        if not moves or min(moves)[0] >= best:
            break
        best, sizes = min(moves)
    short = replace(w, pipelined=True, micro_batches=min(w.micro_batches, 4 * P))   # the steady state repeats
    cost = lambda s: step_time(c, replace(short, stage_layers=tuple(s)), profile).seconds
    even = [len(s) for s in stage_layers(L, P)]
    best, sizes = min((cost(even), even), (cost(sizes), sizes))
    for _ in range(3):   # then a few moves judged by the simulated step itself
        moves = [(cost(cand), cand) for cand in _neighbours(sizes)]
        if not moves or min(moves)[0] >= best:
            break
        best, sizes = min(moves)
    return sizes


def _neighbours(sizes: list[int]) -> list[list[int]]:
    "The cuts one layer away from `sizes` (a layer to a neighbouring stage; middle stages keep one)."
    n, out = len(sizes), []
    for s in range(n):
        for t in (s - 1, s + 1):
            if 0 <= t < n and sizes[s] > (0 if s in (0, n - 1) else 1):
                cand = list(sizes)
                cand[s], cand[t] = cand[s] - 1, cand[t] + 1
                out.append(cand)
    return out


# %% [markdown]
# ## The estimate of a layout
#
# `estimate` puts the parts together for every pipeline rank (the ranks of one pipeline stage hold the same shares
# of the model, whatever their dp, cp or ep coordinates, since experts divide evenly) and `fits` says whether the
# largest peak, with the allocator's slack (10%) and the CUDA context (1 GiB), stays under a GPU's memory.

# %%
#| export
SLACK, CONTEXT = 0.10, 1 * GiB   # the allocator's reserve above allocated (1-13% measured) and the CUDA context


@dataclass
class Estimate:
    "Predicted peaks of every pipeline rank, the largest, and the step time when a profile was given."
    workload: Workload
    peaks: list[Peak]
    time: StepTime | None = None

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
        return f"peak {p.gib():.1f} GiB per GPU ({top}; at the {p.where})"


def estimate(c, make_model, w: Workload, states=lambda name, p: 2, profile: Profile | None = None,
             link: Link = Link(), cache: dict | None = None) -> Estimate:
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
    peaks = [rank_peak(c, u, w, r) for r, u in enumerate(units)]
    time_ = step_time(c, w, profile, units[0], link) if profile is not None else None
    return Estimate(w, peaks, time_)

# %% [markdown]
# ## Examples
#
# The bench configs as `benchmarks/RESULTS.md` ran them on one H200 ("The planner" there compares each with its
# measured peak), and the real Qwen3-30B-A3B in the paper's eight-GPU layout, pp 2 × ep 4, where rank 0 also holds
# the embedding and the head:

# %%
def meta_of(c):
    def make():
        with torch.device("meta"):
            return {"qwen3_moe": qwen3_moe.Qwen3MoeForCausalLM, "deepseek_v2": deepseek_v2.DeepseekV2ForCausalLM,
                    "gpt_oss": gpt_oss.GptOssForCausalLM, "qwen3_5_moe": qwen3_5_moe.Qwen3_5MoeForCausalLM}[
                c.model_type](c)
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
    print(f"Qwen3-30B-A3B, {w.describe()}, pipeline rank {r}: {p.gib():.1f} GiB at the {p.where}")
assert e.peaks[0].total > e.peaks[1].total   # rank 0 holds the embedding and the head

# %% [markdown]
# The Qwen3 bench with and without `train.fp8` (row scales), one and four micro-batches per step, against the peaks
# the H200 measured (benchmarks/RESULTS.md, "FP8: both layouts of each expert weight from one pass"). FP8 adds the
# weights' two copies and keeps the experts' saved inputs in FP8 instead of bf16, in column layouts sized for the
# most 128-row tiles a micro-batch's rows can need (E − 1 spare tiles a layer, 45 MB at Qwen3's width).

# %%
MEASURED_BENCH_PEAKS = {(False, 1): 76.18, (True, 1): 86.11, (False, 4): 91.27, (True, 4): 101.20}   # GiB
c = config_model("bench-qwen3-30b-a3b")
for (fp8, m), got in MEASURED_BENCH_PEAKS.items():
    want = estimate(c, meta_of(c), replace(bench, fp8=fp8, micro_batches=m)).peaks[0].gib()
    print(f"{'FP8 ' if fp8 else 'bf16'}, {m} micro-batch(es): predicted {want:6.2f} GiB, measured {got:6.2f} "
          f"({want / got - 1:+.1%})")
    assert abs(want / got - 1) < 0.01, (fp8, m, want, got)

# %% [markdown]
# And the pipeline cut: with a head that costs as much as three layers (a made-up profile), `choose_stage_layers`
# takes layers off rank 0's two stages, and the simulated step gets shorter than with the even cut.

# %%
c = config_model("bench-qwen3-30b-a3b")
prof = Profile(4096, "made up", False, {"moe full": {"F": 1.0, "B": 1.4, "W": 0.6}}, {"F": 3.0, "B": 1.0},
               {"F": 0.1, "B": 0.1}, 10.0)
w = Workload(pp=2, micro_batch=1, micro_batches=8, pipelined=True)
cut = choose_stage_layers(c, w, prof)
even = step_time(c, w, prof).seconds
best = step_time(c, replace(w, stage_layers=tuple(cut)), prof).seconds
print(f"stages {cut}: {best * 1e3:.1f} ms against {even * 1e3:.1f} ms for the even cut")
assert cut[0] + cut[-1] < 6 and best < even
