# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Sharded data parallelism (FSDP2)
#
# Training state costs 16 bytes per parameter: the fp32 master weight, its fp32 gradient and AdamW's two fp32
# moments. Qwen3-30B-A3B has 30.5B parameters, so about 490 GB: replicated on every data rank it does not fit
# any GPU. Sharded data parallelism keeps 1/N of that state on each of N ranks and all-gathers a layer's
# weights just before the layer runs. PyTorch's `fully_shard` (FSDP2) does this per module: each parameter
# becomes a DTensor holding this rank's rows, and hooks around the module's forward gather the full weights
# (in the compute dtype) and free them afterwards.
#
# What the MoE layout adds:
#
# - **Two meshes.** Non-expert parameters are the same on every rank of `dense` (dp × cp × ep), so they are
#   sharded over all of it; experts are the same only on the ranks of `expert` (dp × cp), so they are sharded
#   there. Under expert parallelism the stacked experts are first made DTensors divided along the expert axis
#   of `ep_mesh`, and FSDP shards them further along dimension 1 (the output rows): their placements become
#   (Shard(1), Shard(0)) over (dp·cp, ep), a distributed checkpoint sees every expert exactly once, and the
#   expert module computes on its local block (`local` in models/20_protocol). HSDP puts a replicate dimension
#   in front of both meshes (engine/30_mesh).
# - **Units.** Each layer's experts are one unit, the rest of the layer another, and the embedding, final norm
#   and head belong to the root. The engine calls `stage1` and the root's `prolog` rather than `forward`, so
#   both are registered as forward methods: FSDP's pre-forward hook gathers the unit, the post-forward hook
#   frees it and places the pre-backward hook on the outputs. The experts unit is entered through its own
#   `forward`, which stage 3 calls, and freed after it. A layer unit stays gathered from its forward to its
#   backward: stage 1 has outputs whose gradients arrive by different paths (the router's weights come back
#   through stage 5 and the combine), and on torch 2.11 the router's backward could run before the hook on the
#   other outputs had gathered the weights again. The attention and router weights are a few percent of a MoE
#   layer, so keeping them costs little.
# - **Sums, not means.** The trainer's objective already divides by the global token count, so gradients must
#   be summed over the data ranks, as the replicated path summed them. Every unit gets a divide factor of 1
#   and plain SUM reductions.
# - **Mixed precision.** The sharded parameters are the fp32 master weights; `MixedPrecisionPolicy` casts them
#   to the compute dtype when gathering and reduces gradients in fp32. The optimizer steps the fp32 shards,
#   and nothing else holds a second copy of the weights.
# - **Once per step.** The pipeline schedule defers weight gradients to its W slots (ops/12's
#   `WeightGradQueue`). FSDP reduce-scatters a unit as soon as the gradient reaches the unit's inputs, which
#   is before a deferred weight gradient exists: the sum would silently miss it. So a step runs with gradient
#   synchronisation off (gradients accumulate unsharded, in fp32) and the units stay gathered after their
#   first backward; `reduce_gradients` then reduce-scatters every unit once, after the last W, and frees the
#   gathered weights before the optimizer step. The plain loop uses the same two calls, so there is one path.
#   The cost is memory: this rank's stages hold unsharded bf16 weights and fp32 gradients during the step (the
#   planner counts it), and the saving is that the fp32 masters and both AdamW moments are sharded.
#
# A unit whose mesh is one rank (a single GPU; experts at dp × cp = 1) has nothing to gather or to sum. If it also
# computes in its own dtype, `fully_shard` would only add copies: each gather copies the weights into the gathered
# buffer and each reduction copies the gradients through a one-rank reduce-scatter, a large part of a one-GPU step
# (benchmarks/RESULTS.md, "Optimizer and sharded data parallelism on one GPU"). Such a unit is left as it is:
# its gradients are already the sums and the optimizer steps it directly. With fp32 masters computing in bf16 the unit is wrapped on one rank
# too, since FSDP's gather is then the cast. Such a unit still frees its bf16 copy after each forward and casts
# again in backward: keeping the copy for the whole step is a little faster but holds a bf16 copy of every weight,
# and memory is what fp32 masters are chosen for (the same section). Checkpoints see the same names and global
# shapes either way.

# %%
#| default_exp engine.fsdp

# %%
#| export
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from pith_lit.engine.mesh import Mesh
from pith_lit.ops.adamw import local, sum_squares

# %% [markdown]
# ## Sharding a model
#
# `shard_model` works in place on a model that is already initialised, cut to this rank's pipeline stages and
# expert slices (engine/31 `shard_experts`), in the dtype its master weights should have (fp32, or bf16 when the
# optimizer states are bf16), and with `stage1` compiled if it is to be: the FSDP hooks then sit outside the
# compiled function, which sees plain gathered tensors. `param_dtype` is the compute dtype; gradients of a
# lower-precision compute are reduced in fp32. None computes and reduces in the parameters' own dtype.

# %%
#| export
def _experts(layer: nn.Module) -> nn.Module | None:
    "The routed-experts module of a decoder layer (`mlp.experts`), or None for a dense layer."
    return getattr(getattr(layer, "mlp", None), "experts", None)


def _as_ep_dtensors(experts: nn.Module, ep_mesh) -> None:
    "Make each stacked expert parameter (this rank's slice) a DTensor divided along dim 0 of `ep_mesh`."
    for name, p in list(experts.named_parameters(recurse=False)):
        d = DTensor.from_local(p.detach(), ep_mesh, [Shard(0)], run_check=False)
        setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))


def _sum_reduction(unit: FSDPModule) -> FSDPModule:
    "Reduce this unit's gradients as plain sums: the objective already divides by the global token count."
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)
    return unit


def shard_model(model: nn.Module, mesh: Mesh, param_dtype: torch.dtype | None = None) -> list[FSDPModule]:
    """Apply FSDP2 to `model` in place: per layer an experts unit (over `mesh.expert_mesh`) and a layer unit (over
    `mesh.dense_mesh`), and the root (embedding, norm, head). Returns the units made, root last."""
    low = param_dtype in (torch.bfloat16, torch.float16)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if low else None)
    ep, units, left = mesh.ep.size() > 1, [], set()   # left: parameters of modules left unwrapped

    def unit(module, device_mesh, **kw):
        if device_mesh.size() == 1 and param_dtype is None:
            left.update(module.parameters())   # one rank, nothing to cast: FSDP would only copy (see above)
            return
        kw = kw | ({"ignored_params": left & set(module.parameters())} if left else {})
        units.append(_sum_reduction(fully_shard(module, mesh=device_mesh, mp_policy=mp, **kw)))

    for layer in model.model.layers.values():
        experts = _experts(layer)
        if experts is not None:
            if ep:
                _as_ep_dtensors(experts, mesh.ep_mesh)
            unit(experts, mesh.expert_mesh, shard_placement_fn=(lambda p: Shard(1)) if ep else None)
        unit(layer, mesh.dense_mesh, reshard_after_forward=False)
        register_fsdp_forward_method(layer, "stage1")     # a no-op on a module left unwrapped
    unit(model, mesh.dense_mesh)
    register_fsdp_forward_method(model, "prolog")
    model.compute_dtype = param_dtype or next(model.parameters()).dtype   # what the pipeline's buffers hold
    # stage1 returns the normalised hidden states flattened to rows, a view; FSDP warns that an in-place op on a view
    # would skip its pre-backward hook. The engine never writes into a stage's outputs, so the warning says nothing.
    warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(\w+\) returned a view tensor", UserWarning)
    # The root must be initialised first: a pipeline rank without the embedding enters through a layer's stage1,
    # which would otherwise make that layer a root of its own.
    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()
    return units

# %% [markdown]
# ## One reduction per step
#
# `begin_step` turns synchronisation off for every unit and keeps gathered weights gathered after backward;
# `reduce_gradients` runs FSDP's post-backward by hand on every unit once all backward and W work of the step
# is done: it adds the last (deferred) gradients to the accumulated ones, reduce-scatters them (all-reduced
# across HSDP replicas) into the sharded `.grad`, and frees the gathered weights. This is private API of
# FSDP2 (the same sequence `torch.distributed.pipelining` uses for its schedules); torch 2.11 keeps one
# parameter group per state, 2.13 a list.
#
# A unit whose mesh is this rank alone (one GPU, or experts at dp × cp = 1) has nothing to sum with anyone, but
# FSDP's reduction still copies every gradient into a flat buffer, through a one-rank reduce-scatter and back
# (its cost is in benchmarks/RESULTS.md, "Optimizer and sharded data parallelism on one GPU"). `_hand_over` gives
# such a unit its accumulated gradient as the sharded one instead, without a copy (with one rank the shard is the
# whole tensor).

# %%
#| export
def _last_backward(model: FSDPModule, last: bool) -> None:
    "Whether the next backward reduces the gradients, frees the gathered weights and ends the step."
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)
    model.set_is_last_backward(last)


def begin_step(model: nn.Module) -> None:
    "Before a step's first forward: accumulate gradients unreduced and keep weights gathered after backward."
    if isinstance(model, FSDPModule):
        _last_backward(model, False)


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return groups


def _hand_over(group) -> None:
    "Reduction over a mesh of one rank: the accumulated unsharded gradient becomes the sharded one, uncopied."
    for fp in group.fsdp_params:
        if not hasattr(fp, "_unsharded_param"):
            continue
        fp.accumulate_unsharded_grad_if_needed()    # a deferred W after unreduced backwards
        fp.to_accumulated_grad_if_needed()          # a low-precision gradient widened to the reduce dtype
        grad = fp.unsharded_accumulated_grad
        if grad is None:
            grad = fp._unsharded_param.grad
        fp.unsharded_accumulated_grad = fp._unsharded_param.grad = None
        if grad is None:
            continue
        grad = fp.to_sharded_dtensor((grad.to_local() if isinstance(grad, DTensor) else grad).view(fp.sharded_size))
        fp.sharded_param.grad = grad if fp.sharded_param.grad is None else fp.sharded_param.grad + grad
    group.reshard()


def reduce_gradients(model: nn.Module) -> None:
    "After a step's last backward and W: reduce-scatter every unit's gradients once and free the gathered weights."
    if not isinstance(model, FSDPModule):
        return
    _last_backward(model, True)
    state = model._get_fsdp_state()
    for st in state._state_ctx.all_states:
        for group in _param_groups(st):
            if group.mesh_info.mesh.size() == 1:
                _hand_over(group)
            else:
                group.post_backward()
    state._root_post_backward_final_callback()   # FSDP's bookkeeping; the groups handed over have nothing left

# %% [markdown]
# ## The gradient norm of sharded gradients
#
# Each rank holds distinct rows of every gradient it has, except that HSDP replicas hold the same rows. So the
# squared norm of the whole model's gradient is the sum over all ranks of their local squared norms, divided by
# the number of replicas. Clipping to `max_norm` multiplies every gradient by
# `c = min(1, max_norm / (‖g‖ + 1e-6))`. The local squared norms are ops/19's `sum_squares` (one pass over the
# gradients); `clip_factor` gives `c` as a 0-d tensor on the gradients' device and the
# optimizer applies it inside its update (ops/19 `AdamW.step(grad_scale=c)`), so the gradients are read once for
# the norm and once for the update, never rewritten.

# %%
#| export
def whole(t: torch.Tensor) -> torch.Tensor:
    "The whole value of a parameter or gradient: a DTensor gathered from its ranks (a collective), else `t` itself."
    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_norm(params, replicas: int = 1, reduce: bool = True) -> torch.Tensor:
    """The whole model's gradient norm (fp32, or wider for wider gradients) from this rank's (sharded) gradients of
    `params`, summed over the default group when one is up and `reduce`. `replicas`: ranks holding the same shard
    (HSDP's dp_replicate)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    sq = sum_squares(grads) if grads else torch.zeros(())
    if reduce and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    return (sq / replicas).sqrt()


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    "What multiplies every gradient to clip gradients of norm `norm` to `max_norm`; None when `max_norm` is 0 (off)."
    return (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else None

# %% [markdown]
# Check, in one process: the norm against float64 by hand over gradients of three shapes (a parameter without a
# gradient is skipped); the factor brings that norm to the limit, is 1 below it, and is None with clipping off.

# %%
gen = torch.Generator().manual_seed(3)
ps = [torch.zeros(s, requires_grad=True) for s in ((4,), (3, 3), (1, 2, 5), (2,))]
for p in ps[:3]:
    p.grad = 3 * torch.randn(p.shape, generator=gen)
by_hand = sum((p.grad.double() ** 2).sum() for p in ps[:3]).sqrt()
norm = grad_norm(ps)
assert abs(norm.item() / by_hand.item() - 1) < 1e-6 and norm.dtype == torch.float32
assert abs((clip_factor(norm, 0.25) * by_hand).item() - 0.25) < 1e-6
assert clip_factor(norm, 1e3).item() == 1.0 and clip_factor(norm, 0.0) is None

# %% [markdown]
# ## Check: one rank, against the unsharded model
#
# On a mesh of size one FSDP changes nothing numerically. The tiny Qwen3-MoE, given a compute dtype (its own,
# fp32) so that every unit is wrapped, gives the same loss and the same gradients as an unsharded copy over two
# micro-batches, its gradients handed over by `_hand_over`, and the gathered weights are freed again after
# `reduce_gradients`; without a compute dtype nothing is wrapped. The checks with several processes (dp, ep × dp,
# HSDP, DualPipeV) run in engine/39.

# %%
import copy

from pith_lit.engine.mesh import build_mesh, init_distributed
from pith_lit.models.protocol import LocalDispatcher, head_loss, run_layers
from pith_lit.models.qwen3_moe import Config, Qwen3MoeForCausalLM

# %%
if not dist.is_initialized():
    init_distributed(60, "cpu")
mesh = build_mesh(1, 1, 1, 1, "cpu", 60)
torch.manual_seed(0)
cfg = Config(vocab_size=64, hidden_size=32, moe_intermediate_size=16, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
             mlp_only_layers=[1])
ref = Qwen3MoeForCausalLM(cfg)
model = copy.deepcopy(ref)
assert shard_model(copy.deepcopy(ref), mesh) == []        # one rank, no cast: left as it is
units = shard_model(model, mesh, torch.float32)
g = torch.Generator().manual_seed(1)
batches = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)) for _ in range(2)]

def step(m, sharded):
    if sharded:
        begin_step(m)
    total = 0.0
    for ids, labels in batches:
        h, _ = run_layers(m.model.layers.values(), m.prolog(ids), torch.arange(8), LocalDispatcher(4))
        loss = head_loss(m, h, labels)
        (loss / 32).backward()
        total += loss.item()
    if sharded:
        reduce_gradients(m)
    return total

assert abs(step(model, True) - step(ref, False)) < 1e-5
worst = max((whole(p.grad) - q.grad).abs().max().item() / q.grad.abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters()))
assert worst < 1e-6, worst
assert all(isinstance(p, DTensor) for p in model.parameters())          # sharded again: the gathered copies are gone
print(f"{len(units)} units; worst relative gradient difference {worst:.1e}")
