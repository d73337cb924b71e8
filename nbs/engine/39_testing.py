# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Checks across processes
#
# Every distributed piece of the engine is checked the same way: several processes run it, and each compares
# what it gets with a single-process run of the same model on the whole batch, computed in the same process
# with no collective involved. This notebook holds those checks. They live in one exported module,
# `pith_lit.testing`, because the processes that torchrun spawns must import them; the runtime modules
# (engine/31_ep, engine/33_dualpipev) hold only what training runs.
#
# `python -m torch.distributed.run --nproc-per-node N -m pith_lit.testing ep|pipeline [options]` runs a check on
# N processes (gloo on the CPU, NCCL with `--device cuda`); an exception on any rank ends the job with its
# traceback (`run_ranked`). tests/test_ep.py and tests/test_pipeline.py launch them on 2 and 4 CPU processes.

# %%
#| default_exp testing

# %%
#| export
import argparse
import copy
import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from pith_lit.engine.dualpipev import DualPipeV, split_model
from pith_lit.engine.ep import EPDispatcher, SyncFreeEPDispatcher, all_reduce_grads, is_expert_param, shard_experts
from pith_lit.engine.fsdp import begin_step, clip_factor, grad_norm, reduce_gradients, shard_model, whole
from pith_lit.engine.mesh import build_mesh, init_distributed, run_ranked
from pith_lit.models.family import family as model_family
from pith_lit.models.protocol import LocalDispatcher, Options, Routing, head_loss, run_layers
from pith_lit.ops.experts import keep_fp8_copies
from pith_lit.ops.ring_attention import ring_group, zigzag_shard

# %%
import os
import subprocess
import sys
import tempfile

# %% [markdown]
# Notebooks and checks find the repository's files (configs, the package's source for spawned processes) through
# `repo_path`, whatever the current directory: Jupyter runs a notebook in its folder, papermill wherever `--cwd`
# says, pytest at the root.

# %%
#| export
def repo_path(*parts: str) -> Path:
    "A path in the repository this package is installed from (`pip install -e .`), whatever the current directory."
    import pith_lit
    return Path(pith_lit.__file__).resolve().parents[1].joinpath(*parts)

# %% [markdown]
# ## The tiny models and the reference step
#
# `tiny_model` is the model of the checks, 4 routed experts top-2 (8 for the EP checks), the family's
# `tiny_config` (models/21–24): a Qwen3-MoE with one dense layer, a DeepSeek-V2 with its first layer dense, a shared
# expert and latent attention, a GPT-OSS with a short sliding window, or a Qwen3.5-MoE whose every fourth layer is
# full attention and the others linear attention (no dense layer). `aux_fn` is a
# micro-batch load-balance term, E · Σ_i f_i · P_i (train/42_load_balance's formula without its bookkeeping).
# `reference_step` runs micro-batches one after the other through `run_layers` with one `backward()` each, and
# `compare` checks every gradient (max |difference| / max |reference|) and the loss.

# %%
#| export
def tiny_model(family: str = "qwen3_moe", layers: int = 5, seed: int = 0, dtype=torch.float32, experts: int = 4,
               top_k: int = 2, dense: int = 2, options: Options = Options()):
    """The tiny model of the checks in `family` (a model_type): `layers` layers, `experts` routed experts
    top-`top_k`, layer `dense` dense (Qwen3-MoE; DeepSeek-V2's first layer is dense, GPT-OSS and Qwen3.5-MoE have
    none), built with `options` (models/20)."""
    module = model_family(family)
    cfg = module.tiny_config(layers, experts, top_k, dense)
    torch.manual_seed(seed)
    return module.Model(cfg, options).to(dtype)


def aux_fn(num_experts: int, coef: float = 0.1):
    "A micro-batch load-balance term E · Σ_i f_i · P_i."
    def aux(key, routing):
        f = torch.bincount(routing.ids.flatten(), minlength=num_experts) / routing.ids.numel()
        return coef * num_experts * (f * routing.probs.mean(0)).sum()
    return aux


def micro_batches(M: int, vocab: int, seed: int = 1, shape=(2, 8)) -> list[tuple[Tensor, Tensor]]:
    "`M` (input ids, labels) pairs of random tokens."
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, shape, generator=g) for _ in range(2)) for _ in range(M)]


def packed_positions(B: int, S: int, seed: int) -> Tensor:
    """(B, S) positions of packed documents: each row an odd number of documents of random lengths (some of one
    token), restarting at 0 at each."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        n = 2 * int(torch.randint(1, max(2, S // 6) + 1, (), generator=g)) + 1   # odd, at most S
        n = min(n, S if S % 2 else S - 1)
        cuts = torch.randperm(S - 1, generator=g)[:n - 1].add(1).sort().values.tolist()
        bounds = [0] + cuts + [S]
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
    return torch.stack(rows)


def reference_step(model, batches, loss_scale, aux=None, dispatcher=None) -> tuple[Tensor, Tensor]:
    """Plain autograd, one micro-batch (ids, labels[, positions]) after the other: (summed loss, summed
    load-balance terms); fills `.grad`. `dispatcher`: the layers' (default: one rank holds every expert)."""
    loss_sum, aux_sum = 0.0, 0.0
    dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(model.config.routed_experts)
    for ids, labels, *pos in batches:
        positions = pos[0] if pos else torch.arange(ids.shape[1], device=ids.device)
        h, routings = run_layers(model.model.layers.values(), model.prolog(ids), positions, dispatcher)
        loss = head_loss(model, h, labels)
        terms = sum(aux(k, r) for k, r in zip(model.model.layers.keys(), routings) if r is not None) if aux else 0.0
        (loss * loss_scale + terms).backward()
        loss_sum = loss_sum + loss.detach().double()
        aux_sum = aux_sum + (terms.detach().double() if torch.is_tensor(terms) else terms)
    return loss_sum, aux_sum


def max_rel_err(a: Tensor, b: Tensor) -> float:
    "max |a - b| / max |b| (the plain difference when b is zero)."
    err, scale = (a.double() - b.double()).abs().max().item(), b.double().abs().max().item()
    return err / scale if scale else err


def compare(model, ref_grads: dict, loss, ref_loss, what: str, grad_tol: float = 1e-5, loss_tol: float = 1e-6):
    """Check every parameter gradient of `model` against `ref_grads[name]` and the losses (unless `ref_loss` is
    None); returns the worst relative gradient difference."""
    worst = max(max_rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters())
    assert worst <= grad_tol, f"{what}: gradients differ by {worst:.2e} relative (limit {grad_tol:g})"
    if ref_loss is not None:
        rel = max_rel_err(loss, ref_loss)
        assert rel <= loss_tol, f"{what}: loss {loss.item()} vs {ref_loss.item()} ({rel:.2e}, limit {loss_tol:g})"
    return worst

# %% [markdown]
# ## Expert parallelism against one process
#
# `ep_check` runs on every rank of a (dp, ep) mesh: it builds the tiny Qwen3-MoE (8 experts) with the same seed as
# every other rank, computes the single-process reference on the **whole** batch, then shards the experts, runs
# its own shard of the batch (by its rank in `mesh.batch`, dp × ep) through the dispatcher, sums the gradients
# with `all_reduce_grads` (over `mesh.dense` and `mesh.expert`), and compares: the summed loss with the reference
# loss, every non-expert gradient with the reference, and its expert slice with the reference's slice. This is
# what the trainer does with ep > 1, so with dp = 2 it also checks the data sharding and the two gradient groups.
#
# The cases cover what breaks all-to-all code: random routing; **top-k larger than the experts per rank** (every
# rank receives several pairs per token, and sends rows to itself); **every token to one expert** (k = 1; all
# ranks but the last receive nothing, and all experts but one are empty); and **every token to one rank** (all
# other ranks receive nothing at all). The skewed routings are forced through the weights: the embedding gets a
# large constant channel 0, which dominates every token's normalised hidden state, and the router's weights on
# that channel rank the favoured experts first. Each case asserts that the forced routing really happened.
#
# float32 must agree within 1e-5 relative to the largest magnitude, float64 within 1e-12. On CUDA the float64
# cases run in float32 (`F.grouped_mm` has no float64), and float32 gets 1e-4: on two H200s the forced-routing
# cases differed by up to 7.4e-5 in one attention norm weight's gradient, rounding outside the expert exchange.

# %%
#| export
DISPATCHERS = {"counted": EPDispatcher, "sync_free": SyncFreeEPDispatcher}


def tolerance(dtype: str, device: str) -> float:
    "The largest relative error `ep_check` accepts in a `dtype` (`float32`, `float64`) run on `device`."
    return 1e-12 if dtype == "float64" else 1e-4 if device == "cuda" else 1e-5


def force_routing(model, favoured: list[int]) -> None:
    "Make every token of every MoE layer of a tiny Qwen3-MoE rank the `favoured` experts first, in that order."
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0     # dominates the normalised hidden state of every token
        for layer in model.model.layers.values():
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                w[:, 0] = -1.0
                w[favoured, 0] = torch.linspace(1.0, 0.5, len(favoured), dtype=w.dtype, device=w.device)


def ep_check(mesh, case: str, dtype: torch.dtype, device: torch.device, dispatcher: str = "counted") -> dict:
    """One case (`random`, `wide`, `one_expert`, `one_rank`) with the `dispatcher` kind on this rank of `mesh`
    (pp = cp = 1), against the single-process reference; raises AssertionError on a mismatch."""
    W, r, E = mesh.ep.size(), mesh.ep.rank(), 8
    L = E // W
    top_k = {"random": 2, "wide": min(L + 1, E), "one_expert": 1, "one_rank": L}[case]
    model = tiny_model(layers=3, dtype=dtype, experts=E, top_k=top_k, dense=1).to(device)
    if case in ("one_expert", "one_rank"):
        force_routing(model, [E - 1] if case == "one_expert" else list(range(L)))
    B, S, shards = 2, 8, mesh.batch.size()
    tokens = torch.randint(0, 64, (shards * B, S + 1), generator=torch.Generator().manual_seed(1)).to(device)
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    ref = copy.deepcopy(model)
    ref_loss, _ = reference_step(ref, batch, 1 / (shards * B * S))
    shard_experts(model, r, W)
    d = DISPATCHERS[dispatcher](mesh.ep, E)
    mine = slice(mesh.batch.rank() * B, (mesh.batch.rank() + 1) * B)
    h, routings = run_layers(model.model.layers.values(), model.prolog(tokens[mine, :-1]),
                             torch.arange(S, device=device), d)
    loss = head_loss(model, h, tokens[mine, 1:])
    (loss / (shards * B * S)).backward()
    all_reduce_grads(model, mesh.dense, mesh.expert)
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.dense)
    ids = [ro.ids for ro in routings if ro is not None]
    assert case != "one_expert" or all(bool((i == E - 1).all()) for i in ids), "routing not forced to the last expert"
    assert case != "one_rank" or all(bool((i < L).all()) for i in ids), "routing not forced to rank 0's experts"
    errs = {"loss": max_rel_err(total, ref_loss)}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        errs[name] = max_rel_err(p.grad, q.grad[r * L:(r + 1) * L] if is_expert_param(name) else q.grad)
    worst, tol = max(errs, key=errs.get), tolerance(str(dtype).removeprefix("torch."), device.type)
    assert errs[worst] <= tol, f"{case} {dtype} {dispatcher}: {worst} differs by {errs[worst]:.3g} (> {tol:g})"
    return {"dp": mesh.dp.size(), "ep": W, "case": case, "dtype": str(dtype).removeprefix("torch."),
            "dispatcher": dispatcher, "top_k": top_k, "max_rel_err": errs[worst], "traffic": asdict(d.traffic)}

# %% [markdown]
# ## The bytes deduplication saves, at Qwen3-30B-A3B's shape
#
# Qwen3-30B-A3B routes each token to 8 of 128 experts at hidden 2048, in bf16 (4 KiB a row). `qwen3_routing`
# gives the router outputs this measurement uses: a Qwen3 router initialised as the model initialises it
# (N(0, 0.02) weights) on N(0, 1) hidden states (what RMSNorm produces), T tokens per rank, reproducible from the
# rank. A trained router is not uniform: its tokens cluster on related experts, which puts more of a token's
# experts on the same rank, so deduplication saves at least as much there as measured here.
#
# `traffic` dispatches these rows through the counted dispatcher for each ep size that divides the world, with an
# identity "expert" and a weight of 1 on each token's first choice, so every token must get exactly its own row
# back; it returns the byte counters summed over all ranks.

# %%
#| export
def qwen3_routing(rank: int, tokens: int, hidden: int = 2048, num_experts: int = 128,
                  top_k: int = 8) -> tuple[Tensor, Routing]:
    "bf16 hidden states and the routing of a freshly initialised Qwen3 router, for `tokens` tokens of `rank`."
    from pith_lit.models.qwen3_moe import Config, Router
    router = Router(Config(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k))
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(0)) * 0.02)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1000 + rank))
        return x.bfloat16(), router(x)


def traffic(tokens: int, device: torch.device, timeout_s: float) -> dict:
    "Dispatcher byte counters summed over the world, for each ep size in (2, 4, 8) that divides it."
    world, rank, out = dist.get_world_size(), dist.get_rank(), {}
    x, routing = qwen3_routing(rank, tokens)
    x, ids = x.to(device), routing.ids.to(device)
    first = torch.zeros(ids.shape, device=device)
    first[:, 0] = 1
    for ep in (2, 4, 8):
        if world % ep:
            continue
        d = EPDispatcher(build_mesh(1, world // ep, 1, ep, device.type, timeout_s).ep, 128)
        r = Routing(ids, first, None)
        rows = d.dispatch(x, r)
        back = d.combine(d.reduce(d.expand(rows, r)[0], r), r)      # identity experts
        assert torch.equal(back, x), f"ep={ep}: rows lost"
        sums = torch.tensor(list(asdict(d.traffic).values()), device=device)
        dist.all_reduce(sums)
        out[ep] = dict(zip(asdict(d.traffic), sums.tolist()))
    return out

# %% [markdown]
# ## DualPipeV against one process
#
# `pipeline_check` runs DualPipeV with pp = world / ep pipeline ranks (and `ep` expert-parallel ranks) against a
# single-process reference, one step per micro-batch count. With ep > 1 each expert-parallel rank reads its own
# micro-batches (as data parallelism does), so the reference runs all of them, and the ranks sum their gradients
# before comparing; expert gradients are compared with the rank's slice. float32 on the CPU (gradients to 1e-5,
# loss to 1e-6 relative); bf16 on CUDA, where only rounding-level agreement is expected (3e-2 and 1e-3): a
# misrouted activation would be off by far more. The model has max(5, 2·pp + 1) layers, so every one of the 2·pp
# stages gets at least one, or sum(`sizes`) layers cut so. `record_timeline` runs a few steps of a wider model
# and writes every pipeline rank's timeline of the last one.

# %%
#| export
def _pipeline_parallel(ep: int, device: torch.device):
    "(pp group, pp rank, pp size, ep rank, mesh) for pp = world / ep."
    world = dist.get_world_size()
    mesh = build_mesh(world // ep, 1, 1, ep, device.type, 120)
    return mesh.pp, mesh.pp.rank(), world // ep, mesh.ep.rank(), mesh


def _dispatcher(model, mesh, num_experts: int):
    "Shard the experts of `model` for this ep rank and return the dispatcher (LocalDispatcher when ep is 1)."
    if mesh.ep.size() == 1:
        return LocalDispatcher(num_experts)
    shard_experts(model, mesh.ep.rank(), mesh.ep.size())
    return EPDispatcher(mesh.ep, num_experts)


def pipeline_check(micro_counts=(4, 5, 6), ep: int = 1, device: torch.device = torch.device("cpu"),
                   family: str = "qwen3_moe", sizes: list[int] | None = None, fp8: str | None = None) -> None:
    """Worker: DualPipeV against a single-process reference (see above); rank 0 prints one line per rank and count.
    `fp8`: both models built with that FP8 scaling (the reference too), the experts' copies kept for the step."""
    pp_group, pp_rank, pp, ep_rank, mesh = _pipeline_parallel(ep, device)
    cpu = device.type == "cpu"
    dtype, (grad_tol, loss_tol) = (torch.float32, (1e-5, 1e-6)) if cpu else (torch.bfloat16, (3e-2, 1e-3))
    lines, layers = [], sum(sizes) if sizes else max(5, 2 * pp + 1)
    for M in micro_counts:
        opts = Options(fp8=fp8, fp8_dense_min=0)   # every dense projection in FP8 too, at these small widths
        ref, model = (tiny_model(family, layers, dtype=dtype, options=opts).to(device) for _ in range(2))
        for m in (ref, model):
            keep_fp8_copies(m, True)   # with fp8: the copies kept across the micro-batches (fsdp_check: each use)
        shards = [[(x.to(device), y.to(device)) for x, y in micro_batches(M, 64, M + 100 * e)] for e in range(ep)]
        scale, aux = 1 / (M * ep * 16), aux_fn(4)
        ref_loss, ref_aux = reference_step(ref, sum(shards, []), scale, aux)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        parts = split_model(model, pp_rank, pp, sizes)
        loss_fn = (lambda h, labels: head_loss(model, h, labels)) if pp_rank == 0 else None
        pipe = DualPipeV(parts, pp_group, _dispatcher(model, mesh, 4), loss_fn, aux, device)
        loss, aux_sum = pipe.step(shards[ep_rank], scale)
        all_reduce_grads(model, mesh.dense, mesh.expert)
        dist.all_reduce(loss, group=mesh.ep)
        n = 4 // ep
        ref_grads = {k: g[ep_rank * n:(ep_rank + 1) * n] if is_expert_param(k) else g for k, g in ref_grads.items()}
        what = f"rank {dist.get_rank()}: {family} pp={pp} ep={ep} M={M}{' fp8 ' + fp8 if fp8 else ''}"
        worst = compare(model, ref_grads, loss, ref_loss if pp_rank == 0 else None, what, grad_tol, loss_tol)
        dist.all_reduce(aux_sum)
        assert abs(aux_sum - ref_aux) <= loss_tol * abs(ref_aux), f"{what}: load-balance sum {aux_sum} vs {ref_aux}"
        lines.append(f"{what} layers {[list(p.layers) for p in parts]} OK (worst grad difference {worst:.1e})")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, lines)
    if dist.get_rank() == 0:
        print("\n".join(sorted(sum(everyone, []))), flush=True)


def record_timeline(path: str, M: int, ep: int = 1, device: torch.device = torch.device("cpu"), steps: int = 2,
                    hidden: int = 128, seq: int = 64) -> None:
    """Worker: `steps` steps of a wider model (4 layers per pipeline rank); writes the timelines of the last one,
    one per pipeline rank (those of ep rank 0), to `path` (JSON) with the P and M they ran."""
    from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM
    pp_group, pp_rank, pp, ep_rank, mesh = _pipeline_parallel(ep, device)
    cfg = Config(vocab_size=256, hidden_size=hidden, moe_intermediate_size=hidden, num_hidden_layers=4 * pp,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, num_experts=8,
                 num_experts_per_tok=2)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(device, torch.float32 if device.type == "cpu" else torch.bfloat16)
    parts = split_model(model, pp_rank, pp)
    loss_fn = (lambda h, labels: head_loss(model, h, labels)) if pp_rank == 0 else None
    pipe = DualPipeV(parts, pp_group, _dispatcher(model, mesh, 8), loss_fn, aux_fn(8), device)
    batches = [(x.to(device), y.to(device)) for x, y in micro_batches(M, cfg.vocab_size, 10 + ep_rank, (2, seq))]
    for _ in range(steps):
        dist.barrier()                            # so the ranks' clocks start together
        pipe.step(batches, 1 / (M * ep * 2 * seq))
    events = [None] * dist.get_world_size()
    dist.all_gather_object(events, pipe.timeline.events())
    if dist.get_rank() == 0:                      # global rank = pp rank · ep + ep rank
        Path(path).write_text(json.dumps({"P": pp, "M": M, "events": events[::ep]}))

# %% [markdown]
# ## Sharded data parallelism against one process
#
# `fsdp_check` trains the tiny model for a few AdamW steps (gradient clipping included) on a (pp, dp_replicate, dp,
# ep) mesh with FSDP2 (engine/36), and a single-process copy on the whole batch beside it. After every step's
# `reduce_gradients`, each sharded gradient, gathered to its full shape (`full_tensor`, all experts included), must
# equal the reference's, the gradient norm must equal the reference's, and after the last step so must every
# parameter: that covers the sums over the two meshes, HSDP's replicas, the experts' placement and the optimizer on
# DTensors, with the clipping folded into its update (engine/36 `clip_factor`), where the reference clips its
# gradients in place (`clip_grad_norm_`) before an unclipped update. The
# check runs in float64 (to 1e-10 relative): AdamW divides each gradient by its own magnitude, so in float32 the
# rounding of a different summation order (1e-7) grows to 1e-4 in a parameter whose gradient is near AdamW's epsilon
# after one step, which would hide a real error of that size. With pp > 1 (or `overlap`) the step runs through
# DualPipeV, whose deferred weight gradients are what makes the once-per-step reduction necessary. With `--fp8` both
# models run in FP8 (the dense projections too), each use quantizing its own copy of a weight as the trainer does
# where FSDP shards the experts: at dp 2 each rank's micro-batches are the reference's, quantized row for row and
# column for column the same, so the float64 bound holds (tests/test_fsdp.py); at ep 2 an expert's columns are
# quantized over both ranks' rows, which the pipeline check above holds to float32's bound instead.

# %%
#| export
def _step_batches(step: int, M: int, shards: int, S: int, documents: bool, device) -> list:
    "Step `step`'s micro-batches (ids, labels, positions) of rows of `S` tokens, one list per batch shard."
    return [[(x.to(device), y.to(device),
              (packed_positions(2, S, 1000 * step + 10 * s + i) if documents else torch.arange(S)).to(device))
             for i, (x, y) in enumerate(micro_batches(M, 64, 1000 * step + 10 * s, (2, S)))]
            for s in range(shards)]


def _same_grads(model, ref, what: str) -> float:
    "Asserts each gathered gradient of `model` equals `ref`'s to 1e-10 relative; the largest difference."
    ref_grads, worst = {n: p.grad for n, p in ref.named_parameters()}, 0.0
    for name, p in model.named_parameters():
        err = max_rel_err(whole(p.grad), ref_grads[name])
        assert err <= 1e-10, f"{what}: gradient of {name} differs by {err:.2e}"
        worst = max(worst, err)
    return worst


def fsdp_check(pp: int = 1, dp_replicate: int = 1, dp: int = 1, ep: int = 1, family: str = "qwen3_moe", M: int = 4,
               overlap: bool = False, steps: int = 2, device: torch.device = torch.device("cpu"),
               optimizer: str = "adamw", cp: int = 1, documents: bool = False, fp8: str | None = None) -> str:
    """Worker: FSDP2 training steps against a single-process reference (see above); returns this rank's line.
    `optimizer`: train/43's "adamw" (ops/19) or "muon" (which orthogonalises whole matrices of sharded parameters).
    `cp`: context-parallel ranks, each given its zigzag chunks of the sequences (ops/17); `documents`: packed
    documents (`packed_positions`) in every row. `fp8`: both models in FP8 with that scaling, the dense projections
    too, each use quantizing its own copy of a weight as the trainer has it (`Fp8Weights`' default; each optimizer
    step drops the row scales found, ops/18)."""
    mesh = build_mesh(pp, dp, cp, ep, device.type, 120, dp_replicate=dp_replicate)
    layers, shards, pipelined = max(5, 2 * pp + 1), mesh.batch.size(), pp > 1 or overlap
    ref = tiny_model(family, layers, dtype=torch.float64, options=Options(fp8=fp8, fp8_dense_min=0)).to(device)
    model = tiny_model(family, layers, dtype=torch.float64, options=Options(cp_group=ring_group(mesh.cp), fp8=fp8,
                                                                            fp8_dense_min=0)).to(device)
    parts = split_model(model, mesh.pp.rank(), pp) if pipelined else None
    dispatcher = _dispatcher(model, mesh, 4)
    shard_model(model, mesh)
    aux = aux_fn(4) if cp == 1 else None   # E·Σ f·P of a micro-batch is not a sum over its pieces
    S = 8 * max(2, cp)
    from pith_lit.train.optim import build_optimizer   # the harness checks every layer; the optimizer is train/43's
    make = lambda m: build_optimizer(m, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, kind=optimizer)
    opt, ref_opt = make(model), make(ref)
    loss_fn = (lambda h, labels: head_loss(model, h, labels)) if mesh.pp.rank() == 0 else None
    pipe = DualPipeV(parts, mesh.pp, dispatcher, loss_fn, aux, device) if pipelined else None
    what = (f"rank {dist.get_rank()}: {family} pp={pp} dp_replicate={dp_replicate} dp={dp} cp={cp} ep={ep} "
            f"{optimizer}{' documents' if documents else ''}{' fp8 ' + fp8 if fp8 else ''}")
    worst = 0.0
    for step in range(steps):
        data = _step_batches(step, M, shards, S, documents, device)
        scale = 1 / (M * shards * 16)
        ref_loss, _ = reference_step(ref, sum(data, []), scale, aux)
        mine = [tuple(zigzag_shard(t, cp, mesh.cp.rank(), t.dim() - 1) for t in batch)
                for batch in data[mesh.batch.rank()]]
        begin_step(model)
        if pipe is not None:
            loss, _ = pipe.step(mine, scale)
        else:
            loss, _ = reference_step(model, mine, scale, aux, dispatcher)
        reduce_gradients(model)
        dist.all_reduce(loss, group=mesh.dense)   # the data ranks and the context ranks hold different tokens
        worst = max(worst, _same_grads(model, ref, f"{what} step {step}"))
        if mesh.pp.rank() == 0:
            assert max_rel_err(loss, ref_loss) <= 1e-12, f"{what} step {step}: loss {loss.item()} vs {ref_loss.item()}"
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)   # in place, before the update
        norm = grad_norm(list(model.parameters()), dp_replicate)
        assert max_rel_err(norm, ref_norm) <= 1e-10, f"{what} step {step}: gradient norm {norm} vs {ref_norm}"
        opt.step(grad_scale=clip_factor(norm, 1.0)), ref_opt.step()   # inside the update
        opt.zero_grad(), ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        err = max_rel_err(whole(p.detach()), ref_params[name].detach())
        assert err <= 1e-10, f"{what}: parameter {name} after {steps} steps differs by {err:.2e}"
    return f"{what} {'DualPipeV' if pipelined else 'plain'}: {steps} steps OK (worst gradient difference {worst:.1e})"

# %% [markdown]
# ## The command line

# %%
#| export
def _ep_main(a, device: torch.device) -> None:
    f32, f64 = torch.float32, torch.float64 if device.type == "cpu" else torch.float32   # no float64 grouped_mm
    world, checks = dist.get_world_size(), []
    for dp in (1, 2) if world % 4 == 0 else (1,):    # ep = world; and dp = 2 × ep = world/2 where it fits
        mesh = build_mesh(1, dp, 1, world // dp, device.type, a.timeout_s)
        checks += [ep_check(mesh, case, dtype, device, kind) for case, dtype, kind in [
            ("random", f32, "counted"), ("random", f64, "counted"), ("wide", f32, "counted"), ("wide", f64, "counted"),
            ("one_expert", f64, "counted"), ("one_rank", f32, "counted"), ("random", f64, "sync_free"),
            ("wide", f32, "sync_free"), ("one_rank", f64, "sync_free")]]
    result = {"world": world, "checks": checks, "traffic": traffic(a.tokens, device, a.timeout_s)}
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pith_lit.testing",
                                 description="Distributed checks against one process; launch with torchrun")
    ap.add_argument("check", choices=["ep", "pipeline", "fsdp"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: gloo; cuda: NCCL")
    ap.add_argument("--timeout-s", type=float, default=120)
    ap.add_argument("--tokens", type=int, default=2048, help="ep: tokens per rank for the traffic measurement")
    ap.add_argument("--micro", type=int, nargs="*", default=[4, 5, 6], help="pipeline: micro-batch counts")
    ap.add_argument("--ep", type=int, default=1, help="pipeline: expert-parallel ranks (pp = processes / ep)")
    ap.add_argument("--model", nargs="*", choices=["qwen3_moe", "deepseek_v2", "gpt_oss", "qwen3_5_moe"],
                    help="the families checked, one after the other (pipeline: default qwen3_moe; fsdp: default "
                         "qwen3_moe and deepseek_v2)")
    ap.add_argument("--layout", type=int, nargs=4, metavar=("PP", "DP_REPLICATE", "DP", "EP"), default=[1, 1, 2, 1],
                    help="fsdp: the mesh (their product × --cp = processes)")
    ap.add_argument("--cp", type=int, default=1, help="fsdp: context-parallel ranks (zigzag chunks, ring attention)")
    ap.add_argument("--documents", action="store_true", help="fsdp: packed documents in every row")
    ap.add_argument("--overlap", action="store_true", help="fsdp: run the step through DualPipeV at pp = 1")
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="fsdp: the optimizer checked")
    ap.add_argument("--stage-layers", type=int, nargs="*", help="pipeline: layers of each stage (default: even)")
    ap.add_argument("--fp8", choices=["rows", "block"], help="pipeline, fsdp: both models in FP8 with this scaling")
    ap.add_argument("--timeline", help="pipeline: also record a timeline and write it to this JSON file")
    ap.add_argument("--timeline-micro", type=int, default=8, help="micro-batches of the timeline step")
    ap.add_argument("--timeline-hidden", type=int, default=128, help="hidden size of the timeline's model")
    ap.add_argument("--timeline-seq", type=int, default=64, help="sequence length of the timeline's micro-batches")
    a = ap.parse_args(argv)
    _, _, device = init_distributed(a.timeout_s, a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    if a.check == "ep":
        run_ranked(_ep_main, a, device)
    elif a.check == "fsdp":
        for family in a.model or ("qwen3_moe", "deepseek_v2"):
            line = run_ranked(fsdp_check, *a.layout, family, overlap=a.overlap, device=device, optimizer=a.optimizer,
                              cp=a.cp, documents=a.documents, fp8=a.fp8)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, line)
            if dist.get_rank() == 0:
                print("\n".join(everyone), flush=True)
    else:
        for family in a.model or ("qwen3_moe",):
            run_ranked(pipeline_check, a.micro, a.ep, device, family, a.stage_layers, a.fp8)
        if a.timeline:
            run_ranked(record_timeline, a.timeline, a.timeline_micro, a.ep, device, 2, a.timeline_hidden,
                       a.timeline_seq)
    dist.destroy_process_group()


if __name__ == "__main__" and __spec__ is not None:
    main()

# %% [markdown]
# ### Two processes: expert parallelism
#
# Two gloo processes, every case and both dispatchers, each compared with the single-process run inside the
# worker; the worker raises (and the job exits non-zero) on any mismatch.

# %%
root = repo_path()
env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))

def torchrun(nproc: int, *args: str, timeout: int = 300) -> str:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "-m", "pith_lit.testing", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout

two = json.loads(torchrun(2, "ep", "--tokens", "1024").strip().splitlines()[-1])
for c in two["checks"]:
    print(f"{c['case']:>10} {c['dtype']:>7} top-{c['top_k']} {c['dispatcher']:>9}: max relative error "
          f"{c['max_rel_err']:.2e}")
assert len(two["checks"]) == 9

# %% [markdown]
# ### The saving, counted two ways
#
# First from the router outputs alone: for each rank's tokens, the rows a deduplicated dispatch sends to other
# ranks are the distinct destination ranks of each token other than its own, and an undeduplicated one sends
# every pair whose expert is elsewhere. Rank g of the world is rank g mod ep of its ep group (ep innermost).
# This count uses nothing of the dispatcher; the two-process run's counters must equal it at ep = 2, and combine
# returns exactly the deduplicated rows.

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
assert (got["dispatch"], got["dispatch_undeduplicated"]) == want and got["combine"] == want[0], (got, want)
print(f"ep=2, 2×1024 tokens: dispatch {got['dispatch'] / 2**20:.1f} MiB deduplicated vs "
      f"{got['dispatch_undeduplicated'] / 2**20:.1f} MiB one row per pair, metadata {got['dispatch_meta'] / 2**10:.0f} "
      f"KiB; combine {got['combine'] / 2**20:.1f} MiB")

# %% [markdown]
# Per token, from the router outputs of 8 ranks × 1024 tokens (ep = 2, 4, 8 over the same 8 ranks). With 8
# choices among ep ranks, a token's experts share ranks less as ep grows, so the saving shrinks: one row per
# token instead of about four at ep 2, 4.67 instead of 7.02 at ep 8. Combine saves the same, since it returns one
# summed row per row dispatched.

# %%
print("| ep | rows / token, dedup | rows / token, no dedup | saving |")
print("|---|---|---|---|")
saving = {}
for ep in (2, 4, 8):
    dd, nd = (b / (8 * 1024) for b in counted(8, ep))
    saving[ep] = nd / dd
    print(f"| {ep} | {dd / ROW:.2f} | {nd / ROW:.2f} | {saving[ep]:.2f}× |")
assert saving[2] > saving[4] > saving[8] > 1   # more ranks, fewer of a token's experts share one

# %% [markdown]
# ### Two processes: the pipeline
#
# Two ranks, with 2P and 3P micro-batches (tests/test_pipeline.py adds pp 4, pp 2 × ep 2, uneven stages and
# DeepSeek-V2); then the timeline of a step with 8 micro-batches of a wider model (8 layers, hidden 128, sequences
# of 64 tokens). The processes share this machine's cores, so the measured durations are noisy.

# %%
out = Path(tempfile.mkdtemp()) / "timeline.json"
print("\n".join(sorted(l for l in torchrun(2, "pipeline", "--micro", "4", "6", "--timeline", str(out)).splitlines()
                       if l.startswith("rank"))))

# %% [markdown]
# In FP8 (`--fp8`, both models built with `Options(fp8=..., fp8_dense_min=0)`, the dense projections and the experts in
# FP8, on a CPU ops/15's torch definition; the experts' copies kept across the micro-batches, as `train.fp8_keep_copies`
# keeps them, where fsdp_check's FP8 run makes them at each use), at pp 2 and at ep 2, against the single-process run in
# FP8 under the same fp32 bounds. At ep 2 an expert's weight gradient quantizes its columns over the rows it gets from
# both ranks, where the reference had one rank's micro-batch; the scales are powers of two, so a column whose maximum
# moves to another binade is scaled by an exact power of two and its normal E4M3 values do not change: only values in
# E4M3's subnormal range can round differently, and the check holds at the fp32 bound.

# %%
for extra in ((), ("--ep", "2")):
    lines = torchrun(2, "pipeline", "--micro", "4", "--fp8", "rows", *extra).splitlines()
    print("\n".join(sorted(l for l in lines if l.startswith("rank"))))

# %% [markdown]
# ### The measured schedule and the predicted one
#
# Every rank's recorded compute actions are its schedule's, in order; `simulate` then predicts the step from the
# measured median duration of each kind of action. The prediction assumes free transfers, so the difference between
# the two bubble fractions is what the transfers and the waiting for them cost on this machine. (validate/v02 draws
# the two timelines.)

# %%
from pith_lit.engine.dualpipev import COMPUTE_ACTIONS, action_kind, bubble_fraction, dualpipev_schedule, simulate

# %%
run = json.loads(out.read_text())
measured = [[tuple(e) for e in ev] for ev in run["events"]]
P, M = run["P"], run["M"]

def median_durations(events):
    "Median duration of each action kind, from a measured timeline; zero-bubble Bs are matched by schedule."
    by = {}
    for r, ev in enumerate(events):
        actions = [a for a in dualpipev_schedule(r, P, M) if a[0] in COMPUTE_ACTIONS]
        spans = [e for e in ev if e[0] != "comm"]
        assert [action_kind(a)[0] for a in actions] == [e[0] for e in spans]
        for a, e in zip(actions, spans):
            by.setdefault(("B", a[3]) if a[0] == "B" else (a[0],), []).append(e[3] - e[2])
    med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
    return lambda a, rank: med[("B", a[3]) if a[0] == "B" else (a[0],)]

predicted = simulate(P, M, median_durations(measured))
print(f"bubble fraction: measured {bubble_fraction(measured):.3f}, predicted {bubble_fraction(predicted):.3f}")

# %% [markdown]
# ### On one GPU
#
# With P = 1 (`parallel.overlap`) on a GPU, in bf16 at a moderate size: the overlapped schedule must match the
# plain reference to bf16 rounding (the two run their additions in different orders). With a local dispatcher
# there is no all-to-all to hide, so this shows the cost of the machinery (events, stream switches, detach points,
# ten `autograd.backward` calls per MoE layer instead of one per micro-batch) rather than a gain; the gain needs
# expert parallelism across GPUs, where it measured faster than the plain loop (benchmarks/RESULTS.md,
# "Throughput on two H200s: expert parallelism and DualPipeV"). The cell runs only where CUDA is available.

# %%
#| cuda
import time

from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM

if torch.cuda.is_available():
    big = Config(vocab_size=4096, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=16, num_experts_per_tok=4)
    torch.manual_seed(0)
    base = Qwen3MoeForCausalLM(big).cuda().bfloat16()
    M, shape = 8, (4, 1024)
    batches = [tuple(torch.randint(0, big.vocab_size, shape, device="cuda") for _ in range(2)) for _ in range(M)]
    scale, aux = 1 / (M * shape[0] * shape[1]), aux_fn(big.num_experts)
    ref = copy.deepcopy(base)
    ref_loss, _ = reference_step(ref, batches, scale, aux)
    model = copy.deepcopy(base)
    pipe = DualPipeV(split_model(model, 0, 1), None, LocalDispatcher(big.num_experts),
                     lambda h, y: head_loss(model, h, y), aux, "cuda")
    loss, _ = pipe.step(batches, scale)
    worst = compare(model, {n: p.grad for n, p in ref.named_parameters()}, loss, ref_loss, "GPU, P=1", 3e-2, 1e-3)
    print(f"GPU P=1: loss {loss.item():.5f} vs reference {ref_loss.item():.5f}; worst grad difference {worst:.1e}")

    def seconds(fn, n=3):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n

    t_ref = seconds(lambda: reference_step(ref, batches, scale, aux))
    t_pipe = seconds(lambda: pipe.step(batches, scale))
    tokens = M * shape[0] * shape[1]
    print(f"step of {tokens} tokens: plain {t_ref * 1e3:.1f} ms, DualPipeV P=1 {t_pipe * 1e3:.1f} ms")
