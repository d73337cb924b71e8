# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # DualPipeV
#
# Pipeline parallelism splits the layers of a model among P ranks and streams micro-batches through them. Its cost
# is the **bubble**: time a rank waits for work at the start and end of each step. DualPipe (DeepSeek-V3) shrinks
# the bubble by feeding micro-batches from both ends of the pipeline and by pairing the forward of one micro-batch
# with the backward of another, so the all-to-alls of expert parallelism hide behind compute (engine/32_stages).
# **DualPipeV** is its "cut in half" variant: it keeps one copy of the parameters instead of two.
#
# The model is cut into 2P **stages**, and rank r holds stages r and 2P−1−r. A micro-batch goes down the ranks
# through their first stage (phase 0: stage r, from rank r−1 to r+1), turns around on the last rank (stages P−1
# and P live there, so the turn is local) and comes back up through their second stage (phase 1: from rank r+1 to
# r−1). Rank 0 therefore holds the first stage (with the embedding) and the last stage (with the head and the
# loss): the "V". Each rank runs a fixed sequence of actions:
#
# - **F** (forward of one stage for one micro-batch), **B** (its backward), **F&B** (the forward of one micro-batch
#   overlapped with the backward of another, stage by stage, on two CUDA streams), and **W** (deferred weight
#   gradients: a B with *zero bubble* leaves its weight gradients in a queue and a later W slot computes them, to
#   fill a gap where the rank would otherwise wait);
# - and the point-to-point transfers between neighbours that feed them: those listed between two actions start
#   together and are waited for before the next one.
#
# This notebook builds the schedule as plain data, checks it by simulating all ranks (every message matched,
# no deadlock, the ideal bubble), then runs it: `split_model` keeps a rank's two stages, and `DualPipeV.step`
# executes one optimizer step's micro-batches and records a timeline. The checks compare against one process
# running the whole model with plain autograd; engine/39 repeats them with several processes.

# %%
#| default_exp engine.dualpipev

# %%
#| export
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from pith_lit.engine.mesh import stage_layers
from pith_lit.engine.stages import (COMPUTE, LayerRun, Streams, backward_layers, forward_layers, new_leaf,
                                    run_steps)
from pith_lit.ops.grouped_linear import WeightGradQueue

# %%
import torch.nn.functional as F

from pith_lit.models.protocol import LocalDispatcher, head_loss, run_layers
from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM

# %% [markdown]
# ## Cutting the model
#
# `stage_layers` (engine/30_mesh) says which layers each of the 2P stages holds. `split_model` keeps what rank r
# needs and drops the rest from the model itself, so `model.parameters()`, `model.state_dict()` (with the same
# Hugging Face names as the full model), the optimizer and the gradient all-reduce all see this rank's
# parameters only. Rank 0 keeps the embedding, the final norm and the head (the
# model protocol's `prolog` and `epilog`); the others drop them. It returns the two `StagePart`s: the layers of
# the stage, keyed by absolute layer index, and what the stage does at the ends of the model.

# %%
#| export
@dataclass
class StagePart:
    "One pipeline stage of one rank: `layers` keyed by absolute index; `prolog` on stage 0; the loss on the last."
    index: int                      # 0 .. 2·pp − 1
    layers: dict                    # {"7": layer, ...} in order
    prolog: Callable | None         # input_ids -> h, on stage 0 only
    is_last: bool                   # stage 2·pp − 1: its output goes to the loss
    hidden_size: int                # width of the hidden states sent between ranks
    model: torch.nn.Module          # what is left of the model on this rank

    def dtype(self) -> torch.dtype:
        """dtype of the hidden states (what receive buffers are allocated in): the compute dtype FSDP gathers the
        weights in (engine/36 records it), else that of the rank's parameters."""
        return getattr(self.model, "compute_dtype", None) or next(self.model.parameters()).dtype


def split_model(model, pp_rank: int, pp_size: int, sizes: list[int] | None = None) -> tuple[StagePart, StagePart]:
    """Keep rank `pp_rank`'s stages (pp_rank and 2·pp_size − 1 − pp_rank) in `model`, drop every other layer, and
    drop the embedding, final norm and head unless pp_rank is 0. Returns (first-phase part, second-phase part).
    `sizes`: the layers of each stage (engine/30_mesh's `stage_layers`; default even)."""
    keys = list(model.model.layers.keys())
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size={pp_size})")
    stages = stage_layers(len(keys), pp_size, sizes)
    mine = (pp_rank, 2 * pp_size - 1 - pp_rank)
    keep = {keys[i] for s in mine for i in stages[s]}
    for key in keys:
        if key not in keep:
            del model.model.layers[key]
    if pp_rank != 0:
        del model.model.embed_tokens, model.model.norm, model.lm_head
    return tuple(StagePart(s, {keys[i]: model.model.layers[keys[i]] for i in stages[s]},
                           (lambda ids: model.prolog(ids)) if s == 0 else None,   # late-bound: FSDP may wrap it
                           s == 2 * pp_size - 1, model.config.hidden_size, model)
                 for s in mine)

# %% [markdown]
# ## The schedule, as data
#
# `dualpipev_schedule(rank, P, M)` lists what one rank does in one step with M micro-batches, as tuples with the
# micro-batch numbers filled in:
# `("F", phase, m)`, `("B", phase, m, zero_bubble)`, `("FB", (phase, m), (phase, m))` (forward, backward),
# `("W", phase, m)`, and the
# transfers `("recv_f" | "send_f" | "recv_b" | "send_b", phase, m)` (f: activations going forward, b: gradients
# going back). Transfers to or from a neighbour that does not exist (rank 0 in phase 0
# receives token ids from the data, the last rank turns phase 0 into phase 1 locally) are left out.
#
# It follows the step structure of DeepSeek's DualPipeV, in eight parts (for rank r):
#
# 1. `2(P−r−1)` forwards of phase 0: the pipeline fills; deeper ranks start later;
# 2. `r+1` pairs of forwards, phase 0 then phase 1 (the first micro-batches turn around and come back up);
# 3. `P−r−1` times: B of phase 1 with zero bubble, W, F of phase 1: the W fills the wait for the next input;
# 4. the steady state, `M−2P+r+1` times: F&B (forward phase 0, backward phase 1), F&B (forward phase 1, backward
#    phase 0). On the last rank the first pair runs F and B one after the other: F needs no transfer there, so it
#    runs while B's gradient is on its way. With P = 1 nothing travels and B's gradient comes from the loss on
#    the same rank, so that pair overlaps too: then only the first micro-batch's forward and the last one's
#    backward run alone, and at most a share 1 − 1/M of the expert all-to-alls can hide under the other
#    micro-batch's compute;
# 5. `P−r−1` times: B of phase 1, F&B (forward phase 1, backward phase 0);
# 6. `r+1` pairs of backwards, phase 1 then phase 0; the second half of them defer their weight gradients;
# 7. `P−r−1` times: W, then B of phase 0 with zero bubble;
# 8. `r+1` W slots: the deferred weight gradients.
#
# The steady state needs at least one iteration on every rank, so M ≥ 2P. Every F, B and W is counted below.
#
# With P = 1 (`parallel.overlap`) the same eight parts give forward j beside backward j − 2 of the half-model
# tasks, and only the first forward and the last backward run alone.
#
# **Transfers.** The schedule lists each send after the action that makes its tensor and each receive before the
# action that reads it; the order of the lists is what matters. NCCL (and gloo, with one tag) pair the sends from
# A to B with B's receives from A by **order alone**, and every message here has the same shape: a schedule that
# sent two messages in a different order than the neighbour receives them would swap activations silently. The
# simulation below checks the order of every pair of neighbours. When the executor starts and waits for them is
# described with `DualPipeV` below.

# %%
#| export
class _Plan:
    "The actions of one rank being planned: `dualpipev_schedule` calls these in the order of the eight parts."

    def __init__(self, rank: int, P: int):
        self.first, self.last = rank == 0, rank == P - 1
        self.acts, self.n = [], {}   # n[(name, phase)]: how many of that kind were planned so far = the next micro
        self.deferred = []           # (phase, m) of zero-bubble backwards whose W has not been planned yet

    def add(self, name, phase, *rest):
        m = self.n.get((name, phase), 0)
        self.n[name, phase] = m + 1
        self.acts.append((name, phase, m, *rest))

    def transfer(self, name: str, p: int):
        "A transfer, unless its neighbour does not exist (rank 0 reads tokens; the last rank turns locally)."
        first_skips = p == (name in ("send_f", "recv_b"))   # rank 0: phase 0 reads tokens, phase 1 ends in the loss
        last_skips = p == (name in ("recv_f", "send_b"))    # the last rank: the turn between phases is local
        if not (self.first and first_skips or self.last and last_skips):
            self.add(name, p)

    def fwd(self, p, recv=True, send=True):
        if recv: self.transfer("recv_f", p)
        self.add("F", p)
        if send: self.transfer("send_f", p)

    def bwd(self, p, zb=False, recv=True, send=True):
        if recv: self.transfer("recv_b", p)
        self.add("B", p, zb)
        if zb: self.deferred.append(self.acts[-1][1:3])
        if send: self.transfer("send_b", p)

    def fwd_bwd(self, pf, pb, recv=True):
        if recv: self.transfer("recv_f", pf)
        self.transfer("recv_b", pb)
        mf, mb = self.n.get(("F", pf), 0), self.n.get(("B", pb), 0)
        self.n["F", pf], self.n["B", pb] = mf + 1, mb + 1
        self.acts.append(("FB", (pf, mf), (pb, mb)))
        self.transfer("send_f", pf)
        self.transfer("send_b", pb)

    def weights(self):
        self.acts.append(("W", *self.deferred.pop(0)))


def dualpipev_schedule(rank: int, P: int, M: int) -> list[tuple]:
    "The actions of pipeline rank `rank` of `P` for one step of `M` micro-batches, in order (see above)."
    if M < 2 * P:
        raise ValueError(f"DualPipeV with pp = {P} needs at least 2·pp = {2 * P} micro-batches per step, got {M}; "
                         "raise train.global_batch or lower train.micro_batch")
    a, last = _Plan(rank, P), rank == P - 1
    for _ in range(2 * (P - rank - 1)):                      # 1
        a.fwd(0)
    a.transfer("recv_f", 0)                                   # 2
    for i in range(rank + 1):
        a.fwd(0, recv=False, send=last)
        a.transfer("recv_f", 0)
        a.fwd(1, send=not last or i < rank)
        if not last:
            a.transfer("send_f", 0)
    for _ in range(P - rank - 1):                             # 3
        a.bwd(1, zb=True)
        a.transfer("recv_f", 1)
        a.weights()
        a.fwd(1, recv=False)
    for i in range(M - 2 * P + rank + 1):                     # 4
        if i == 0 and last and P > 1:
            a.fwd(0, recv=False, send=False)
            a.transfer("send_f", 1)
            a.bwd(1, send=False)
            a.transfer("send_f", 0)
            a.transfer("send_b", 1)
        else:
            a.fwd_bwd(0, 1, recv=i > 0)
        a.fwd_bwd(1, 0)
    for _ in range(P - rank - 1):                             # 5
        a.bwd(1)
        a.fwd_bwd(1, 0)
    zb = False                                                # 6
    for i in range(rank + 1):
        zb = zb or (i == (rank + 1) // 2 and rank % 2 == 1)
        a.bwd(1, zb=zb)
        zb = zb or (i == (rank + 1) // 2 and rank % 2 == 0)
        a.bwd(0, zb=zb)
    for _ in range(P - rank - 1):                             # 7
        a.weights()
        a.bwd(0, zb=True)
    for _ in range(rank + 1):                                 # 8
        a.weights()
    return a.acts


COMPUTE_ACTIONS = ("F", "B", "FB", "W")   # the schedule's actions that compute (the rest transfer)


def _tasks(action) -> list[tuple]:
    "The forwards and backwards an action runs, as (\"F\" | \"B\", phase, m), in order."
    match action:
        case ("F", p, m) | ("B", p, m, _):
            return [(action[0], p, m)]
        case ("FB", f, b):
            return [("F", *f), ("B", *b)]
    return []

# %%
acts = dualpipev_schedule(1, 2, 4)
print("rank 1 of 2, 4 micro-batches:\n ", "\n  ".join(map(str, acts)))

# %% [markdown]
# ## Simulating all ranks
#
# `simulate` runs the schedules of all P ranks against each other, with a given duration per compute action and
# instantaneous transfers, and returns each rank's timeline as `(kind, micro, start, end)` events, the same
# format `DualPipeV` records (kind `"F0"`, `"B1"`, `"F1&B0"`, `"W"`, …). It is also the schedule's test:
#
# - for every pair of neighbours, the i-th message A sends to B is the i-th one B receives from A (same direction,
#   phase and micro-batch), so order-matched transfers deliver the right data;
# - a rank's batch of transfers completes when every partner has reached the batch holding the matching
#   transfer (as with NCCL: a send needs its receive posted); if at some point no rank can move, the schedule
#   deadlocks and `simulate` raises;
# - every micro-batch gets its F and B in both phases on every rank, each W follows its B, and every F reads an
#   input that an earlier transfer (or the V's local turn) delivered.
#
# The bubble fraction is the idle share of P × (step time).

# %%
#| export
def action_kind(action) -> tuple[str, object]:
    "The timeline label of a compute action: (kind, micro)."
    match action:
        case ("F", p, m):
            return f"F{p}", m
        case ("W", p, m):
            return "W", m
        case ("B", p, m, _):
            return f"B{p}", m
        case ("FB", _, _):
            (k1, p1, m1), (k2, p2, m2) = _tasks(action)
            return f"{k1}{p1}&{k2}{p2}", (m1, m2)


def _peer(name: str, phase: int, rank: int) -> int:
    "The neighbour a transfer goes to or comes from: activations flow down in phase 0 and up in phase 1."
    down = (name in ("send_f", "recv_b")) == (phase == 0)
    return rank + 1 if down else rank - 1


def _inputs_arrive(r: int, P: int, actions: list[tuple]) -> None:
    "Assert that every F and B of rank r finds its input (activations or gradient) delivered before it runs."
    have = set()     # ("f" | "b", phase, m) delivered so far, by a receive or by the V's turn
    for a in actions:
        if a[0] in ("recv_f", "recv_b"):
            have.add((a[0][-1], a[1], a[2]))
        for kind, *task in _tasks(a):
            if kind == "F":
                assert (r == 0 and task[0] == 0) or ("f", *task) in have, f"rank {r}: F{task} before its input"
                if r == P - 1 and task[0] == 0:
                    have.add(("f", 1, task[1]))
            else:
                assert (r == 0 and task[0] == 1) or ("b", *task) in have, f"rank {r}: B{task} before its gradient"
                if r == P - 1 and task[0] == 1:
                    have.add(("b", 0, task[1]))


def _rank_batches(P: int, M: int) -> list[list[tuple]]:
    "Per rank: `[(transfers, compute action or None)]`, each compute action after the transfers that precede it."
    batches = []
    for r in range(P):
        actions = dualpipev_schedule(r, P, M)
        _inputs_arrive(r, P, actions)
        rank_batches, pending = [], []
        for a in actions:
            if a[0] in ("recv_f", "send_f", "recv_b", "send_b"):
                pending.append(a)
            else:
                rank_batches.append((pending, a))
                pending = []
        batches.append(rank_batches + [(pending, None)])
    return batches


def _partners(P: int, M: int, batches) -> dict:
    "`(rank, batch) -> [(peer, batch)]`: each send paired with its receive, in order, between each pair of neighbours."
    sent, received = {}, {}
    for r in range(P):
        for k, (transfers, _) in enumerate(batches[r]):
            for name, p, m in transfers:
                peer = _peer(name, p, r)
                book = sent if name.startswith("send") else received
                pair = (r, peer) if name.startswith("send") else (peer, r)
                book.setdefault(pair, []).append(((name[-1], p, m), (r, k)))
    partners = {}
    for pair in sent.keys() | received.keys():
        s, rcv = sent.get(pair, []), received.get(pair, [])
        if [x for x, _ in s] != [x for x, _ in rcv]:
            raise RuntimeError(f"P={P} M={M}: rank {pair[0]} sends {[x for x, _ in s]} to rank {pair[1]}, "
                               f"which receives {[x for x, _ in rcv]}")
        for (_, a), (_, b) in zip(s, rcv):
            partners.setdefault(a, []).append(b)
            partners.setdefault(b, []).append(a)
    return partners


def simulate(P: int, M: int, duration: Callable[[tuple, int], float]) -> list[list[tuple]]:
    """Every rank's timeline `[(kind, micro, start, end)]` under `duration(action, rank)`; raises on a mismatch or
    deadlock. Each rank advances as far as its transfers allow."""
    batches = _rank_batches(P, M)
    partners = _partners(P, M, batches)
    posted = [[0.0] + [None] * len(b) for b in batches]   # posted[r][k]: when rank r reaches its batch k
    events, at, done = [[] for _ in range(P)], [0] * P, set()
    while any(at[r] < len(batches[r]) for r in range(P)):
        moved = False
        for r in range(P):
            k = at[r]
            if k == len(batches[r]) or any(posted[q][j] is None for q, j in partners.get((r, k), [])):
                continue
            start = max([posted[r][k]] + [posted[q][j] for q, j in partners.get((r, k), [])])
            action = batches[r][k][1]
            end = start if action is None else start + duration(action, r)
            if action is not None:
                events[r].append((*action_kind(action), start, end))
                if action[0] == "B" and action[3]:
                    done.add((r, action[1], action[2]))
                if action[0] == "W":
                    assert (r, action[1], action[2]) in done, f"rank {r}: W before its B"
            posted[r][k + 1] = end
            at[r], moved = k + 1, True
        if not moved:
            raise RuntimeError(f"P={P} M={M}: deadlock, ranks stopped at batches {at}")
    for r in range(P):
        kinds = [k for k, _, _, _ in events[r]]
        for x in ("F0", "F1", "B0", "B1"):
            count = sum(k.split("&").count(x) for k in kinds)
            assert count == M, f"rank {r}: {count} × {x}, expected {M}"
    return events


def bubble_fraction(events: list[list[tuple]]) -> float:
    "Idle share of P × step time: everything that is not an F, B, F&B or W action (waits for transfers included)."
    t0 = min(e[2] for ev in events for e in ev)
    t1 = max(e[3] for ev in events for e in ev)
    busy = sum(e[3] - e[2] for ev in events for e in ev if e[0] != "comm")
    return 1 - busy / (len(events) * (t1 - t0))

# %% [markdown]
# Every schedule from 1 to 8 ranks with 2P to 3P+1 micro-batches passes. For the ideal case take the units of
# the DualPipe paper: F = 1, B = 2 (input gradient 1 + weight gradient 1), so a zero-bubble B costs 1 and its W 1,
# and an F&B pair costs 3: `unit_duration`, in `tests/references.py` (shared with the tests).

# %%
from tests.references import unit_duration

for P in range(1, 9):
    for M in range(2 * P, 3 * P + 2):
        simulate(P, M, unit_duration)
try:
    dualpipev_schedule(0, 4, 7)
    raise AssertionError("expected a ValueError")
except ValueError as e:
    print("M < 2P:", e)
for P, M in [(4, 8), (4, 16), (8, 16), (8, 32)]:
    print(f"P={P} M={M}: ideal bubble fraction {bubble_fraction(simulate(P, M, unit_duration)):.3f}")
assert bubble_fraction([[("F0", 0, 0.0, 2.0), ("comm", None, 2.0, 3.0), ("B0", 0, 3.0, 4.0)]]) == 0.25  # waits

# %% [markdown]
# ## Running a stage: `StageRun`
#
# `StageRun` is `LayerRun` (engine/32_stages) one level up: one stage on one micro-batch, as generators of steps.
# Around the layers it adds the embedding (stage 0: the input is token ids) and the loss (the last stage: the
# loss is computed on a leaf copy of the last hidden states, so its backward is a step of its own that hands
# `h_last.grad` to the layers). `loss_fn(h, labels)` returns the summed token loss; the backward scales it by
# `loss_scale` (the trainer's 1 / tokens in the global batch). Each `StageRun` owns a `WeightGradQueue` that its
# layers' expert weight gradients go to (every model's stage 3 passes it to its grouped expert linears); the
# schedule drains it right after the B, or later in a W slot for a zero-bubble B.

# %%
#| export
class StageRun:
    "One `StagePart` on one micro-batch: the embedding, the layers' `LayerRun`s and the loss, as steps."

    def __init__(self, part: StagePart, dispatcher, aux_fn=None):
        self.part, self.wgrad = part, WeightGradQueue()
        self.runs = [LayerRun(layer, key, dispatcher, aux_fn, self.wgrad) for key, layer in part.layers.items()]
        self.loss = self.output = self.grad_in = None

    def forward(self, x: Tensor, positions: Tensor, labels: Tensor | None = None, loss_fn=None):
        "x: token ids on stage 0, hidden states elsewhere. Afterwards `output` (or `loss` on the last stage)."
        if self.part.prolog is not None:
            self.ids = x
            yield COMPUTE, self._embed
            x = self.h0
        h = yield from forward_layers(self.runs, x, positions)
        if self.part.is_last:
            self.h_last, self.labels, self.loss_fn = new_leaf(h), labels, loss_fn
            yield COMPUTE, self._loss
        else:
            self.output = h

    def backward(self, grad: Tensor | None, loss_scale=1.0):
        "grad: of `output` (None on the last stage). Afterwards `grad_in`, the input's gradient (None on stage 0)."
        if self.part.is_last:
            self.loss_scale = loss_scale
            yield COMPUTE, self._loss_backward
            grad, self.h_last = self.h_last.grad, None
        grad = yield from backward_layers(self.runs, grad)
        if self.part.prolog is not None:
            self.g0 = grad
            yield COMPUTE, self._embed_backward
        else:
            self.grad_in = grad

    def aux(self) -> Tensor | float:
        "Sum of this micro-batch's load-balance loss terms over the stage's layers (detached)."
        return sum(r.aux.detach() for r in self.runs if r.aux is not None)

    def _embed(self):
        self.h0 = self.part.prolog(self.ids)

    def _loss(self):
        self.loss = self.loss_fn(self.h_last, self.labels)

    def _loss_backward(self):
        (self.loss * self.loss_scale).backward()
        self.loss = self.loss.detach()

    def _embed_backward(self):
        self.h0.backward(self.g0)
        self.h0 = self.g0 = None

# %% [markdown]
# ## Timelines
#
# `Timeline` records the start and end of every action of a step: the host clock on the CPU, and CUDA events on
# the compute stream on a GPU (so a span is the time the compute stream spent on it, and a `comm` span the time it
# waited for transfers). Reading them (`events()`) synchronises the GPU once, after the step.

# %%
#| export
class Timeline:
    "Spans `(kind, micro, start, end)` in seconds from `reset()`: host clock on CPU, CUDA events on a GPU."

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reset(self):
        self.spans, self.origin = [], self._now()

    @contextmanager
    def span(self, kind: str, micro):
        "Time the block; it is also a `record_function` range, so a profiler trace shows the schedule's slots."
        start = self._now()
        with torch.profiler.record_function(kind):
            yield
        self.spans.append((kind, micro, start, self._now()))

    def events(self) -> list[tuple]:
        if self.cuda:
            torch.cuda.synchronize()
            return [(k, m, self.origin.elapsed_time(s) / 1e3, self.origin.elapsed_time(e) / 1e3)
                    for k, m, s, e in self.spans]
        return [(k, m, s - self.origin, e - self.origin) for k, m, s, e in self.spans]

# %% [markdown]
# ## The executor: `DualPipeV`
#
# `DualPipeV(parts, group, dispatcher, loss_fn, aux_fn, device)` runs this rank's schedule. `group` is the pipeline
# process group (None, or a group of one, for a single pipeline rank). `step(micro_batches, loss_scale)` takes the
# step's micro-batches as `(input_ids, labels)` pairs, or `(input_ids, labels, positions)` triples when the
# positions are not 0..S-1 (packed documents; every pipeline rank passes the same list; only rank 0 reads the
# tokens, the others need their shape and the positions), accumulates gradients into the parameters' `.grad` like
# `loss.backward()` would, and returns `(loss_sum, aux_sum)`: the sum of `loss_fn` over the micro-batches (on rank
# 0; zero elsewhere) and the sum of this rank's load-balance terms, both float64.
#
# State lives in dictionaries keyed by `(phase, micro)`, filled and emptied as the schedule says: received inputs,
# outputs waiting to be sent, output gradients (received, or handed over locally at the V's turn), input gradients
# waiting to be sent, the `StageRun`s between their F and B, and the weight-gradient queues between a zero-bubble B
# and its W. A missing key is a schedule bug, and fails loudly. Receive buffers are allocated with the micro-batch's
# `(batch, seq, hidden)` shape in the dtype of the stage's parameters.
#
# **Transfers.** The transfers listed between two compute actions start together, one `batch_isend_irecv`, and
# the compute stream waits for all of them before the next action. So a rank's sends go out with the receives of
# its next action, and a rank never waits on a receive while holding back a send its neighbour needs. The
# transfer itself is exposed, but it is short: at pp 2 on the bench Qwen3 config, 9 ms of a 2.3 s step. Running
# the transfers beside compute instead (one communicator per direction, each send as soon as its tensor exists)
# hid 92% of their NCCL time on two H200s and was 3.8% slower: a receive posted early is an NCCL kernel waiting on
# an SM, and the persistent grouped GEMMs beside it ran up to 1.8× longer (benchmarks/RESULTS.md, "Pipeline stage
# sizes, and transfers beside compute"). The constructor's barrier is the pipeline group's first collective,
# which `batch_isend_irecv` requires to involve all ranks.
#
# With P = 1 (`parallel.overlap`) the same code runs with no transfers at all: rank 0 holds both stages, and in
# the steady state every action is an F&B pair of two micro-batches.

# %%
#| export
def _segments(schedule: list[tuple]) -> tuple[list[tuple[list, tuple]], list]:
    """The compute actions of a schedule, each with the transfers listed since the one before, `[(transfers,
    action)]`, and the transfers after the last action (sends only)."""
    out, transfers = [], []
    for a in schedule:
        if a[0] in COMPUTE_ACTIONS:
            out.append((transfers, a))
            transfers = []
        else:
            transfers.append(a)
    assert all(t[0].startswith("send") for t in transfers), f"receives after the last compute action: {transfers}"
    return out, transfers


# %%
#| export
class DualPipeV:
    """DualPipeV for one pipeline rank: `step(micro_batches, loss_scale) -> (loss_sum, aux_sum)`.

    `parts`: this rank's two `StagePart`s from `split_model`. `group`: the pipeline process group, or None for one
    rank. `dispatcher`: stages 2 and 4 (`LocalDispatcher` or an expert-parallel one). `loss_fn(h, labels)`: summed
    token loss from the last hidden states. `aux_fn(layer_key, routing)`: the load-balance term added to the
    objective (optional). After a step, `timeline.events()` lists its actions."""

    def __init__(self, parts, group, dispatcher, loss_fn, aux_fn=None, device: torch.device | str = "cpu"):
        self.rank = 0 if group is None else dist.get_rank(group)
        self.size = 1 if group is None else dist.get_world_size(group)
        if tuple(p.index for p in parts) != (self.rank, 2 * self.size - 1 - self.rank):
            raise ValueError(f"pipeline rank {self.rank} of {self.size} runs stages {self.rank} and "
                             f"{2 * self.size - 1 - self.rank}, got parts of stages {[p.index for p in parts]}; "
                             "split the model with split_model(model, pp_rank, pp_size) of this group")
        self.parts, self.group, self.dispatcher = parts, group, dispatcher
        self.loss_fn, self.aux_fn, self.device = loss_fn, aux_fn, torch.device(device)
        self.streams, self.timeline = Streams(self.device), Timeline(self.device)
        if self.size > 1:     # the group's first collective, with every rank present (batch_isend_irecv needs it)
            dist.barrier(group=group)

    def step(self, micro_batches: list, loss_scale=1.0) -> tuple[Tensor, Tensor]:
        shapes = {tuple(batch[0].shape) for batch in micro_batches}
        if len(shapes) != 1:
            raise ValueError(f"every micro-batch of a step needs the same (batch, seq) shape, because pipeline "
                             f"receive buffers are allocated from it; got {sorted(shapes)}")
        schedule = dualpipev_schedule(self.rank, self.size, len(micro_batches))   # checks M >= 2P
        (B, S), = shapes
        self.batches, self.loss_scale = micro_batches, loss_scale
        self.buffer = dict(size=(B, S, self.parts[0].hidden_size), dtype=self.parts[0].dtype(), device=self.device)
        self.positions = torch.arange(S, device=self.device)
        self.inputs, self.outputs, self.out_grads, self.in_grads, self.runs, self.wgrads = ({} for _ in range(6))
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)   # sums of detached scalars
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.timeline.reset()
        actions, tail = _segments(schedule)
        for transfers, action in actions:
            self._exchange(transfers)
            self._run(action)
        self._exchange(tail)
        left = [self.inputs, self.outputs, self.out_grads, self.in_grads, self.runs, self.wgrads]
        assert not any(left), f"the schedule left work behind: {left}"
        return self.loss_sum, self.aux_sum

    def _run(self, action: tuple) -> None:
        "One compute action, timed: its forwards and backwards as steps (an F&B's interleaved), then due W."
        with self.timeline.span(*action_kind(action)):
            match action:
                case ("W", p, m):
                    self.wgrads.pop((p, m)).drain()
                    return
                case ("B", _, _, True):       # zero bubble: its W comes later
                    tasks = []
                case _:
                    tasks = [t for t in _tasks(action) if t[0] == "B"]
            gens = [self._forward(p, m) if k == "F" else self._backward(p, m) for k, p, m in _tasks(action)]
            run_steps(self.streams, *gens[::-1])       # a backward's steps are issued first (engine/32_stages)
            for _, p, m in tasks:
                self.wgrads.pop((p, m)).drain()

    def _forward(self, p: int, m: int):
        "Steps of F for stage `p` on micro-batch `m`, then where its output goes."
        part, (ids, labels, *positions) = self.parts[p], self.batches[m]
        run = StageRun(part, self.dispatcher, self.aux_fn)
        x = ids if part.prolog is not None else self.inputs.pop((p, m))
        yield from run.forward(x, positions[0] if positions else self.positions, labels if part.is_last else None,
                               self.loss_fn)
        self.runs[p, m] = run
        self.aux_sum += run.aux()
        if part.is_last:
            self.loss_sum += run.loss.detach()
        elif p == 0 and self.rank == self.size - 1:
            self.inputs[1, m] = run.output             # the V's turn: stage P-1 feeds stage P on the same rank
        else:
            self.outputs[p, m] = run.output.detach()

    def _backward(self, p: int, m: int):
        "Steps of B for stage `p` on micro-batch `m`, then where its input gradient goes."
        run = self.runs.pop((p, m))
        grad = None if run.part.is_last else self.out_grads.pop((p, m))
        yield from run.backward(grad, self.loss_scale)
        self.wgrads[p, m] = run.wgrad
        if run.part.prolog is None:
            if p == 1 and self.rank == self.size - 1:
                self.out_grads[0, m] = run.grad_in     # the V's turn, backwards
            else:
                self.in_grads[p, m] = run.grad_in

    def _exchange(self, transfers: list[tuple]) -> None:
        "Start `transfers` (schedule actions) together and make compute wait for all of them."
        stores = {"send_f": self.outputs, "send_b": self.in_grads, "recv_f": self.inputs, "recv_b": self.out_grads}
        ops = []
        for name, p, m in transfers:
            if name.startswith("send"):
                op, t = dist.isend, stores[name].pop((p, m)).contiguous()
            else:
                op = dist.irecv
                t = stores[name][p, m] = torch.empty(**self.buffer)
            ops.append(dist.P2POp(op, t, group=self.group, group_peer=_peer(name, p, self.rank)))
        if ops:
            with self.timeline.span("comm", None):
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

# %% [markdown]
# ### One rank: the overlapped schedule against plain autograd
#
# With P = 1 the check runs in this process. The tiny model has five layers (layer 2 dense), split 3 + 2 into the
# two stages; the loss is the protocol's `head_loss` (summed token cross-entropy), scaled by 1 / tokens, and the
# load-balance loss is a micro-batch one (the trainer passes its `LoadBalance`). The reference runs the same
# micro-batches one after the other through `run_layers` with one `backward()` each. Loss and gradients must agree
# to 1e-6 / 1e-5 relative in float32. engine/39 runs the same comparison with several pipeline and expert ranks.

# %%
def tiny_model():
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Config(vocab_size=64, hidden_size=32, moe_intermediate_size=16, intermediate_size=48,
                                      num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, mlp_only_layers=[2]))

def lb_term(key, routing, E=4):
    f = torch.bincount(routing.ids.flatten(), minlength=E) / routing.ids.numel()
    return 0.1 * E * (f * routing.probs.mean(0)).sum()

def reference(model, batches, scale):
    loss_sum = aux_sum = 0.0
    for ids, labels in batches:
        h, routings = run_layers(model.model.layers.values(), model.prolog(ids), torch.arange(ids.shape[1]),
                                 LocalDispatcher(4))
        loss = head_loss(model, h, labels)
        aux = sum(lb_term(k, r) for k, r in zip(model.model.layers.keys(), routings) if r is not None)
        (loss * scale + aux).backward()
        loss_sum, aux_sum = loss_sum + loss.detach().double(), aux_sum + aux.detach().double()
    return loss_sum, aux_sum

g = torch.Generator().manual_seed(1)
for M in (2, 3, 5):
    ref, model = tiny_model(), tiny_model()
    batches = [tuple(torch.randint(0, 64, (2, 8), generator=g) for _ in range(2)) for _ in range(M)]
    ref_loss, ref_aux = reference(ref, batches, 1 / (M * 16))
    pipe = DualPipeV(split_model(model, 0, 1), None, LocalDispatcher(4), lambda h, y: head_loss(model, h, y), lb_term)
    loss, aux = pipe.step(batches, 1 / (M * 16))
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                for p, q in zip(model.parameters(), ref.parameters()))
    assert worst < 1e-5 and abs(loss - ref_loss) < 1e-6 * ref_loss and abs(aux - ref_aux) <= 1e-6 * abs(ref_aux)
    print(f"P=1, M={M}: loss {loss.item():.6f} (reference {ref_loss.item():.6f}), worst grad difference {worst:.1e};",
          "actions:", " ".join(k for k, *_ in pipe.timeline.events() if k != "comm"))

try:
    pipe.step(batches[:1], 1.0)
    raise AssertionError("expected a ValueError")
except ValueError as e:
    print("one micro-batch:", e)
