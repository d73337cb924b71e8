# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The layer protocol
#
# A mixture-of-experts layer does four kinds of work: attention and the router, which are local to each
# token; sending each token to the experts it chose; the experts themselves; and bringing the results
# back. With expert parallelism the sending and the bringing back are all-to-alls between GPUs, and the
# whole system's speed comes from overlapping them with the compute of another micro-batch. So every
# decoder layer of every model is cut at those seams into five stages:
#
# | stage | call | by | does |
# |---|---|---|---|
# | 1 | `layer.stage1(h, positions) -> (h, x, routing)` | model | attention + residual, norm, router, shared experts |
# | 2 | `dispatcher.dispatch(x, routing) -> rows` | engine | send each token's row to the ranks of its experts |
# | 3 | `dispatcher.expand`, `layer.stage3(x_grouped, counts, wgrad_queue=None) -> y`, `dispatcher.reduce` | model, between two engine permutations | the routed experts on rows grouped by expert, then each row's router-weighted sum |
# | 4 | `dispatcher.combine(rows, routing) -> y` | engine | bring the sums back to the tokens' rank, one (T, H) row per token |
# | 5 | `layer.stage5(h, y) -> h` | model | the residual |
#
# The router weights are applied where the experts ran (`reduce`, in stage 3), so that combine returns one row
# per token and rank instead of one per (token, expert) pair: at ep 2 with top-8 that is a quarter of the bytes,
# and it measures faster than returning the pairs (benchmarks/RESULTS.md, "Throughput on two H200s: expert parallelism and
# DualPipeV").
#
# Stage 3's optional `wgrad_queue` (ops/12_grouped_linear) defers the experts' weight gradients: backward then
# computes only the input gradient, and a pipeline schedule computes the weight gradient later, in a slot that
# would otherwise be idle. A model never sees stages 2 and 4, and the engine never looks inside 1, 3 and 5. This
# notebook defines the pieces they share: the `Routing` record that travels from stage 1 to stage 5, the
# single-rank dispatcher, `run_layers`, the plain loop that calls the five stages, and `head_loss`, the loss of a
# micro-batch. The expert-parallel dispatchers and the overlapped schedules (in `engine/`) replace the dispatcher
# and the loop without touching any model. At its end come the small helpers each family's notebook uses to say
# what it keeps for backward (for the planner, engine/37) and how it reads a Hugging Face config.json (train/46).

# %%
#| default_exp models.protocol

# %%
#| export
import hashlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pith_lit.ops.adamw import local   # this rank's block of a DTensor: the stacked experts under ep with FSDP
from pith_lit.ops.experts import Fp8Weights, expert_mlp
from pith_lit.ops.permute import gather_rows, sort_by_expert, weighted_gather

# %% [markdown]
# ## Config fields carry their help and their range
#
# Every model's `Config` is a dataclass whose fields are declared with `cfg(default, help)`, so the command
# line can print what each field means (train/config). A number's valid range is declared on the field too
# (`gt`, `ge`, `lt`, `le`), and the config validation checks every declared range, with no list of names of its
# own.

# %%
#| export
def cfg(default, help: str, **bounds):
    """A dataclass field that carries its documentation (`--help` prints it) and, for a number, its valid range:
    `gt`, `ge`, `lt`, `le` (train/config checks them). Lists and dicts get a factory."""
    unknown = set(bounds) - {"gt", "ge", "lt", "le"}
    if unknown:
        raise TypeError(f"cfg: unknown bound(s) {sorted(unknown)}; use gt, ge, lt or le")
    meta = {"help": help, **bounds}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)

# %% [markdown]
# ## Options: how a model runs, beside its weights
#
# Three choices change how a layer computes without changing its parameters, and all three come from the run's
# config. `Options` holds them, and a model's constructor takes it and hands each field to the modules that read it:
#
# - `fp8`: the routed experts' and the dense projections' matmuls in the compute dtype (`None`) or in FP8 with
#   `"rows"` or `"block"` scales (`train.fp8`, `train.fp8_scaling`); the experts module keeps the step's FP8 weight
#   copies (ops/experts), and `CausalLM` marks its projections (`Projection` below);
# - `fp8_dense_min`: under `fp8`, a dense projection runs in FP8 only when its input and its output are both at
#   least this wide (`train.fp8_dense_min`). The FP8 layer beats bf16 only where its GEMMs are wide against its
#   quantization passes and launches; the default, 4096, is where it measured ahead, alone and in whole steps
#   (benchmarks/RESULTS.md, "FP8 dense projections" and "FP8 end to end"); 0 puts every projection that allows FP8
#   in it (the checks of this package, at their small widths);
# - `cp_group`: the context-parallel process group the attention's ring runs over (`parallel.cp > 1`, ops/17
#   `ring_group`), or `None` to attend within the rank's own sequence;
# - `route`: `"learned"`, the router's top-k, or `"round_robin"`, a fixed assignment for benchmarks (`train.route`,
#   train/42).
#
# The default is a plain model: the compute dtype, local attention, learned routing. The object is frozen: a model
# runs with the options it was built with. Recomputation is not among them: it changes what the engine keeps for a
# stage's backward, not what the layer computes, so the engine wraps the stages it recomputes (engine/32
# `recompute_layers`).

# %%
#| export
@dataclass(frozen=True)
class Options:
    """How a model runs, given to its constructor: `fp8` None, 'rows' or 'block'; `fp8_dense_min`, the narrowest
    dense projection in FP8; `cp_group` a group or None; `route`."""
    fp8: str | None = None
    fp8_dense_min: int = 4096
    cp_group: object = None
    route: str = "learned"

    def __post_init__(self):
        if self.fp8 not in (None, "rows", "block"):
            raise ValueError(f"Options(fp8={self.fp8!r}): expected None, 'rows' or 'block' (train.fp8_scaling)")
        if self.route not in ("learned", "round_robin"):
            raise ValueError(f"Options(route={self.route!r}): expected 'learned' or 'round_robin' (train.route)")

# %%
for bad, msg in [(dict(fp8="tensor"), "Options(fp8='tensor')"), (dict(route="random"), "Options(route='random')")]:
    try:
        Options(**bad)
    except ValueError as e:
        assert str(e).startswith(msg), e
    else:
        raise AssertionError(f"no error for {bad}")
assert Options() == Options(None, 4096, None, "learned")

# %% [markdown]
# ## Routing: what stage 1 tells stages 2–5
#
# Stage 1 decides, for each of the T = B·S tokens of a micro-batch, which k experts it goes to and with what
# weight. `probs` keeps the full softmax over all experts for the load-balance loss; `counts`, set by dispatch,
# is the number of (token, expert) pairs per expert, for load-balance statistics. A dispatcher keeps what it
# needs between dispatch and combine in `plan`; a model only reads the fields above it.

# %%
#| export
@dataclass
class Routing:
    """Router decision for the T tokens of one micro-batch, passed from stage 1 through stages 2-5.

    ids: (T, k) int64 expert ids; weights: (T, k) router weights (the model's compute dtype);
    probs: (T, E) full router probabilities (float32, float64 for a float64 model) or None; counts: (E,) int64
    (token, expert) pairs per expert in this micro-batch, set by dispatch; plan: what the dispatcher keeps
    between dispatch and combine (its index maps, and `plan.weights`, the router weights that `reduce` applies)."""
    ids: Tensor
    weights: Tensor
    probs: Tensor | None
    counts: Tensor | None = None
    plan: object | None = None

# %% [markdown]
# ## Stages 2 and 4 on one rank
#
# Every dispatcher offers the same four calls, and a schedule needs nothing else to know about it:
#
# - `dispatch(x (T, H), routing) -> rows`: the rows this rank's experts need, exchanged between ranks (a
#   communication step); sets `routing.counts` and `routing.plan`;
# - `expand(rows, routing) -> (x_grouped (N, H), counts (E_local,))`: one row per (token, expert) pair, grouped
#   by local expert (`counts[e]` rows for local expert e);
# - `reduce(y (N, H), routing) -> rows`: per received row, the sum of its pairs' outputs weighted by
#   `routing.plan.weights`;
# - `combine(rows, routing) -> (T, H)`: the sums back on the tokens' rank, each token's rows added up (a
#   communication step); drops the plan.
#
# `expand` and `reduce` only permute and sum rows: a schedule that runs communication on a stream of its own
# (engine/32_stages) calls them in stage 3, on its compute stream. `counts_step` says whether the dispatcher
# also wants `exchange_counts(routing)` called as a communication step of its own before `dispatch` (engine/31).
# All four are differentiable, in the rows and in `plan.weights`.
#
# With all experts on one rank nothing travels: `dispatch` sorts the T·k (token, expert) pairs by expert and
# returns the rows as they are, `expand` copies each token's row once per pair, `reduce` forms each token's
# weighted sum and `combine` passes it on. `sort_by_expert`, `gather_rows` and `weighted_gather` (ops/permute)
# are the torch reference on CPU and Triton kernels on CUDA.

# %%
#| export
@dataclass(eq=False)
class LocalPlan:
    "What `LocalDispatcher` keeps between dispatch and combine."
    src_token: Tensor    # (T·k,) the token of each grouped pair
    row_index: Tensor    # (T, k) the grouped row of each (token, choice)
    weights: Tensor      # (T, k) the router weights `reduce` applies


class LocalDispatcher:
    "Stages 2 and 4 when one rank holds all `num_experts` experts (the calls are described above)."
    counts_step = False

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x: Tensor, routing: Routing) -> Tensor:
        src_token, row_index, routing.counts = sort_by_expert(routing.ids, self.num_experts)
        routing.plan = LocalPlan(src_token, row_index, routing.weights)
        return x

    def expand(self, rows: Tensor, routing: Routing) -> tuple[Tensor, Tensor]:
        return gather_rows(rows, routing.plan.src_token, routing.plan.row_index), routing.counts

    def reduce(self, y: Tensor, routing: Routing) -> Tensor:
        return weighted_gather(y, routing.plan.row_index, routing.plan.weights)

    def combine(self, rows: Tensor, routing: Routing) -> Tensor:
        routing.plan = None
        return rows

# %% [markdown]
# ## The five calls
#
# `run_layers` is the whole schedule with no overlap: for each layer, the five stages in order. A dense layer
# (one that does its MLP in stage 1) returns `routing = None` and skips stages 2–5. The overlapped schedules
# in `engine/` make the same calls in a different order, and their tests compare against this loop.
#
# `head_loss` is the loss of a micro-batch from the last hidden states, written once for the plain loop, the
# pipeline schedule and the checks: the final norm, the head and the summed token cross-entropy over labels that
# are not -100, in fp32 (`compute_dtype`: float64 for a float64 model, the dtype the families' norms, RoPE and
# routers compute in too). On CUDA the fused linear cross-entropy of ops/13 computes it without materialising the
# (tokens × vocabulary) logits.

# %%
#| export
def run_layers(layers, h: Tensor, positions: Tensor, dispatcher) -> tuple[Tensor, list]:
    """Run `layers` (an iterable of layers that follow the five-stage protocol) on `h` (B, S, H).

    Returns the output hidden states and each layer's `Routing` (None for a dense layer)."""
    routings = []
    for layer in layers:
        h, x, routing = layer.stage1(h, positions)
        if routing is not None:
            rows = dispatcher.dispatch(x, routing)
            y = layer.stage3(*dispatcher.expand(rows, routing))
            h = layer.stage5(h, dispatcher.combine(dispatcher.reduce(y, routing), routing))
        routings.append(routing)
    return h, routings


def head_loss(model, h: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Summed token cross-entropy (fp32, or fp64 for a float64 model) of the model's final norm and head on
    `h (B, S, H)` against `labels (B, S)`."""
    h, labels = model.model.norm(h).flatten(0, 1), labels.flatten()
    if h.is_cuda:
        from pith_lit.ops.cross_entropy import linear_cross_entropy
        return linear_cross_entropy(h, model.lm_head.weight, labels, ignore_index)
    logits = model.lm_head(h)
    return F.cross_entropy(logits.to(compute_dtype(logits.dtype)), labels, ignore_index=ignore_index, reduction="sum")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    "float32 for bf16/fp16/fp32 tensors, float64 for float64 ones: where norms, RoPE, routers and losses compute."
    return torch.promote_types(dtype, torch.float32)

# %% [markdown]
# ## The rotary angles, computed once per layer call
#
# Every family rotates queries and keys by angles `position × frequency`. Left inside a compiled stage 1, the cos and
# sin of those angles are fused by the compiler into each kernel that reads them, so they are recomputed for every
# head of q and k, forward and backward: transcendental functions on ~10⁸ elements a layer, which keep those kernels
# several times longer than their memory traffic needs on the H200 (RESULTS.md, "The step's anatomy"). `cos_sin` is
# an operator of its own (`torch.library.custom_op`), which the compiler calls instead of fusing: the tables,
# `positions.shape + inv_freq.shape`, are computed once per call, and the rotations read them. No gradient flows into
# positions or frequencies, so it needs no backward.

# %%
#| export
@torch.library.custom_op("pith_lit::cos_sin", mutates_args=())
def cos_sin(positions: Tensor, inv_freq: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    "cos and sin of `positions[..., None] × inv_freq`, times `factor`, in `inv_freq`'s dtype."
    angles = positions.to(inv_freq.dtype)[..., None] * inv_freq
    return angles.cos() * factor, angles.sin() * factor


@cos_sin.register_fake
def _(positions, inv_freq, factor):
    shape = (*positions.shape, *inv_freq.shape)
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


def rope_cos_sin(positions: Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin in the rotate-half layout (Qwen3, Qwen3.5): channels i and i + dim/2 at angle
    `position · θ^(-2i/dim)`; shape `positions.shape + (dim,)`, computed in `compute_dtype`, cast to `dtype`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=compute_dtype(dtype)) / dim)
    cos, sin = cos_sin(positions, inv_freq, 1.0)
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)

# %%
pos, freq = torch.arange(50).view(2, 25), 0.3 ** torch.arange(4, dtype=torch.float64)
c, s = cos_sin(pos, freq, 0.5)
assert torch.equal(c, (pos[..., None] * freq).cos() * 0.5) and torch.equal(s, (pos[..., None] * freq).sin() * 0.5)

# %% [markdown]
# ## Check: five stages equal a plain loop over experts
#
# A toy layer shows the protocol in its smallest form: stage 1 is a softmax top-k router (no attention),
# each expert is one tanh-linear map, and stage 5 adds the dispatcher's weighted sums to the residual. Its
# `reference` computes the same thing without any protocol piece: every expert on every token, masked by
# whether the token chose it. A dense toy layer in the middle checks that `run_layers` skips stages 2–5
# for it.

# %%
class ToyMoE(nn.Module):
    def __init__(self, H, E, k):
        super().__init__()
        self.k = k
        self.router = nn.Parameter(torch.randn(E, H))
        self.w = nn.Parameter(torch.randn(E, H, H) / H**0.5)

    def stage1(self, h, positions):
        x = h.flatten(0, 1)
        probs = torch.softmax(x @ self.router.T, -1)
        weights, ids = probs.topk(self.k, -1)
        return h, x, Routing(ids, weights, probs)

    def stage3(self, x, counts, wgrad_queue=None):  # a toy: no deferred weight gradients
        ends = counts.cumsum(0).tolist()  # the one host sync: row ranges per expert
        return torch.cat([torch.tanh(x[s:e] @ w.T) for s, e, w in zip([0] + ends[:-1], ends, self.w)])

    def stage5(self, h, y):
        return h + y.view(h.shape)

    def reference(self, h):
        x = h.flatten(0, 1)
        weights, ids = torch.softmax(x @ self.router.T, -1).topk(self.k, -1)
        out = torch.zeros_like(x)
        for e, w in enumerate(self.w):
            out = out + ((ids == e) * weights).sum(-1, keepdim=True) * torch.tanh(x @ w.T)
        return h + out.view(h.shape)


class ToyDense(nn.Module):
    def __init__(self, H):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H) / H**0.5)

    def stage1(self, h, positions):
        return h + torch.tanh(h @ self.w.T), None, None

    def reference(self, h):
        return h + torch.tanh(h @ self.w.T)

# %%
torch.manual_seed(0)
B, S, H, E, k = 2, 5, 8, 4, 2
layers = [ToyMoE(H, E, k), ToyDense(H), ToyMoE(H, E, k)]
for l in layers: l.double()
h0 = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)

out, routings = run_layers(layers, h0, torch.arange(S), LocalDispatcher(E))
ref = h0
for l in layers: ref = l.reference(ref)
assert torch.allclose(out, ref, rtol=0, atol=1e-12), (out - ref).abs().max()
assert routings[1] is None and routings[0].plan is None     # combine dropped the plan
assert torch.equal(routings[0].counts, torch.bincount(routings[0].ids.flatten(), minlength=E))

params = [h0, *(p for l in layers for p in l.parameters())]
g = torch.autograd.grad(out.square().sum(), params)
g_ref = torch.autograd.grad(ref.square().sum(), params)
for a, b in zip(g, g_ref): assert torch.allclose(a, b, rtol=0, atol=1e-12), (a - b).abs().max()
print("five stages == plain loop over experts: outputs and gradients agree to 1e-12 in float64")

# %% [markdown]
# Every token routed to one expert: the other experts get zero rows, and the grouped compute must still
# place every row correctly.

# %%
skewed = ToyMoE(H, E, 1).double()
with torch.no_grad(): skewed.router.zero_(); skewed.router[2] = 50.0  # positive inputs all prefer expert 2
hp = torch.rand(B, S, H, dtype=torch.float64) + 0.1
out, (r,) = run_layers([skewed], hp, torch.arange(S), LocalDispatcher(E))
assert r.counts.tolist() == [0, 0, B * S, 0]
assert torch.allclose(out, skewed.reference(hp), rtol=0, atol=1e-12)
print("all tokens on one expert:", r.counts.tolist())

# %% [markdown]
# ## Initialisation that does not depend on the layout
#
# A 30B-parameter model does not fit one GPU in float32, so the trainer builds it on the **meta device**
# (shapes only, no memory), drops the layers and experts that other ranks own, and only then allocates this
# rank's parameters and initialises them. For that to give the same model as building it whole, a parameter's
# random values must not depend on which other parameters exist or in what order they are drawn: with one
# global generator, dropping layer 3 would shift every draw after it.
#
# `SeededInit` gives each parameter its own generator, seeded from (seed, the parameter's name) — names are
# stable, since pipeline stages keep the absolute layer keys — and each expert of a stacked `(E, ...)` expert
# tensor its own, from (seed, name, global expert index). An `experts` module that holds a slice of the experts
# says where it starts in its `first_expert` attribute (set by `engine/31_ep`'s `shard_experts`). The models'
# `init_weights(seed)` draw every random matrix through it; on the meta device it draws nothing.

# %%
#| export
class SeededInit:
    "N(0, σ) or U(a, b) draws keyed by (seed, parameter name[, global expert index]), the same however the model is cut."

    def __init__(self, model: torch.nn.Module, seed: int):
        self.seed = seed
        self.names = {id(p): n for n, p in model.named_parameters()}   # tied weights: their first name
        self.first = {id(p): getattr(m, "first_expert", 0)            # stacked expert tensors: first global index
                      for name, m in model.named_modules() if name.split(".")[-1] == "experts"
                      for p in m.parameters(recurse=False)}

    def _generator(self, p: Tensor, *key) -> torch.Generator:
        digest = hashlib.sha256("/".join(map(str, (self.seed, *key))).encode()).digest()
        return torch.Generator(p.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    @torch.no_grad()
    def normal_(self, p: Tensor, std: float) -> Tensor:
        "Fill `p` with N(0, std) draws of its own; a no-op on the meta device."
        if p.is_meta:
            return p
        name = self.names[id(p)]
        if id(p) in self.first:
            for e in range(p.shape[0]):
                p[e].normal_(0, std, generator=self._generator(p, name, self.first[id(p)] + e))
        else:
            p.normal_(0, std, generator=self._generator(p, name))
        return p

    @torch.no_grad()
    def uniform_(self, p: Tensor, low: float, high: float) -> Tensor:
        "Fill `p` (not a stacked expert tensor) with U(low, high) draws of its own; a no-op on the meta device."
        if not p.is_meta:
            p.uniform_(low, high, generator=self._generator(p, self.names[id(p)]))
        return p

# %% [markdown]
# Every family's `init_weights` starts the same way, so that part lives here: norms to 1, `Linear` biases to 0,
# and the embedding and an untied head N(0, σ) — on the pipeline ranks that hold them (rank 0). It hands back
# the `SeededInit` with σ and σ/√(2L), for the family's own matrices.

# %%
#| export
@torch.no_grad()
def init_shared(model: torch.nn.Module, seed: int | None, norm_type: type) -> tuple[SeededInit, float, float]:
    """The start of every family's `init_weights`: `norm_type` weights to 1, Linear biases to 0, embedding and
    untied head N(0, σ) where present. `seed` defaults to torch's initial seed (`torch.manual_seed`).
    Returns (init, σ, σ/√(2L)) with σ = `config.initializer_range` and L the number of layers."""
    c = model.config
    init = SeededInit(model, torch.initial_seed() if seed is None else seed)
    std = c.initializer_range
    for m in model.modules():
        if isinstance(m, norm_type):
            m.weight.fill_(1.0)
        elif isinstance(m, torch.nn.Linear) and m.bias is not None:
            m.bias.zero_()
    if hasattr(model.model, "embed_tokens"):     # pipeline ranks other than 0 hold no embedding or head
        init.normal_(model.model.embed_tokens.weight, std)
    if not c.tie_word_embeddings and hasattr(model, "lm_head"):
        init.normal_(model.lm_head.weight, std)
    return init, std, std / math.sqrt(2 * c.num_hidden_layers)

# %% [markdown]
# Check: a toy model with a stacked expert tensor, initialised whole and as a slice of experts 2..3 that was
# built on the meta device, gets bitwise the same values for what both hold; another seed gives other values.

# %%
class ToyStack(nn.Module):
    def __init__(self, E, first=0):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.empty(E, 4, 3))
        self.experts.first_expert = first

    def init_weights(self, seed):
        init = SeededInit(self, seed)
        init.normal_(self.proj.weight, 0.02)
        init.normal_(self.experts.w, 0.02)

whole = ToyStack(4)
whole.init_weights(7)
with torch.device("meta"):
    part = ToyStack(2, first=2)
part.init_weights(7)                      # nothing to draw on meta
part.to_empty(device="cpu")
part.init_weights(7)
assert torch.equal(part.proj.weight, whole.proj.weight) and torch.equal(part.experts.w, whole.experts.w[2:])
other = ToyStack(4)
other.init_weights(8)
assert not torch.equal(other.experts.w, whole.experts.w) and abs(whole.experts.w.std().item() / 0.02 - 1) < 0.5
print("experts 2..3 built on meta and initialised alone == the same experts of the whole model")

# %% [markdown]
# ## The modules every family builds from
#
# The four families differ in attention, router and norms; the rest of a model is the same code, written once
# here:
#
# - `projection(in, out, bias)`: the one constructor of the dense projections (attention, dense and shared MLPs), a
#   `Projection`: an `nn.Linear` (same parameters, same state dict) that runs in FP8 when its `fp8` names a scaling.
#   `project(x, *projections)` runs the projections that read one input: each `F.linear`, or those in FP8 as one
#   FP8 layer over their stacked weights, the input quantized once (ops/15 "Dense projections"); `linear(x, w,
#   fp8)` is the same for a bare weight (MLA's up projection, which the ring hands around). A projection built with
#   `fp8=False` stays in the compute dtype (Qwen3.5's per-head gate inputs, a few dozen outputs wide that feed the
#   decay and the write strength directly: FP8 would save nothing there and round what sets the recurrence);
# - `MLP`: the dense SwiGLU MLP, `down_proj(silu(gate_proj(x)) · up_proj(x))` under transformers' names;
# - `Experts`: E SwiGLU experts as stacked `gate_up_proj (E, 2I, H)` and `down_proj (E, H, I)`, computed by
#   ops/18's `expert_mlp` on rows grouped by expert; with an FP8 scaling (`Options.fp8`) it keeps the step's FP8
#   weight copies (GPT-OSS's experts, with biases and a clamped SwiGLU, are its own); `reference` is the same
#   product written out per expert, for the families' `reference_forward`;
# - `route_ids`: the experts a router chooses, its top k or, with `Options.route = "round_robin"`, a fixed cycle
#   over the experts (token t's j-th choice is expert (t·k + j) mod E), for benchmarks that need a balanced load;
# - `RoutedLayer`: stages 3 and 5 of a decoder layer whose routed experts are `self.mlp.experts`: stage 3 runs
#   them, stage 5 adds the reduced rows to the residual. A family's `DecoderLayer` subclasses it and writes its
#   own `__init__` and `stage1`;
# - `CausalLM`: the model class of the protocol. It holds `config`, the inner `model` (a `DecoderStack`:
#   `embed_tokens`, the `layers` under their absolute keys, and the final `norm`, transformers' tree) and the
#   `lm_head`, tied to the embedding when `config.tie_word_embeddings`; it calls the family's `init_weights()`
#   once built, and gives `prolog`, `epilog`, `forward` (the five stages on one rank, `LocalDispatcher` over
#   `config.routed_experts`) and `num_params`. A family's `...ForCausalLM` subclasses it once, passing how to build
#   its layer `i`, its final norm and its `Options` (`CausalLM` sets `Options.fp8` on every `Projection` that
#   allows it and is at least `Options.fp8_dense_min` wide both ways),
#   and writes `init_weights`, `reference_forward`, `active_matmul_params` and
#   `flops_per_token`.

# %%
#| export
class Projection(nn.Linear):
    """`nn.Linear`, in FP8 when `fp8` names a scaling ('rows' or 'block'; `CausalLM` sets it from `Options.fp8`
    where `fp8_allowed`)."""
    fp8: str | None = None
    fp8_allowed: bool = True

    def forward(self, x: Tensor) -> Tensor:
        return project(x, self)[0]


def projection(in_features: int, out_features: int, bias: bool = False, fp8: bool = True) -> Projection:
    """A dense projection (attention, dense and shared MLPs): the one constructor of the dense projections. `fp8 =
    False`: it stays in the compute dtype under `Options.fp8`."""
    p = Projection(in_features, out_features, bias=bias)
    p.fp8_allowed = fp8
    return p


def linear(x: Tensor, weight: Tensor, fp8: str | None = None) -> Tensor:
    "`x @ weightᵀ`: `F.linear`, or with `fp8` a scaling the FP8 layer (ops/15 `fp8_linear`)."
    if not fp8:
        return F.linear(x, weight)
    from pith_lit.ops.fp8 import fp8_linear   # the FP8 path alone loads the FP8 kernels
    return fp8_linear(x, [weight], fp8)


def project(x: Tensor, *projections: Projection) -> tuple[Tensor, ...]:
    """The outputs of `projections` that read the same `x`: each `F.linear`, and those with `fp8` set as one FP8
    layer over their stacked weights (x quantized once, one GEMM), split back, each plus its bias."""
    stacked = [p for p in projections if p.fp8]
    if stacked:
        from pith_lit.ops.fp8 import fp8_linear
        ys = iter(fp8_linear(x, [p.weight for p in stacked], stacked[0].fp8).split([p.out_features for p in stacked],
                                                                                  -1))
    outs = []
    for p in projections:
        if p.fp8:
            y = next(ys)
            outs.append(y if p.bias is None else y + p.bias)
        else:
            outs.append(F.linear(x, p.weight, p.bias))
    return tuple(outs)


class MLP(nn.Module):
    "A dense SwiGLU MLP with three projections (a dense layer's MLP, a shared expert)."
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = projection(hidden, inter), projection(hidden, inter)
        self.down_proj = projection(inter, hidden)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    "E SwiGLU experts as stacked weights; `forward` takes rows grouped by expert, `counts` (E,) rows each."
    MUON_PARTS = {"gate_up_proj": (-2, False)}   # two matrices, gate's rows then up's (train/43)

    def __init__(self, num_experts: int, hidden: int, inter: int, fp8: str | None = None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.fp8_copies = Fp8Weights(fp8) if fp8 else None   # with an FP8 scaling: the step's FP8 weight copies

    def forward(self, x: Tensor, counts: Tensor, wgrad_queue=None) -> Tensor:
        "`wgrad_queue`: defer the weight gradients to the pipeline schedule's W slots (see ops/12_grouped_linear)."
        return expert_mlp(x, local(self.gate_up_proj), local(self.down_proj), counts, wgrad_queue, self.fp8_copies)

    def reference(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        "For tests: every expert on every token of x (..., H), weighted by `weights` where `ids` (..., k) chose it."
        out = torch.zeros_like(x)
        for e, (w_gate_up, w_down) in enumerate(zip(self.gate_up_proj, self.down_proj)):
            gate, up = (x @ w_gate_up.T).chunk(2, -1)
            out = out + (weights * (ids == e)).sum(-1, keepdim=True) * ((F.silu(gate) * up) @ w_down.T)
        return out


def route_ids(scores: Tensor, k: int, route: str) -> Tensor:
    "The k experts of each row of `scores` (T, E): its top k ('learned'), or a fixed cycle ('round_robin', Options)."
    if route == "round_robin":
        T, E = scores.shape
        return (torch.arange(T * k, device=scores.device) % E).view(T, k)
    return scores.topk(k, -1).indices


class RoutedLayer(nn.Module):
    "Stages 3 and 5 of a decoder layer whose routed experts are `self.mlp.experts`; a family writes `stage1`."
    def stage3(self, x: Tensor, counts: Tensor, wgrad_queue=None) -> Tensor:
        "Rows grouped by local expert, `counts` (E_local,) -> expert outputs, same rows."
        return self.mlp.experts(x, counts, wgrad_queue)

    def stage5(self, h: Tensor, y: Tensor) -> Tensor:
        "h + y: the residual plus each token's router-weighted sum of its experts' outputs, (T, H) -> (B, S, H)."
        return h + y.view(h.shape)


class DecoderStack(nn.Module):
    "Transformers' inner model: `embed_tokens`, `layers` keyed by absolute index (`layer(i)` builds one), `norm`."
    def __init__(self, c, layer, norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleDict({str(i): layer(i) for i in range(c.num_hidden_layers)})
        self.norm = norm


class CausalLM(nn.Module):
    """A family's model class: `config`, the inner `model` (a `DecoderStack` of the family's `layer(i)` and final
    `norm`), `lm_head`, the five stages."""
    def __init__(self, config, layer, norm: nn.Module, options: Options = Options()):
        super().__init__()
        self.config, self.model = config, DecoderStack(config, layer, norm)
        for m in self.model.modules():   # Options.fp8: the dense projections that allow it and are wide enough
            if isinstance(m, Projection) and m.fp8_allowed:
                wide = min(m.in_features, m.out_features) >= options.fp8_dense_min
                m.fp8 = options.fp8 if wide else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights()

    def prolog(self, input_ids: Tensor) -> Tensor:
        "input_ids (B, S) -> h (B, S, H)."
        return self.model.embed_tokens(input_ids)

    def epilog(self, h: Tensor) -> Tensor:
        "h (B, S, H) -> logits (B, S, vocab)."
        return self.lm_head(self.model.norm(h))

    def forward(self, input_ids: Tensor, positions: Tensor | None = None) -> tuple[Tensor, list]:
        "The five-stage forward on one rank: (logits, one Routing per layer, None for a dense layer)."
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h, routings = run_layers(self.model.layers.values(), self.prolog(input_ids), positions,
                                 LocalDispatcher(self.config.routed_experts))
        return self.epilog(h), routings

    def num_params(self) -> int:
        "All parameters, a tied embedding counted once."
        return sum(p.numel() for p in self.parameters())

# %% [markdown]
# Check: the round-robin cycle and the learned top-k; `Experts.reference` against the grouped computation, on
# rows sorted by expert.

# %%
assert route_ids(torch.zeros(3, 4), 2, "round_robin").tolist() == [[0, 1], [2, 3], [0, 1]]
assert route_ids(torch.tensor([[0.1, 0.7, 0.2]]), 2, "learned").tolist() == [[1, 2]]
torch.manual_seed(0)
ex = Experts(3, 8, 5).double()
with torch.no_grad():
    for w in ex.parameters(): w.normal_()
xe, ids = torch.randn(6, 8, dtype=torch.float64), torch.tensor([[0], [2], [2], [1], [0], [2]])
order = ids.flatten().argsort(stable=True)
grouped = ex(xe[order], torch.bincount(ids.flatten(), minlength=3))
ref = ex.reference(xe, torch.ones(6, 1, dtype=torch.float64), ids)
assert torch.allclose(grouped, ref[order], rtol=0, atol=1e-10), (grouped - ref[order]).abs().max()

# %% [markdown]
# ## What the families share with the planner and the Hugging Face conversion
#
# Each family's notebook also says, in plain functions under the same names in every family (models/29_family
# finds a family's module by its `model_type`), what its layers keep from forward to backward, for the planner of
# engine/37, and how its `Config` reads from and writes to a Hugging Face config.json, for train/46. The byte counts
# of the operators every family uses are written once, here, per token, with `b` the compute dtype's bytes and `f`
# the bytes of the float32 that norms and routers compute in (wider for a float64 model):
#
# - an **RMSNorm** in eager mode keeps a float32 copy of its input (when the input is narrower), its reciprocal
#   root per row and the normalised rows (in the compute dtype, or in float32 where the gain is float32, as GPT-OSS's
#   and Qwen3.5's are); compiled, only the reciprocal roots and, where nothing else keeps it, the norm's input: the
#   rest is recomputed in backward;
# - a **SwiGLU MLP** keeps the gate and up projections, the SiLU and the product (eager) or three of the four
#   (compiled);
# - a **router** keeps its float32 probabilities, the chosen ids and the top-k weights, and what the family's
#   router adds.

# %%
#| export
def norm_bytes(n: int, b: int, f: int, compiled: bool, fp32_gain: bool = False, groups: int = 1,
               keep_input: int = 0) -> float:
    """Bytes per token an RMSNorm over `n` channels (`groups` rows per token) keeps: eager, the float32 copy, the
    reciprocal roots and the normalised rows; compiled, the roots and `keep_input` (its input, where nothing else
    keeps it)."""
    if compiled:
        return f * groups + keep_input
    return (f * n if b < f else 0) + f * groups + (f if fp32_gain else b) * n


def mlp_bytes(inter: int, b: int, compiled: bool) -> float:
    "Bytes per token a SwiGLU MLP of width `inter` keeps: gate, SiLU, up and product (eager); three of them compiled."
    return (3 if compiled else 4) * b * inter


def router_bytes(E: int, k: int, b: int, f: int, extra: float = 0.0) -> float:
    "Router probabilities (float32), chosen ids (int64), top-k weights; `extra`: what a family's router adds."
    return f * E + 8 * k + b * k + extra

# %% [markdown]
# A config.json spells RoPE one of two ways: `rope_theta` + `rope_scaling` (the published checkpoints,
# transformers 4.x) or one `rope_parameters` dict (transformers 5.x), and some keys are null where our `Config` holds
# a number (`q_lora_rank: null` is no low-rank query path, our 0). `hf_rope` and `hf_or` read both, for the
# families' `from_hf`.

# %%
#| export
def hf_or(hf: dict, key: str, if_null):
    "config.json's value for `key`, `if_null` where it is null; None (reported as missing) where it is absent."
    return hf[key] if hf.get(key) is not None else (if_null if key in hf else None)


def hf_rope(hf: dict) -> tuple[float | None, str, dict]:
    "RoPE in either spelling -> (rope_theta, the RoPE type, its other parameters)."
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta"))
    kind = rope.pop("rope_type", None)
    kind = rope.pop("type", None) or kind or "default"  # 4.x spelled it `type`; 5.x writes both
    return None if theta is None else float(theta), kind, rope

# %%
assert norm_bytes(8, 2, 4, False) == 4 * 8 + 4 + 2 * 8 and norm_bytes(8, 2, 4, True, keep_input=16) == 4 + 16
assert norm_bytes(8, 4, 4, False, fp32_gain=True, groups=2) == 4 * 2 + 4 * 8   # float32 input: no copy
assert mlp_bytes(10, 2, False) == 80 and router_bytes(4, 2, 2, 4, 1.0) == 16 + 16 + 4 + 1
assert hf_rope({"rope_theta": 10, "rope_scaling": {"type": "yarn", "factor": 4}}) == (10.0, "yarn", {"factor": 4})
assert hf_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5}}) == (5.0, "default", {})
assert (hf_or({"a": None}, "a", 0), hf_or({"a": 3}, "a", 0), hf_or({}, "a", 0)) == (0, 3, None)
