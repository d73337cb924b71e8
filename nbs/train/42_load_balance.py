# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Load balance
#
# A router that sends most tokens to a few experts wastes the rest of them, and under expert parallelism it
# also makes the rank that owns the popular experts the straggler every other rank waits for. The usual
# remedy (Switch Transformer, GShard, Qwen3-MoE) is an auxiliary loss added to the language-model loss:
#
# $$\mathcal{L}_{\text{aux}} = E \sum_{i=1}^{E} f_i\, P_i, \qquad
#   f_i = \frac{\#\{(t, j) : \text{ids}_{t,j} = i\}}{T\,k}, \qquad P_i = \frac{1}{T} \sum_t \text{probs}_{t,i}$$
#
# for $T$ tokens, $E$ experts and top-$k$ routing. $f_i$ is the fraction of the $T k$ (token, expert)
# assignments that went to expert $i$; it comes from a top-k, so it has no gradient. $P_i$ is the mean router
# probability of expert $i$; it carries the gradient, which pushes probability away from the experts that
# received more than their share. With this normalisation perfectly uniform routing ($f_i = P_i = 1/E$) gives
# exactly 1.0, whatever $E$ and $k$, so the number is readable as "how many times worse than uniform".
#
# **Micro or global.** The loss can be measured on each micro-batch alone (*micro*), or with $f$ taken from a
# larger batch (*global*, Qiu et al. 2025, "Demons in the Detail"). Micro-batch balance asks every micro-batch
# (often a handful of sequences from one document domain) to spread over all experts, which fights
# specialisation: a code micro-batch *should* mostly go to the code experts. What costs compute is imbalance of
# the whole batch that an optimizer step processes across all ranks, and that can be balanced while each
# micro-batch is specialised. So *global* takes $f$ from the counts of the whole step, all-reduced over the
# data/expert-parallel group, and keeps $P$ per micro-batch (the gradient still flows only through this
# micro-batch's router probabilities).
#
# "The whole step" needs care: with gradient accumulation, micro-batch 1 runs its backward before micro-batch 2
# has been routed, so its $f$ cannot include later micro-batches. Here **global means a running accumulation**:
# the $f$ used for micro-batch $m$ counts the assignments of micro-batches $1..m$ of the current step on every
# rank of the group. The last micro-batch sees the exact step-level $f$; the first sees only itself, summed
# over ranks. `start_step()` resets the counts.
#
# **Sequence.** `level="sequence"` asks each sequence to be balanced on its own (DeepSeek-V3's complementary
# sequence-wise loss): $f$ and $P$ are taken per sequence of the micro-batch, and the loss is the mean over its
# $B$ sequences of $E \sum_i f_{b,i} P_{b,i}$. It is the strictest of the three; DeepSeek-V3 pairs it, with a tiny
# weight, with the bias below, to stop a single sequence from sending everything to a few experts.
#
# The class keeps per-layer state keyed by the caller's layer key (the absolute layer index), so a pipeline
# stage that holds any subset of layers works unchanged.
#
# **Scale.** `loss` returns `coef` times the auxiliary loss of one layer and one micro-batch. The trainer adds it to
# that micro-batch's language-model loss and scales it the same way: since the token-weighted loss of `43_optim` makes
# gradients add up over micro-batches and data-parallel ranks, the auxiliary term is divided by the number of
# micro-batches times ranks so the step sees its mean, and averaged over the MoE layers. Hugging Face's Qwen3-MoE
# divides the counts by $T$ rather than $T k$, so its loss is $k$ times this one: its `router_aux_loss_coef`
# corresponds to `lb_coef = k · router_aux_loss_coef` here.

# %%
#| default_exp train.load_balance

# %%
#| export
import torch
import torch.distributed as dist
from torch import nn

# %%
#| export
class _Pending:
    "The global counts of one deferred `loss` call while their all-reduce may still be running."

    def __init__(self, counts: torch.Tensor, work, mean_probs: torch.Tensor, scale: float):
        self.counts, self.work, self.mean_probs, self.scale = counts, work, mean_probs, scale

    def f(self, dtype: torch.dtype) -> torch.Tensor:
        "The assignment fractions, once the counts have arrived (on a GPU: the current stream waits for them)."
        if self.work is not None:
            self.work.wait()
            self.work = None
        return (self.counts / self.counts.sum()).to(dtype)


class _DeferredTerm(torch.autograd.Function):
    """`coef · E · Σ_i f_i · mean_t probs[t, i]` with f not yet known: the forward returns 0 (the value is
    `_Pending`'s, read later), the backward waits for f and returns the gradient `coef · E · f_i / T`."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, pending: _Pending) -> torch.Tensor:
        ctx.pending, ctx.shape = pending, probs.shape
        return probs.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        T, E = ctx.shape
        f = ctx.pending.f(grad.dtype)
        return (grad * ctx.pending.scale * f / T).expand(T, E), None


# %%
#| export
class LoadBalance:
    """The auxiliary load-balance loss `coef · E · Σ_i f_i P_i` for every MoE layer, plus step-level statistics.

    `level="micro"`: f from this micro-batch. `level="global"`: f from the counts of all micro-batches of the
    current optimizer step so far (this one included), all-reduced over `group` when one is given. P is this
    micro-batch's mean router probability. `level="sequence"`: f and P of each sequence of `seq_len` tokens
    (the rows of `probs` are B sequences one after the other), the loss averaged over the sequences. Call `start_step()` before the first micro-batch of each step,
    `loss(layer_key, probs, ids)` once per MoE layer per micro-batch (the key is the absolute layer index), and
    `stats()` after the last one.
    With a group, every rank of the group must make the same `loss` and `stats` calls in the same order
    (they are collectives).

    `deferred=True` (level "global" only) does not wait for the counts in the forward: `loss` starts their
    all-reduce and returns a zero that carries the gradient, whose backward waits for the counts; `settle()`
    returns the sum of the values those calls would have returned. See "Not waiting in the forward" below.
    """

    def __init__(self, num_experts: int, coef: float, level: str, group: dist.ProcessGroup | None = None,
                 deferred: bool = False, seq_len: int | None = None):
        if level not in ("micro", "global", "sequence"):
            raise ValueError(f"load-balance level must be 'micro', 'global' or 'sequence', got {level!r} (set "
                             "train.lb_level)")
        if level == "sequence" and not (seq_len and seq_len > 0):
            raise ValueError(f"load-balance level 'sequence' needs the sequence length, got seq_len={seq_len}")
        if coef < 0:
            raise ValueError(f"load-balance coefficient must be >= 0 (0 disables the loss), got {coef} "
                             "(set train.lb_coef)")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts, self.coef, self.level, self.seq_len = num_experts, coef, level, seq_len
        self.group = group if group is not None and group.size() > 1 else None   # a group of one sums nothing
        self.deferred = deferred and level == "global"
        self.pending: list[_Pending] = []
        self.start_step()

    def start_step(self):
        "Forget the previous step: per layer, assignment counts and the sum of router probabilities."
        self.counts: dict = {}     # layer_key -> (E,) float64, this rank's assignments so far this step
        self.prob_sum: dict = {}   # layer_key -> (E,) float64, this rank's Σ_t probs[t, :] so far this step
        self.pending = []

    def loss(self, layer_key, probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        "`coef · E · Σ_i f_i P_i` for one layer and one micro-batch: `probs (T, E)` with grad, `ids (T, k)` int64."
        T, E = probs.shape
        if E != self.num_experts or ids.dim() != 2 or ids.shape[0] != T:
            raise ValueError(f"expected probs (T, {self.num_experts}) and ids (T, k) with the same T, got probs "
                             f"{tuple(probs.shape)} and ids {tuple(ids.shape)}")
        # scatter_add rather than bincount: bincount on CUDA reads the max id back to the host.
        counts = torch.zeros(E, dtype=torch.float64, device=ids.device)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.float64, device=ids.device))
        psum = probs.detach().sum(0, dtype=torch.float64)
        if layer_key in self.counts:
            self.counts[layer_key] += counts
            self.prob_sum[layer_key] += psum
        else:
            self.counts[layer_key], self.prob_sum[layer_key] = counts, psum
        if self.coef == 0:
            return torch.zeros((), dtype=probs.dtype, device=probs.device)
        if self.level == "sequence":
            S, k = self.seq_len, ids.shape[1]
            if T % S:
                raise ValueError(f"level 'sequence': {T} routed tokens are not whole sequences of {S}")
            per_seq = torch.zeros(T // S, E, dtype=probs.dtype, device=ids.device)
            per_seq.scatter_add_(1, ids.reshape(T // S, S * k), per_seq.new_ones(()).expand(T // S, S * k))
            f = per_seq / (S * k)                                             # (B, E), no gradient
            return self.coef * E * (f * probs.reshape(T // S, S, E).mean(1)).sum(-1).mean()
        if self.level == "global":
            counts = self.counts[layer_key].clone()
            work = None
            if self.group is not None:
                work = dist.all_reduce(counts, group=self.group, async_op=self.deferred)
            if self.deferred:
                pending = _Pending(counts, work, psum / T, self.coef * E)
                self.pending.append(pending)
                return _DeferredTerm.apply(probs, pending)
        f = (counts / counts.sum()).to(probs.dtype)  # counts.sum() = T·k assignments (summed over what f covers)
        return self.coef * E * (f * probs.mean(0)).sum()

    def settle(self) -> torch.Tensor:
        """The sum of the values of the `loss` calls made in deferred mode since the last `settle` or
        `start_step` (float64; 0 if none), waiting for their counts. For logging: the gradients do not need it."""
        terms = [p.scale * (p.f(torch.float64) * p.mean_probs).sum() for p in self.pending]
        self.pending = []
        return torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float64)

    def totals(self) -> dict:
        """Per layer key, a (2, E) float64 tensor: the step's assignment counts and sums of router probabilities so
        far, summed over the group when one is given (one collective for all layers; {} before any `loss`)."""
        keys = sorted(self.counts)   # the same order on every rank of the group
        if not keys:
            return {}
        both = torch.stack([torch.stack([self.counts[k], self.prob_sum[k]]) for k in keys])
        if self.group is not None:
            dist.all_reduce(both, group=self.group)
        return dict(zip(keys, both))

    def stats(self, totals: dict | None = None) -> dict:
        """The step's balance `E · Σ_i f_i P_i` per layer from the whole step's counts and mean probabilities
        (over the group when one is given), and their mean. 1.0 is perfectly balanced. For logging only.
        `totals`: what `totals()` returned this step, to save its collective."""
        totals = self.totals() if totals is None else totals
        if not totals:
            raise RuntimeError("LoadBalance.stats() found no routing this step: call loss() for every MoE layer "
                               "of every micro-batch before stats(), and start_step() only at the start of a step")
        keys = list(totals)
        # A token's probabilities sum to 1, so Σ_i prob_sum = #tokens.
        both = torch.stack([totals[k] for k in keys])
        f = both[:, 0] / both[:, 0].sum(-1, keepdim=True)
        P = both[:, 1] / both[:, 1].sum(-1, keepdim=True)
        balance = (self.num_experts * (f * P).sum(-1)).tolist()
        out = {f"lb/layer{k}": v for k, v in zip(keys, balance)}
        out["lb/mean"] = sum(balance) / len(balance)
        return out

# %% [markdown]
# `P` in `stats()` is the sum of probabilities divided by its own total, which is the number of tokens because
# each token's softmax sums to one; this avoids storing a token count that can be derived.
#
# ### Checks
# Uniform routing: every expert receives the same number of assignments and the probabilities are flat, so the
# loss (with `coef = 1`) is exactly 1.0, and the statistic too.

# %%
E, k, T = 8, 2, 16
ids = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1)   # each expert gets 2T/E assignments
probs = torch.full((T, E), 1 / E, requires_grad=True)
lb = LoadBalance(E, coef=1.0, level="micro")
uniform = lb.loss(0, probs, ids)
assert abs(uniform.item() - 1.0) < 1e-6, uniform
assert abs(lb.stats()["lb/mean"] - 1.0) < 1e-12
uniform.item()

# %% [markdown]
# The gradient reaches only `probs`, and equals the hand-written derivative
# $\partial \mathcal{L}/\partial\,\text{probs}_{t,i} = \text{coef} \cdot E \cdot f_i / T$ for every token $t$.
# The value is compared with the formula computed independently with `bincount` in float64.

# %%
torch.manual_seed(0)
T, E, k, coef = 12, 6, 2, 0.01
logits = torch.randn(T, E, dtype=torch.float64)
probs = logits.softmax(-1).requires_grad_()
ids = probs.detach().topk(k, -1).indices
lb = LoadBalance(E, coef, "micro")
out = lb.loss("a", probs, ids)
out.backward()
f_ref = torch.bincount(ids.flatten(), minlength=E).double() / (T * k)
assert torch.allclose(out, coef * E * (f_ref * probs.detach().mean(0)).sum(), rtol=1e-12)
assert torch.allclose(probs.grad, (coef * E * f_ref / T).expand(T, E), rtol=1e-12)
probs.grad[0]

# %% [markdown]
# `torch.autograd.gradcheck` in float64 agrees with the analytic gradient by finite differences (a fresh
# `LoadBalance` per call, so `f` stays fixed while `probs` is perturbed).

# %%
assert torch.autograd.gradcheck(lambda p: LoadBalance(E, coef, "micro").loss(0, p, ids),
                                (probs.detach().clone().requires_grad_(),))

# %% [markdown]
# **Global within a step.** Two micro-batches, each routed to one half of the experts: each is as unbalanced as
# it can be on its own, and together they are perfectly balanced. The first micro-batch's `global` loss equals
# its `micro` loss (it is all the step has seen); the second's uses the counts of both, so it drops to the
# perfectly-balanced value, while `micro` keeps penalising the specialisation. The step statistic says the
# step was balanced. After `start_step()` the counts start again.

# %%
T, E, k = 8, 4, 2
def half(lo):   # every token picks experts lo and lo+1, with probability 1/2 each
    ids = torch.tensor([[lo, lo + 1]] * T)
    probs = torch.zeros(T, E)
    probs[:, lo:lo + 2] = 0.5
    return probs.requires_grad_(), ids

micro, glob = LoadBalance(E, 1.0, "micro"), LoadBalance(E, 1.0, "global")
l_micro = [micro.loss(0, *half(lo)).item() for lo in (0, 2)]
l_glob = [glob.loss(0, *half(lo)).item() for lo in (0, 2)]
print("micro", l_micro, "global", l_glob, "step balance", glob.stats())
assert l_micro == [2.0, 2.0] and l_glob == [2.0, 1.0]
assert glob.stats() == {"lb/layer0": 1.0, "lb/mean": 1.0}
glob.start_step()
assert glob.loss(0, *half(2)).item() == 2.0

# %% [markdown]
# **Sequence level** against its definition, computed independently: a micro-batch of three sequences is the
# mean of three `micro` losses, one per sequence; and the gradient, by
# finite differences (`gradcheck`). The two halves of the example above, as two sequences of one micro-batch,
# show the difference: the batch is balanced, each sequence is not, and `sequence` says 2.0 where `micro`
# says 1.0.

# %%
torch.manual_seed(2)
B, S, Es, ks, c = 3, 5, 6, 2, 0.1
probs = torch.randn(B * S, Es, dtype=torch.float64).softmax(-1).requires_grad_()
ids = probs.detach().topk(ks, -1).indices
seq = LoadBalance(Es, c, "sequence", seq_len=S).loss(0, probs, ids)
per_seq = [LoadBalance(Es, c, "micro").loss(0, probs[b * S:(b + 1) * S], ids[b * S:(b + 1) * S]) for b in range(B)]
assert torch.allclose(seq, sum(per_seq) / B, rtol=1e-12)
assert torch.autograd.gradcheck(lambda p: LoadBalance(Es, c, "sequence", seq_len=S).loss(0, p, ids),
                                (probs.detach().clone().requires_grad_(),))
(p0, i0), (p2, i2) = half(0), half(2)
two = torch.cat([p0, p2]).detach().requires_grad_(), torch.cat([i0, i2])
assert LoadBalance(4, 1.0, "sequence", seq_len=8).loss(0, *two).item() == 2.0
assert LoadBalance(4, 1.0, "micro").loss(0, *two).item() == 1.0
seq.item()

# %% [markdown]
# `coef = 0` turns the loss off: it returns a zero that is not connected to the graph (no backward work),
# while the counts are still kept so the statistic can be logged.

# %%
off = LoadBalance(E, 0.0, "global")
z = off.loss(0, *half(0))
assert z.item() == 0.0 and z.grad_fn is None and not z.requires_grad
off.loss(1, *half(2))
assert off.stats() == {"lb/layer0": 2.0, "lb/layer1": 2.0, "lb/mean": 2.0}

# %% [markdown]
# ### Not waiting in the forward
# Under expert or data parallelism, `global` all-reduces the counts in every MoE layer of every micro-batch. The
# forward does not need the result: $f$ enters only the gradient (as $\text{coef} \cdot E \cdot f_i / T$) and
# the logged loss value. Waiting for it in the forward costs twice on a GPU: the compute stream stalls until the
# slowest rank of the group has reached the same layer, so the ranks run in lock step, and the all-reduce's
# time is exposed. With `deferred=True` the forward starts the all-reduce and returns a zero that carries the
# gradient; the backward of that term, which runs much later, waits for the counts (on a GPU it only makes the
# stream wait), and `settle()` adds up the values once the step's counts are in. The trainer uses this mode.
#
# The check: the same micro-batches through an eager and a deferred `LoadBalance` give the same gradients, and
# `settle()` returns the sum of the eager values.

# %%
torch.manual_seed(1)
T, E, k = 10, 6, 2
eager, lazy = LoadBalance(E, 0.1, "global"), LoadBalance(E, 0.1, "global", deferred=True)
values = []
for m in range(3):
    probs = torch.randn(T, E, dtype=torch.float64).softmax(-1)
    ids = probs.topk(k, -1).indices
    p_eager, p_lazy = probs.clone().requires_grad_(), probs.clone().requires_grad_()
    out = eager.loss(0, p_eager, ids)
    out.backward()
    values.append(out.item())
    zero = lazy.loss(0, p_lazy, ids)
    assert zero.item() == 0.0 and zero.requires_grad     # the value comes from settle()
    zero.backward()
    assert torch.allclose(p_lazy.grad, p_eager.grad, rtol=1e-12, atol=0), m
assert abs(lazy.settle().item() - sum(values)) < 1e-12 and lazy.settle().item() == 0.0   # settled once
sum(values)

# %% [markdown]
# Bad arguments name the setting to change.

# %%
for args, msg in [((E, 1.0, "batch"), "must be 'micro', 'global' or 'sequence'"), ((E, -1.0, "micro"), "must be >= 0"),
                  ((E, 1.0, "sequence"), "needs the sequence length")]:
    try:
        LoadBalance(*args)
        raise AssertionError("no error")
    except ValueError as e:
        assert msg in str(e), e

# %% [markdown]
# ## Balancing without a loss: a bias on the choice
#
# An auxiliary loss balances by changing what the router computes, so it trades against the language-model loss
# (too small a coefficient does not balance, too large one hurts the model). DeepSeek-V3 balances without one
# (Wang et al. 2024, "Auxiliary-loss-free load balancing"): each MoE layer keeps a per-expert bias $b_i$ that is
# added to the router's scores **for choosing the top-k only**; the weights that multiply the chosen experts'
# outputs stay the unbiased scores, so the bias changes where tokens go, never how much an expert's output
# counts, and no gradient flows through it. After each optimizer step the bias moves by a fixed amount $\gamma$
# (`train.lb_bias_rate`) against the step's load:
#
# $$b_i \leftarrow b_i + \gamma \,\operatorname{sign}(\bar c - c_i), \qquad \bar c = \tfrac{1}{E}\sum_j c_j,$$
#
# where $c_i$ counts the (token, expert) assignments of expert $i$ over the whole step on every rank: an
# overloaded expert becomes less attractive, an idle one more. The sign makes the step size independent of how
# skewed the load is; the bias settles where each expert hovers around its share.
#
# The bias is model state, not a parameter: a buffer named `e_score_correction_bias` (DeepSeek-V3's name) in each
# router (models/21–23, which say what "scores" are there: probabilities for Qwen3-MoE and DeepSeek-V2, logits
# for GPT-OSS, so $\gamma$ is in those units). As a buffer it is in the model's `state_dict`, so checkpoints
# keep it and DCP reshards it like any replicated tensor, and FSDP2 leaves it whole on every rank (it shards
# parameters only); the optimizer never sees it.
#
# **Under parallelism.** Every rank that holds a layer must apply the same update, or the copies of the router
# drift apart. `LoadBalance.totals()` sums the step's counts over its group, the ranks that see different
# tokens through the same layers (data and expert parallel ranks; the trainer passes its `dense` group): each of
# them gets the same $c$ and computes the same new bias. A pipeline rank updates the layers it holds, from counts
# that its own stages gathered, which are the same on every rank of its group. `routers(model)` finds this
# rank's routers, by layer key, as the modules that hold that buffer.

# %%
#| export
def routers(model: nn.Module) -> dict:
    "This rank's MoE routers by layer key: in each layer, the module that holds the buffer `e_score_correction_bias`."
    out = {}
    for key, layer in model.model.layers.items():
        for name, _ in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                out[key] = layer.get_submodule(name.rpartition(".")[0])
    return out


@torch.no_grad()
def update_bias(routers: dict, totals: dict, rate: float) -> None:
    """After an optimizer step: each router's `e_score_correction_bias += rate · sign(mean count − count)`, with the
    counts of the whole step from `LoadBalance.totals()` (the same on every rank that holds the layer)."""
    for key, router in routers.items():
        counts = totals[key][0]
        bias = router.e_score_correction_bias
        bias += (rate * torch.sign(counts.mean() - counts)).to(bias.dtype)

# %% [markdown]
# The update against its definition written out expert by expert: above the mean, down by γ; below, up by γ; at
# the mean, unchanged.

# %%
from pith_lit.models.qwen3_moe import Config as QwenConfig, Router

qr = Router(QwenConfig(hidden_size=8, num_experts=5, num_experts_per_tok=2))
counts = torch.tensor([9.0, 1.0, 4.0, 2.0, 4.0], dtype=torch.float64)      # mean 4
before = torch.tensor([0.1, -0.2, 0.0, 0.3, 0.05])
qr.e_score_correction_bias.copy_(before)
update_bias({"0": qr}, {"0": torch.stack([counts, torch.zeros(5, dtype=torch.float64)])}, rate=0.01)
expect = [b - 0.01 if c > 4 else b + 0.01 if c < 4 else b for b, c in zip(before.tolist(), counts.tolist())]
assert torch.allclose(qr.e_score_correction_bias, torch.tensor(expect)), qr.e_score_correction_bias

# %% [markdown]
# What it does: a Qwen3 router whose weights favour two of eight experts, on a fixed set of 512 tokens. Each
# round routes the tokens, counts, and updates the bias with γ = 10⁻³; the weights never change. The balance
# statistic starts far from 1 and ends near it, and the combine weights are still the unbiased probabilities.

# %%
torch.manual_seed(0)
qc = QwenConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2)
qr = Router(qc)
nn.init.normal_(qr.weight, std=0.3)
xq = torch.randn(512, 16)
xq[:, 0] += 2.0
with torch.no_grad():
    qr.weight[:2, 0] += 1.0                      # experts 0 and 1 score high for every token
history = []
for _ in range(300):
    with torch.no_grad():
        rq = qr(xq)
    lbq = LoadBalance(8, 0.0, "global")
    lbq.loss("0", rq.probs, rq.ids)
    totals = lbq.totals()
    history.append(lbq.stats(totals)["lb/mean"])
    update_bias({"0": qr}, totals, rate=1e-3)
w = rq.probs.gather(1, rq.ids)
assert torch.allclose(rq.weights, w / w.sum(-1, keepdim=True))
print(f"balance {history[0]:.2f} -> {history[-1]:.3f}; bias {[round(b, 3) for b in qr.e_score_correction_bias.tolist()]}")
assert history[0] > 1.3 and history[-1] < 1.01

# %% [markdown]
# ## Forced balance: round-robin routing
#
# A benchmark of the MoE step needs its routing stated, since the slowest expert rank sets the pace. Measured
# with a learned router, a number mixes the system's speed with how balanced the router happened to be.
# `train.route = "round_robin"` removes that: the trainer builds the model with `Options(route="round_robin")`
# (models/20), and each router assigns token t of a micro-batch to experts t·k, …, t·k + k − 1 (mod E). Every
# expert then gets exactly T·k/E assignments when E divides T·k, on every rank, so the balance statistic is 1, and
# the router's matmul and softmax still run, so the compute is that of a learned router. The weights are the
# router's probabilities of the assigned experts, so gradients still flow.

# %%
from pith_lit.models.protocol import Options
from pith_lit.models.qwen3_moe import Qwen3MoeForCausalLM

tiny_cfg = QwenConfig(vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4)
tiny = Qwen3MoeForCausalLM(tiny_cfg, Options(route="round_robin"))
assert sorted(routers(tiny)) == ["0", "1"]
with torch.no_grad():
    routing = routers(tiny)["1"](torch.randn(6, 16))
assert routing.ids.flatten().tolist() == [0, 1, 2, 3] * 3
lbr = LoadBalance(4, 0.0, "global")
lbr.loss("1", routing.probs, routing.ids)
assert lbr.stats()["lb/mean"] == 1.0
assert all(r.route == "learned" for r in routers(Qwen3MoeForCausalLM(tiny_cfg)).values())

# %% [markdown]
# ### Across ranks
# With a process group, `global` all-reduces the accumulated counts, so every rank uses the `f` of all ranks'
# micro-batches so far. `check_across_ranks` (in `tests/references.py`, where spawned processes import it) runs
# in each of several processes: rank `r` routes its own share of every micro-batch, and checks that its loss,
# gradient (which is `coef · E · f / T`, so it exposes `f`) and step statistics equal those of a single-process
# `LoadBalance` that sees all ranks' shares of each micro-batch as one micro-batch, and that a deferred one gives
# the same gradients and, settled, the same values. `tests/test_lb_optim.py` runs it in two gloo processes.
