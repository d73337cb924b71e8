# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Five-stage execution
#
# With expert parallelism every MoE layer does two all-to-alls (dispatch and combine) in its forward and two more
# in its backward. Nothing else can happen on a GPU that waits for them, unless there is other work at hand: the
# forward of one micro-batch can compute while the all-to-all of another micro-batch's backward is in flight, and
# the other way round. DeepSeek-V3 builds its whole pipeline schedule on this.
#
# Plain autograd cannot do it: `loss.backward()` runs a micro-batch's whole backward in one call. So the engine
# runs each layer **stage by stage** (models/20_protocol: stage 1, dispatch, stage 3, combine, stage 5) and makes
# every stage boundary a **detach point**: a stage's inputs are fresh leaves that require grad, and its outputs
# are kept. The backward then runs one stage at a time, in reverse, handing gradients across each boundary
# explicitly with `torch.autograd.backward(outputs, grads)`: stage 5, combine, stage 3, dispatch, stage 1. Each of
# those ten pieces (five forward, five backward) is a **step** that runs either on the compute stream or, for
# dispatch and combine, on a communication stream. `run_steps` interleaves the steps of two micro-batches so each
# one's communication overlaps the other's compute.
#
# This notebook builds that machinery and checks it against plain autograd; engine/33_dualpipev puts it inside
# the DualPipeV pipeline schedule.

# %%
#| default_exp engine.stages

# %%
#| export
import functools

import torch
import torch.utils.checkpoint
from torch import Tensor

# %%
import copy

import torch.nn.functional as F

from pith_lit.models.protocol import LocalDispatcher, run_layers
from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM

# %% [markdown]
# ## Boundaries
#
# A detach point is `t.detach().requires_grad_()`: the next stage builds its graph on a new leaf, and after that
# stage's backward the leaf's `.grad` is the gradient to hand to the stage before. `_backward` runs autograd on the
# (output, gradient) pairs that take part: an output that does not require grad (a load-balance loss with
# coefficient 0) or a gradient that never arrived is skipped, as autograd itself would. Parameter gradients
# accumulate into `.grad` as usual.
#
# `_use` is about memory on a GPU. A tensor allocated on one stream and read on another must not be handed back to
# the caching allocator while the reader may still be using it; `record_stream` tells the allocator to wait for
# the reading stream's work first. Every step calls `_use` on the inputs it reads, so tensors that cross between
# the compute and the communication stream stay valid however early Python drops them. On the CPU it does nothing.

# %%
#| export
def new_leaf(t: Tensor) -> Tensor:
    "A stage boundary: the same values as a new leaf that requires grad."
    return t.detach().requires_grad_()


def _backward(outputs: list, grads: list) -> None:
    "`torch.autograd.backward` over the (output, grad) pairs where the output requires grad and the grad exists."
    pairs = [(o, g) for o, g in zip(outputs, grads) if o is not None and g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _use(*tensors) -> None:
    "Mark CUDA tensors as in use by the current stream, so their memory is not reused before it has read them."
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))

# %% [markdown]
# ## One layer, one micro-batch: `LayerRun`
#
# A `LayerRun` holds what a layer's backward needs between its forward and its backward. `forward(h, positions)`
# and `backward(grad)` are **generators of steps**: each yields `(kind, fn)`, where `kind` says which stream the
# step belongs to and `fn` does the work when called. Whoever drives the generator (`run_steps`, below) calls each
# `fn` before asking for the next step, which is why the forward can look at `self.routing` after stage 1 to learn
# whether the layer is dense (stage 1 did the whole layer; one step each way) or MoE (five steps each way).
#
# The boundaries of an MoE layer, and what crosses them:
#
# | step | reads (leaves) | keeps (outputs) | its backward hands back |
# |---|---|---|---|
# | stage 1 | `h_in` | `h`, `x`, `routing.weights`, the load-balance loss | `h_in.grad` |
# | dispatch | `x`, `w` | `xg_out` (the rows as received), `pw_out` (their router weights) | `x.grad`, `w.grad` |
# | stage 3 | `xg`, `pw` | `y_out` (per received row, the weighted sum of its experts' outputs) | `xg.grad`, `pw.grad` |
# | combine | `y` | `yc_out` (each token's sum, back home) | `y.grad` |
# | stage 5 | `h1`, `yc` | `h_out` | `h1.grad`, `yc.grad` |
#
# The router weights leave stage 1 as the leaf `w`, which replaces them on the routing record; they travel with
# the rows in dispatch (a no-op with one rank), and stage 3 reads them as the leaf `pw`. Stage 1's backward
# receives three gradients plus the load-balance loss, whose gradient is 1: the loss `aux_fn(key, routing)` joins
# stage 1's backward, as it would in one `loss.backward()`. Each backward step drops what the next one no longer
# needs.
#
# `wgrad_queue` is where the expert weight gradients of stage 3 go when a pipeline defers them to a W slot
# (zero-bubble scheduling; ops/12_grouped_linear's `WeightGradQueue`): the layer protocol's
# `stage3(x, counts, wgrad_queue)` hands it to the grouped expert linears, whose backward then computes only the
# input gradient and leaves the weight gradient in the queue until the schedule drains it.
#
# **What runs where.** The dispatch and combine steps only exchange rows. Stage 3 expands the received rows to
# (token, expert) pairs (`dispatcher.expand`) and, after the experts, sums each received row's pairs back into one
# row (`dispatcher.reduce`), on the compute stream. The reason is memory, not arithmetic: PyTorch's caching
# allocator keeps a pool per stream, and a block freed by one stream's tensors is not reused by another stream's
# allocations. The pair buffers (T·k rows, or ep·T·k with the sync-free dispatcher) and their gradients are the
# largest tensors of a layer; made in the communication steps, they filled a second pool of 37 GiB on an H200
# while the compute stream's pool ran out, and the allocator freed its cache and synchronised about ten times a
# step. Made in stage 3 they share the compute stream's pool (benchmarks/RESULTS.md,
# "Throughput on two H200s: expert parallelism and DualPipeV").

# %%
#| export
COMPUTE, COMM = "compute", "comm"   # the two kinds of step: which stream a step runs on


class LayerRun:
    """One decoder layer on one micro-batch, cut at the five stage boundaries: its forward and backward as steps.

    `forward(h, positions)` yields the forward steps; afterwards `h_out` is the layer's output. `backward(grad)`, with
    `grad` the gradient of `h_out`, yields the backward steps; afterwards `grad_in` is the gradient of `h`.
    A step is `(kind, fn)`: `kind` is COMPUTE or COMM, and the driver calls `fn()` before taking the next step.
    `aux_fn(key, routing) -> Tensor` (optional) is the load-balance loss term of this layer, added to the objective
    with gradient 1; `aux` holds it after stage 1 (None for a dense layer)."""

    def __init__(self, layer, key: str, dispatcher, aux_fn=None, wgrad_queue=None):
        self.layer, self.key, self.dispatcher, self.aux_fn = layer, key, dispatcher, aux_fn
        self.wgrad_queue = wgrad_queue
        self.aux = None

    def forward(self, h: Tensor, positions: Tensor):
        self.h_in, self.positions = new_leaf(h), positions
        yield COMPUTE, self._stage1
        if self.routing is not None:
            if self.dispatcher.counts_step:   # sizes across ranks first, rows after a switch
                yield COMM, self._counts
            yield COMM, self._dispatch
            yield COMPUTE, self._stage3
            yield COMM, self._combine
            yield COMPUTE, self._stage5

    def backward(self, grad: Tensor):
        self.g_out = grad
        if self.routing is not None:
            yield COMPUTE, self._stage5_backward
            yield COMM, self._combine_backward
            yield COMPUTE, self._stage3_backward
            yield COMM, self._dispatch_backward
        yield COMPUTE, self._stage1_backward

    # forward steps
    def _stage1(self):
        h, x, self.routing = self.layer.stage1(self.h_in, self.positions)
        if self.routing is None:                      # dense layer: stage 1 was the whole layer
            self.h_out, self.s1_out = h, [h]
            return
        if self.aux_fn is not None:
            self.aux = self.aux_fn(self.key, self.routing)
        self.s1_out = [h, x, self.routing.weights, self.aux]
        self.h1, self.x, self.w = new_leaf(h), new_leaf(x), new_leaf(self.routing.weights)
        self.routing.weights = self.w                 # dispatch sends these with the rows

    def _counts(self):
        self.dispatcher.exchange_counts(self.routing)

    def _dispatch(self):
        _use(self.x, self.w)
        self.xg_out = self.dispatcher.dispatch(self.x, self.routing)
        plan = self.routing.plan
        self.pw_out = plan.weights                    # the received rows' router weights: stage 3 applies them
        self.xg, self.pw = new_leaf(self.xg_out), new_leaf(self.pw_out)
        plan.weights = self.pw

    def _stage3(self):
        d, r = self.dispatcher, self.routing
        _use(self.xg, *(v for v in vars(r.plan).values() if isinstance(v, Tensor)))
        y = self.layer.stage3(*d.expand(self.xg, r), self.wgrad_queue)
        self.y_out = d.reduce(y, r)
        self.y = new_leaf(self.y_out)

    def _combine(self):
        _use(self.y)
        self.yc_out = self.dispatcher.combine(self.y, self.routing)
        self.yc = new_leaf(self.yc_out)

    def _stage5(self):
        _use(self.yc)
        self.h_out = self.layer.stage5(self.h1, self.yc)

    # backward steps, in the order they run
    def _stage5_backward(self):
        _backward([self.h_out], [self.g_out])
        self.h_out = self.g_out = None

    def _combine_backward(self):
        _use(self.yc.grad)
        _backward([self.yc_out], [self.yc.grad])
        self.yc_out = self.yc = None

    def _stage3_backward(self):
        _use(self.y.grad)
        _backward([self.y_out], [self.y.grad])
        self.y_out = self.y = None

    def _dispatch_backward(self):
        _use(self.xg.grad, self.pw.grad)
        _backward([self.xg_out, self.pw_out], [self.xg.grad, self.pw.grad])
        self.xg_out = self.xg = self.pw_out = self.pw = None

    def _stage1_backward(self):
        if self.routing is None:
            grads = [self.g_out]
        else:
            _use(self.x.grad, self.w.grad)
            one = None if self.aux is None else torch.ones_like(self.aux)
            grads = [self.h1.grad, self.x.grad, self.w.grad, one]
        _backward(self.s1_out, grads)
        self.grad_in = self.h_in.grad
        self.s1_out = self.h_in = self.g_out = self.h1 = self.x = self.w = None
        if self.aux is not None:
            self.aux = self.aux.detach()

# %% [markdown]
# The simplest driver calls the steps in order. One MoE layer, forward and backward step by step, must give the
# same output, input gradient and parameter gradients as plain autograd on `run_layers` (the five calls without
# detach points), with the load-balance loss added to the objective in both. The tiny model has a dense layer
# (layer 1) so both kinds of layer are covered below. Everything is float64 here, so any difference is in the
# order of additions, not in rounding of the inputs.

# %%
cfg = Config(vocab_size=64, hidden_size=32, moe_intermediate_size=16, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
             mlp_only_layers=[1])
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(cfg).double()
dispatcher = LocalDispatcher(cfg.num_experts)

def make_lb_loss(E: int):
    "A micro-batch load-balance loss, E · Σ_i f_i · P_i with coefficient 0.1 (train/42_load_balance's formula)."
    def lb_loss(key, routing):
        f = torch.bincount(routing.ids.flatten(), minlength=E) / routing.ids.numel()
        return 0.1 * E * (f * routing.probs.mean(0)).sum()
    return lb_loss

lb_loss = make_lb_loss(cfg.num_experts)

def grads_of(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

def max_rel(a: dict, b: dict) -> float:
    "Largest max|a - b| / max|b| over the tensors of two dicts with the same keys."
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in a)

# %%
layer, positions = model.model.layers["0"], torch.arange(8)
h = torch.randn(2, 8, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
g = torch.randn(2, 8, cfg.hidden_size, dtype=torch.float64)

out, routings = run_layers([layer], h, positions, dispatcher)       # plain autograd through the five calls
torch.autograd.backward([out, lb_loss("0", routings[0])], [g, None])
ref_params, ref_h = grads_of(layer), h.grad.clone()
layer.zero_grad(set_to_none=True)

run = LayerRun(layer, "0", dispatcher, lb_loss)
kinds = []
for kind, fn in run.forward(h, positions):
    fn()
    kinds.append(kind)
assert torch.equal(run.h_out, out) and kinds == [COMPUTE, COMM, COMPUTE, COMM, COMPUTE]
for kind, fn in run.backward(g):
    fn()
print("max relative difference, parameter grads:", max_rel(grads_of(layer), ref_params),
      " input grad:", max_rel({"h": run.grad_in}, {"h": ref_h}))
assert max_rel(grads_of(layer), ref_params) < 1e-12 and max_rel({"h": run.grad_in}, {"h": ref_h}) < 1e-12
model.zero_grad(set_to_none=True)

# %% [markdown]
# ## Recomputation
#
# A layer's forward keeps what its backward reads: the attention block's projections, norms and softmax
# statistics, the router's logits, and in stage 3 the grouped rows and the SwiGLU input of every expert. At long
# sequences and many micro-batches in flight that, not the weights, fills the GPU. `recompute_layers` trades compute
# for it, per layer, at stage granularity:
#
# - `"attention"` recomputes stage 1 (the attention block with its residual, the post-attention norm, the router;
#   a dense layer's MLP) in backward, keeping only its input;
# - `"layer"` recomputes stage 3 (the routed experts) as well, keeping only the dispatched rows.
#
# The exchanges (stages 2 and 4) are never recomputed: repeating an all-to-all costs the network, not a few
# matmuls, and its output is kept anyway as stage 3's input. Each recomputed stage is wrapped in PyTorch's
# non-reentrant `checkpoint`, which composes with the stage-by-stage backward (the recomputation runs when that
# stage's backward runs), with FSDP2 (its hooks sit outside the wrapped function, so the weights are gathered when
# the recomputation needs them), with the deferred weight gradients (a recomputed grouped linear queues its W
# as usual) and with `torch.compile`, which is applied to the wrapped stage.

# %%
#| export
def recomputed(fn):
    "`fn`, with its intermediate activations recomputed in backward instead of kept (non-reentrant checkpoint)."
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return run


def recompute_layers(layers, what: str) -> None:
    "Recompute, in place: 'none', 'attention' (stage 1 of every layer) or 'layer' (stages 1 and 3)."
    if what not in ("none", "attention", "layer"):
        raise ValueError(f"recompute = {what!r}: expected 'none', 'attention' or 'layer'")
    if what == "none":
        return
    for layer in layers:
        layer.stage1 = recomputed(layer.stage1)
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if what == "layer" and experts is not None:
            experts.forward = recomputed(experts.forward)

# %% [markdown]
# Check: the same layer run stage by stage with each setting gives the same gradients as plain autograd without
# recomputation, in float64, and keeps fewer bytes for backward. The bytes are counted with a saved-tensor hook
# over the forward, each storage once.

# %%
def kept_bytes_and_grads(what):
    m = copy.deepcopy(model)
    layer = m.model.layers["0"]
    recompute_layers([layer], what)
    seen = {}
    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    run = LayerRun(layer, "0", dispatcher, lb_loss)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _, fn in run.forward(h.detach(), positions):
            fn()
    for _, fn in run.backward(g):
        fn()
    return sum(seen.values()), grads_of(layer), run.grad_in

kept = {}
for what in ("none", "attention", "layer"):
    kept[what], grads, grad_in = kept_bytes_and_grads(what)
    assert max_rel(grads, ref_params) < 1e-12 and max_rel({"h": grad_in}, {"h": ref_h}) < 1e-12, what
print({k: f"{v / 1024:.1f} KiB" for k, v in kept.items()})
assert kept["none"] > kept["attention"] > kept["layer"]

# %% [markdown]
# ## Many layers, and two micro-batches at once: `run_steps`
#
# `forward_layers` and `backward_layers` chain the `LayerRun`s of a stack of layers into one generator: the output
# of one layer is the next one's input (another detach point), and the input gradient of one layer's backward is
# the output gradient of the layer before.
#
# `run_steps(streams, *tasks)` drives one or two such generators (tasks). It takes steps from the first task up to
# and including its next COMM step, then switches to the other task, and so on; a task that runs out leaves the
# rest to the other. With a backward task `b` and a forward task `f`, one MoE layer each, the issue order is
#
#     b.stage5_backward  b.combine_backward | f.stage1  f.dispatch | b.stage3_backward  b.dispatch_backward |
#     f.stage3  f.combine | b.stage1_backward  f.stage5
#
# so every all-to-all of one micro-batch is issued next to a compute step of the other, and across layer
# boundaries the same rule keeps pairing them. Across ranks (`EPDispatcher`), dispatch needs its split sizes on
# the host, so a forward layer has one more COMM step, `counts`, just before `dispatch`: the counts exchange is
# queued, the driver switches, the other micro-batch queues a compute step, and only then does `dispatch` block
# the host on the sizes, while the GPU still has that compute step to run. (That step is one expert backward, and
# on two H200s that is not enough: the host block still drains the GPU's queue. `SyncFreeEPDispatcher`
# never blocks and asks for no `counts` step, so the two tasks switch in lock step; see `uncovered` below,
# engine/31_ep and benchmarks/RESULTS.md.)
# On a GPU, COMPUTE steps run on `streams.compute` (the stream that
# was current when `Streams` was made) and COMM steps on `streams.comm`. Within a task each step waits for the
# task's previous step through a CUDA event (recorded after every step), so a task is a chain of dependencies
# alternating between the streams, while the two tasks run concurrently. Autograd runs each backward op on the
# stream of its forward op, so dispatch and combine also run their backward on the communication stream, and their
# forward must always be issued there, overlapped or not. The first step of a task waits for everything issued
# on the compute stream before the call (that is where its inputs come from), and when `run_steps` returns the
# compute stream has waited for the communication stream, so the caller can use every result on the compute stream.
# On the CPU (`Streams` of a CPU device) the same steps run in the same order, one after the other.

# %%
#| export
def forward_layers(runs: list[LayerRun], h: Tensor, positions: Tensor):
    "The forward steps of consecutive layers; the generator returns the last output (`h` itself if `runs` is empty)."
    for run in runs:
        yield from run.forward(h, positions)
        h = run.h_out
    return h


def backward_layers(runs: list[LayerRun], grad: Tensor):
    "The backward steps of `runs` in reverse; the generator returns the gradient of the first layer's input."
    for run in reversed(runs):
        yield from run.backward(grad)
        grad = run.grad_in
    return grad


class Streams:
    "The compute stream (current when made) and a communication stream, on a CUDA device; both None on the CPU."
    def __init__(self, device: torch.device):
        cuda = torch.device(device).type == "cuda"
        self.compute = torch.cuda.current_stream(device) if cuda else None
        self.comm = torch.cuda.Stream(device) if cuda else None


class _Task:
    "A generator of steps and the CUDA event of its last step."
    def __init__(self, steps, streams: Streams):
        self.steps = steps
        self.event = streams.compute.record_event() if streams.compute is not None else None

    def issue(self, streams: Streams, kind: str, fn) -> None:
        if streams.compute is None:
            fn()
            return
        stream = streams.comm if kind == COMM else streams.compute
        stream.wait_event(self.event)
        with torch.cuda.stream(stream):
            fn()
        self.event = stream.record_event()


def run_steps(streams: Streams, *tasks, trace: list | None = None) -> None:
    """Run the steps of one or two tasks, switching task after each COMM step (see above).
    `trace`, when given, receives `(task index, step name)` in issue order."""
    queue = [(i, _Task(t, streams)) for i, t in enumerate(tasks)]
    while queue:
        i, task = queue.pop(0)
        for kind, fn in task.steps:
            task.issue(streams, kind, fn)
            if trace is not None:
                trace.append((i, fn.__name__.lstrip("_")))
            if kind == COMM:
                queue.append((i, task))
                break
    if streams.comm is not None:
        streams.compute.wait_stream(streams.comm)


# %%
EXCHANGES = ("dispatch", "combine", "combine_backward", "dispatch_backward")   # the steps that move rows


def uncovered(trace: list) -> list[tuple[int, str]]:
    """The exchanges of a `run_steps` trace that no compute step of the other task follows before their own task's
    next compute step (which may need their result): nothing is issued to run beside them. Every other step
    name but `counts` is compute."""
    compute = lambda name: name not in EXCHANGES and name != "counts"
    return [(task, name) for i, (task, name) in enumerate(trace) if name in EXCHANGES
            and next((t for t, n in trace[i + 1:] if compute(n)), task) == task]

# %% [markdown]
# ### The whole model, stage by stage
#
# The embedding and the head sit outside the layers, behind detach points of their own: the embedding output
# `h0` is the first layer's input, and the loss is computed on a leaf copy of the last layer's output, so its
# backward hands `h_last.grad` to the layers and the layers hand `grad_in` back to the embedding. The objective is
# the trainer's (train/45_trainer): token cross-entropy summed over tokens, divided by the token
# count, plus every MoE layer's load-balance loss. Stage by stage must match one `loss.backward()` of the plain
# model, in float64 to 1e-12 and, for the record, in float32 to 1e-6.

# %%
def plain_step(model, ids, labels):
    "Plain autograd: the five calls without detach points, one backward."
    logits, routings = model(ids)
    aux = sum(lb_loss(k, r) for k, r in zip(model.model.layers.keys(), routings) if r is not None)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
    (loss + aux).backward()
    return loss.detach()

def staged_step(model, ids, labels, streams):
    runs = [LayerRun(layer, k, dispatcher, lb_loss) for k, layer in model.model.layers.items()]
    h0 = model.prolog(ids)
    run_steps(streams, forward_layers(runs, h0, torch.arange(ids.shape[1], device=ids.device)))
    h_last = new_leaf(runs[-1].h_out)
    loss = F.cross_entropy(model.epilog(h_last).flatten(0, 1).float(), labels.flatten(), reduction="sum")
    (loss / labels.numel()).backward()                       # head and loss: gives h_last.grad
    run_steps(streams, backward_layers(runs, h_last.grad))
    h0.backward(runs[0].grad_in)                             # the embedding
    return loss.detach() / labels.numel()

cpu = Streams(torch.device("cpu"))
ids, labels = torch.randint(0, cfg.vocab_size, (2, 2, 8))
for dtype, tol in [(torch.float64, 1e-12), (torch.float32, 1e-6)]:
    m = copy.deepcopy(model).to(dtype)
    ref_loss, ref = plain_step(m, ids, labels), grads_of(m)
    m.zero_grad(set_to_none=True)
    loss, got = staged_step(m, ids, labels, cpu), grads_of(m)
    print(f"{dtype}: loss {loss.item():.6f} (plain {ref_loss.item():.6f}); "
          f"max relative grad difference {max_rel(got, ref):.2e}; bitwise equal: {all(torch.equal(got[k], ref[k]) for k in ref)}")
    assert abs(loss - ref_loss) <= tol * abs(ref_loss) and max_rel(got, ref) <= tol
    assert len(got) == len(list(m.parameters()))            # every parameter got a gradient

# %% [markdown]
# ### The overlapped chunk
#
# Now the point of it all: the forward of micro-batch A interleaved with the backward of micro-batch B. The
# trace shows the issue order (task 0 is B's backward, task 1 is A's forward): B's combine and dispatch backward
# sit between A's compute steps and vice versa, and the dense layer 1 (one step each way) shifts the pairing
# without breaking it. On the CPU the result must be bitwise what running A's forward and then B's backward
# separately gives: the same operations in the same order per micro-batch, and parameter gradients are only
# touched by B.

# %%
def prepared_backward(model, ids, labels):
    "B's forward and loss backward, ready for its layer backward: (runs, gradient of the last layer output, h0)."
    runs = [LayerRun(layer, k, dispatcher, lb_loss) for k, layer in model.model.layers.items()]
    h0 = model.prolog(ids)
    run_steps(cpu, forward_layers(runs, h0, torch.arange(ids.shape[1])))
    h_last = new_leaf(runs[-1].h_out)
    F.cross_entropy(model.epilog(h_last).flatten(0, 1), labels.flatten(), reduction="sum").backward()
    return runs, h_last.grad, h0

idsA, idsB = torch.randint(0, cfg.vocab_size, (2, 2, 8))
results = []
for overlapped in (False, True):
    m = copy.deepcopy(model)
    runs_b, g_b, h0_b = prepared_backward(m, idsB, labels)
    m.zero_grad(set_to_none=True)                # only what B's layer backward adds is compared
    runs_a = [LayerRun(layer, k, dispatcher, lb_loss) for k, layer in m.model.layers.items()]
    trace = []
    fwd_a = forward_layers(runs_a, m.prolog(idsA), torch.arange(8))
    if overlapped:
        run_steps(cpu, backward_layers(runs_b, g_b), fwd_a, trace=trace)
    else:
        run_steps(cpu, fwd_a)
        run_steps(cpu, backward_layers(runs_b, g_b))
    results.append((runs_a[-1].h_out, runs_b[0].grad_in, grads_of(m)))

print(" ".join(f"{'BA'[i]}.{name}" for i, name in trace))
assert uncovered(trace) == [], uncovered(trace)
(h_seq, gin_seq, g_seq), (h_ovl, gin_ovl, g_ovl) = results
assert torch.equal(h_seq, h_ovl) and torch.equal(gin_seq, gin_ovl)
assert g_seq.keys() == g_ovl.keys() and all(torch.equal(g_seq[k], g_ovl[k]) for k in g_seq)
print("overlapped == forward then backward, bitwise")

# %% [markdown]
# `uncovered(trace)` lists the exchanges after which the other task issues no compute before their own task's next
# compute step: nothing is queued to run beside them, so on a GPU they are exposed. Above there are none: with
# two COMM steps per MoE layer each way, the tasks switch in lock step. A forward with one more COMM step per
# layer (the `counts` step of a dispatcher whose sizes travel to the host) drifts against the backward: the
# check below gives the local dispatcher such a step, which does nothing, and a part of the exchanges lose their
# partner: in a chunk of six MoE layers, 8 of the 24 exchanges. The sync-free dispatcher, which exchanges nothing
# before dispatch, asks for no such step (`counts_step` is False); its effect on two H200s is in
# benchmarks/RESULTS.md, "Sync-free dispatch".

# %%
class CountsFirst(LocalDispatcher):
    "The local dispatcher with an (empty) counts step before dispatch, as a dispatcher that syncs on sizes has."
    counts_step = True
    def exchange_counts(self, routing): pass

m = copy.deepcopy(model)
runs_b, g_b, _ = prepared_backward(m, idsB, labels)
drift = CountsFirst(cfg.num_experts)
runs_a = [LayerRun(layer, k, drift, lb_loss) for k, layer in m.model.layers.items()]
trace = []
run_steps(cpu, backward_layers(runs_b, g_b), forward_layers(runs_a, m.prolog(idsA), torch.arange(8)), trace=trace)
left = uncovered(trace)
n = sum(name in EXCHANGES for _, name in trace)
print(f"with a counts step: {len(left)} of {n} exchanges have no compute of the other task beside them: {left}")
assert left

# %% [markdown]
# ## On the GPU
#
# On CUDA the same check runs with real streams, in bf16 at a moderate size: the overlapped chunk must give the
# same A output, B input gradient and parameter gradients as the sequential one. They are the same kernels on the
# same data, so only atomics in the scatter-adds can make them differ, by a rounding. A profile then shows where
# the kernels ran: dispatch and combine (gathers here, with one GPU) on the second stream, beside the other
# micro-batch's compute. A real overlap of all-to-alls needs expert parallelism across GPUs.
#
# Two streams are not enough by themselves. The grouped GEMMs of stage 3 (`torch._grouped_mm`) are persistent
# kernels: one block per SM, each looping over tiles until the whole product is done, so a kernel queued on the
# communication stream (an index sort, a gather, NCCL's all-to-all) starts only when the GEMM ends. On two H200s
# that left most of the all-to-alls' transfer exposed although the issue order paired every one of them with
# compute. The trainer therefore sets torch's experimental SM carveout under DualPipeV at ep > 1
# (`parallel.comm_sms`, 16 by default): grouped GEMMs and cuBLAS matmuls then use all SMs but 16, and the
# communication side runs on those (benchmarks/RESULTS.md has the measurements).

# %%
#| cuda
def cuda_chunk(overlapped: bool, m, streams):
    "B's forward and loss backward, then A's forward and B's layer backward, overlapped or one after the other."
    runs_b = [LayerRun(layer, k, disp, big_lb) for k, layer in m.model.layers.items()]
    run_steps(streams, forward_layers(runs_b, m.prolog(idsB_c), pos_c))
    h_last = new_leaf(runs_b[-1].h_out)
    F.cross_entropy(m.epilog(h_last).flatten(0, 1).float(), idsA_c.flatten(), reduction="sum").backward()
    m.zero_grad(set_to_none=True)
    runs_a = [LayerRun(layer, k, disp, big_lb) for k, layer in m.model.layers.items()]
    fwd_a, bwd_b = forward_layers(runs_a, m.prolog(idsA_c), pos_c), backward_layers(runs_b, h_last.grad)
    if overlapped:
        run_steps(streams, bwd_b, fwd_a)
    else:
        run_steps(streams, fwd_a)
        run_steps(streams, bwd_b)
    torch.cuda.synchronize()
    return runs_a[-1].h_out, runs_b[0].grad_in, grads_of(m)

big = Config(vocab_size=1024, hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048,
             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=16,
             num_experts_per_tok=4, mlp_only_layers=[1])
torch.manual_seed(0)
gpu_model = Qwen3MoeForCausalLM(big).cuda().bfloat16()
big_lb, disp, gpu_streams = make_lb_loss(big.num_experts), LocalDispatcher(big.num_experts), Streams(torch.device("cuda"))
idsA_c, idsB_c = torch.randint(0, big.vocab_size, (2, 4, 1024), device="cuda")
pos_c = torch.arange(1024, device="cuda")
seq = cuda_chunk(False, copy.deepcopy(gpu_model), gpu_streams)
ovl = cuda_chunk(True, copy.deepcopy(gpu_model), gpu_streams)
print("GPU, overlapped vs sequential: A output equal:", torch.equal(seq[0], ovl[0]), "· B input grad equal:",
      torch.equal(seq[1], ovl[1]), f"· max relative parameter-grad difference {max_rel(ovl[2], seq[2]):.1e}")
assert max_rel({"h": ovl[0]}, {"h": seq[0]}) < 1e-2 and max_rel({"g": ovl[1]}, {"g": seq[1]}) < 1e-2
assert max_rel(ovl[2], seq[2]) < 1e-2

# %%
#| cuda
import json, tempfile
from torch.profiler import ProfilerActivity, profile

m = copy.deepcopy(gpu_model)
cuda_chunk(True, m, gpu_streams)                  # warm-up
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    cuda_chunk(True, m, gpu_streams)
trace_file = tempfile.mktemp(suffix=".json")
prof.export_chrome_trace(trace_file)
kernels = [e for e in json.load(open(trace_file))["traceEvents"] if e.get("cat") == "kernel"]
per_stream = {}
for e in kernels:
    per_stream.setdefault(e["args"]["stream"], []).append(e["name"])
for stream, names in per_stream.items():
    print(f"stream {stream}: {len(names)} kernels, e.g. {sorted(set(n[:40] for n in names))[:4]}")
assert len(per_stream) >= 2, "expected kernels on both the compute and the communication stream"
