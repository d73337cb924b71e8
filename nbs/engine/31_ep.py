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
# The one idea that matters for bandwidth is **deduplication**: a token whose top-k experts include several on
# the same rank is sent to that rank *once*; the receiving rank copies the row to each of its (token, expert)
# pairs locally, where copies cost memory bandwidth instead of network bandwidth. With Qwen3-30B-A3B's top-8 of
# 128 experts at ep = 2, a token has on average four experts on the other rank but needs to cross only once.
#
# Combine can be deduplicated the same way: the expert rank weights the outputs of a token's pairs by their
# router weights and **sums them before sending**, so one row per (token, rank) goes back instead of one per
# (token, expert) pair, and the home rank only adds the rows from its token's ranks. That needs the router
# weights on the expert rank (they travel with the slot ids, k floats per row) and their gradient sent back
# (through the same exchange's backward). At ep = 2 with top-8 it cuts combine's bytes by four.
#
# This notebook builds `EPDispatcher(group, num_experts, combine="sum")`, a drop-in for `LocalDispatcher`:
#
# | step | where | what |
# |---|---|---|
# | counts exchange | dispatch | an all-to-all of (rows, pairs per expert) per rank pair; **one host sync** |
# | rows out | dispatch | gather each token once per destination rank, all-to-all the rows (+ slot ids, weights) |
# | expand | dispatch | on the expert rank: copy rows to (token, expert) pairs, grouped by local expert |
# | weighted sum | combine | on the expert rank: per received row, Σ weight · output over its pairs there |
# | outputs back | combine | one row per (token, rank), all-to-all to the home rank, which adds them up |
#
# `combine="pairs"` is the undeduplicated return for comparison: one row per (token, expert) pair, and stage
# 5 weights and sums them through `routing.row_index` (the layer protocol's `expert_sum` handles both).
#
# and the pieces around it: `shard_experts` and `is_expert_param` (which parameters live where),
# `all_reduce_grads` (the gradient rule), and an exported self-check that runs the tiny Qwen3-MoE on several
# processes against a single-process run.

# %%
#| default_exp engine.ep

# %%
#| export
import argparse
import copy
import json
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pith_lit.engine.mesh import Mesh, build_mesh, init_distributed, run_ranked
from pith_lit.models.protocol import LocalDispatcher, Routing, run_layers
from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM, Router
from pith_lit.ops.permute import gather_rows, sort_by_expert, weighted_gather

# %%
#| hide
import os
import subprocess
import sys
from pathlib import Path

torch.manual_seed(0)

# %% [markdown]
# ## 1. The all-to-all as a pair of autograd functions
#
# `dist.all_to_all_single(out, x, recv_splits, send_splits, async_op=True)` sends `send_splits[i]` rows of `x`
# to rank i and receives `recv_splits[i]` rows from it, and returns a handle at once. Its backward is the same
# exchange in reverse (splits swapped). To let a scheduler do other work while the rows travel, the exchange is
# two autograd functions:
#
# - `all_to_all_start(x, send, recv, group) -> (out, handle)`: launches the exchange; `out` is **not valid yet**.
# - `all_to_all_wait(out, handle) -> out`: waits; from here `out` holds the received rows.
#
# Backward runs the mirror image: the wait's backward *launches* the reverse exchange of the gradient, and the
# start's backward *waits* for it. Autograd runs later-created nodes first, so whatever the forward did between
# start and wait is also what backward does while the gradient travels.
#
# **Handles and lifetimes.** An `A2AHandle` holds the split sizes, the group, the in-flight `work` and the two
# buffers the collective reads and writes. The buffers stay referenced from launch to wait: on CUDA the
# exchange runs on NCCL's own stream, and a buffer freed early could be handed to another kernel while NCCL
# still uses it; `work.wait()` makes the current stream wait for NCCL's without blocking the host (on gloo it
# blocks the host). One handle serves one exchange: one start and one wait in forward, then one launch and one
# wait in backward, after which it holds nothing. Every rank of the group must make the same exchanges in the
# same order, forward and backward: an output that receives no gradient on one rank would leave the others
# waiting in backward.

# %%
#| export
@dataclass(eq=False)
class A2AHandle:
    """One uneven all-to-all over `group`: `send[i]` rows go to rank i, `recv[i]` rows come from it. The reverse
    exchange of backward runs over `group_back` (the same ranks, perhaps another communicator; default `group`)."""
    send: list[int]
    recv: list[int]
    group: dist.ProcessGroup
    group_back: dist.ProcessGroup | None = None
    work: object = None    # the collective in flight between a launch and its wait (a torch Work)
    buffers: tuple = ()    # (input, output) of that collective, kept alive until the wait


def _launch(h: A2AHandle, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    h.work = dist.all_to_all_single(out, x, recv, send, group=group, async_op=True)
    h.buffers = (x, out)
    return out


def _finish(h: A2AHandle) -> Tensor:
    h.work.wait()
    out = h.buffers[1]
    h.work, h.buffers = None, ()
    return out


class _A2AStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h):
        ctx.h = h
        return _launch(h, x, h.send, h.recv, h.group)

    @staticmethod
    def backward(ctx, _):       # the gradient arrives through the handle: launched by _A2AWait.backward
        return _finish(ctx.h), None


class _A2AWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, h):
        ctx.h = h
        _finish(h)
        return out

    @staticmethod
    def backward(ctx, grad):
        h = ctx.h       # the reverse exchange, waited for by _A2AStart.backward
        _launch(h, grad, h.recv, h.send, h.group_back or h.group)
        return grad, None


def all_to_all_start(x: Tensor, send: list[int], recv: list[int], group,
                     group_back=None) -> tuple[Tensor, A2AHandle]:
    """Launch the exchange of the rows of `x` (`send[i]` to rank i, `recv[i]` from it); differentiable. Backward's
    reverse exchange runs over `group_back` when given (a twin communicator of `group`)."""
    if len(send) != group.size() or len(recv) != group.size() or sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all_start: send {send} and recv {recv} need one entry per rank of a group of "
                         f"{group.size()}, and send must sum to the {x.shape[0]} rows of x")
    h = A2AHandle(list(send), list(recv), group, group_back)
    return _A2AStart.apply(x, h), h


def all_to_all_wait(out: Tensor, h: A2AHandle) -> Tensor:
    "Wait for the exchange `h`; returns `out`, now holding the received rows."
    return _A2AWait.apply(out, h)

# %% [markdown]
# The checks in this notebook that need no second process run in a one-rank gloo group; the multi-rank checks
# launch real processes (section 5).

# %%
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
solo = dist.group.WORLD

xa = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
out, h = all_to_all_start(xa * 2, [5], [5], solo)
assert h.work is not None and len(h.buffers) == 2
out = all_to_all_wait(out, h)
assert h.work is None and h.buffers == () and torch.equal(out, xa * 2)
g = torch.randn(5, 3, dtype=torch.float64)
out.backward(g)
assert torch.equal(xa.grad, 2 * g) and h.work is None and h.buffers == ()

# %% [markdown]
# ## 2. The plan: who sends what, with one host synchronisation
#
# Rank r holds T tokens with top-k ids `ids (T, k)`. With L = E/ep experts per rank, pair (t, j) goes to rank
# `dest = ids // L`. Token t sends **one row to each distinct rank in `dest[t]`**: the boolean `sends (T, ep)`.
#
# An uneven all-to-all needs its split sizes on the host (NCCL takes them as Python ints, and the receive
# buffer must be allocated with its size), and the receive sizes are known only to the senders. So dispatch
# first exchanges, for every ordered pair of ranks, a fixed-size record: the number of rows, and the number of
# (token, expert) pairs per expert of the receiver, `(ep, 1 + L)` int64 values. That exchange has equal splits
# and needs nothing on the host. Then **one** copy to the host (`.tolist()`) brings every size this micro-batch
# needs: rows out, rows in, pairs out and pairs in per rank. That is the only host synchronisation per layer
# and micro-batch: combine and both backward exchanges reuse these sizes, and every index below is computed
# with sizes already on the host (`torch.nonzero_static` instead of `nonzero`, which would sync again).
# Without the exchange a receiver could only allocate for the worst case and pad.
#
# The exchange and the sync are two calls. `exchange_counts` queues the counts all-to-all and an asynchronous
# copy of every size into pinned host memory, then returns without waiting; `dispatch_start` waits for that
# copy (a CUDA event) and launches the rows. `dispatch` does both at once. The overlapped schedule of
# `engine/32_stages` puts another micro-batch's compute between the two, so that when the host blocks on the
# sizes the GPU still has that compute queued and does not run dry.
#
# Along with each row goes its **slots**: `(k,)`, the receiver's local expert index for each of the token's k
# choices that live on the receiver, and L (meaning "elsewhere") for the others. With `combine="sum"` the k
# router weights of those choices (0 elsewhere) travel in the same float32 buffer (slot ids below 2^24 are exact
# in float32), and the exchange is differentiable in them. That is 8k bytes per row against 2H for a bf16 row
# (1.6% at Qwen3-30B's H = 2048, k = 8); 4k bytes of int32 slots with `"pairs"`.
#
# On the expert rank, the received slots are sorted by local expert with `sort_by_expert` from ops/permute (L
# is one extra group that sorts last and is dropped): its `src_token` says which received row each grouped
# pair copies, so the expansion to (token, expert) pairs is one `gather_rows`, whose backward is the
# scatter-add that sums a row's gradients over its experts — deduplicated again on the way back.
#
# **Orders.** Every buffer on the way keeps one order, so that no extra index has to travel:
#
# - the send buffer is sorted by destination rank, tokens in order within a rank;
# - the received rows are therefore in (source rank, token) order, and the grouped rows of one expert keep it;
# - `"sum"`: combine sends each source rank one row per row it received, in the received order, so the home
#   rank gets back exactly the layout it sent; `plan.home[t, d]` is token t's row for rank d there (-1 if
#   none), and `weighted_gather` with unit weights adds a token's rows (fp32 accumulation, -1 adds nothing). On
#   the expert rank, `plan.pair_row[r, j]` is the grouped row of received row r's slot j (-1 elsewhere), and
#   `weighted_gather(y, pair_row, weights)` forms the sums, with the weights' gradient in its backward;
# - `"pairs"`: combine sends each source rank its pairs in (token, slot) order, from the received layout, so
#   on the home rank the returned pairs are in (expert rank, token, slot) order, and `routing.row_index` is the
#   position of each pair in that order: exactly the `row_index` of `sort_by_expert(dest, ep)`, a stable sort
#   of the pairs by destination rank.
#
# **Without the host: `sync_free=True`.** The one host sync per layer costs more than it looks on a GPU: when
# the host blocks on the sizes, everything it had queued runs out, and after the sync the GPU waits for each
# new launch until the host is ahead again (engine/34_overlap measures this as idle time). Every size can
# instead be a bound known in advance. A token sends at most one row to each rank, so each rank sends a block
# of exactly T rows to every rank: first the rows of the tokens that go there (in token order, as above), then
# zero rows whose slots all say "elsewhere". The exchanges have equal splits and need no counts. On the expert
# rank the `sort_by_expert` of all ep·T·k received slots puts this rank's pairs first, and the grouped buffer
# keeps all ep·T·k rows: the real pairs (their number, n, stays on the GPU, as `counts`), then rows that copy
# nothing and that no one reads. `grouped_linear` leaves rows after its last group alone (ops/12), and the
# weighted sums read only real pairs. The cost is bytes and memory: a block travels whole (at ep = 2 with
# top-8, 99.6% of tokens have an expert on the other rank, so almost nothing is padding; at ep = 8 about a
# third is), and the expert buffers are ep·T·k rows instead of about T·k. It needs `combine="sum"`, whose return
# trip has the same block sizes. `traffic` then counts the whole blocks, what really travels, and leaves
# `dispatch_undeduplicated` at 0 (counting it would need the sizes on the host).

# %%
#| export
@dataclass
class Traffic:
    "Bytes a dispatcher sent to *other* ranks in forward (backward sends the same amounts back), summed over calls."
    dispatch: int = 0                  # hidden rows of dispatch: one per (token, destination rank)
    dispatch_undeduplicated: int = 0   # what one row per (token, expert) pair would have been
    dispatch_meta: int = 0             # the slot ids sent with the rows and the counts exchange
    combine: int = 0                   # expert outputs: one row per (token, expert) pair
    calls: int = 0


@dataclass(eq=False)
class EPPlan:
    "What dispatch learned about one micro-batch's routing, kept on the Routing until combine has been waited for."
    pairs_in: list[int]          # (token, expert) pairs received from each rank: combine sends them back
    pairs_out: list[int]         # pairs sent to each rank: combine receives their outputs
    rows_in: list[int]           # token rows received from each rank
    rows_out: list[int]          # token rows sent to each rank
    back: Tensor | None = None   # combine "pairs": (N,) grouped row of each received pair, in arrival order
    pair_row: Tensor | None = None   # combine "sum": (R, k) grouped row of each received slot, -1 if elsewhere
    weights: Tensor | None = None    # combine "sum": (R, k) float32 router weights of the received slots
    home: Tensor | None = None       # combine "sum": (T, ep) row of the sent buffer for (token, rank), -1 if none
    expand_rows: Tensor | None = None    # `dispatch_wait(expand=False)`: the received row of each grouped row
    pending: tuple = ()          # (out, handle, ...) of the exchanges launched and not yet waited for


@dataclass(eq=False)
class EPCounts:
    "The counts exchange of one micro-batch, launched by `exchange_counts` and not yet read on the host."
    dest: Tensor                 # (T, k) rank of each pair's expert
    sends: Tensor                # (T, ep) bool: token t sends a row to rank d
    host: Tensor | None          # sizes, on the host (pinned) once `ready` has fired; None when sync-free
    ready: object = None         # the CUDA event after the copy to the host; None on the CPU

# %% [markdown]
# ## 3. The dispatcher
#
# `dispatch(x, routing)` and `combine(y, routing)` keep `LocalDispatcher`'s contract; each is `*_wait` after
# `*_start`, so a schedule can put other work between the two halves. The plan travels on the `Routing` of the
# micro-batch (`routing.plan`), so several micro-batches can be in flight at once.

# %%
#| export
COMBINE_MODES = ("sum", "pairs")   # how combine returns the expert outputs: see the table above


class EPDispatcher:
    """Stages 2 and 4 across the ranks of `group` (the ep group); rank r owns experts [r·L, (r+1)·L), L = E/size.

    `dispatch(x (T, H), routing) -> (x_grouped (N, H), counts (L,))`: this rank's experts' rows, grouped by local
    expert; sets `routing.counts` (this rank's pairs per global expert) and `routing.plan`.
    `combine(y (N, H), routing)`: with `combine="sum"`, (T, H), each token's router-weighted sum of its experts'
    outputs (dispatch is then differentiable in `routing.weights`, and `routing.row_index` stays None); with
    `"pairs"`, (T·k, H), one row per (token, expert) pair at `routing.row_index`. `dispatch_start`/`dispatch_wait`
    and `combine_start`/`combine_wait` are the two halves; `dispatch_wait(routing, expand=False)`, `expand`,
    `reduce` and `combine_start(..., reduced=True)` cut out the steps that only permute rows, so that a schedule can
    run them on its compute stream (see below). `sync_free` sizes every exchange by its bound instead
    of reading counts on the host (see above). `traffic` counts the bytes sent to other ranks. `group_back`, a
    twin communicator of `group` (`twin_group`), carries backward's exchanges, so that an overlapped schedule's
    forward and backward all-to-alls do not queue behind each other. `permute_in_compute` tells a schedule that
    runs stages on two streams (engine/32_stages) to use the cut-out steps."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, combine: str = "sum", sync_free: bool = False,
                 group_back: dist.ProcessGroup | None = None, permute_in_compute: bool = True):
        self.group, self.size, self.rank = group, group.size(), group.rank()
        self.group_back, self.permute_in_compute = group_back, permute_in_compute
        if num_experts % self.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {self.size}; "
                             "choose parallel.ep among the divisors of the model's num_experts")
        if combine not in COMBINE_MODES:
            raise ValueError(f"combine={combine!r}: choose one of {COMBINE_MODES}")
        if sync_free and combine != "sum":
            raise ValueError("sync_free needs combine='sum': a per-pair combine's sizes are only known on the host "
                             "after the counts exchange")
        self.sum, self.sync_free = combine == "sum", sync_free
        self.num_experts, self.local = num_experts, num_experts // self.size
        self.traffic = Traffic()

    @property
    def counts_step(self) -> bool:
        """Whether a schedule should call `exchange_counts` as a communication step of its own before dispatch:
        only when sizes travel (not `sync_free`), so the host can queue other work before it waits for them."""
        return not self.sync_free

    def dispatch(self, x: Tensor, routing: Routing) -> tuple[Tensor, Tensor]:
        self.dispatch_start(x, routing)
        return self.dispatch_wait(routing)

    def combine(self, y: Tensor, routing: Routing) -> Tensor:
        self.combine_start(y, routing)
        return self.combine_wait(routing)

    def exchange_counts(self, routing: Routing) -> None:
        """Launch the counts exchange and its copy to the host without waiting for either; `dispatch_start` waits.
        Called early, it lets the host queue other work (another micro-batch's stage) before the one host sync."""
        W, L, ids = self.size, self.local, routing.ids
        (T, k), dev = ids.shape, ids.device
        dest = ids // L
        if not self.sum:                                            # pair -> row of the combined buffer
            _, routing.row_index, _ = sort_by_expert(dest, W)
        flat = ids.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=dev)
        routing.counts = counts.scatter_add_(0, flat, torch.ones_like(flat))   # not bincount: that syncs on CUDA
        sends = torch.zeros(T, W, dtype=torch.bool, device=dev).scatter_(1, dest, True)
        if self.sync_free:                      # nothing to exchange: every size is a bound known in advance
            routing.plan = EPCounts(dest, sends, None)
            return
        rows_out = sends.sum(0)
        meta = torch.cat([rows_out[:, None], counts.view(W, L)], 1)  # to rank d: rows, then pairs per its experts
        meta_in = torch.empty_like(meta)
        dist.all_to_all_single(meta_in, meta, group=self.group)      # equal splits: no sizes needed on the host
        sizes = torch.cat([rows_out, counts.view(W, L).sum(1), meta_in.flatten()])
        ready = None
        if dev.type == "cuda":   # into pinned memory, asynchronously; `ready` marks the copy done
            host = torch.empty(sizes.shape, dtype=sizes.dtype, pin_memory=True)
            host.copy_(sizes, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = sizes
        routing.plan = EPCounts(dest, sends, host, ready)

    def dispatch_start(self, x: Tensor, routing: Routing) -> None:
        "Wait for the counts on the host (the one host sync; exchanged first if not yet), then launch rows and slots."
        if not isinstance(routing.plan, EPCounts):
            self.exchange_counts(routing)
        if self.sync_free:
            return self._dispatch_start_bounded(x, routing)
        W, L, c = self.size, self.local, routing.plan
        T, dest, sends = routing.ids.shape[0], c.dest, c.sends
        if c.ready is not None:
            c.ready.synchronize()
        sizes = c.host.tolist()                                    # the host sync
        rows_out, pairs_out, got = sizes[:W], sizes[W:2 * W], sizes[2 * W:]
        rows_in = got[::L + 1]
        pairs_in = [sum(got[s * (L + 1) + 1:(s + 1) * (L + 1)]) for s in range(W)]

        dest_tok = torch.nonzero_static(sends.T, size=sum(rows_out))  # (S, 2): (rank, token), by rank, then token
        d, t = dest_tok[:, 0:1], dest_tok[:, 1]
        meta = self._meta(routing, t, d, dest[t] == d)
        plan = EPPlan(pairs_in, pairs_out, rows_in, rows_out)
        if self.sum:
            order = sends.T.flatten().cumsum(0).view(W, T) - 1    # row of the sent buffer for (rank, token)
            plan.home = torch.where(sends.T, order, -1).T.contiguous()
        x_in, hx = all_to_all_start(gather_rows(x, t), rows_out, rows_in, self.group, self.group_back)
        s_in, hs = all_to_all_start(meta, rows_out, rows_in, self.group, self.group_back)
        plan.pending = (x_in, hx, s_in, hs)
        routing.plan = plan

        others = [i for i in range(W) if i != self.rank]
        row = x.shape[1] * x.element_size()
        tr = self.traffic
        tr.dispatch += row * sum(rows_out[i] for i in others)
        tr.dispatch_undeduplicated += row * sum(pairs_out[i] for i in others)
        meta_row = meta.shape[1] * meta.element_size()
        tr.dispatch_meta += sum(rows_out[i] for i in others) * meta_row + (W - 1) * (1 + L) * 8
        tr.calls += 1

    def _meta(self, routing: Routing, t: Tensor, d: Tensor, there: Tensor) -> Tensor:
        """What travels with the rows of tokens `t` to ranks `d` ((S, 1)), `there` (S, k) marking the choices whose
        expert lives on `d`: each choice's local slot (L: elsewhere), int32; with combine "sum" followed by the
        choices' router weights (0 elsewhere), in one float32 (or wider) buffer, differentiable in the weights."""
        slots = torch.where(there, routing.ids[t] - d * self.local, self.local)
        if not self.sum:
            return slots.to(torch.int32)
        wide = torch.promote_types(routing.weights.dtype, torch.float32)   # slot ids are exact in float32
        return torch.cat([slots.to(wide), torch.where(there, routing.weights[t].to(wide), 0.0)], 1)

    def _dispatch_start_bounded(self, x: Tensor, routing: Routing) -> None:
        "`dispatch_start` without the host: T rows to every rank, the rows for rank d first in block d, then zeros."
        W, c = self.size, routing.plan
        (T, k), dev = routing.ids.shape, routing.ids.device
        rank_of_row = torch.arange(W, device=dev).repeat_interleave(T)[:, None]     # (W·T, 1) destination
        place = torch.where(c.sends.T, c.sends.T.cumsum(1) - 1, T)                  # (W, T) row in its block
        src = torch.full((W, T + 1), -1, dtype=torch.int64, device=dev)
        src.scatter_(1, place, torch.arange(T, device=dev).expand(W, T))            # column T collects the rest
        src = src[:, :T].flatten()                                                  # token of each sent row, or -1
        t = src.clamp(min=0)
        meta = self._meta(routing, t, rank_of_row, (c.dest[t] == rank_of_row) & (src >= 0)[:, None])
        plan = EPPlan([T * k] * W, [T * k] * W, [T] * W, [T] * W)   # pair counts: bounds, unused by "sum"
        offset = torch.arange(W, device=dev)[:, None] * T
        plan.home = torch.where(c.sends.T, place + offset, -1).T.contiguous()
        x_in, hx = all_to_all_start(gather_rows(x, src), [T] * W, [T] * W, self.group, self.group_back)
        s_in, hs = all_to_all_start(meta, [T] * W, [T] * W, self.group, self.group_back)
        plan.pending = (x_in, hx, s_in, hs)
        routing.plan = plan
        sent = T * (W - 1)                      # what travels: whole blocks, padding included
        self.traffic.dispatch += sent * x.shape[1] * x.element_size()
        self.traffic.dispatch_meta += sent * meta.shape[1] * meta.element_size()
        self.traffic.calls += 1

    def dispatch_wait(self, routing: Routing, expand: bool = True) -> tuple[Tensor, Tensor]:
        """Wait for the rows; expand them to (token, expert) pairs grouped by local expert (`expand=False`: return
        the received rows, and `expand` makes the pairs)."""
        plan, L = routing.plan, self.local
        x_in, hx, s_in, hs = plan.pending
        x_in, meta = all_to_all_wait(x_in, hx), all_to_all_wait(s_in, hs)
        k = routing.ids.shape[1]
        slots = meta[:, :k].long()
        src_row, grouped_row, counts = sort_by_expert(slots, L + 1)   # slot L ("elsewhere") sorts last
        if self.sync_free:   # every slot gets a grouped row; those after this rank's pairs copy nothing
            mine = torch.arange(src_row.numel(), device=src_row.device) < counts[:L].sum()
            n, src_row = src_row.numel(), torch.where(mine, src_row, -1)
        else:
            n = sum(plan.pairs_in)
        if self.sum:
            plan.pair_row = torch.where(slots < L, grouped_row, -1)
            plan.weights = meta[:, k:]
        else:
            mine = torch.nonzero_static(slots.flatten() < L, size=n).squeeze(1)
            plan.back = grouped_row.flatten()[mine]
        plan.pending = ()
        if not expand:
            plan.expand_rows = src_row[:n]
            return x_in, counts[:L]
        return gather_rows(x_in, src_row[:n]), counts[:L]

    def expand(self, x_in: Tensor, routing: Routing) -> Tensor:
        "The received rows of `dispatch_wait(expand=False)` as (token, expert) pairs grouped by local expert."
        return gather_rows(x_in, routing.plan.expand_rows)

    def reduce(self, y: Tensor, routing: Routing) -> Tensor:
        "What combine sends: per received row the weighted sum of its pairs (`sum`), or each pair's row (`pairs`)."
        plan = routing.plan
        return weighted_gather(y, plan.pair_row, plan.weights) if self.sum else gather_rows(y, plan.back)

    def combine_start(self, y: Tensor, routing: Routing, reduced: bool = False) -> None:
        "Launch the return of the expert outputs `y` (`reduced`: of `reduce(y)`)."
        plan = routing.plan
        rows = y if reduced else self.reduce(y, routing)
        send, recv = (plan.rows_in, plan.rows_out) if self.sum else (plan.pairs_in, plan.pairs_out)
        out, h = all_to_all_start(rows, send, recv, self.group, self.group_back)
        plan.pending = (out, h)
        others = sum(send[i] for i in range(self.size) if i != self.rank)
        self.traffic.combine += y.shape[1] * y.element_size() * others

    def combine_wait(self, routing: Routing) -> Tensor:
        """Wait for the returned rows. "sum": add each token's rows from its ranks, giving (T, H) already weighted
        (`routing.row_index` stays None). "pairs": `routing.row_index` points into the result. Drops the plan."""
        plan = routing.plan
        out, h = plan.pending
        routing.plan = None
        out = all_to_all_wait(out, h)
        if self.sum:
            out = weighted_gather(out, plan.home, torch.ones(plan.home.shape, device=out.device))
        return out

# %% [markdown]
# ### Check: one rank, against `LocalDispatcher`
#
# With one rank every pair stays home, and the dispatcher must reproduce the local permutation exactly: the
# same grouped rows, counts and row index, and the same gradients through dispatch, a stand-in expert
# computation, combine and the weighted sum of stage 5. (The multi-rank checks follow in section 5.)

# %%
from pith_lit.models.protocol import expert_sum

T, H, E, k = 12, 6, 4, 3
ids = torch.randn(T, E).topk(k, -1).indices
w = torch.rand(T, k, dtype=torch.float64)
xs = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
scale = torch.randn(1, H, dtype=torch.float64)

def through(dispatcher):
    wl = w.clone().requires_grad_()
    r = Routing(ids, wl, None)
    xg, c = dispatcher.dispatch(xs, r)
    y = dispatcher.combine(xg * scale + c.repeat_interleave(c)[:, None], r)   # an "expert" that sees its counts
    out = expert_sum(y, r)
    gx, gw = torch.autograd.grad(out.square().sum(), [xs, wl])
    return xg, c, r.counts, out, gx, gw

local = through(LocalDispatcher(E))
pairs = EPDispatcher(solo, E, combine="pairs")
for a, b in zip(through(pairs), local):      # the same permutation and the same sums, bit for bit
    assert torch.equal(a, b)
summed = EPDispatcher(solo, E)               # combine="sum": the same sums, formed before the (empty) trip back
for a, b in zip(through(summed), local):
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
assert pairs.traffic == summed.traffic == Traffic(calls=1)   # nothing crossed to another rank
free = EPDispatcher(solo, E, sync_free=True)  # sizes by bounds: T·k grouped rows, the real pairs first
xg, c, counts, out, gx, gw = through(free)
n = int(c.sum())
assert xg.shape[0] == T * k and n == T * k    # with one rank every slot is a real pair
for a, b in zip((xg[:n], c, counts, out, gx, gw), local):
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)

# %% [markdown]
# **The cut-out steps.** A schedule that runs stages on two streams (engine/32_stages) calls the exchange alone
# in its communication steps, `dispatch_wait(routing, expand=False)` and `combine_start(rows, routing,
# reduced=True)`, and `expand` and `reduce`, which only permute rows, in stage 3 on its compute stream. Composed,
# they are `dispatch` and `combine`, bit for bit, gradients included:

# %%
def through_cut(dispatcher):
    wl = w.clone().requires_grad_()
    r = Routing(ids, wl, None)
    dispatcher.dispatch_start(xs, r)
    rows, c = dispatcher.dispatch_wait(r, expand=False)
    xg = dispatcher.expand(rows, r)
    dispatcher.combine_start(dispatcher.reduce(xg * scale + c.repeat_interleave(c)[:, None], r), r, reduced=True)
    out = expert_sum(dispatcher.combine_wait(r), r)
    gx, gw = torch.autograd.grad(out.square().sum(), [xs, wl])
    return xg, c, r.counts, out, gx, gw

for make in (lambda: EPDispatcher(solo, E, combine="pairs"), lambda: EPDispatcher(solo, E),
             lambda: EPDispatcher(solo, E, sync_free=True)):
    for a, b in zip(through_cut(make()), through(make())):
        assert torch.equal(a, b)

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
# ## 5. The self-check: several processes against one
#
# `selfcheck` runs on every rank of a (dp, ep) mesh: it builds the tiny Qwen3-MoE with the same seed as every
# other rank, computes the single-process reference on the **whole** batch (loss and gradients, with
# `LocalDispatcher`; no collective involved), then shards the experts, runs its own shard of the batch (by its
# rank in `mesh.batch`, dp × ep) through `EPDispatcher`, sums the gradients with `all_reduce_grads` (over
# `mesh.dense` and `mesh.expert`), and compares: the summed loss with the reference loss, every non-expert
# gradient with the reference, and its expert slice with the reference's slice. This is exactly what the
# trainer does with ep > 1, so with dp = 2 it also checks the data sharding and the two gradient groups.
#
# The cases cover what breaks all-to-all code: random routing; **top-k larger than the experts per rank**
# (every rank receives several pairs per token, and sends rows to itself); **every token to one expert** (k =
# 1; all ranks but the last receive nothing, and all experts but one are empty); and **every token to one
# rank** (all other ranks receive nothing at all). The skewed routings are forced through the weights: the
# embedding gets a large constant channel 0, which dominates every token's normalised hidden state, and the
# router's weights on that channel rank the favoured experts first (distinct values, so there are no ties to
# break differently). Each case asserts that the forced routing really happened.
#
# float32 must agree within 1e-5 relative to the largest magnitude, float64 within 1e-12. On CUDA the float64
# cases run in float32 (`F.grouped_mm` has no float64, and the Triton permutes accumulate in fp32), and float32
# gets 1e-4: on two H200s the forced-routing cases (`one_expert`, `one_rank`) differ by 7.4e-5 and 6.7e-5 in one
# attention norm weight's gradient, with either combine mode alike, so the difference is rounding outside the
# expert exchange; the random and wide cases agree to 5e-7 to 9e-7 there.

# %%
#| export
def tolerance(dtype: str, device: str) -> float:
    "The largest relative error `selfcheck` accepts in a `dtype` (`float32`, `float64`) run on `device`."
    return 1e-12 if dtype == "float64" else 1e-4 if device == "cuda" else 1e-5


def _force_routing(model: Qwen3MoeForCausalLM, favoured: list[int]) -> None:
    "Make every token of every MoE layer rank the `favoured` experts first, in that order."
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0     # dominates the normalised hidden state of every token
        for layer in model.model.layers.values():
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                w[:, 0] = -1.0
                w[favoured, 0] = torch.linspace(1.0, 0.5, len(favoured), dtype=w.dtype, device=w.device)


def _loss_sum(model, inputs: Tensor, labels: Tensor, dispatcher) -> tuple[Tensor, list]:
    positions = torch.arange(inputs.shape[1], device=inputs.device)
    h, routings = run_layers(model.model.layers.values(), model.prolog(inputs), positions, dispatcher)
    logits = model.epilog(h)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), routings


def _max_rel_err(a: Tensor, b: Tensor) -> float:
    "max |a - b| / max |b| (0 when both are zero)."
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    return err / scale if scale else err


def selfcheck(mesh: Mesh, case: str, dtype: torch.dtype, device: torch.device, combine: str = "sum",
              sync_free: bool = False) -> dict:
    """One case (`random`, `wide` (top-k > experts per rank), `one_expert`, `one_rank`) on this rank of `mesh`
    (pp = cp = 1), against the single-process reference; raises AssertionError on a mismatch. Each rank of
    `mesh.batch` (dp × ep) takes its own shard of the batch. `combine` and `sync_free` configure the dispatcher."""
    W, r, E = mesh.ep.size(), mesh.ep.rank(), 8
    L = E // W
    top_k = {"random": 2, "wide": min(L + 1, E), "one_expert": 1, "one_rank": L}[case]
    c = Config(vocab_size=64, hidden_size=32, moe_intermediate_size=16, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=E, num_experts_per_tok=top_k,
               mlp_only_layers=[1])
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(c).to(device, dtype)
    if case == "one_expert":
        _force_routing(model, [E - 1])
    elif case == "one_rank":
        _force_routing(model, list(range(L)))
    B, S, shards = 2, 8, mesh.batch.size()
    tokens = torch.randint(0, c.vocab_size, (shards * B, S + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels, n = tokens[:, :-1].to(device), tokens[:, 1:].to(device), shards * B * S

    ref = copy.deepcopy(model)
    ref_loss, _ = _loss_sum(ref, inputs, labels, LocalDispatcher(E))
    (ref_loss / n).backward()

    shard_experts(model, r, W)
    dispatcher = EPDispatcher(mesh.ep, E, combine, sync_free)
    mine = slice(mesh.batch.rank() * B, (mesh.batch.rank() + 1) * B)
    loss, routings = _loss_sum(model, inputs[mine], labels[mine], dispatcher)
    (loss / n).backward()
    all_reduce_grads(model, mesh.dense, mesh.expert)
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.dense)

    moe_ids = [ro.ids for ro in routings if ro is not None]
    if case == "one_expert":
        assert all(bool((i == E - 1).all()) for i in moe_ids), "routing was not forced to the last expert"
    if case == "one_rank":
        assert all(bool((i < L).all()) for i in moe_ids), "routing was not forced to rank 0's experts"
    tol = tolerance(str(dtype).removeprefix("torch."), device.type)
    errs = {"loss": _max_rel_err(total, ref_loss.detach())}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        want = q.grad[r * L:(r + 1) * L] if is_expert_param(name) else q.grad
        errs[name] = _max_rel_err(p.grad, want)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{case} {dtype}: {worst} differs by {errs[worst]:.3g} relative (> {tol:g})"
    return {"dp": mesh.dp.size(), "ep": W, "case": case, "dtype": str(dtype).removeprefix("torch."),
            "combine": combine, "sync_free": sync_free, "top_k": top_k, "max_rel_err": errs[worst], "worst": worst,
            "traffic": asdict(dispatcher.traffic)}

# %% [markdown]
# ## 6. The saving at Qwen3-30B-A3B's shape
#
# Qwen3-30B-A3B routes each token to 8 of 128 experts at hidden 2048, in bf16 (4 KiB a row). `qwen3_routing`
# gives the router outputs this measurement uses: a Qwen3 router initialised as the model initialises it
# (N(0, 0.02) weights) on N(0, 1) hidden states (what RMSNorm produces), T tokens per rank, reproducible
# from the rank. A trained router is not uniform: its tokens cluster on related experts, which puts more of
# a token's experts on the same rank, so deduplication saves at least as much there as measured here on a
# random one.
#
# `traffic` dispatches these rows through `EPDispatcher` for each ep size that divides the world, with an
# identity "expert", and combines, once per combine mode: with `"pairs"` every (token, expert) pair must get its
# own row back; with `"sum"` and a weight of 1 on each token's first choice (0 on the others) every token must
# get exactly its own row back. It returns the `"sum"` dispatcher's byte counters summed over all ranks, and
# the `"pairs"` dispatcher's combine bytes as `combine_pairs`.

# %%
#| export
def qwen3_routing(rank: int, tokens: int, hidden: int = 2048, num_experts: int = 128,
                  top_k: int = 8) -> tuple[Tensor, Routing]:
    "bf16 hidden states and the routing of a freshly initialised Qwen3 router, for `tokens` tokens of `rank`."
    router = Router(Config(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k))
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(0)) * 0.02)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1000 + rank))
        return x.bfloat16(), router(x)


def traffic(tokens: int, device: torch.device, timeout_s: float) -> dict:
    "Dispatcher byte counters summed over the world, for each ep size in (2, 4, 8) that divides it."
    world, rank, out = dist.get_world_size(), dist.get_rank(), {}
    x, routing = qwen3_routing(rank, tokens)
    x, routing.ids = x.to(device), routing.ids.to(device)
    for ep in (2, 4, 8):
        if world % ep:
            continue
        mesh = build_mesh(1, world // ep, 1, ep, device.type, timeout_s)
        first = torch.zeros_like(routing.weights)
        first[:, 0] = 1
        for mode in ("pairs", "sum"):
            d = EPDispatcher(mesh.ep, 128, mode)
            r = Routing(routing.ids, first.to(device), None)
            xg, _ = d.dispatch(x, r)
            back = d.combine(xg, r)                  # identity experts
            if mode == "pairs":                      # each pair gets its token's row
                want, back = x[:, None].expand(-1, r.ids.shape[1], -1), back[r.row_index]
            else:                                    # each token gets its own row: weight 1 on one choice
                want = x
            assert torch.equal(back, want), f"ep={ep}, combine={mode}: rows lost"
            sums = torch.tensor(list(asdict(d.traffic).values()), device=device)
            dist.all_reduce(sums)
            counted = dict(zip(asdict(d.traffic), sums.tolist()))
            if mode == "pairs":
                combine_pairs = counted["combine"]
        out[ep] = counted | {"combine_pairs": combine_pairs}
    return out

# %% [markdown]
# ### The command line
#
# `python -m torch.distributed.run --nproc-per-node N -m pith_lit.engine.ep [--device cuda] [--tokens T]` runs
# every self-check case in float32 and float64 with ep = N (and with dp = 2, ep = N/2 when N is a multiple of
# 4), then the traffic measurement, and rank 0 prints one JSON object. On CUDA the same code runs over NCCL (the split sizes are Python ints, as NCCL requires).
# An exception on any rank ends the job with its traceback (`run_ranked`).

# %%
#| export
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="EP self-check against a single process, and dispatch traffic")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank for the traffic measurement")
    p.add_argument("--timeout-s", type=float, default=120)
    a = p.parse_args(argv)
    rank, world, device = init_distributed(a.timeout_s, a.device)
    f32, f64 = torch.float32, torch.float64 if a.device == "cpu" else torch.float32   # no float64 grouped_mm
    checks = []
    for dp in (1, 2) if world % 4 == 0 else (1,):    # ep = world; and dp = 2 × ep = world/2 where it fits
        mesh = build_mesh(1, dp, 1, world // dp, a.device, a.timeout_s)
        checks += [selfcheck(mesh, case, dtype, device, combine, free)
                   for case, dtype, combine, free in [
                       ("random", f32, "sum", False), ("random", f64, "sum", False), ("wide", f32, "sum", False),
                       ("wide", f64, "sum", False), ("one_expert", f64, "sum", False), ("one_rank", f32, "sum", False),
                       ("random", f64, "pairs", False), ("wide", f32, "pairs", False), ("random", f64, "sum", True),
                       ("wide", f32, "sum", True), ("one_rank", f64, "sum", True)]]
    result = {"world": world, "checks": checks, "traffic": traffic(a.tokens, device, a.timeout_s)}
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and __spec__ is not None:
    run_ranked(main)

# %% [markdown]
# ### Check: two processes
#
# Two gloo processes on the CPU, every case, compared with the single-process run inside the worker. The
# worker raises (and the job exits non-zero) on any mismatch; here we also look at the numbers.

# %%
dist.destroy_process_group()
root = Path.cwd().parents[1]   # nbdev_test runs a notebook in its folder
env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "pith_lit.engine.ep", "--tokens", "1024"], cwd=root, env=env, capture_output=True,
                      text=True, timeout=300)
assert proc.returncode == 0, proc.stderr[-4000:]
two = json.loads(proc.stdout.strip().splitlines()[-1])
for c in two["checks"]:
    print(f"{c['case']:>10} {c['dtype']:>7} top-{c['top_k']} combine {c['combine']:>5}"
          f"{' sync-free' if c['sync_free'] else '':10}: max relative error {c['max_rel_err']:.2e}")
assert len(two["checks"]) == 11

# %% [markdown]
# ### The saving, counted two ways
#
# First from the router outputs alone: for each rank's tokens, the rows a deduplicated dispatch sends to other
# ranks are the distinct destination ranks of each token other than its own, and an undeduplicated one sends
# every pair whose expert is elsewhere. Rank g of the world is rank g mod ep of its ep group (ep innermost).
# This count uses nothing of the dispatcher; the two-process run's counters must equal it at ep = 2.

# %%
ROW = 2048 * 2   # bytes of one bf16 row at hidden 2048
dests = {g: qwen3_routing(g, 1024)[1].ids for g in range(8)}   # router outputs of 8 ranks × 1024 tokens

def counted(world: int, ep: int) -> tuple[int, int]:
    "Bytes sent to other ranks by all `world` ranks, (deduplicated, one row per pair), from the router alone."
    dedup = undedup = 0
    for g in range(world):
        home = g % ep
        for row in (dests[g] // (128 // ep)).tolist():
            dedup += len(set(row) - {home})
            undedup += sum(d != home for d in row)
    return dedup * ROW, undedup * ROW

want = counted(2, 2)
got = two["traffic"]["2"]
assert (got["dispatch"], got["dispatch_undeduplicated"]) == want, (got, want)
assert got["combine_pairs"] == want[1]    # "pairs": every pair's output comes back, one row each
assert got["combine"] == want[0]          # "sum": one row back per row sent
print(f"ep=2, 2×1024 tokens: {got['dispatch'] / 2**20:.1f} MiB deduplicated vs "
      f"{got['dispatch_undeduplicated'] / 2**20:.1f} MiB, metadata {got['dispatch_meta'] / 2**10:.0f} KiB; "
      f"combine {got['combine'] / 2**20:.1f} MiB summed vs {got['combine_pairs'] / 2**20:.1f} MiB as pairs")

# %% [markdown]
# Per token, from the router outputs of 8 ranks × 1024 tokens (ep = 2, 4, 8 over the same 8 ranks):

# %%
print("| ep | rows / token, dedup | rows / token, no dedup | KiB / token, dedup | KiB / token, no dedup | saving |")
print("|---|---|---|---|---|---|")
saving = {}
for ep in (2, 4, 8):
    dd, nd = (b / (8 * 1024) for b in counted(8, ep))
    saving[ep] = nd / dd
    print(f"| {ep} | {dd / ROW:.2f} | {nd / ROW:.2f} | {dd / 2**10:.2f} | {nd / 2**10:.2f} | {saving[ep]:.2f}× |")
assert saving[2] > saving[4] > saving[8] > 1   # more ranks, fewer of a token's experts share one

# %% [markdown]
# And from the dispatcher's counters, with 8 CPU processes (ep = 2, 4, 8 over the same world; too slow for
# CI on two cores, so the cell is marked `slow`; run with `nbdev_test --flags slow`). Recorded on a 1-core CPU
# container, 2026-11-29, `--tokens 1024`, before `combine="sum"` existed: the metadata column is the int32 slot
# ids of `"pairs"` (the float32 slots and weights of `"sum"` take twice that), and the combine column is the
# per-pair return; `"sum"` returns exactly the dispatch column, which the cell asserts.
#
# | ep | dispatch MiB (dedup) | dispatch MiB (no dedup) | metadata MiB | combine MiB (pairs) | saving | = router count |
# |---|---|---|---|---|---|---|
# | 2 | 31.9 | 127.1 | 0.25 | 127.1 | 3.99× | True |
# | 4 | 87.0 | 192.1 | 0.69 | 192.1 | 2.21× | True |
# | 8 | 149.6 | 224.8 | 1.18 | 224.8 | 1.50× | True |
#
# (bytes sent to other ranks by all 8 ranks together for one MoE layer's forward; backward sends the same
# amounts in the other direction.) Dispatch bytes are 1.00, 2.72 and 4.67 rows per token instead of 3.97,
# 6.00 and 7.02: with 8 choices among ep ranks, a token's experts share ranks less as ep grows. The slot ids and
# counts add 0.8% to dispatch (1.6% with the weights of `"sum"`). Combine with `"pairs"` returns one row per
# remote pair, like undeduplicated dispatch; `"sum"` cuts it to the deduplicated dispatch bytes, 3.99×, 2.21× and
# 1.50× less at ep = 2, 4 and 8.

# %%
#| slow
proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                       "-m", "pith_lit.engine.ep", "--tokens", "1024"], cwd=root, env=env, capture_output=True,
                      text=True, timeout=600)
assert proc.returncode == 0, proc.stderr[-4000:]
eight = json.loads(proc.stdout.strip().splitlines()[-1])
print("| ep | dispatch MiB (dedup) | dispatch MiB (no dedup) | metadata MiB | combine MiB (pairs) | saving | "
      "= router count |")
print("|---|---|---|---|---|---|---|")
for ep in (2, 4, 8):
    t = eight["traffic"][str(ep)]
    ok = (t["dispatch"], t["dispatch_undeduplicated"]) == counted(8, ep)
    assert t["combine"] == t["dispatch"]     # "sum" returns one row per row sent
    print(f"| {ep} | {t['dispatch'] / 2**20:.1f} | {t['dispatch_undeduplicated'] / 2**20:.1f} | "
          f"{t['dispatch_meta'] / 2**20:.2f} | {t['combine_pairs'] / 2**20:.1f} | "
          f"{t['dispatch_undeduplicated'] / t['dispatch']:.2f}× | {ok} |")
    assert ok
