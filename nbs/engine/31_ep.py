# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Expert parallelism
#
# With expert parallelism (EP) the E routed experts of every MoE layer are divided among the `ep` ranks of a
# group: rank r owns the E/ep consecutive experts `[r·E/ep, (r+1)·E/ep)`, and every rank runs everything else
# (attention, router, norms) on its own tokens. Stages 2 and 4 of the layer protocol (models/protocol) become
# all-to-alls: **dispatch** sends each token's hidden row to the ranks that own its experts, and **combine**
# brings the expert outputs back.
#
# The idea that matters for bandwidth is **deduplication**, both ways. A token whose top-k experts include
# several on the same rank is sent to that rank *once*; the receiving rank copies the row to each of its (token,
# expert) pairs locally, where copies cost memory bandwidth instead of network bandwidth. On the way back the
# expert rank weights the outputs of a token's pairs by their router weights and **sums them before sending**,
# so one row per (token, rank) returns, and the home rank only adds the rows from its token's ranks. That needs
# the router weights on the expert rank (they travel with the rows, k floats each) and their gradient sent back
# (through the same exchange's backward). With Qwen3-30B-A3B's top-8 of 128 experts at ep = 2, a token has on
# average four experts on the other rank but crosses once each way.
#
# The sizes of an uneven all-to-all must be known on the host, and there are two ways to get them, with
# different costs; each is a dispatcher class, and both keep the protocol's four calls:
#
# | dispatcher | sizes | host | expert buffers |
# |---|---|---|---|
# | `EPDispatcher` | exchanged counts | one synchronisation per layer and micro-batch | about T·k rows |
# | `SyncFreeEPDispatcher` | bounds: T rows to every rank | never waits | ep·T·k rows |
#
# On two H200s the sync-free one was 5% faster on the Qwen3 bench at ep 2 and cost 7–13 GiB more memory
# (benchmarks/RESULTS.md, "Sync-free dispatch"): `parallel.ep_sync_free` chooses.
#
# | step | call | stream | what |
# |---|---|---|---|
# | counts exchange | `exchange_counts` (counted only) | communication | an all-to-all of (rows, pairs per expert) per rank pair |
# | rows out | `dispatch` | communication | gather each token once per destination rank, all-to-all the rows with their slots and weights |
# | expand | `expand` | compute | on the expert rank: copy rows to (token, expert) pairs, grouped by local expert |
# | weighted sum | `reduce` | compute | on the expert rank: per received row, Σ weight · output over its pairs there |
# | outputs back | `combine` | communication | one row per (token, rank) to the home rank, which adds them up |
#
# Around the dispatchers: `shard_experts` and `is_expert_param` (which parameters live where) and
# `all_reduce_grads` (the gradient rule). The checks with several processes against one are in engine/39.

# %%
#| default_exp engine.ep

# %%
#| export
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pith_lit.models.protocol import Routing
from pith_lit.ops.permute import gather_rows, sort_by_expert, weighted_gather

# %%
#| hide
import copy

from pith_lit.models.protocol import LocalDispatcher
from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM

torch.manual_seed(0)

# %% [markdown]
# ## 1. The all-to-all as an autograd function
#
# `dist.all_to_all_single(out, x, recv_splits, send_splits)` sends `send_splits[i]` rows of `x` to rank i and
# receives `recv_splits[i]` rows from it. Its backward is the same exchange in reverse (splits swapped), and
# `all_to_all` wraps the pair as one differentiable call. On CUDA the exchange runs on NCCL's stream, and the
# calling stream waits for it without blocking the host; on gloo it blocks the host. Every rank of the group must
# make the same exchanges in the same order, forward and backward: an output that receives no gradient on one
# rank would leave the others waiting in backward.

# %%
#| export
def _exchange(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    "Exchange the rows of `x`: `send[i]` to rank i, `recv[i]` from it; differentiable (backward sends them back)."
    if len(send) != group.size() or len(recv) != group.size() or sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all: send {send} and recv {recv} need one entry per rank of a group of "
                         f"{group.size()}, and send must sum to the {x.shape[0]} rows of x")
    return _AllToAll.apply(x, list(send), list(recv), group)

# %% [markdown]
# The checks in this notebook run in a one-rank gloo group; the multi-rank checks are in engine/39.

# %%
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
solo = dist.group.WORLD

xa = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
out = all_to_all(xa * 2, [5], [5], solo)
assert torch.equal(out, xa * 2)
g = torch.randn(5, 3, dtype=torch.float64)
out.backward(g)
assert torch.equal(xa.grad, 2 * g)

# %% [markdown]
# ## 2. The plan: who sends what
#
# Rank r holds T tokens with top-k ids `ids (T, k)`. With L = E/ep experts per rank, pair (t, j) goes to rank
# `dest = ids // L`. Token t sends **one row to each distinct rank in `dest[t]`**: the boolean `sends (T, ep)`.
#
# **Counted sizes (`EPDispatcher`).** An uneven all-to-all needs its split sizes on the host (NCCL takes them as
# Python ints, and the receive buffer must be allocated with its size), and the receive sizes are known only to
# the senders. So the counts go first: for every ordered pair of ranks a fixed-size record, the number of rows
# and the number of (token, expert) pairs per expert of the receiver, `(ep, 1 + L)` int64 values. That exchange
# has equal splits and needs nothing on the host. Then **one** copy to the host brings every size this
# micro-batch needs; combine and both backward exchanges reuse them, and every index is computed with sizes
# already on the host (`torch.nonzero_static` instead of `nonzero`, which would sync again). `exchange_counts`
# queues the counts exchange and an asynchronous copy into pinned host memory and returns; `dispatch` waits for
# the copy (a CUDA event). The overlapped schedule (engine/32_stages) makes the counts a communication step of
# their own (`counts_step`), so that another micro-batch's compute is queued before the host blocks.
#
# **Bounded sizes (`SyncFreeEPDispatcher`).** When the host blocks on the sizes, everything it had queued runs
# out, and after the sync the GPU waits for each new launch until the host is ahead again (engine/34_overlap
# measures this as idle time). Every size can instead be a bound known in advance. A token sends at most one row
# to each rank, so each rank sends a block of exactly T rows to every rank: first the rows of the tokens that go
# there (in token order), then zero rows whose slots all say "elsewhere". The exchanges have equal splits and
# need no counts. On the expert rank the sort of all ep·T·k received slots puts this rank's pairs first, and the
# grouped buffer keeps all ep·T·k rows: the real pairs (their number stays on the GPU, in `counts`), then rows
# that copy nothing and that no one reads (`grouped_linear` leaves rows after its last group alone, ops/12). The
# cost is memory and bytes: a block travels whole (at ep = 2 with top-8, 99.6% of tokens have an expert on the
# other rank, so almost nothing is padding; at ep = 8 about a third is).
#
# **What travels with a row.** Its **slots**, `(k,)`: the receiver's local expert index for each of the token's
# k choices that live on the receiver, and L ("elsewhere") for the others; and the k router weights of those
# choices (0 elsewhere), in the same float32 buffer (slot ids below 2^24 are exact in float32), so the exchange
# is differentiable in them. That is 8k bytes per row against 2H for a bf16 row (1.6% at Qwen3-30B's H = 2048,
# k = 8).
#
# **Orders.** Every buffer keeps one order, so that no extra index has to travel:
#
# - the send buffer is sorted by destination rank, tokens in order within a rank;
# - the received rows are therefore in (source rank, token) order; `sort_by_expert` of their slots (L is one
#   extra group that sorts last and is dropped) gives `expand_rows`, the received row each grouped pair copies,
#   and `pair_row[r, j]`, the grouped row of received row r's slot j (-1 elsewhere), through which `expand`'s
#   backward sums each received row's pairs without a sort;
# - `reduce` is `weighted_gather(y, pair_row, weights)`: per received row the weighted sum of its pairs, with
#   the weights' gradient in its backward; combine sends each source rank one row per row it received, in the
#   received order, so the home rank gets back exactly the layout it sent;
# - `plan.home[t, d]` is token t's row for rank d in that layout (-1 if none), and `weighted_gather` with unit
#   weights adds a token's rows (fp32 accumulation, -1 adds nothing).

# %%
#| export
@dataclass
class Traffic:
    "Bytes a dispatcher sent to *other* ranks in forward (backward sends the same amounts back), summed over calls."
    dispatch: int = 0                  # hidden rows of dispatch: one per (token, destination rank)
    dispatch_undeduplicated: int = 0   # what one row per (token, expert) pair would have been (counted only)
    dispatch_meta: int = 0             # the slots and weights sent with the rows, and the counts exchange
    combine: int = 0                   # the summed rows of combine: one per (token, rank)
    calls: int = 0


@dataclass(eq=False)
class EPCounts:
    "The counts exchange of one micro-batch, launched by `exchange_counts` and not yet read on the host."
    dest: Tensor                 # (T, k) rank of each pair's expert
    sends: Tensor                # (T, ep) bool: token t sends a row to rank d
    host: Tensor                 # sizes, on the host (pinned) once `ready` has fired
    ready: object = None         # the CUDA event after the copy to the host; None on the CPU


@dataclass(eq=False)
class EPPlan:
    "What dispatch learned about one micro-batch's routing, kept on the Routing until combine."
    rows_in: list[int]           # token rows received from each rank: combine sends as many back
    rows_out: list[int]          # token rows sent to each rank: combine receives as many
    home: Tensor                 # (T, ep) row of the sent buffer for (token, rank), -1 if none
    expand_rows: Tensor          # (N,) the received row of each grouped pair (-1: a row that copies nothing)
    pair_row: Tensor             # (R, k) grouped row of each received slot, -1 if elsewhere
    weights: Tensor              # (R, k) float32 router weights of the received slots (0 elsewhere)
    counts: Tensor               # (L,) pairs per local expert

# %% [markdown]
# ## 3. The dispatchers
#
# Both keep the protocol's calls (models/protocol): `dispatch` and `combine` exchange rows, `expand` and `reduce`
# permute and sum them on the expert rank. The plan travels on the `Routing` of the micro-batch
# (`routing.plan`), so several micro-batches can be in flight at once. `traffic` counts the bytes sent to other
# ranks; the sync-free dispatcher counts the whole blocks, what really travels, and leaves
# `dispatch_undeduplicated` at 0 (counting it would need the sizes on the host).

# %%
#| export
class EPDispatcher:
    """Stages 2 and 4 across the ranks of `group` (the ep group); rank r owns experts [r·L, (r+1)·L), L = E/size.
    Split sizes are exchanged (`exchange_counts`) and read on the host once per layer and micro-batch."""
    counts_step = True

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group, self.size, self.rank = group, group.size(), group.rank()
        if num_experts % self.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {self.size}; "
                             "choose parallel.ep among the divisors of the model's num_experts")
        self.num_experts, self.local = num_experts, num_experts // self.size
        self.traffic = Traffic()

    def _route(self, routing: Routing) -> tuple[Tensor, Tensor]:
        "(dest (T, k) rank of each pair's expert, sends (T, ep)); sets `routing.counts` without a host sync."
        ids = routing.ids
        dest, flat = ids // self.local, ids.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
        routing.counts = counts.scatter_add_(0, flat, torch.ones_like(flat))   # not bincount: that syncs on CUDA
        sends = torch.zeros(ids.shape[0], self.size, dtype=torch.bool, device=ids.device).scatter_(1, dest, True)
        return dest, sends

    def exchange_counts(self, routing: Routing) -> None:
        "Launch the counts exchange and its copy to the host without waiting for either; `dispatch` waits."
        W, L = self.size, self.local
        dest, sends = self._route(routing)
        rows_out, pairs = sends.sum(0), routing.counts.view(W, L)
        meta = torch.cat([rows_out[:, None], pairs], 1)            # to rank d: rows, then pairs per its experts
        meta_in = torch.empty_like(meta)
        dist.all_to_all_single(meta_in, meta, group=self.group)    # equal splits: no sizes needed on the host
        sizes, ready = torch.cat([rows_out, pairs.sum(1), meta_in.flatten()]), None
        if sizes.is_cuda:   # into pinned memory, asynchronously; `ready` marks the copy done
            host = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True)
            host.copy_(sizes, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = sizes
        routing.plan = EPCounts(dest, sends, host, ready)

    def dispatch(self, x: Tensor, routing: Routing) -> Tensor:
        "Wait for the counts on the host (the one host sync; exchanged first if not yet), then exchange the rows."
        if not isinstance(routing.plan, EPCounts):
            self.exchange_counts(routing)
        W, L, c, T = self.size, self.local, routing.plan, x.shape[0]
        if c.ready is not None:
            c.ready.synchronize()
        sizes = c.host.tolist()                                    # the host sync
        rows_out, pairs_out, got = sizes[:W], sizes[W:2 * W], sizes[2 * W:]
        rows_in = got[::L + 1]
        dest_tok = torch.nonzero_static(c.sends.T, size=sum(rows_out))  # (S, 2): (rank, token), by rank, token
        d, t = dest_tok[:, 0:1], dest_tok[:, 1]
        meta = self._meta(routing, t, d, c.dest[t] == d)
        order = c.sends.T.flatten().cumsum(0).view(W, T) - 1     # row of the sent buffer for (rank, token)
        home = torch.where(c.sends.T, order, -1).T.contiguous()
        others = [i for i in range(W) if i != self.rank]
        self._count(x, meta, sum(rows_out[i] for i in others), sum(pairs_out[i] for i in others))
        self.traffic.dispatch_meta += (W - 1) * (1 + L) * 8        # the counts exchange
        return self._exchange_rows(gather_rows(x, t), meta, rows_out, rows_in, home, sum(got) - sum(rows_in),
                                   routing)

    def _meta(self, routing: Routing, t: Tensor, d: Tensor, there: Tensor) -> Tensor:
        """What travels with the rows of tokens `t` to ranks `d` ((S, 1)), `there` (S, k) marking the choices whose
        expert lives on `d`: each choice's local slot (L: elsewhere), then the choices' router weights (0
        elsewhere), in one float32 (or wider) buffer, differentiable in the weights."""
        slots = torch.where(there, routing.ids[t] - d * self.local, self.local)
        wide = torch.promote_types(routing.weights.dtype, torch.float32)   # slot ids are exact in float32
        return torch.cat([slots.to(wide), torch.where(there, routing.weights[t].to(wide), 0.0)], 1)

    def _count(self, x: Tensor, meta: Tensor, rows: int, pairs: int = 0) -> None:
        "Add one dispatch of `rows` rows (and `pairs` undeduplicated pairs) to other ranks to `traffic`."
        tr = self.traffic
        tr.dispatch += rows * x.shape[1] * x.element_size()
        tr.dispatch_undeduplicated += pairs * x.shape[1] * x.element_size()
        tr.dispatch_meta += rows * meta.shape[1] * meta.element_size()
        tr.calls += 1

    def _exchange_rows(self, rows: Tensor, meta: Tensor, send: list[int], recv: list[int], home: Tensor,
                       pairs: int, routing: Routing) -> Tensor:
        "Exchange the rows and their slots; sort the received slots by local expert into `routing.plan`."
        x_in, meta_in = all_to_all(rows, send, recv, self.group), all_to_all(meta, send, recv, self.group)
        L, k = self.local, routing.ids.shape[1]
        slots = meta_in[:, :k].long()
        src_row, grouped_row, counts = sort_by_expert(slots, L + 1)   # slot L ("elsewhere") sorts last
        routing.plan = EPPlan(recv, send, home, self._expand_rows(src_row, counts, pairs),
                              torch.where(slots < L, grouped_row, -1), meta_in[:, k:], counts[:L])
        return x_in

    def _expand_rows(self, src_row: Tensor, counts: Tensor, pairs: int) -> Tensor:
        "The received row of each grouped pair: this rank's `pairs` pairs, the slots elsewhere sorted after them."
        return src_row[:pairs]

    def expand(self, rows: Tensor, routing: Routing) -> tuple[Tensor, Tensor]:
        "The received rows as (token, expert) pairs grouped by local expert, and the pairs per local expert."
        return gather_rows(rows, routing.plan.expand_rows, routing.plan.pair_row), routing.plan.counts

    def reduce(self, y: Tensor, routing: Routing) -> Tensor:
        "Per received row, the router-weighted sum of its pairs' outputs: what combine sends back."
        return weighted_gather(y, routing.plan.pair_row, routing.plan.weights)

    def combine(self, rows: Tensor, routing: Routing) -> Tensor:
        "Return the summed rows to their home ranks and add up each token's rows there, (T, H). Drops the plan."
        plan, routing.plan = routing.plan, None
        out = all_to_all(rows, plan.rows_in, plan.rows_out, self.group)
        self.traffic.combine += rows.shape[1] * rows.element_size() * (sum(plan.rows_in) - plan.rows_in[self.rank])
        return weighted_gather(out, plan.home, torch.ones(plan.home.shape, device=out.device))


class SyncFreeEPDispatcher(EPDispatcher):
    """`EPDispatcher` with every exchange sized by its bound: T rows from each rank to each rank, ep·T·k grouped
    rows on the expert rank (this rank's pairs first). No counts exchange and no host synchronisation."""
    counts_step = False

    def dispatch(self, x: Tensor, routing: Routing) -> Tensor:
        "T rows to every rank: the rows for rank d first in block d, then zero rows whose slots say elsewhere."
        W, (T, k) = self.size, routing.ids.shape
        dest, sends = self._route(routing)
        dev = x.device
        rank_of_row = torch.arange(W, device=dev).repeat_interleave(T)[:, None]     # (W·T, 1) destination
        place = torch.where(sends.T, sends.T.cumsum(1) - 1, T)                      # (W, T) row in its block
        src = torch.full((W, T + 1), -1, dtype=torch.int64, device=dev)
        src.scatter_(1, place, torch.arange(T, device=dev).expand(W, T))            # column T collects the rest
        src = src[:, :T].flatten()                                                  # token of each sent row, or -1
        t = src.clamp(min=0)
        meta = self._meta(routing, t, rank_of_row, (dest[t] == rank_of_row) & (src >= 0)[:, None])
        home = torch.where(sends.T, place + torch.arange(W, device=dev)[:, None] * T, -1).T.contiguous()
        self._count(x, meta, T * (W - 1))              # what travels: whole blocks, padding included
        return self._exchange_rows(gather_rows(x, src), meta, [T] * W, [T] * W, home, W * T * k, routing)

    def _expand_rows(self, src_row: Tensor, counts: Tensor, pairs: int) -> Tensor:
        "Every slot gets a grouped row; those after this rank's pairs copy nothing (-1)."
        mine = torch.arange(src_row.numel(), device=src_row.device) < counts[:self.local].sum()
        return torch.where(mine, src_row, -1)

# %% [markdown]
# ### Check: one rank, against `LocalDispatcher`
#
# With one rank every pair stays home, and both dispatchers must reproduce the local permutation: the same grouped
# rows, counts and sums, and the same gradients through dispatch, a stand-in expert computation that also reads
# its counts, and combine. The sync-free one has T·k grouped rows (with one rank every slot is a real pair).

# %%
T, H, E, k = 12, 6, 4, 3
ids = torch.randn(T, E).topk(k, -1).indices
w = torch.rand(T, k, dtype=torch.float64)
xs = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
scale = torch.randn(1, H, dtype=torch.float64)

def through(dispatcher):
    wl = w.clone().requires_grad_()
    r = Routing(ids, wl, None)
    xg, c = dispatcher.expand(dispatcher.dispatch(xs, r), r)
    y = xg * scale + c.repeat_interleave(c)[:, None]            # an "expert" that sees its counts
    out = dispatcher.combine(dispatcher.reduce(y, r), r)
    gx, gw = torch.autograd.grad(out.square().sum(), [xs, wl])
    assert r.plan is None
    return xg, c, r.counts, out, gx, gw

local = through(LocalDispatcher(E))
for make in (EPDispatcher, SyncFreeEPDispatcher):
    d = make(solo, E)
    for a, b in zip(through(d), local):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert d.traffic.dispatch == d.traffic.combine == 0 and d.traffic.calls == 1   # nothing crossed to another rank

# %% [markdown]
# ## 4. Which parameters live where, and how their gradients are summed
#
# `shard_experts(model, ep_rank, ep_size)` replaces the stacked expert parameters of every module named
# `experts` (`gate_up_proj (E, 2I, H)`, `down_proj (E, H, I)`) by this rank's slice of E/ep experts, as new
# parameters (a copy, so the full tensor can be freed). A model built with the same seed on every rank and then
# sharded therefore holds exactly the single-process model's weights. `is_expert_param(name)` names them.
#
# The gradient rule, for a loss that is a **sum** over tokens divided by the global token count:
#
# - a non-expert parameter is replicated on every rank of `dense` (dp × cp × ep) and each rank's gradient
#   covers its own tokens: sum over `dense`;
# - an expert's gradient already includes every token of the ep group that chose it (they came through the
#   all-to-all, and their output gradients went back through it), so sum only over the replicas of that expert,
#   `expert` (dp × cp).
#
# `all_reduce_grads` does that with one flat all-reduce per group and dtype. A parameter without a gradient
# gets zeros first, so that every rank contributes the same flat buffer.

# %%
#| export
def is_expert_param(name: str) -> bool:
    "True for parameters of a routed-experts module (a module named `experts`), which EP shards."
    return "experts" in name.split(".")


@torch.no_grad()
def shard_experts(model: nn.Module, ep_rank: int, ep_size: int) -> nn.Module:
    "Keep experts [ep_rank·E/ep_size, (ep_rank+1)·E/ep_size) of every `experts` module; in place, returns `model`."
    for name, module in model.named_modules():
        if name.split(".")[-1] != "experts":
            continue
        for pname, p in list(module.named_parameters(recurse=False)):
            E = p.shape[0]
            if E % ep_size:
                raise ValueError(f"{name}.{pname} stacks {E} experts, not divisible by the expert-parallel size "
                                 f"{ep_size}; choose parallel.ep among the divisors of {E}")
            n = E // ep_size
            setattr(module, pname, nn.Parameter(p[ep_rank * n:(ep_rank + 1) * n].clone(), p.requires_grad))
            module.first_expert = ep_rank * n   # the global index of the first kept expert: SeededInit keys on it
    return model


def all_reduce_grads(model: nn.Module, dense: dist.ProcessGroup, expert: dist.ProcessGroup) -> None:
    "Sum gradients: expert parameters over `expert` (dp × cp), all others over `dense` (dp × cp × ep)."
    for group, experts in ((dense, False), (expert, True)):
        params = [p for n, p in model.named_parameters() if p.requires_grad and is_expert_param(n) == experts]
        if group.size() == 1 or not params:
            continue
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in sorted({p.grad.dtype for p in params}, key=str):   # same order on every rank
            grads = [p.grad for p in params if p.grad.dtype == dtype]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

# %%
tiny = Qwen3MoeForCausalLM(Config(vocab_size=32, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4))
full = copy.deepcopy(tiny)
shard_experts(tiny, 1, 2)
for (name, p), (_, q) in zip(tiny.named_parameters(), full.named_parameters()):
    if is_expert_param(name):
        assert p.shape[0] == 2 and torch.equal(p, q[2:4]), name
    else:
        assert torch.equal(p, q), name
assert sum(is_expert_param(n) for n, _ in tiny.named_parameters()) == 4      # 2 layers × (gate_up, down)
assert not is_expert_param("model.layers.0.mlp.shared_experts.gate_proj.weight")
try:
    shard_experts(copy.deepcopy(full), 0, 3)
    raise AssertionError("expected a ValueError")
except ValueError as err:
    assert "stacks 4 experts, not divisible by the expert-parallel size 3" in str(err)

# %% [markdown]
# ## 5. Several processes
#
# engine/39 runs these dispatchers on several processes against one: every skewed routing, both dispatchers,
# float32 and float64, with dp and ep; and measures the bytes deduplication saves at Qwen3-30B-A3B's shape.

# %%
dist.destroy_process_group()
