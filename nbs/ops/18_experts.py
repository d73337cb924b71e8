# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The routed experts' matmuls
#
# Every model family runs its routed experts through the two calls here, on rows grouped by expert:
# `expert_mlp`, the SwiGLU experts (Qwen3, DeepSeek-V2, Qwen3.5), and `expert_linear`, one projection (GPT-OSS,
# whose experts add biases and clamp). Each runs in the compute dtype, `grouped_linear` (ops/12) and `swiglu`
# (ops/10), unless it is given an `Fp8Weights`: then it runs the FP8 layers of ops/15 on the step's FP8 copies of
# the weights.
#
# Precision is chosen once, when the model is built: an experts module built with `Options.fp8` set (models/20;
# `train.fp8`, `train.fp8_scaling`) holds an `Fp8Weights` with that scaling and hands it to these calls; one built
# without holds `None`. Only the FP8 branch imports ops/15, so a model in the compute dtype never loads the FP8
# kernels.

# %%
#| default_exp ops.experts

# %%
#| export
import weakref

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from pith_lit.ops.grouped_linear import WeightGradQueue, grouped_linear
from pith_lit.ops.swiglu import swiglu

# %% [markdown]
# ## One FP8 copy of each expert weight per step
#
# A step runs every expert layer once per micro-batch, forward and backward, and the weights change only at the
# optimizer step. So `train.fp8` can quantize each expert weight once per step: `Fp8Weights` holds the copies of one
# experts module (forward layout and transposed, both made by one pass over the weight on first use when the weight
# will get a gradient, only the forward's under `no_grad`) and `clear()` drops them. The copies cost 2 bytes per
# expert weight element for the step (1 each way), as much as a bf16 copy of the weights, and turn the 2
# quantization passes over each weight per micro-batch into 1 per step.
#
# A copy made from a weight that has since changed would be silently stale: the layer would go on multiplying by
# last step's weights. So the copies do not rely on their caller to drop them. Importing this module registers a hook
# that runs after every `torch.optim.Optimizer`'s step (PyTorch's global `register_optimizer_step_post_hook`; ops/19's
# AdamW and train/43's Muon are optimizers of that kind) and clears every live `Fp8Weights` of the process, the
# trainer's and those of a user's own loop alike. Clearing those of a model the step did not update costs a
# quantization pass and never a wrong value. It frees the copies where the trainer would want them freed, before the
# next forward makes new ones. A weight changed any other way (a checkpoint loaded into a model that has already
# run, an edit under `no_grad`) needs `drop_fp8_copies(model)`, which clears every `Fp8Weights` the model's modules
# hold. The check below changes a weight in place and shows what `clear` prevents, that it does, and that an
# optimizer's step does it unasked.
#
# The copies pay for themselves only when a step runs several micro-batches. With one, a kept copy saves a single read
# of the weight (one pass writing both layouts instead of one pass each way) and holds both layouts of every expert
# weight from its layer's forward to the optimizer step, which takes FP8's peak above bf16's (benchmarks/RESULTS.md,
# "FP8 end to end"). Nor do they pay where FSDP shards the experts (over dp × cp ranks, engine/36): a copy is made from
# the gathered, whole weight, so keeping it would hold every layer's experts whole through the step, 2 bytes an element
# where the rank's share of the bf16 weights is 2 bytes over the number of ranks, undoing what the sharding saves. So
# with `keep` off an `Fp8Weights` keeps no copy: each use quantizes the layout it needs from the weight, the forward's
# in the forward and the transposed in the backward, and frees it when the product is done, as the dense projections do
# (ops/15). It keeps each weight's row scales, one float a row, which the step's first use finds: every later use is
# given them and reads the weight once (ops/15 `weight_each_use`). `fp8_copies_pay` is that rule. Where the copies
# pay in time they still cost memory: with several micro-batches a step they take FP8's peak above bf16's
# (benchmarks/RESULTS.md, "FP8 end to end"), so the trainer keeps them only when `train.fp8_keep_copies` asks and the
# rule agrees (`fp8_copies_kept`, train/45), and the planner counts them the same way (engine/37).
#
# `scaling` is `train.fp8_scaling`: `"rows"` (its default, and the config's) or `"block"` (ops/15 explains both).
# The FP8 layers keep their copies here in either implementation: the Triton kernels' on a GPU,
# `quantize_weight_ref`'s (the same values, in plain torch) on a CPU.

# %%
#| export
class Fp8Weights:
    """The FP8 copies of one experts module's weights for the current step, by name and direction, and the scaling;
    `keep`: copies kept until the step ends (or each use quantizing its own). Every optimizer step clears them."""
    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        _LIVE.add(self)                            # here, not in __init__: a deepcopy (or unpickling) skips __init__
        return self

    def __init__(self, scaling: str = "rows", keep: bool = False):
        self.scaling, self.keep = scaling, keep    # the trainer sets keep by keep_fp8_copies
        self._copies: dict[tuple[str, bool], tuple[Tensor, Tensor]] = {}
        self._scales: dict[str, Tensor] = {}       # with keep off: each weight's row scales, found by its first use

    def weight(self, name: str, w: Tensor):
        """`weight(transposed, quantize)` for `fp8_grouped_linear`: w's copy under `name`, quantized on first use.
        When gradients will flow into w (a training step: its backward asks for the transposed copy too), the
        first use makes both copies in one pass over w; otherwise only the one asked for. With `keep` off, every
        use quantizes w in the direction it asks (ops/15 `weight_each_use`) and only the row scales are kept, so
        every use after the step's first reads w once."""
        if not self.keep:
            from pith_lit.ops.fp8 import weight_each_use   # the FP8 path alone loads the FP8 kernels
            return weight_each_use(w.detach(), self._scales, name)
        both = torch.is_grad_enabled() and w.requires_grad
        def get(transposed: bool, quantize) -> tuple[Tensor, Tensor]:
            key = (name, transposed)
            if key not in self._copies:
                with torch.no_grad():
                    if both:
                        self._copies[(name, False)], self._copies[(name, True)] = quantize(w.detach(), "both")
                    else:
                        self._copies[key] = quantize(w.detach(), transposed)
            return self._copies[key]
        return get

    def clear(self) -> None:
        self._copies.clear()
        self._scales.clear()


_LIVE: "weakref.WeakSet[Fp8Weights]" = weakref.WeakSet()   # every Fp8Weights alive in the process


def _weights_moved(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    "After any optimizer's step: every live `Fp8Weights` drops its copies and row scales, made from the old weights."
    for v in list(_LIVE):
        v.clear()


register_optimizer_step_post_hook(_weights_moved)   # for the life of the process


def _fp8_weights(model: torch.nn.Module):
    "Every `Fp8Weights` held by a module of `model`."
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, Fp8Weights)]


def drop_fp8_copies(model: torch.nn.Module) -> None:
    """Clear every `Fp8Weights` held by a module of `model`: the next forward quantizes anew. Needed where the weights
    change other than by an optimizer's step, which clears them itself (a checkpoint loaded, an edit in place)."""
    for v in _fp8_weights(model):
        v.clear()


def keep_fp8_copies(model: torch.nn.Module, keep: bool) -> None:
    "Set `keep` on every `Fp8Weights` of `model`: copies kept for the step, or each use quantizing its own."
    for v in _fp8_weights(model):
        v.keep = keep
        v.clear()


def fp8_copies_pay(micro_batches: int, expert_shards: int) -> bool:
    """Whether the experts keep their FP8 copies for the step: when a step runs several micro-batches through each
    layer and this rank holds its experts whole (`expert_shards`, the ranks FSDP shards them over, is 1)."""
    return micro_batches > 1 and expert_shards == 1

# %% [markdown]
# ## The two calls

# %%
#| export
def expert_linear(x: Tensor, w: Tensor, counts: Tensor, wgrad_queue: WeightGradQueue | None = None,
                  fp8: Fp8Weights | None = None, name: str = "") -> Tensor:
    "An experts module's projection: `grouped_linear`, or with `fp8` the FP8 layer on the step's copy of `w`."
    if fp8 is None:
        return grouped_linear(x, w, counts, wgrad_queue)
    from pith_lit.ops.fp8 import fp8_grouped_linear   # the FP8 path alone loads the FP8 kernels
    return fp8_grouped_linear(x, w, counts, wgrad_queue, weight=fp8.weight(name, w), scaling=fp8.scaling)


def expert_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, counts: Tensor,
               wgrad_queue: WeightGradQueue | None = None, fp8: Fp8Weights | None = None) -> Tensor:
    "SwiGLU experts, `down(swiglu(gate_up(x)))`: in the compute dtype, or with `fp8` in FP8 on the step's copies."
    if fp8 is None:
        return grouped_linear(swiglu(grouped_linear(x, w_gate_up, counts, wgrad_queue)), w_down, counts, wgrad_queue)
    from pith_lit.ops.fp8 import fp8_swiglu_experts   # the FP8 path alone loads the FP8 kernels
    return fp8_swiglu_experts(x, w_gate_up, w_down, counts, wgrad_queue,
                              weight_gate_up=fp8.weight("gate_up", w_gate_up), weight_down=fp8.weight("down", w_down),
                              scaling=fp8.scaling)

# %% [markdown]
# ## Checks
#
# A model in the compute dtype does not load the FP8 module: each family is imported in a fresh process, which must
# not hold `pith_lit.ops.fp8` afterwards.

# %%
import copy
import os
import subprocess
import sys

# %%
for family in ("qwen3_moe", "deepseek_v2", "gpt_oss", "qwen3_5_moe"):
    code = f"import sys, pith_lit.models.{family}; assert 'pith_lit.ops.fp8' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{family} imports ops.fp8:\n{proc.stderr[-2000:]}"
print("the four model families import without ops.fp8")

# %% [markdown]
# The FP8 checks run on the GPU when there is one, otherwise under the Triton interpreter (set in the environment before
# Triton is imported, as ops/15 says). Two micro-batches through one `Fp8Weights`: the same outputs and gradients as
# quantizing inside, each weight quantized once, both layouts in one pass; then the weight moves (as an optimizer step
# would move it): without `clear` the output is still the old weight's, after `drop_fp8_copies` the new one's; then an
# optimizer's step moves it, and the copies are gone from the `Fp8Weights` and from a deep copy of its module, with no
# call to clear, and the next output is the moved weight's. Under `no_grad` only the forward's copy is made. Both
# scalings. With `keep` off, each use quantizes its own layout; with row scales the step's first use finds the scales
# and every later one is given them.

# %%
import pith_lit.ops.fp8 as fp8_ops
from pith_lit.ops.fp8 import fp8_grouped_linear

# %%
if torch.cuda.is_available():
    torch.set_default_device("cuda")
else:
    assert os.environ.get("TRITON_INTERPRET") == "1", "on a CPU, run this notebook with TRITON_INTERPRET=1 set"

def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

# %%
def check_copies(scaling, n_in=256, n_out=128, counts=(100, 0, 60)):
    counts = torch.tensor(counts)
    n, E = int(counts.sum()), len(counts)
    g = torch.Generator(device="cpu").manual_seed(7)
    x1, x2, w, dy = (torch.randn(*s, generator=g, device="cpu").to(torch.get_default_device())
                     for s in ((n, n_in), (n, n_in), (E, n_out, n_in), (n, n_out)))
    w = w.requires_grad_()
    ref = []
    for x in (x1, x2):
        xr = x.clone().requires_grad_()
        y = fp8_grouped_linear(xr, w, counts, impl="triton", scaling=scaling)
        y.backward(dy)
        ref.append((y.detach(), xr.grad))
    ref_dw, w.grad = w.grad, None
    holder = torch.nn.Module()                 # an experts module holding its copies
    holder.copies = fp8 = Fp8Weights(scaling, keep=True)
    made = []
    def counted(get):              # a weight() (made outside the layer, as expert_mlp does) recording each pass
        def weight(transposed, quantize):
            def quantize_counted(w, layouts):
                made.append(layouts)
                return quantize(w, layouts)
            return get(transposed, quantize_counted)
        return weight
    for x, (y_ref, dx_ref) in zip((x1, x2), ref):
        xr = x.clone().requires_grad_()
        y = fp8_grouped_linear(xr, w, counts, impl="triton", weight=counted(fp8.weight("w", w)), scaling=scaling)
        y.backward(dy)
        assert torch.equal(y, y_ref) and torch.equal(xr.grad, dx_ref)
    assert torch.equal(w.grad, ref_dw) and sorted(fp8._copies) == [("w", False), ("w", True)] and made == ["both"]
    with torch.no_grad():
        w.mul_(2.0)
    stale = fp8_grouped_linear(x1, w, counts, impl="triton", weight=fp8.weight("w", w), scaling=scaling)
    drop_fp8_copies(holder)
    fresh = fp8_grouped_linear(x1, w, counts, impl="triton", weight=fp8.weight("w", w), scaling=scaling)
    assert torch.equal(stale, ref[0][0]) and rel_err(fresh, 2 * ref[0][0]) < 1e-6
    twin = copy.deepcopy(holder).copies             # a copy of the module: its own Fp8Weights, with the copies made
    assert fp8._copies and twin._copies
    w.grad = -w.detach()
    torch.optim.SGD([w], lr=1.0).step()             # w moves to 2w (4 times the first); no one calls clear
    assert not fp8._copies and not twin._copies
    moved = fp8_grouped_linear(x1, w, counts, impl="triton", weight=fp8.weight("w", w), scaling=scaling)
    assert rel_err(moved, 4 * ref[0][0]) < 1e-6
    with torch.no_grad():
        w.mul_(0.5)                                 # back to twice the first, exactly (a power of two)
    w.grad = None
    drop_fp8_copies(holder)
    fp8.clear()                                     # the torch implementation (a CPU run's) keeps the same copies
    with torch.no_grad():
        y = expert_linear(x1, w, counts, None, fp8, "w")
    assert rel_err(y, 2 * ref[0][0]) < 1e-5 and list(fp8._copies) == [("w", False)]
    keep_fp8_copies(holder, False)                  # nothing kept: each use quantizes its own layout, same values
    made.clear()
    w.grad = None
    for x, (y_ref, dx_ref) in zip((x1, x2), ref):
        xr, half = x.clone().requires_grad_(), w / 2    # w as it was before the move
        y = fp8_grouped_linear(xr, half, counts, impl="triton", weight=counted(fp8.weight("w", half)),
                               scaling=scaling)
        y.backward(dy)
        assert torch.equal(y, y_ref) and torch.equal(xr.grad, dx_ref)
    assert torch.equal(w.grad, ref_dw / 2) and not fp8._copies and made == [False, True, False, True], made
    if scaling == "rows":                           # the row scales alone kept: every use after the first given them
        given, real = [], fp8_ops.quantize_weight_rows
        def spy(w, transposed=False, scales=None):
            given.append(scales is not None)
            return real(w, transposed, scales)
        fp8.clear()
        fp8_ops.quantize_weight_rows = spy          # the name the layer's passes and weight_each_use look up
        try:
            for x, (y_ref, dx_ref) in zip((x1, x2), ref):
                xr = x.clone().requires_grad_()
                y = fp8_grouped_linear(xr, w / 2, counts, impl="triton", weight=fp8.weight("w", w / 2),
                                       scaling=scaling)
                y.backward(dy)
                assert torch.equal(y, y_ref) and torch.equal(xr.grad, dx_ref)
        finally:
            fp8_ops.quantize_weight_rows = real
        assert given == [False, True, True, True] and list(fp8._scales) == ["w"], given
        drop_fp8_copies(holder)
        assert not fp8._scales

for scaling in ("rows", "block"):
    check_copies(scaling)
assert [fp8_copies_pay(m, n) for m, n in ((1, 1), (4, 1), (4, 2), (1, 2))] == [False, True, False, False]
print("FP8 copies: the same outputs and gradients, one quantization pass per step, fresh after drop_fp8_copies and "
      "after any optimizer's step; without keep, one pass per use and only the row scales held")
