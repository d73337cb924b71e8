# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Step time: a measured profile and a link model
#
# The planner of engine/37 says whether a layout fits a GPU; this notebook says how long its step takes. The time of
# a layer on a GPU is measured, not modelled: `profile_layers` times one layer of each kind, the head, the embedding
# and the optimizer step on one GPU at the run's micro-batch, with what the run turns on (compiled stages, FP8
# experts, AdamW or Muon). A stated link model prices the all-to-alls and FSDP's collectives and copies, and the
# DualPipeV schedule is simulated with those durations (engine/33 `simulate`). `python -m pith_lit.plan` (train/50)
# predicts the step of every layout it lists from one measured profile, and `parallel.pp_stage_layers = "auto"`
# (train/45) cuts the pipeline with `choose_stage_layers` (below).

# %%
#| default_exp engine.steptime

# %%
#| export
import copy
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from pith_lit.engine.dualpipev import simulate
from pith_lit.engine.fsdp import clip_factor, grad_norm
from pith_lit.engine.mesh import stage_layers
from pith_lit.engine.planner import Unit, Workload, is_moe, ranks_per_token
from pith_lit.engine.stages import LayerRun
from pith_lit.models.protocol import head_loss
from pith_lit.ops.grouped_linear import WeightGradQueue

# %% [markdown]
# ## The profile
#
# `profile_layers` builds one layer of each kind of the model (dense or MoE, and the attention kind: full, sliding,
# linear) at full width on one GPU, runs a micro-batch through it stage by stage with the local dispatcher (engine/32
# `LayerRun`) and times its forward, its backward with the expert weight gradients deferred, and their W (ops/12's
# queue); for a MoE layer also the forward of its stage 3 alone, which `train.recompute = "layer"` runs again in
# backward (`"attention"` the rest of the forward). Then the head's loss and its backward, and the embedding.
# Compiled stages are compiled first (`w.compile`); under `train.fp8` the layers' experts run FP8 (ops/15). Times
# scale with a rank's tokens per micro-batch (the sequence length stays the profile's).
#
# The optimizer step is timed the same way, on the parameters themselves: for each layer kind, the clipping of the
# gradients and one step of the run's optimizer (train/43: AdamW, or Muon, whose Newton–Schulz iterations run on
# each stacked `(E, out, in)` expert tensor) over the layer's routed experts and, separately, over the rest of the
# layer; and over the root (embedding, final norm, head). The parameters are in the optimizer's dtype and carry the
# names they have in the model (`model.layers.KEY.…`), which is what Muon's choice of matrices reads.

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
    layers: dict              # kind -> {"F": ms, "B": ms (its W deferred), "W": ms, "F3": ms of F in stage 3}
    head: dict                # {"F": ms (the loss, gradients included), "B": ms}
    embed: dict               # {"F": ms, "B": ms}
    optimizer_ms: dict        # kind, "KIND experts", "root" -> ms of clipping and one step of those parameters, whole
    optimizer: str = "adamw"  # the optimizer timed (train.optimizer)
    fp8: bool = False         # the layers' experts timed in FP8 (train.fp8)
    param_bytes: int = 2      # the bytes of the parameters the optimizer steps

    def scaled(self, tokens: int) -> "Profile":
        "The same profile for `tokens` tokens per micro-batch (layer, head and embedding times proportional to tokens)."
        s = tokens / self.tokens
        sc = lambda d: {k: v * s for k, v in d.items()}
        return replace(self, tokens=tokens, layers={k: sc(v) for k, v in self.layers.items()}, head=sc(self.head),
                       embed=sc(self.embed))


DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}   # element bytes -> the dtype the planner means


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

# %% [markdown]
# A layer's three times come from three loops: forward alone, forward and backward, forward, backward and W; the
# backward is the second minus the first, W the third minus the second. Stage 3's forward is timed inside whole
# forwards, so that it sees the inputs the rest of the layer made.

# %%
#| export
def _time_layer(layer: nn.Module, key: str, x, positions, dispatcher, device, reps: int, moe: bool) -> dict:
    """ms of `layer`'s forward stage by stage (F), its backward with the expert weight gradients deferred (B), their W,
    and for a MoE layer the forward of its stage 3 alone (F3)."""
    queue, state = WeightGradQueue(), {}

    def fwd():
        run = LayerRun(layer, key, dispatcher, None, queue)
        for _, fn in run.forward(x.detach().requires_grad_(), positions):
            fn()
        state["run"] = run

    def bwd():
        run = state.pop("run")
        for _, fn in run.backward(torch.ones_like(run.h_out)):
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
        t_3 = experts_time() if moe else 0.0
    return {"F": t_f, "B": max(t_fb - t_f, 0.0), "W": max(t_w - t_fb, 0.0), "F3": t_3}

# %% [markdown]
# The optimizer is the run's, given as `optimizer(module)`: an optimizer over a module's parameters that require
# gradients (train/45 `optimizer_for` passes train/43's `build_optimizer` with the config's settings; this engine
# notebook does not import the trainer's). The gradients are random; the clipping is engine/36's `grad_norm` (without
# its all-reduce: every rank times its own layers) and `clip_factor`, handed to the optimizer's update.

# %%
#| export
def _as_model(key: str, module: nn.Module) -> nn.Module:
    "`module` under the names it has in a model, `model.layers.KEY.…` (Muon chooses its matrices by name, train/43)."
    return nn.ModuleDict({"model": nn.ModuleDict({"layers": nn.ModuleDict({key: module})})})


def _time_optimizer(module: nn.Module, optimizer, device, reps: int) -> float:
    "ms of clipping the gradients of `module`'s parameters that require them, then one step of `optimizer(module)`."
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = optimizer(module)
    return _time(lambda: opt.step(grad_scale=clip_factor(grad_norm(params, reduce=False), 1.0)), device, reps)


def _time_layer_optimizer(layer: nn.Module, key: str, optimizer, device, dtype, reps: int) -> dict:
    "ms of the optimizer step over a layer's routed experts (\"experts\") and over the rest of it, in `dtype`."
    layer.to(dtype)
    out = {}
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is not None:
        alone = nn.ModuleDict({"mlp": nn.ModuleDict({"experts": experts})})
        out["experts"] = _time_optimizer(_as_model(key, alone), optimizer, device, reps)
        experts.requires_grad_(False)   # the rest: the optimizer leaves out what needs no gradient
    out["rest"] = _time_optimizer(_as_model(key, layer), optimizer, device, reps)
    return out


def _time_ends(ends: nn.Module, ids, x, device, reps: int) -> tuple[dict, dict]:
    "ms of the head's loss (gradients included) and its backward, and of the embedding forward and backward."
    labels = ids.clone()
    with torch.enable_grad():
        h = x.detach().requires_grad_()
        t_loss = _time(lambda: head_loss(ends, h, labels), device, reps)
        t_lossb = _time(lambda: head_loss(ends, h, labels).backward(), device, reps) - t_loss
        t_emb = _time(lambda: ends.prolog(ids), device, reps)
        t_embb = _time(lambda: ends.prolog(ids).backward(x), device, reps) - t_emb
    return {"F": t_loss, "B": max(t_lossb, 0.0)}, {"F": t_emb, "B": max(t_embb, 0.0)}

# %% [markdown]
# `profile_layers` puts them together. The layers run as the model was built: FP8 experts when its `Options` say so
# (models/20; the trainer's `meta_model` builds it with the run's), which must agree with the workload's `fp8`. Their
# `Fp8Weights` hold no copies (ops/18's default, the trainer's unless `train.fp8_keep_copies`), so every timed
# repetition quantizes the weights it uses, as each micro-batch of a run does.

# %%
#| export
def profile_layers(model: nn.Module, w: Workload, device, dispatcher, optimizer, reps: int = 3) -> Profile:
    """Measure `model` (a whole model on the meta device, left as it is) on `device`: one layer of each kind, the head,
    the embedding and the optimizer step, for one micro-batch of `w.micro_batch` × `w.seq_len` tokens in `w`'s
    compute dtype. `dispatcher`: the local one (models/20 `LocalDispatcher`); `optimizer(module)`: the run's optimizer
    over a module's parameters that require gradients."""
    if any(getattr(m, "fp8_copies", None) is not None for m in model.modules()) != w.fp8:
        raise ValueError(f"workload fp8={w.fp8}, but the model's experts disagree: build it with Options(fp8=...)")
    device = torch.device(device)
    dtype, param_dtype = DTYPES[w.compute_bytes], DTYPES[w.param_bytes]
    c, g = model.config, torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (w.micro_batch, w.seq_len), device=device, generator=g)
    x = torch.randn(w.micro_batch, w.seq_len, c.hidden_size, device=device, generator=g, dtype=dtype)
    positions = torch.arange(w.seq_len, device=device)
    layers, steps = {}, {}
    for i, (key, meta_layer) in enumerate(model.model.layers.items()):
        kind = layer_kind(c, i)
        if kind in layers:
            continue
        layer = _materialise(copy.deepcopy(meta_layer), device, dtype)
        if w.compile:
            layer.stage1, layer.stage5 = torch.compile(layer.stage1), torch.compile(layer.stage5, fullgraph=True)
        layers[kind] = _time_layer(layer, key, x, positions, dispatcher, device, reps, is_moe(c, i))
        for part, ms in _time_layer_optimizer(layer, key, optimizer, device, param_dtype, reps).items():
            steps[kind if part == "rest" else f"{kind} experts"] = ms
        del layer
    ends = copy.deepcopy(model)
    ends.model.layers = nn.ModuleDict()
    _materialise(ends, device, dtype)
    head, embed = _time_ends(ends, ids, x, device, reps)
    steps["root"] = _time_optimizer(ends.to(param_dtype), optimizer, device, reps)
    return Profile(w.tokens, str(device), w.compile, layers, head, embed, steps, w.optimizer, w.fp8, w.param_bytes)

# %% [markdown]
# **Check on the CPU.** A tiny Qwen3-MoE with one dense layer: the profile has both layer kinds and an optimizer time
# for each part of the model, and under `train.fp8` the layers' experts run the FP8 layer (on the CPU, ops/15's torch
# reference `_torch_forward`, counted here), without it they do not.

# %%
import pith_lit.ops.fp8 as fp8
from pith_lit.engine.planner import rank_units
from pith_lit.models import qwen3_moe
from pith_lit.models.protocol import LocalDispatcher, Options
from pith_lit.ops.adamw import AdamW

tiny = qwen3_moe.Config(vocab_size=96, hidden_size=32, moe_intermediate_size=24, intermediate_size=40,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                        num_experts_per_tok=2, mlp_only_layers=[1])

def meta_tiny(fp8=None):
    with torch.device("meta"):
        return qwen3_moe.Qwen3MoeForCausalLM(tiny, Options(fp8=fp8))

adamw = lambda m: AdamW([p for p in m.parameters() if p.requires_grad])
w = Workload(micro_batch=2, seq_len=16, compute_bytes=4, param_bytes=4)
forwards = []
torch_forward = fp8._torch_forward
fp8._torch_forward = lambda *a: (forwards.append(1), torch_forward(*a))[1]
try:
    prof = profile_layers(meta_tiny(), w, "cpu", LocalDispatcher(4), adamw, reps=1)
    plain = len(forwards)
    prof8 = profile_layers(meta_tiny("rows"), replace(w, fp8=True), "cpu", LocalDispatcher(4), adamw, reps=1)
finally:
    fp8._torch_forward = torch_forward
print({k: {x: round(v, 3) for x, v in d.items()} for k, d in prof.layers.items()})
print({k: round(v, 3) for k, v in prof.optimizer_ms.items()}, f"FP8 layer forwards: {plain}, {len(forwards) - plain}")
assert set(prof.layers) == {"moe full", "dense full"}
assert set(prof.optimizer_ms) == {"moe full", "moe full experts", "dense full", "root"}
assert all(v > 0 for v in prof.optimizer_ms.values()) and prof.layers["moe full"]["F3"] > 0
assert plain == 0 and len(forwards) > 0 and prof8.fp8 and not prof.fp8
try:
    profile_layers(meta_tiny(), replace(w, fp8=True), "cpu", LocalDispatcher(4), adamw, reps=1)
except ValueError as e:
    assert "Options(fp8=...)" in str(e), e
else:
    raise AssertionError("a bf16 model profiled as FP8")

# %% [markdown]
# ## The link model
#
# What moves between GPUs takes bytes ÷ bandwidth, with one bandwidth inside a node and another between nodes, stated
# and overridable: NVLink 200 GB/s per GPU and direction for NCCL's all-to-all and collectives inside an H100/H200 node
# (nominal 450 GB/s; NCCL reaches well under it), 40 GB/s between nodes (400 Gb/s InfiniBand per GPU). Ranks are laid
# out with ep innermost, then cp, dp, dp_replicate and pp (engine/30), so a group spans nodes when its ranks' stride
# times its size exceeds the node.
#
# - **Expert parallelism**: per MoE layer and micro-batch, dispatch sends each token's row once to each of the other
#   ranks holding one of its experts (engine/37 `ranks_per_token`), combine returns as many, and backward does both
#   again; exposed in the plain loop and in an F or B that runs alone, hidden beside the other task of an F&B.
# - **FSDP**: the all-gathers run ahead of compute (FSDP2 prefetches) and count as hidden; `reduce_gradients`
#   reduce-scatters every unit's fp32 gradient after the last backward, exposed; HSDP then all-reduces the shards
#   across replicas. A wrapped unit also costs copies on its own GPU, at the GPU's copy bandwidth (4.3 TB/s read plus
#   written on the H200, DESIGN.md): each gather writes the weights in the compute dtype (an experts unit is gathered
#   in every backward and in the first forward), each backward adds the unit's gradient into its fp32 accumulator.
# - **Pipeline transfers** of activations between ranks are small beside these (0.4% of a two-GPU step,
#   benchmarks/RESULTS.md) and are left out, and so are Muon's exchanges of momentum (an all-gather of each
#   sharded single matrix, the size of one FSDP gather of it; two all-to-alls of a 1/ranks share for the experts,
#   train/43).

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

# %% [markdown]
# ## One step
#
# `step_time` adds up one step of a rank from four parts, each a function below:
#
# 1. every layer's seconds on one micro-batch: its F, B (where recomputation runs a stage's forward again, that
#    forward too), W, and one exchange of its all-to-alls;
# 2. the micro-batches through the layers: one after another in the plain loop, every exchange exposed; or the
#    DualPipeV schedule of engine/33 simulated with each stage's sums, the embedding on the first stage and the
#    head on the last;
# 3. the optimizer step, from the profile's step over whole layers: AdamW's time follows the elements a rank holds
#    (its experts, its FSDP shard, in its dtype); Muon divides the routed experts' whole matrices among the ranks of
#    a shard group and orthogonalises every other matrix whole on each of them (train/43), so its time follows a
#    rank's share of the experts, and the whole of the other matrices. The root (embedding, norm, head) steps with
#    AdamW under either;
# 4. FSDP's copies and exposed collectives (the link model above).

# %%
#| export
@dataclass
class StepTime:
    "A predicted step: its time (s), tokens/s for all ranks, and where the time goes (s)."
    seconds: float
    tokens_per_s: float
    parts: dict


def _layer_seconds(c, w: Workload, prof: Profile, key: str, link: Link) -> dict:
    "Seconds of layer `key` on one micro-batch: F, B (with the forward recomputation runs again), W, X: one exchange."
    ms = prof.layers[layer_kind(c, int(key))]
    again = 0.0
    if w.recompute != "none":
        again = ms["F"] - (ms.get("F3", 0.0) if w.recompute == "attention" else 0.0)
    exchange = 0.0
    if is_moe(c, int(key)) and w.ep > 1:
        d = w.ep if w.sync_free else ranks_per_token(c.routed_experts, c.num_experts_per_tok, w.ep)
        exchange = w.tokens * c.hidden_size * w.compute_bytes * d * (w.ep - 1) / w.ep / link.bandwidth(1, w.ep)
    return {"F": ms["F"] / 1e3, "B": (ms["B"] + again) / 1e3, "W": ms["W"] / 1e3, "X": exchange}


def _plain_loop(w: Workload, per: dict, prof: Profile) -> tuple[float, float]:
    "(seconds, of which exposed all-to-alls) of the micro-batches run one after another."
    ends = (prof.head["F"] + prof.head["B"] + prof.embed["F"] + prof.embed["B"]) / 1e3
    one = sum(t["F"] + t["B"] + t["W"] + 4 * t["X"] for t in per.values()) + ends
    return w.micro_batches * one, w.micro_batches * 4 * sum(t["X"] for t in per.values())


def _stage_sums(w: Workload, per: dict, keys: list[str], prof: Profile) -> dict:
    "(stage, \"F\" | \"B\" | \"W\" | \"X\") -> seconds of one micro-batch on that stage; X: its exchanges."
    last, sums = 2 * w.pp - 1, {}
    for s, layers in enumerate(stage_layers(len(keys), w.pp, list(w.stage_layers) or None)):
        for what in ("F", "B", "W"):
            sums[s, what] = sum(per[keys[i]][what] for i in layers)
        sums[s, "X"] = 2 * sum(per[keys[i]]["X"] for i in layers)
        for what in ("F", "B"):   # the embedding on the first stage, the head and the loss on the last
            sums[s, what] += ((prof.embed[what] if s == 0 else 0) + (prof.head[what] if s == last else 0)) / 1e3
    return sums


def _dualpipev(w: Workload, sums: dict) -> tuple[float, float]:
    "(seconds, of which exposed all-to-alls) of the DualPipeV schedule simulated with the stages' sums."
    last, exposed = 2 * w.pp - 1, [0.0]
    work = lambda r, p, what: sums[r if p == 0 else last - r, what]

    def duration(action, r):
        match action:
            case ("F", p, m):
                exposed[0] += work(r, p, "X")
                return work(r, p, "F") + work(r, p, "X")
            case ("B", p, m, zb):
                exposed[0] += work(r, p, "X")
                return work(r, p, "B") + (0 if zb else work(r, p, "W")) + work(r, p, "X")
            case ("FB", (pf, _), (pb, _)):
                compute = work(r, pf, "F") + work(r, pb, "B") + work(r, pb, "W")
                hidden = max(work(r, pf, "X") + work(r, pb, "X") - compute, 0.0)
                exposed[0] += hidden
                return compute + hidden
            case ("W", p, m):
                return work(r, p, "W")

    events = simulate(w.pp, w.micro_batches, duration)
    span = max(e[3] for ev in events for e in ev) - min(e[2] for ev in events for e in ev)
    return span, exposed[0] / w.pp


def _optimizer_seconds(c, w: Workload, profile: Profile, units: list[Unit]) -> float:
    "Seconds of the optimizer step of a rank holding `units` (part 3 above)."
    total = 0.0
    for u in units:
        if u.numel == 0:
            continue
        part = "root" if u.layer is None else layer_kind(c, int(u.layer)) + (" experts" if u.experts else "")
        held = 1 / w.ep if u.experts else 1.0   # the profile's layer holds every expert
        if w.optimizer == "adamw" or u.layer is None:
            held *= u.shard / u.numel * w.param_bytes / profile.param_bytes
        elif u.experts:   # Muon: the shard group's ranks divide the experts' whole matrices among them (train/43)
            held *= u.shard / u.numel
        total += profile.optimizer_ms[part] * held / 1e3
    return total


def _fsdp_seconds(w: Workload, units: list[Unit], link: Link) -> dict:
    "FSDP's casts on the GPU, the gradients' reduce-scatter and HSDP's all-reduce across replicas (seconds)."
    b = w.compute_bytes
    moved = 0.0   # a wrapped unit's casts: each gather reads the shard and writes the compute dtype, each
    for u in units:   # backward adds its gradient into the fp32 accumulator
        if u.wrapped:
            gathers = w.micro_batches + 1 if u.experts else 1
            moved += u.numel * (gathers * (w.param_bytes / u.shards + b) + w.micro_batches * (b + 2 * max(4, b)))
    parts = {"FSDP casts": moved / link.copy}
    parts["gradient reduce-scatter"] = sum(
        u.numel * max(4, b) * (u.shards - 1) / u.shards / link.bandwidth(1 if not u.experts else w.ep, u.shards)
        for u in units if u.wrapped and u.shards > 1)
    if w.dp_replicate > 1:
        parts["replica all-reduce"] = sum(2 * u.shard * max(4, b) * (w.dp_replicate - 1) / w.dp_replicate
                                          for u in units) / link.bandwidth(w.dp * w.cp * w.ep, w.dp_replicate)
    return parts


def step_time(c, w: Workload, profile: Profile, units: list[Unit] | None = None, link: Link = Link()) -> StepTime:
    """The predicted time of one step of `w` for model config `c`, from `profile` (measured at another micro-batch is
    fine; with the run's optimizer and FP8) and `link`; `units`: pipeline rank 0's FSDP units (engine/37
    `rank_units`), for the optimizer and FSDP's parts."""
    if (profile.optimizer, profile.fp8) != (w.optimizer, w.fp8):
        raise ValueError(f"the profile timed optimizer {profile.optimizer} with fp8 {profile.fp8}, the run has "
                         f"{w.optimizer} with fp8 {w.fp8}: measure a profile of the run (python -m pith_lit.plan "
                         "CONFIG --measure FILE)")
    prof = profile.scaled(w.tokens)
    keys = [str(i) for i in range(c.num_hidden_layers)]
    per = {key: _layer_seconds(c, w, prof, key, link) for key in keys}
    if w.pipelined:
        compute, exposed = _dualpipev(w, _stage_sums(w, per, keys, prof))
    else:
        compute, exposed = _plain_loop(w, per, prof)
    parts = {"compute and exposed all-to-alls": compute, "of which all-to-alls": exposed}
    if units is not None:
        parts["optimizer"] = _optimizer_seconds(c, w, profile, units)
        parts |= _fsdp_seconds(w, units, link)
    seconds = sum(v for k, v in parts.items() if not k.startswith("of which"))
    tokens = w.micro_batch * w.seq_len * w.micro_batches * w.dp_replicate * w.dp * w.ep
    return StepTime(seconds, tokens / seconds, parts)

# %% [markdown]
# **Check: the optimizer in the step.** On one rank the step's optimizer part is the profile's times of every part of
# the model, added by hand here, and the step without the units is that much shorter (no FSDP unit is wrapped: fp32
# throughout). At dp 2 AdamW steps half of every unit; the same times read as Muon's halve the root and the experts.

# %%
units = rank_units(meta_tiny(), w)
t = step_time(tiny, w, prof, units)
by_hand = prof.optimizer_ms["root"] + sum(prof.optimizer_ms[layer_kind(tiny, i)]
                                          + prof.optimizer_ms.get(f"{layer_kind(tiny, i)} experts", 0.0)
                                          for i in range(tiny.num_hidden_layers))
print({k: f"{v * 1e3:.3f} ms" for k, v in t.parts.items()})
assert abs(t.parts["optimizer"] - by_hand / 1e3) < 1e-12
assert abs(t.seconds - step_time(tiny, w, prof).seconds - by_hand / 1e3) < 1e-12
w2 = replace(w, dp=2)
half = step_time(tiny, w2, prof, rank_units(meta_tiny(), w2)).parts["optimizer"]
muon = step_time(tiny, replace(w2, optimizer="muon"), replace(prof, optimizer="muon"),
                 rank_units(meta_tiny(), w2)).parts["optimizer"]
assert abs(half / t.parts["optimizer"] - 0.5) < 0.01, half / t.parts["optimizer"]
experts = sum(prof.optimizer_ms.get(f"{layer_kind(tiny, i)} experts", 0.0) for i in range(tiny.num_hidden_layers))
assert abs(muon - (by_hand - prof.optimizer_ms["root"] / 2 - experts / 2) / 1e3) < 1e-9, (muon, by_hand)

# %% [markdown]
# ## Cutting the pipeline from measured times
#
# At pp > 1 rank 0 holds the first and the last stage, the embedding, the final norm and the head, so layers cut
# evenly leave the other ranks waiting for it (benchmarks/RESULTS.md: 3-4-3-2 beat 3-3-3-3 on the Qwen3 bench).
# `choose_stage_layers` starts from the even cut and moves one layer at a time to a neighbouring stage while the
# busiest rank's work on a micro-batch (its two stages, with the embedding or the head) gets smaller; from the better
# of that cut and the even one it makes up to three more such moves judged by the simulated step (the profile's times
# through `simulate`, with at most 4·pp micro-batches: more only repeat the steady state). `parallel.pp_stage_layers =
# "auto"` runs it at start-up on a profile measured there (train/45).

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
# With a head that costs as much as three layers (a made-up profile of twelve MoE layers, the Qwen3 bench's depth),
# `choose_stage_layers` takes layers off rank 0's two stages, and the simulated step gets shorter than with the even
# cut.

# %%
twelve = replace(tiny, num_hidden_layers=12, mlp_only_layers=[])
made_up = Profile(4096, "made up", False, {"moe full": {"F": 1.0, "B": 1.4, "W": 0.6}}, {"F": 3.0, "B": 1.0},
                  {"F": 0.1, "B": 0.1}, {"moe full": 0.1, "moe full experts": 0.5, "root": 0.2})
w = Workload(pp=2, micro_batch=1, micro_batches=8, pipelined=True)
cut = choose_stage_layers(twelve, w, made_up)
even = step_time(twelve, w, made_up).seconds
best = step_time(twelve, replace(w, stage_layers=tuple(cut)), made_up).seconds
print(f"stages {cut}: {best * 1e3:.1f} ms against {even * 1e3:.1f} ms for the even cut")
assert cut[0] + cut[-1] < 6 and best < even
