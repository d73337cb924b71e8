# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The gated delta rule
#
# Qwen3.5's linear-attention layers ("Gated DeltaNet") replace softmax attention by a recurrent state: one
# `K × V` matrix per value head that every token first decays, then corrects towards its own key-value pair, then
# reads with its query. Per token the cost is `O(K·V)` whatever the sequence length, so three of every four
# Qwen3.5 layers cost the same at 32K tokens as at 4K.
#
# Token by token the recurrence is a loop of `T` small matrix-vector products, which no GPU runs fast. This
# notebook writes the **chunked** form: inside a chunk of `C` tokens everything is matrix products (the WY/UT
# representation), and only one `K × V` state travels from chunk to chunk. It gives the forward and backward as
# Triton kernels, packed documents (the state resets at each document start) at any length, grouped heads (GVA),
# an initial and a final state, the short causal convolution and the gates that feed the rule in Qwen3.5, a
# torch version of the same chunked form for CPU training, and the per-token loop that all of them are checked
# against.

# %%
#| default_exp ops.gated_delta_rule

# %%
#| export
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pith_lit.ops.attention import INTERPRET, dot_dtype

# %% [markdown]
# The checks run on the GPU when there is one (compiled kernels), otherwise on the CPU under the Triton
# interpreter, which must be switched on in the environment before Triton is imported.

# %%
import os
import time

# %%
if torch.cuda.is_available():
    torch.set_default_device("cuda")
else:
    assert os.environ.get("TRITON_INTERPRET") == "1", "on a CPU, run this notebook with TRITON_INTERPRET=1 set"
T0 = time.time()

# %% [markdown]
# ## The recurrence
#
# Per value head, with the state `S` a `K × V` matrix, a token `t` with query `q_t`, key `k_t` (both length `K`),
# value `v_t` (length `V`), log-decay `g_t ≤ 0` and write strength `β_t ∈ (0, 1)` does
#
# `S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`,  `o_t = S_tᵀ q_t`,  with `α_t = e^{g_t}`.
#
# Read as a learning rule: the state predicts `S̃ᵀ k_t` for the key after decaying (`S̃ = α_t S_{t−1}`), and one
# step of gradient descent with rate `β_t` on `½‖S̃ᵀ k_t − v_t‖²` moves it to `S̃ + β_t k_t (v_t − S̃ᵀ k_t)ᵀ`, the
# same thing. Qwen3.5 feeds it as follows (transformers' `Qwen3_5MoeGatedDeltaNet`):
#
# - `q` and `k` are l2-normalised per head (`x · rsqrt(Σx² + 10⁻⁶)`), and `q` is then scaled by `K^-½`;
# - `g = −e^{A_log} · softplus(a + dt_bias)` and `β = sigmoid(b)`, per token and value head;
# - there are more value heads than key heads (32 and 16): value head `h` reads key head `h // (Hv / Hk)` (GVA).
#
# **Packed documents.** A training row holds several documents, and no state may flow from one into the next. A
# reset is the recurrence with `α_t = 0` at a document's first token: `S_t = β_t k_t v_tᵀ`, the fresh start. So a
# document start is a token whose decay is zero and whose `g_t` does not matter (its gradient is zero). An
# initial state belongs to the first document of its row, and the final state is the state after the row's last
# token.
#
# The reference is this loop, in whatever dtype it is given (float64 for the checks). Shapes follow transformers:
# `q, k (B, T, Hk, K)`, `v (B, T, Hv, V)`, `g, β (B, T, Hv)`, states `(B, Hv, K, V)`, document ids `docs (B, T)`,
# non-decreasing along a row, as `pith_lit.ops.attention.documents` makes them from positions.

# %%
#| export
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    "x · rsqrt(Σx² + eps) over the last dim, computed in float32 (or x's dtype if wider), returned in x's dtype."
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _check_args(q, k, v, g, beta, initial_state, docs, scale):
    "Validate the shapes of the gated delta rule's inputs; return (scale, docs as contiguous int32 or None)."
    for name, t, dim in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a {dim}-D float tensor ({'B, T, heads, dim' if dim == 4 else 'B, T, Hv'})"
                             f"; got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    (B, T, Hk, K), (Hv, V) = q.shape, v.shape[2:]
    if k.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape (B, T, Hk, K)")
    if v.shape[:2] != (B, T) or g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"v (B, T, Hv, V), g and beta (B, T, Hv) must agree with q's (B, T) = ({B}, {T}); got v "
                         f"{tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if Hk < 1 or Hv % Hk:
        raise ValueError(f"the value heads ({Hv}) must be a multiple of the key heads ({Hk}) (GVA)")
    if initial_state is not None and initial_state.shape != (B, Hv, K, V):
        raise ValueError(f"initial_state must have shape (B, Hv, K, V) = ({B}, {Hv}, {K}, {V}); got "
                         f"{tuple(initial_state.shape)}")
    if docs is not None:
        if docs.shape != (B, T) or docs.dtype.is_floating_point or docs.dtype == torch.bool:
            raise ValueError(f"docs must be an integer tensor of shape (B, T) = ({B}, {T}); got {tuple(docs.shape)} "
                             f"{docs.dtype}")
        docs = docs.to(device=q.device, dtype=torch.int32).contiguous()
    return (K ** -0.5 if scale is None else float(scale)), docs


def gated_delta_rule_reference(q, k, v, g, beta, *, initial_state=None, output_final_state=False, docs=None,
                               use_qk_l2norm=True, scale=None):
    "The per-token loop: (o (B, T, Hv, V), final state (B, Hv, K, V) or None), computed in q's dtype. The oracle."
    scale, docs = _check_args(q, k, v, g, beta, initial_state, docs, scale)
    (B, T, Hk, K), (Hv, V) = q.shape, v.shape[2:]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = (x.repeat_interleave(Hv // Hk, 2) * s for x, s in ((q, scale), (k, 1.0)))
    S = q.new_zeros(B, Hv, K, V) if initial_state is None else initial_state.to(q.dtype)
    out = []
    for t in range(T):
        if docs is not None and t > 0:  # a document start: nothing flows in
            S = S * (docs[:, t] == docs[:, t - 1]).to(S.dtype).view(B, 1, 1, 1)
        S = S * g[:, t].to(S.dtype).exp()[..., None, None]
        delta = beta[:, t, :, None].to(S.dtype) * (v[:, t].to(S.dtype) - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, 1).to(v.dtype), (S if output_final_state else None)


# %% [markdown]
# Check the loop against transformers' own per-token and chunked versions (one document: transformers' torch
# fallbacks ignore document boundaries), with GVA and an initial state. The model repeats each key head's q and k over
# its value heads before it calls them (some transformers versions repeat inside the function, some do not), so
# the check does that too. transformers computes in float32 whatever it is given, so the loop runs in float64 and
# the tolerance is float32's:

# %%
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf


def make_inputs(B, T, Hk, Hv, K, V, seed, dtype=torch.float32, state=False):
    "Random inputs of the shapes Qwen3.5 gives: q, k, v, g (≤ 0, some near 0 and some large), β in (0, 1)."
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cpu")
    q, k, v = rand(B, T, Hk, K), rand(B, T, Hk, K), rand(B, T, Hv, V)
    g = -F.softplus(rand(B, T, Hv) * 2 - 1)
    beta = torch.sigmoid(rand(B, T, Hv) * 2)
    s0 = rand(B, Hv, K, V) * 0.3 if state else None
    dev = torch.get_default_device()
    to = lambda t: None if t is None else t.to(dev, dtype)
    return to(q), to(k), to(v), to(g), to(beta), to(s0)


def rel_err(a, b):
    "max |a − b| / max |b| in float64."
    a, b = a.double(), b.double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


q, k, v, g, beta, s0 = make_inputs(2, 50, 2, 4, 16, 24, seed=0, dtype=torch.float64, state=True)
o, s = gated_delta_rule_reference(q, k, v, g, beta, initial_state=s0, output_final_state=True)
def hf_rule(name, q, k, v, g, beta, s0, **kw):
    "transformers' `name`, given each value head's q and k (the model repeats them before the call)."
    q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], 2) for x in (q, k))
    return getattr(hf, name)(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, **kw)


for name, kw in (("torch_recurrent_gated_delta_rule", {}), ("torch_chunk_gated_delta_rule", dict(chunk_size=16))):
    o_hf, s_hf = hf_rule(name, q, k, v, g, beta, s0, **kw)
    assert rel_err(o, o_hf) < 2e-6 and rel_err(s, s_hf) < 2e-6, (name, rel_err(o, o_hf), rel_err(s, s_hf))
    print(f"{name}: out {rel_err(o, o_hf):.1e}, state {rel_err(s, s_hf):.1e}")

# %% [markdown]
# ## The chunked form
#
# Take a chunk of `C` tokens `1 … C` that starts from the state `S_0`. Let `γ_i = g_1 + … + g_i` (the log-decay
# from the chunk start to token `i`) and `Γ_ij = e^{γ_i − γ_j}` for `i ≥ j`, else 0. Unrolling the recurrence,
# every state in the chunk has the form
#
# `S_i = e^{γ_i} S_0 + Σ_{j ≤ i} Γ_ij k_j u_jᵀ`
#
# for some vectors `u_j` (the delta rule's corrections). Substituting this into the update for token `i` gives
# `u_i = β_i (v_i − S̃ᵀ k_i)` with `S̃ = α_i S_{i−1}`, i.e.
#
# `u_i + β_i Σ_{j < i} Γ_ij (k_i·k_j) u_j = β_i v_i − β_i e^{γ_i} S_0ᵀ k_i`.
#
# In matrix form, with `A = strict-lower(diag(β) K Kᵀ ⊙ Γ)` and `T = (I + A)⁻¹` (unit lower triangular), the
# corrections are `U' = T (β ⊙ V) − T (β ⊙ e^γ ⊙ K) S_0 = U − W S_0`: this is the WY (or UT) representation, and
# `U`, `W` depend on the chunk alone. Then
#
# - output: `O = (Q ⊙ e^γ) S_0 + (Q Kᵀ ⊙ Γ) U'` (diagonal included);
# - next state: `S_C = e^{γ_C} S_0 + (K ⊙ e^{γ_C − γ})ᵀ U'`.
#
# Per chunk that is a handful of `C × C`, `C × K` and `K × V` products; only `U' = U − W S_0` and the state
# update depend on the previous chunk. So the kernels split the work: a chunk-parallel kernel for `W` and `U`, a
# sequential pass over chunks per head for the states and `U'`, and a chunk-parallel kernel for the outputs.
#
# **Inverting `I + A`.** `A` is strictly lower triangular, so `A^C = 0` and `(I + A)⁻¹ = Σ_{n<C} (−A)ⁿ
# = (I − A)(I + A²)(I + A⁴)⋯(I + A^{C/2})`: `log₂C − 1` squarings and as many products, all `C × C` matrix
# products, which the tensor cores run; no row-by-row substitution.
#
# **Documents inside a chunk.** A document start at token `s` makes `α_s = 0`, which breaks `γ` into pieces: the
# kernels take `γ` as the cumulative sum within each document piece of the chunk (the `g` of a document's first
# token left out), and every factor that would cross a start is zero: `Γ_ij = 0` for tokens of different
# documents, `e^{γ_i} → 0` for tokens not in the document that the chunk starts in, `e^{γ_C − γ_i} → 0` for
# tokens not in the document that the chunk ends in. Chunks stay aligned to the row, whatever the documents'
# lengths; the last chunk of a row is padded with inert tokens (`k = v = q = 0`, `β = g = 0`) that belong to the
# last document.
#
# The torch version below is this form exactly, with autograd for its backward. It is the CPU path for training
# (vectorised over chunks except for the state pass) and a second check on the kernels.

# %%
#| export
def _chunk_decays(g, docs, C: int):
    """Per chunk of C tokens: the decay factors of the chunked form with documents. g (B, H, N, C) float, docs
    (B, N, C) int or None, and the document of the token before each chunk. Returns eg (from the chunk start to i),
    el (from i to the chunk end), ec (the whole chunk), Γ (B, H, N, C, C) (i ≥ j, same document)."""
    B, H, N, _ = g.shape
    causal = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    if docs is None:
        gam = g.cumsum(-1)
        seg = causal.expand(B, 1, N, C, C)
        reach = last = torch.ones(B, 1, N, C, dtype=torch.bool, device=g.device)
    else:
        before = torch.cat([docs[:, :1, :1], docs[:, :-1, -1:]], 1)  # the document flowing into each chunk
        prev = torch.cat([before, docs[..., :-1]], -1)
        g = g.masked_fill((docs != prev)[:, None], 0.0)              # a document's first token: no decay
        seg = (causal & (docs[..., :, None] == docs[..., None, :]))[:, None]
        gam = (g[..., None, :] * seg).sum(-1)
        reach, last = (docs == before)[:, None], (docs == docs[..., -1:])[:, None]
    gam_c = gam[..., -1:]
    eg = torch.where(reach, gam.exp(), 0.0)
    el = torch.where(last, (gam_c - gam).exp(), 0.0)
    ec = torch.where(reach[..., -1:], gam_c.exp(), 0.0)
    Gam = torch.where(seg, (gam[..., :, None] - gam[..., None, :]).masked_fill(~seg, 0.0).exp(), 0.0)
    return eg, el, ec, Gam


def chunk_gated_delta_rule_torch(q, k, v, g, beta, *, initial_state=None, output_final_state=False, docs=None,
                                 use_qk_l2norm=True, scale=None, chunk_size: int = 64):
    """The chunked gated delta rule in plain torch (float32 or wider; autograd gives the backward): the CPU path.
    Same arguments and results as `chunk_gated_delta_rule`."""
    scale, docs = _check_args(q, k, v, g, beta, initial_state, docs, scale)
    (B, T, Hk, K), (Hv, V), C, out_dtype = q.shape, v.shape[2:], chunk_size, v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    N, pad = -(-T // C), -T % C
    heads = lambda x: F.pad(x.to(dtype).repeat_interleave(Hv // Hk, 2).transpose(1, 2), (0, 0, 0, pad))
    q, k, v = heads(q) * scale, heads(k), F.pad(v.to(dtype).transpose(1, 2), (0, 0, 0, pad))
    q, k, v = (x.unflatten(2, (N, C)) for x in (q, k, v))                       # (B, Hv, N, C, D)
    g, beta = (F.pad(x.to(dtype).transpose(1, 2), (0, pad)).unflatten(2, (N, C)) for x in (g, beta))
    if docs is not None:
        docs = F.pad(docs, (0, pad), mode="replicate").unflatten(1, (N, C))     # padding: the last document
    eg, el, ec, Gam = _chunk_decays(g, docs, C)
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * Gam).tril(-1)
    eye = torch.eye(C, dtype=dtype, device=q.device)
    Tinv = torch.linalg.solve_triangular(A + eye, eye, upper=False, unitriangular=True)
    U, W = Tinv @ (beta[..., None] * v), Tinv @ ((beta * eg)[..., None] * k)
    M = (q @ k.transpose(-1, -2)) * Gam
    S = q.new_zeros(B, Hv, K, V) if initial_state is None else initial_state.to(dtype)
    out = []
    for n in range(N):                                                           # the only sequential part
        u = U[:, :, n] - W[:, :, n] @ S
        out.append((q[:, :, n] * eg[:, :, n, :, None]) @ S + M[:, :, n] @ u)
        S = ec[:, :, n, :, None] * S + (k[:, :, n] * el[:, :, n, :, None]).transpose(-1, -2) @ u
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :T].transpose(1, 2).to(out_dtype)   # v's dtype on the way in
    return o, (S if output_final_state else None)


# %% [markdown]
# Check the torch chunked form against the loop, float64: chunk-unaligned lengths, GVA, an initial state, and
# packed documents that differ between the two rows of the batch (documents of length 1, a document that starts
# at a chunk boundary, one that spans several chunks), outputs and final state; then every input gradient
# through autograd.

# %%
def doc_ids_from_lengths(*rows):
    "(B, T) int32 document ids from per-row lists of document lengths."
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).int()


DOCS = doc_ids_from_lengths([1, 15, 16, 3, 1, 1, 20, 2, 4], [40, 1, 22])  # T = 63: boundaries at and off chunk starts
q, k, v, g, beta, s0 = make_inputs(2, 63, 2, 4, 16, 24, seed=1, dtype=torch.float64, state=True)
for docs in (None, DOCS):
    kw = dict(initial_state=s0, output_final_state=True, docs=docs)
    o_ref, s_ref = gated_delta_rule_reference(q, k, v, g, beta, **kw)
    o_t, s_t = chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size=16, **kw)
    assert rel_err(o_t, o_ref) < 1e-12 and rel_err(s_t, s_ref) < 1e-12, (rel_err(o_t, o_ref), rel_err(s_t, s_ref))
    print(f"docs {docs is not None}: torch chunked vs loop, out {rel_err(o_t, o_ref):.1e} state {rel_err(s_t, s_ref):.1e}")

# %% [markdown]
# A document reset means exactly "run each document on its own": the packed output equals the loop run on each
# document separately (with the initial state on the first one only).

# %%
lens = [1, 15, 16, 3, 1, 1, 20, 2, 4]
o_ref, _ = gated_delta_rule_reference(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=s0[:1], docs=DOCS[:1])
start, pieces = 0, []
for i, n in enumerate(lens):
    sl = slice(start, start + n)
    pieces.append(gated_delta_rule_reference(q[:1, sl], k[:1, sl], v[:1, sl], g[:1, sl], beta[:1, sl],
                                             initial_state=s0[:1] if i == 0 else None)[0])
    start += n
assert rel_err(o_ref, torch.cat(pieces, 1)) < 1e-14

# %% [markdown]
# ## The Triton kernels: forward
#
# Four kernels, each program one head (or one chunk of one head):
#
# 1. `_wy_kernel`, per chunk: `γ` and the decay factors, `A`, `T = (I + A)⁻¹`, `W = T (β e^γ ⊙ K)`, `U = T(β ⊙ V)`.
# 2. `_state_fwd_kernel`, per head and block of value columns: the sequential pass over chunks, `U' = U − W S` and
#    `S ← e^{γ_C} S + (K ⊙ e^{γ_C−γ})ᵀ U'`, storing the state at each chunk start and the final state.
# 3. `_out_fwd_kernel`, per chunk: `O = (Q ⊙ e^γ) S_start + (Q Kᵀ ⊙ Γ) U'`.
#
# Every kernel recomputes the decay factors of its chunk from `g` and the document ids, which costs a `C × C`
# masked sum and saves storing them. `_decays` is that computation, the kernel form of `_chunk_decays` above. A
# row's last chunk is padded by masked loads: rows past `T` load zeros and the last token's document id.
#
# Tiles: a head dim is one power-of-two tile of at least 16 (Qwen3.5's 128 is one tile), masked beyond the dim.
# The products take the input dtype as operands on the GPU (bf16 on tensor cores) with float32 accumulators; the
# `C × C` inverse and the products with `T` stay in float32 (`tf32x3`: three tf32 passes, close to float32),
# since `T`'s entries are not bounded by 1. Under the interpreter everything is float32 (its bf16 arithmetic is
# broken) and exact (`ieee`).

# %%
#| export
_PREC32 = "ieee" if INTERPRET else "tf32x3"  # the float32 products' input_precision


def _precisions(dtype: torch.dtype) -> dict:
    "Compile-time dot settings DOT (operand dtype of the main products) and PREC (theirs): ops/14's `dot_dtype`."
    dot, prec = dot_dtype(dtype, "chunk_gated_delta_rule", "gated_delta_rule_reference")
    return dict(DOT=dot, PREC=prec)


@triton.jit
def _rows(base, rows, stride_t, T, D: tl.constexpr, BD: tl.constexpr, COL0: tl.constexpr = 0):
    "Load rows × columns [COL0, COL0 + BD) of a (T, D) matrix with unit column stride as float32, zeros outside."
    cols = COL0 + tl.arange(0, BD)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_t + cols[None, :]
    return tl.load(ptrs, mask=(rows < T)[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_rows(base, rows, stride_t, T, x, D: tl.constexpr, BD: tl.constexpr, COL0: tl.constexpr = 0):
    cols = COL0 + tl.arange(0, BD)
    ptrs = base + rows.to(tl.int64)[:, None] * stride_t + cols[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(rows < T)[:, None] & (cols < D)[None, :])


@triton.jit
def _dot(a, b, DOT: tl.constexpr, PREC: tl.constexpr):
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC)


@triton.jit
def _decays(Gh, stride_gt, DOCb, t0, T, C: tl.constexpr, HAS_DOC: tl.constexpr):
    """The chunk [t0, t0 + C)'s decays: eg (chunk start → i), el (i → chunk end), ec (the whole chunk), Γ (C, C),
    the (i ≥ j, same document) mask, and the document starts (whose g is unused)."""
    idx = tl.arange(0, C)
    rows = t0 + idx
    g = tl.load(Gh + rows.to(tl.int64) * stride_gt, mask=rows < T, other=0.0).to(tl.float32)
    seg = idx[:, None] >= idx[None, :]
    is_last = idx == C - 1
    if HAS_DOC:
        rc = tl.minimum(rows, T - 1)                 # padding rows: the last token's document
        d = tl.load(DOCb + rc)
        start = (d != tl.load(DOCb + tl.maximum(rc - 1, 0))) & (rows < T)
        d_in = tl.load(DOCb + tl.maximum(t0 - 1, 0))   # the document whose state enters the chunk
        d_last = tl.sum(tl.where(is_last, d, 0), 0)
        g = tl.where(start, 0.0, g)
        seg = seg & (d[:, None] == d[None, :])
        reach = d == d_in
        tail = d == d_last
    else:
        start = idx < 0
        reach = idx >= 0
        tail = reach
    gam = tl.sum(tl.where(seg, g[None, :], 0.0), 1)
    gam_c = tl.sum(tl.where(is_last, gam, 0.0), 0)
    eg = tl.where(reach, tl.exp(gam), 0.0)
    el = tl.where(tail, tl.exp(gam_c - gam), 0.0)
    ec = tl.sum(tl.where(is_last & reach, tl.exp(gam_c), 0.0), 0)
    Gam = tl.where(seg, tl.exp(tl.where(seg, gam[:, None] - gam[None, :], 0.0)), 0.0)
    return eg, el, ec, Gam, seg, start


@triton.jit
def _unit_lower_inverse(A, C: tl.constexpr, LOG2C: tl.constexpr, PREC32: tl.constexpr):
    "(I + A)⁻¹ for a strictly lower triangular (C, C) A: (I − A)(I + A²)(I + A⁴)⋯ (A^C = 0)."
    idx = tl.arange(0, C)
    N = -A
    Tm = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0) + N
    P = N
    for _ in tl.static_range(LOG2C - 1):
        P = tl.dot(P, P, input_precision=PREC32)
        Tm = Tm + tl.dot(Tm, P, input_precision=PREC32)
    return Tm


@triton.jit
def _wy_kernel(Kp, Vp, Gp, BETA, DOC, Wp, Up, Tp,
               sqb, sqt, sqh, svb, svt, svh, sgb, sgt, sgh,
               T, H, GROUP, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               C: tl.constexpr, LOG2C: tl.constexpr, HAS_DOC: tl.constexpr, STORE_T: tl.constexpr,
               DOT: tl.constexpr, PREC: tl.constexpr, PREC32: tl.constexpr):
    "Program (chunk, b·H + h): W (C, K) and U (C, V) of one chunk, into (B, H, T, ·) float32 buffers."
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t0 = n * C
    rows = t0 + tl.arange(0, C)
    Gh = Gp + b.to(tl.int64) * sgb + h * sgh
    eg, el, ec, Gam, seg, start = _decays(Gh, sgt, DOC + b.to(tl.int64) * T, t0, T, C, HAS_DOC)
    beta = tl.load(BETA + b.to(tl.int64) * sgb + h * sgh + rows.to(tl.int64) * sgt, mask=rows < T,
                   other=0.0).to(tl.float32)
    k = _rows(Kp + b.to(tl.int64) * sqb + (h // GROUP) * sqh, rows, sqt, T, K, BK)
    idx = tl.arange(0, C)
    A = tl.where(idx[:, None] > idx[None, :], _dot(k, tl.trans(k), DOT, PREC) * beta[:, None] * Gam, 0.0)
    Tm = _unit_lower_inverse(A, C, LOG2C, PREC32)
    W = tl.dot(Tm, k * (beta * eg)[:, None], input_precision=PREC32)
    _store_rows(Wp + bh.to(tl.int64) * T * K, rows, K, T, W, K, BK)
    Vh = Vp + b.to(tl.int64) * svb + h * svh
    Uh = Up + bh.to(tl.int64) * T * V
    for v0 in tl.static_range(0, V, BV):
        vt = _rows(Vh, rows, svt, T, V, BV, v0)
        _store_rows(Uh, rows, V, T, tl.dot(Tm, vt * beta[:, None], input_precision=PREC32), V, BV, v0)
    if STORE_T:  # the backward keeps T: (B, H, T, C), row i of chunk n at token n·C + i
        _store_rows(Tp + bh.to(tl.int64) * T * C, rows, C, T, Tm, C, C)


@triton.jit
def _state_fwd_kernel(Kp, Gp, DOC, Wp, Up, S0, STATES, UN, SFIN,
                      sqb, sqt, sqh, sgb, sgt, sgh,
                      T, NT, H, GROUP, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      C: tl.constexpr, HAS_DOC: tl.constexpr, HAS_S0: tl.constexpr, STORE_FIN: tl.constexpr,
                      DOT: tl.constexpr, PREC: tl.constexpr):
    """Program (b·H + h, value block): the pass over chunks. Stores the state at each chunk start (B, H, NT, K, V),
    U' = U − W S (B, H, T, V) and the final state (B, H, K, V), all float32."""
    bh = tl.program_id(0)
    v0 = tl.program_id(1) * BV
    b = bh // H
    h = bh % H
    ck = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    smask = (ck < K)[:, None] & (cv < V)[None, :]
    soff = ck[:, None] * V + cv[None, :]
    if HAS_S0:
        S = tl.load(S0 + bh.to(tl.int64) * K * V + soff, mask=smask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], tl.float32)
    Kh = Kp + b.to(tl.int64) * sqb + (h // GROUP) * sqh
    Gh = Gp + b.to(tl.int64) * sgb + h * sgh
    DOCb = DOC + b.to(tl.int64) * T
    Wh = Wp + bh.to(tl.int64) * T * K
    Uh = Up + bh.to(tl.int64) * T * V
    UNh = UN + bh.to(tl.int64) * T * V
    for n in range(NT):
        tl.store(STATES + (bh.to(tl.int64) * NT + n) * K * V + soff, S, mask=smask)
        t0 = n * C
        rows = t0 + tl.arange(0, C)
        eg, el, ec, Gam, seg, start = _decays(Gh, sgt, DOCb, t0, T, C, HAS_DOC)
        w = _rows(Wh, rows, K, T, K, BK)
        k = _rows(Kh, rows, sqt, T, K, BK)
        un = _rows(Uh, rows, V, T, V, BV, v0) - _dot(w, S, DOT, PREC)
        _store_rows(UNh, rows, V, T, un, V, BV, v0)
        S = S * ec + _dot(tl.trans(k * el[:, None]), un, DOT, PREC)
    if STORE_FIN:
        tl.store(SFIN + bh.to(tl.int64) * K * V + soff, S, mask=smask)


@triton.jit
def _out_fwd_kernel(Qp, Kp, Gp, DOC, STATES, UN, Op,
                    sqb, sqt, sqh, sgb, sgt, sgh, sob, sot, soh,
                    T, NT, H, GROUP, scale, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    C: tl.constexpr, HAS_DOC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    "Program (chunk, b·H + h, value block): O = (Q ⊙ e^γ) S_start + (Q Kᵀ ⊙ Γ) U'."
    n = tl.program_id(0)
    bh = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    b = bh // H
    h = bh % H
    t0 = n * C
    rows = t0 + tl.arange(0, C)
    eg, el, ec, Gam, seg, start = _decays(Gp + b.to(tl.int64) * sgb + h * sgh, sgt, DOC + b.to(tl.int64) * T, t0,
                                          T, C, HAS_DOC)
    q = _rows(Qp + b.to(tl.int64) * sqb + (h // GROUP) * sqh, rows, sqt, T, K, BK) * scale
    k = _rows(Kp + b.to(tl.int64) * sqb + (h // GROUP) * sqh, rows, sqt, T, K, BK)
    ck = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    S = tl.load(STATES + (bh.to(tl.int64) * NT + n) * K * V + ck[:, None] * V + cv[None, :],
                mask=(ck < K)[:, None] & (cv < V)[None, :], other=0.0)
    un = _rows(UN + bh.to(tl.int64) * T * V, rows, V, T, V, BV, v0)
    M = _dot(q, tl.trans(k), DOT, PREC) * Gam
    o = _dot(q * eg[:, None], S, DOT, PREC) + _dot(M, un, DOT, PREC)
    _store_rows(Op + b.to(tl.int64) * sob + h * soh, rows, sot, T, o, V, BV, v0)


# %% [markdown]
# The launchers. `q` and `k` arrive contiguous (they share strides) and `g`, `β` as contiguous float32; `v` and
# `dO` are read through their strides (a slice of a fused projection needs no copy). The buffers between kernels
# are float32 and `(B, Hv, T, ·)`. Chunk size and value block: 64 and 64 on the GPU (the state block `K × 64` in
# float32 is 32 KB of registers at `K = 128`); under the interpreter the value block is the whole head, so that
# there are few programs. Eight warps per program: compiled for sm_90 at `K = V = 128`, `C = 64`, four warps spill
# 0.7–16 KB of registers per kernel, eight warps 0.1–1.6 KB, except the per-chunk backward (12 KB, its five
# `C × K` and `C × C` float32 accumulators).

# %%
#| export
def _consts(q, v, C: int, docs) -> dict:
    """The compile-time constants of every kernel: head dims K, V, the key tile BK (the whole padded head), the value
    block BV, C, HAS_DOC, DOT and PREC."""
    K, V = q.shape[-1], v.shape[-1]
    BV = max(16, triton.next_power_of_2(V))
    return dict(K=K, V=V, BK=max(16, triton.next_power_of_2(K)), BV=min(64, BV) if q.is_cuda else BV, C=C,
                HAS_DOC=docs is not None, **_precisions(q.dtype))


def _states(q, k, v, g, beta, s0, docs, C: int, want_final: bool, keep_t: bool):
    """Run the WY and state kernels: (W, states at chunk starts, U', T if keep_t, final state if want_final)."""
    (B, T, Hk, K), (Hv, V) = q.shape, v.shape[2:]
    NT = triton.cdiv(T, C)
    f32 = dict(dtype=torch.float32, device=q.device)
    W, U, UN = torch.empty(B, Hv, T, K, **f32), torch.empty(B, Hv, T, V, **f32), torch.empty(B, Hv, T, V, **f32)
    Tm = torch.empty(B, Hv, T, C, **f32) if keep_t else None
    states = torch.empty(B, Hv, NT, K, V, **f32)
    s_fin = torch.empty(B, Hv, K, V, **f32) if want_final else None
    if B * T * Hv == 0:
        if want_final:
            s_fin.copy_(s0 if s0 is not None else torch.zeros_like(s_fin))
        return W, states, UN, Tm, s_fin
    docs_, common = docs if docs is not None else g, _consts(q, v, C, docs)
    _wy_kernel[(NT, B * Hv)](k, v, g, beta, docs_, W, U, Tm if keep_t else W, *q.stride()[:3], *v.stride()[:3],
                             *g.stride(), T, Hv, Hv // Hk, LOG2C=int(math.log2(C)), STORE_T=keep_t, PREC32=_PREC32,
                             **common, num_warps=8)
    _state_fwd_kernel[(B * Hv, triton.cdiv(V, common["BV"]))](
        k, g, docs_, W, U, s0 if s0 is not None else g, states, UN, s_fin if want_final else g, *q.stride()[:3],
        *g.stride(), T, NT, Hv, Hv // Hk, HAS_S0=s0 is not None, STORE_FIN=want_final, **common, num_warps=8)
    return W, states, UN, Tm, s_fin


def _fwd(q, k, v, g, beta, s0, docs, scale: float, C: int, want_final: bool):
    "Launch the forward: (o (B, T, Hv, V) in v's dtype, final state (B, Hv, K, V) float32 or None)."
    (B, T, Hk, K), (Hv, V) = q.shape, v.shape[2:]
    _, states, UN, _, s_fin = _states(q, k, v, g, beta, s0, docs, C, want_final, keep_t=False)
    o = torch.empty(B, T, Hv, V, dtype=v.dtype, device=q.device)
    if B * T * Hv:
        common = _consts(q, v, C, docs)
        _out_fwd_kernel[(triton.cdiv(T, C), B * Hv, triton.cdiv(V, common["BV"]))](
            q, k, g, docs if docs is not None else g, states, UN, o, *q.stride()[:3], *g.stride(), *o.stride()[:3],
            T, triton.cdiv(T, C), Hv, Hv // Hk, scale, **common, num_warps=8)
    return o, s_fin


def _prepare(q, k, v, g, beta, s0, C):
    "The kernels' layouts: q, k contiguous, v with unit last stride, g and β contiguous float32, s0 float32."
    if C < 16 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16; got {C}")
    q, k = q.contiguous(), k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    s0 = None if s0 is None else s0.float().contiguous()
    return q, k, v, g, beta, s0


# %% [markdown]
# Check the forward kernels against the loop (float64, the kernels on float32 inputs), at chunk-unaligned lengths
# with chunks of 16, GVA, an initial state, documents:

# %%
def fwd_of(q, k, v, g, beta, s0=None, docs=None, C=16, want_final=True):
    "The forward launcher on l2-normalised q, k (what the public function passes it)."
    scale, docs = _check_args(q, k, v, g, beta, s0, docs, None)
    return _fwd(*_prepare(l2norm(q), l2norm(k), v, g, beta, s0, C), docs, scale, C, want_final)


def ref64(q, k, v, g, beta, s0=None, docs=None):
    d = lambda t: None if t is None else t.double()
    return gated_delta_rule_reference(d(q), d(k), d(v), d(g), d(beta), initial_state=d(s0), docs=docs,
                                      output_final_state=True)


for seed, (B, T, Hk, Hv, K, V, state, docs) in enumerate([(2, 63, 2, 4, 16, 24, True, DOCS), (1, 40, 1, 2, 32, 16, False, None),
                                                          (1, 16, 1, 1, 16, 16, True, None)]):
    q, k, v, g, beta, s0 = make_inputs(B, T, Hk, Hv, K, V, seed=10 + seed, state=state)
    o, s = fwd_of(q, k, v, g, beta, s0, docs)
    o_ref, s_ref = ref64(q, k, v, g, beta, s0, docs)
    print(f"{(B, T, Hk, Hv, K, V)} state {state} docs {docs is not None}: out {rel_err(o, o_ref):.1e}, "
          f"final state {rel_err(s, s_ref):.1e}")
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5

# %% [markdown]
# ## Backward
#
# Reverse the chunked form, chunk by chunk from the last. With `dO`, and `dS_C` the gradient of the state at the
# chunk's end (the final state's gradient for the last chunk), and `M = Q Kᵀ ⊙ Γ`:
#
# - `dU' = Mᵀ dO + (K ⊙ e^{γ_C−γ}) dS_C`, and the state at the chunk's start gets
#   `dS_0 = e^{γ_C} dS_C + (Q ⊙ e^γ)ᵀ dO − Wᵀ dU'`. This is the only sequential part: a pass over chunks in
#   reverse, the mirror of the forward's state pass.
# - Then each chunk on its own: `dQ = (dO S_0ᵀ) ⊙ e^γ + (dM ⊙ Γ) K` with `dM = dO U'ᵀ`;
#   `dK = (dM ⊙ Γ)ᵀ Q + (U' dS_Cᵀ) ⊙ e^{γ_C−γ}` plus the WY terms; `dW = −dU' S_0ᵀ`, `dU = dU'`.
# - Through the WY representation: `dV = β ⊙ Tᵀ dU`, `d(β e^γ K) = Tᵀ dW`, `dT = dU (β V)ᵀ + dW (β e^γ K)ᵀ`, and
#   `dA = −Tᵀ dT Tᵀ` on the strict lower triangle (the derivative of an inverse), which reaches `K` and `β` through
#   `A = β_i (k_i·k_j) Γ_ij`.
# - `dβ` collects the three places `β` appears (`β V`, `β e^γ K`, `A`). `γ` appears in `Γ` (in `M` and `A`) and
#   in the three decay vectors; each exponential's derivative is itself, so each term gives `Σ (gradient ⊙ value)`
#   along a row, with a minus sign for the `−γ_j` of `Γ_ij` and of `e^{γ_C − γ_i}`, and the `γ_C` terms land on the
#   chunk's last token. `dg` is then the reverse cumulative sum of `dγ` within each document piece, and zero at a
#   document's first token.
#
# **Recompute or store the states.** The backward needs the state at every chunk start. Storing them from the
# forward costs `(T / C) · K · V` float32 per head: at Qwen3.5's shapes (32 value heads of 128 × 128, `C = 64`)
# that is 134 MB per layer for a 4K sequence, four times the bf16 `v` it comes from, kept for every linear layer
# until its backward (30 layers: 4 GB per 4K sequence). Recomputing them is one more run of the two forward
# kernels that produce them, a few percent of the layer's FLOPs (see the table below). So the autograd function
# saves only its inputs, and the backward recomputes `W`, `U`, `T` and the states, which live only while the
# layer's backward runs.
#
# Kernels: `_state_bwd_kernel` is the reverse pass (per head and value block: `dU'`, the end-of-chunk state
# gradients, `dS` of the initial state); `_chunk_bwd_kernel` does the rest per chunk, looping over value blocks
# and accumulating the `C × K` and `C × C` pieces. It writes `dq` and `dk` per value head; the launcher sums the
# heads of each GVA group.

# %%
#| export
@triton.jit
def _state_bwd_kernel(Qp, Kp, Gp, DOC, Wp, DOp, DSFIN, DSTATES, DUN, DS0,
                      sqb, sqt, sqh, sgb, sgt, sgh, sdb, sdt, sdh,
                      T, NT, H, GROUP, scale, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, C: tl.constexpr, HAS_DOC: tl.constexpr, HAS_DSFIN: tl.constexpr,
                      STORE_DS0: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """Program (b·H + h, value block): the reverse pass. Stores the gradient of the state at each chunk end
    (B, H, NT, K, V), dU' (B, H, T, V) and that of the initial state, all float32."""
    bh = tl.program_id(0)
    v0 = tl.program_id(1) * BV
    b = bh // H
    h = bh % H
    ck = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    smask = (ck < K)[:, None] & (cv < V)[None, :]
    soff = ck[:, None] * V + cv[None, :]
    if HAS_DSFIN:
        dS = tl.load(DSFIN + bh.to(tl.int64) * K * V + soff, mask=smask, other=0.0)
    else:
        dS = tl.zeros([BK, BV], tl.float32)
    Qh = Qp + b.to(tl.int64) * sqb + (h // GROUP) * sqh
    Kh = Kp + b.to(tl.int64) * sqb + (h // GROUP) * sqh
    Gh = Gp + b.to(tl.int64) * sgb + h * sgh
    DOCb = DOC + b.to(tl.int64) * T
    DOh = DOp + b.to(tl.int64) * sdb + h * sdh
    for i in range(NT):
        n = NT - 1 - i
        tl.store(DSTATES + (bh.to(tl.int64) * NT + n) * K * V + soff, dS, mask=smask)
        t0 = n * C
        rows = t0 + tl.arange(0, C)
        eg, el, ec, Gam, seg, start = _decays(Gh, sgt, DOCb, t0, T, C, HAS_DOC)
        q = _rows(Qh, rows, sqt, T, K, BK) * scale
        k = _rows(Kh, rows, sqt, T, K, BK)
        w = _rows(Wp + bh.to(tl.int64) * T * K, rows, K, T, K, BK)
        do = _rows(DOh, rows, sdt, T, V, BV, v0)
        M = _dot(q, tl.trans(k), DOT, PREC) * Gam
        dun = _dot(tl.trans(M), do, DOT, PREC) + _dot(k * el[:, None], dS, DOT, PREC)
        _store_rows(DUN + bh.to(tl.int64) * T * V, rows, V, T, dun, V, BV, v0)
        dS = dS * ec + _dot(tl.trans(q * eg[:, None]), do, DOT, PREC) - _dot(tl.trans(w), dun, DOT, PREC)
    if STORE_DS0:
        tl.store(DS0 + bh.to(tl.int64) * K * V + soff, dS, mask=smask)


@triton.jit
def _chunk_bwd_kernel(Qp, Kp, Vp, Gp, BETA, DOC, Tp, STATES, DSTATES, UN, DUN, DOp,
                      DQ, DK, DV, DG, DBETA,
                      sqb, sqt, sqh, svb, svt, svh, sgb, sgt, sgh, sdb, sdt, sdh, sxb, sxt, sxh,
                      T, NT, H, GROUP, scale, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, C: tl.constexpr, HAS_DOC: tl.constexpr, DOT: tl.constexpr,
                      PREC: tl.constexpr, PREC32: tl.constexpr):
    """Program (chunk, b·H + h): dq, dk (per value head, float32, (B, T, H, K)), dv, dβ and dg of one chunk."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t0 = n * C
    idx = tl.arange(0, C)
    rows = t0 + idx
    eg, el, ec, Gam, seg, start = _decays(Gp + b.to(tl.int64) * sgb + h * sgh, sgt, DOC + b.to(tl.int64) * T, t0,
                                          T, C, HAS_DOC)
    rmask = rows < T
    beta = tl.load(BETA + b.to(tl.int64) * sgb + h * sgh + rows.to(tl.int64) * sgt, mask=rmask,
                   other=0.0).to(tl.float32)
    q = _rows(Qp + b.to(tl.int64) * sqb + (h // GROUP) * sqh, rows, sqt, T, K, BK) * scale
    k = _rows(Kp + b.to(tl.int64) * sqb + (h // GROUP) * sqh, rows, sqt, T, K, BK)
    Tm = _rows(Tp + bh.to(tl.int64) * T * C, rows, C, T, C, C)
    ck = tl.arange(0, BK)
    Sbase = (bh.to(tl.int64) * NT + n) * K * V
    dqs = tl.zeros([C, BK], tl.float32)   # dO S_0ᵀ
    dks = tl.zeros([C, BK], tl.float32)   # U' dS_Cᵀ
    dW = tl.zeros([C, BK], tl.float32)
    dM = tl.zeros([C, C], tl.float32)
    dT = tl.zeros([C, C], tl.float32)
    dbeta = tl.zeros([C], tl.float32)
    dec = tl.zeros([BK], tl.float32)      # Σ S_0 ⊙ dS_C, for the chunk decay
    for v0 in tl.static_range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        soff = Sbase + ck[:, None] * V + cv[None, :]
        smask = (ck < K)[:, None] & (cv < V)[None, :]
        S = tl.load(STATES + soff, mask=smask, other=0.0)
        dS = tl.load(DSTATES + soff, mask=smask, other=0.0)
        un = _rows(UN + bh.to(tl.int64) * T * V, rows, V, T, V, BV, v0)
        dun = _rows(DUN + bh.to(tl.int64) * T * V, rows, V, T, V, BV, v0)
        do = _rows(DOp + b.to(tl.int64) * sdb + h * sdh, rows, sdt, T, V, BV, v0)
        vt = _rows(Vp + b.to(tl.int64) * svb + h * svh, rows, svt, T, V, BV, v0)
        dqs += _dot(do, tl.trans(S), DOT, PREC)
        dks += _dot(un, tl.trans(dS), DOT, PREC)
        dW -= _dot(dun, tl.trans(S), DOT, PREC)
        dM += _dot(do, tl.trans(un), DOT, PREC)
        dT += tl.dot(dun, tl.trans(vt * beta[:, None]), input_precision=PREC32)
        dvb = tl.dot(tl.trans(Tm), dun, input_precision=PREC32)
        _store_rows(DV + b.to(tl.int64) * sxb + h * sxh, rows, sxt, T, dvb * beta[:, None], V, BV, v0)
        dbeta += tl.sum(dvb * vt, 1)
        dec += tl.sum(S * dS, 1)
    # the intra-chunk output term M = Q Kᵀ ⊙ Γ
    dMG = dM * Gam
    dq = dqs * eg[:, None] + _dot(dMG, k, DOT, PREC)
    dk = _dot(tl.trans(dMG), q, DOT, PREC) + dks * el[:, None]
    QK = _dot(q, tl.trans(k), DOT, PREC)
    PM = dMG * QK
    # the WY representation: W = T (β e^γ ⊙ K), U = T (β ⊙ V), T = (I + A)⁻¹
    kbe = k * (beta * eg)[:, None]
    dkbe = tl.dot(tl.trans(Tm), dW, input_precision=PREC32)
    dT += tl.dot(dW, tl.trans(kbe), input_precision=PREC32)
    dk += dkbe * (beta * eg)[:, None]
    dbeta += tl.sum(dkbe * k, 1) * eg
    strict = idx[:, None] > idx[None, :]
    dA = -tl.dot(tl.dot(tl.trans(Tm), dT, input_precision=PREC32), tl.trans(Tm), input_precision=PREC32)
    dA = tl.where(strict, dA, 0.0)
    KK = _dot(k, tl.trans(k), DOT, PREC)
    GA = dA * Gam                          # ∂/∂(k_i·k_j) of A_ij = β_i (k_i·k_j) Γ_ij is β_i Γ_ij
    Hb = GA * beta[:, None]
    dk += _dot(Hb, k, DOT, PREC) + _dot(tl.trans(Hb), k, DOT, PREC)
    dbeta += tl.sum(GA * KK, 1)
    PA = Hb * KK                           # dA ⊙ A
    # γ: Γ in M and A (+ row, − column), e^γ (Q term and W), e^{γ_C − γ} and e^{γ_C} (state update)
    dgam = tl.sum(PM + PA, 1) - tl.sum(PM + PA, 0)
    dgam += tl.sum(dqs * q, 1) * eg + tl.sum(dkbe * kbe, 1)
    e = tl.sum(k * dks, 1) * el
    dgam -= e
    dgam += tl.where(idx == C - 1, tl.sum(e, 0) + ec * tl.sum(dec, 0), 0.0)
    dg = tl.sum(tl.where(seg, dgam[:, None], 0.0), 0)   # reverse cumulative sum within each document piece
    dg = tl.where(start, 0.0, dg)
    doff = b.to(tl.int64) * sgb + h * sgh + rows.to(tl.int64) * sgt
    tl.store(DG + doff, dg, mask=rmask)
    tl.store(DBETA + doff, dbeta, mask=rmask)
    dbase = (b.to(tl.int64) * T * H + h) * K
    _store_rows(DQ + dbase, rows, H * K, T, dq * scale, K, BK)
    _store_rows(DK + dbase, rows, H * K, T, dk, K, BK)


def _bwd(q, k, v, g, beta, s0, docs, scale: float, C: int, do, dsfin, want_ds0: bool):
    """Gradients (dq, dk, dv, dg, dβ, ds0 or None) of the kernels' inputs (q, k already normalised), given dO (or
    None) and the final state's gradient (or None). dq, dk are summed over each GVA group; dg, dβ float32."""
    (B, T, Hk, K), (Hv, V) = q.shape, v.shape[2:]
    NT = triton.cdiv(T, C)
    f32 = dict(dtype=torch.float32, device=q.device)
    if do is None:
        do = torch.zeros(B, T, Hv, V, dtype=v.dtype, device=v.device)
    do = do if do.stride(-1) == 1 else do.contiguous()
    W, states, UN, Tm, _ = _states(q, k, v, g, beta, s0, docs, C, want_final=False, keep_t=True)
    dstates, DUN = torch.empty(B, Hv, NT, K, V, **f32), torch.empty(B, Hv, T, V, **f32)
    ds0 = torch.empty(B, Hv, K, V, **f32) if want_ds0 else None
    dq, dk = torch.empty(B, T, Hv, K, **f32), torch.empty(B, T, Hv, K, **f32)
    dv, dg, dbeta = torch.empty(v.shape, dtype=v.dtype, device=v.device), torch.empty_like(g), torch.empty_like(beta)
    docs_, common = docs if docs is not None else g, _consts(q, v, C, docs)
    if B * T * Hv:
        _state_bwd_kernel[(B * Hv, triton.cdiv(V, common["BV"]))](
            q, k, g, docs_, W, do, dsfin if dsfin is not None else g, dstates, DUN,
            ds0 if want_ds0 else g, *q.stride()[:3], *g.stride(), *do.stride()[:3], T, NT, Hv, Hv // Hk, scale,
            HAS_DSFIN=dsfin is not None, STORE_DS0=want_ds0, **common, num_warps=8)
        _chunk_bwd_kernel[(NT, B * Hv)](
            q, k, v, g, beta, docs_, Tm, states, dstates, UN, DUN, do, dq, dk, dv, dg, dbeta,
            *q.stride()[:3], *v.stride()[:3], *g.stride(), *do.stride()[:3], *dv.stride()[:3], T, NT, Hv, Hv // Hk,
            scale, PREC32=_PREC32, **common, num_warps=8)
    elif want_ds0:
        ds0.copy_(dsfin if dsfin is not None else torch.zeros_like(ds0))
    dq, dk = (x.view(B, T, Hk, Hv // Hk, K).sum(3) for x in (dq, dk))
    return dq, dk, dv, dg, dbeta, ds0


# %% [markdown]
# Check every gradient against autograd through the float64 loop: `dq`, `dk` (through the l2 norm, which autograd
# differentiates here as the public function does), `dv`, `dg`, `dβ` and the initial state's, for a loss that
# uses both the output and the final state, on the same cases as the forward.

# %%
def ref_grads(q, k, v, g, beta, s0, docs, do, dsfin):
    "Reference gradients of Σ do·o + Σ dsfin·S_final through autograd on the float64 loop."
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, g, beta)]
    s64 = None if s0 is None else s0.detach().double().requires_grad_()
    o, s = gated_delta_rule_reference(*leaves, initial_state=s64, docs=docs, output_final_state=True)
    loss = (o * do.double()).sum() + (s * dsfin.double()).sum()
    return torch.autograd.grad(loss, leaves + ([s64] if s64 is not None else []))


def kernel_grads(q, k, v, g, beta, s0, docs, do, dsfin, C=16):
    "The backward launcher's gradients, with the l2 norm's backward through autograd."
    scale, docs = _check_args(q, k, v, g, beta, s0, docs, None)
    qk = [t.detach().requires_grad_() for t in (q, k)]
    qn, kn = l2norm(qk[0]), l2norm(qk[1])
    dqn, dkn, dv, dg, dbeta, ds0 = _bwd(*_prepare(qn.detach(), kn.detach(), v, g, beta, s0, C), docs, scale, C, do,
                                        dsfin, s0 is not None)
    dq, dk = torch.autograd.grad((qn, kn), qk, (dqn, dkn))
    return (dq, dk, dv, dg, dbeta) + ((ds0,) if s0 is not None else ())


for seed, (B, T, Hk, Hv, K, V, state, docs) in enumerate([(2, 63, 2, 4, 16, 24, True, DOCS), (1, 40, 1, 2, 32, 16, False, None),
                                                          (1, 16, 1, 1, 16, 16, True, None)]):
    q, k, v, g, beta, s0 = make_inputs(B, T, Hk, Hv, K, V, seed=20 + seed, state=state)
    do, dsfin = torch.randn(B, T, Hv, V), torch.randn(B, Hv, K, V)
    got = kernel_grads(q, k, v, g, beta, s0, docs, do, dsfin)
    want = ref_grads(q, k, v, g, beta, s0, docs, do, dsfin)
    errs = {n: rel_err(a, b) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "ds0"), got, want)}
    print((B, T, Hk, Hv, K, V), f"state {state} docs {docs is not None}:", " ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) < 1e-5, errs

# %% [markdown]
# ## The entry point
#
# The models call the rule from stage 1, which the trainer compiles with `torch.compile(fullgraph=True)`, so the
# forward and the backward are two PyTorch custom operators (`torch.library.custom_op`) with shape-only versions,
# as for attention: the compiler sees each as one opaque call. The forward operator always returns the final
# state (one `K × V` float32 matrix per head); the public function drops it unless asked. The l2 norm is plain
# torch before the operator, so autograd differentiates it; the kernels see normalised `q`, `k` in their dtype.
# The operator saves only its inputs for the backward (see above).

# %%
#| export
@torch.library.custom_op("pith_lit::gated_delta_rule_fwd", mutates_args=())
def _gdr_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, docs: torch.Tensor | None, scale: float,
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, initial_state, chunk_size)
    return _fwd(q, k, v, g, beta, s0, docs, scale, chunk_size, want_final=True)


@_gdr_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, docs, scale, chunk_size):
    (B, T, _, K), (Hv, V) = q.shape, v.shape[2:]
    return v.new_empty(B, T, Hv, V), q.new_empty(B, Hv, K, V, dtype=torch.float32)


@torch.library.custom_op("pith_lit::gated_delta_rule_bwd", mutates_args=())
def _gdr_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, docs: torch.Tensor | None, do: torch.Tensor | None,
                dsfin: torch.Tensor | None, scale: float, chunk_size: int) -> list[torch.Tensor]:
    dtypes = [t.dtype for t in (q, k, v, g, beta)]
    args = _prepare(q, k, v, g, beta, initial_state, chunk_size)
    grads = _bwd(*args, docs, scale, chunk_size, do, None if dsfin is None else dsfin.float().contiguous(),
                 initial_state is not None)
    out = [x.to(dt) for x, dt in zip(grads[:5], dtypes)]
    return out + ([grads[5].to(initial_state.dtype)] if initial_state is not None else [])


@_gdr_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, docs, do, dsfin, scale, chunk_size):
    return [torch.empty_like(t) for t in (q, k, v, g, beta)] + (
        [torch.empty_like(initial_state)] if initial_state is not None else [])


def _gdr_setup(ctx, inputs, output):
    q, k, v, g, beta, initial_state, docs, scale, chunk_size = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, docs)
    ctx.scale, ctx.chunk_size = scale, chunk_size


def _gdr_backward(ctx, do, dsfin):
    q, k, v, g, beta, s0, docs = ctx.saved_tensors
    grads = _gdr_bwd_op(q, k, v, g, beta, s0, docs, do, dsfin, ctx.scale, ctx.chunk_size)
    return *grads[:5], (grads[5] if s0 is not None else None), None, None, None


_gdr_fwd_op.register_autograd(_gdr_backward, setup_context=_gdr_setup)


def chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state: bool = False, docs=None,
                           use_qk_l2norm: bool = True, scale: float | None = None, chunk_size: int | None = None):
    """The gated delta rule with Triton kernels (CUDA tensors, or CPU ones under TRITON_INTERPRET=1).

    q, k (B, T, Hk, K); v (B, T, Hv, V) with Hv a multiple of Hk (value head h reads key head h // (Hv / Hk));
    g (B, T, Hv) log-decays; beta (B, T, Hv) write strengths; initial_state (B, Hv, K, V); docs (B, T) integer
    document ids, non-decreasing along a row (the state resets where the id changes). q and k are l2-normalised
    when use_qk_l2norm, and q is scaled by `scale` (default K**-0.5). chunk_size: a power of two >= 16 (default 64).
    Returns (o (B, T, Hv, V) in v's dtype, the final state (B, Hv, K, V) float32 if output_final_state else None);
    every input, the initial state included, gets a gradient."""
    scale, docs = _check_args(q, k, v, g, beta, initial_state, docs, scale)
    if not (q.is_cuda or INTERPRET):
        raise ValueError("chunk_gated_delta_rule runs Triton kernels: give CUDA tensors, or set TRITON_INTERPRET=1 "
                         "before importing triton to run them on the CPU (chunk_gated_delta_rule_torch is the "
                         "plain-torch version)")
    for t in (q, k, v):
        _precisions(t.dtype)
    chunk_size = 64 if chunk_size is None else chunk_size
    if not isinstance(chunk_size, int) or chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16; got {chunk_size!r}")
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    o, s = _gdr_fwd_op(q, k, v, g, beta, initial_state, docs, scale, chunk_size)
    return o, (s if output_final_state else None)


# %% [markdown]
# Check the whole function through autograd against the loop: one loss on the output and the final state, every
# gradient, with transposed-projection inputs (`v` a slice of a wider tensor), packed documents whose first row
# starts with a document of length 1, and against transformers' chunked version on one document. Then the
# same compiled with `fullgraph=True` (`aot_eager` traces forward and backward as the compiler does), and bf16
# and fp16 inputs (computed in float32 under the interpreter; bf16 stores truncate there, so the tolerance is
# a few bf16 ulps).

# %%
def check_api(B, T, Hk, Hv, K, V, docs, seed, dtype=torch.float32, tol=1e-5, compile=False, state=True, C=16):
    q, k, v, g, beta, s0 = make_inputs(B, T, Hk, Hv, K, V, seed, state=state)
    vwide = torch.cat([v, torch.randn_like(v)], -1)[..., :V]   # a view with a row stride of 2·V
    leaves = [t.to(dtype).requires_grad_() for t in (q, k)] + [vwide.to(dtype)[..., :V].requires_grad_()] + \
             [t.requires_grad_() for t in (g, beta)] + ([s0.requires_grad_()] if state else [])
    fn = lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5] if state else None, output_final_state=True,
                                           docs=docs, chunk_size=C)
    if compile:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    o, s = fn(*leaves)
    do, dsfin = torch.randn_like(o.float()), torch.randn_like(s)
    got = torch.autograd.grad((o.float() * do).sum() + (s * dsfin).sum(), leaves)
    o_ref, s_ref = ref64(*[t.detach() for t in leaves[:5]], s0 if state else None, docs)
    want = ref_grads(*[t.detach() for t in leaves[:5]], s0 if state else None, docs, do, dsfin)
    errs = [rel_err(o, o_ref), rel_err(s, s_ref)] + [rel_err(a, b) for a, b in zip(got, want)]
    assert max(errs) < tol, (dtype, errs)
    assert o.dtype == dtype and all(a.dtype == t.dtype for a, t in zip(got, leaves))
    return errs


DOCS1 = doc_ids_from_lengths([1, 30, 1, 1, 17], [50])
for args, kw in [((2, 50, 2, 4, 16, 24, DOCS1, 30), {}), ((1, 37, 1, 2, 32, 16, None, 31), dict(state=False)),
                 ((2, 50, 2, 4, 16, 24, DOCS1, 32), dict(compile=True)),
                 ((1, 40, 1, 2, 32, 32, None, 33), dict(dtype=torch.float16, tol=3e-3)),
                 ((1, 40, 1, 2, 32, 32, DOCS1[:1, :40], 34), dict(dtype=torch.bfloat16, tol=3e-2))]:
    print(args[:6], "docs" if args[6] is not None else "", kw, f"max err {max(check_api(*args, **kw)):.1e}")
torch._dynamo.reset()

q, k, v, g, beta, s0 = make_inputs(1, 70, 2, 4, 32, 32, seed=35, state=True)
o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=32)
o_hf, s_hf = hf_rule("torch_chunk_gated_delta_rule", q, k, v, g, beta, s0)
print(f"vs transformers' chunked version: out {rel_err(o, o_hf):.1e}, state {rel_err(s, s_hf):.1e}")
assert rel_err(o, o_hf) < 1e-5 and rel_err(s, s_hf) < 1e-5

# %% [markdown]
# Unused outputs: a loss on the output alone (the training case: no final state) and one on the final state
# alone (which does not depend on `q`) both give exact gradients.

# %%
q, k, v, g, beta, s0 = make_inputs(1, 33, 1, 2, 16, 16, seed=36, state=True)
leaves = [t.requires_grad_() for t in (q, k, v, g, beta, s0)]
for pick in (0, 1):
    out = chunk_gated_delta_rule(*leaves[:5], initial_state=s0, output_final_state=True, docs=DOCS1[:1, :33],
                                 chunk_size=16)[pick]
    ref = ref64(*leaves, DOCS1[:1, :33])[pick]
    grad = lambda y: torch.autograd.grad(y.sum(), leaves, allow_unused=True, materialize_grads=True)
    got, want = grad(out), grad(ref)
    errs = [rel_err(a, b) if b.abs().max() > 0 else a.abs().max().item() for a, b in zip(got, want)]
    assert max(errs) < 1e-5, errs

# %% [markdown]
# ## What feeds the rule: the short convolution and the gates
#
# In Qwen3.5 the fused projection `[q | k | v]` first goes through a depthwise causal convolution of width 4
# (per channel: `y_t = Σ_j w_j x_{t−3+j}`), then SiLU. With packed documents the window must not reach into the
# previous document: inputs before the document start count as zero, as if each document were convolved alone.
# It is four shifted multiply-adds in float32 (channels last, as the projection produces them), with the shifted
# copies masked where they cross a document start; `torch.compile` fuses them into one pass.
#
# The gates are plain elementwise torch, in transformers' precision: `g = −e^{A_log} softplus(a + dt_bias)` in
# float32, `β = sigmoid(b)` in the input dtype, and the output goes through an RMS norm gated by `silu(z)`. All
# three compute in float64 for float64 inputs, so a float64 check is not held to float32's rounding.

# %%
#| export
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, docs: torch.Tensor | None = None,
                  silu: bool = True) -> torch.Tensor:
    """Depthwise causal convolution of x (B, T, D) (channels last) with weight (D, W): y_t = Σ_j w[:, j] x_{t−W+1+j},
    inputs before a document start (docs (B, T), as for the rule) counting as zero; then SiLU. Computed in float32 (or
    x's dtype if wider), returned in x's dtype."""
    B, T, D = x.shape
    width = weight.shape[-1]
    if weight.shape != (D, width):
        raise ValueError(f"weight must be (D, W) = ({D}, W) for x {tuple(x.shape)}; got {tuple(weight.shape)}")
    ct = torch.promote_types(x.dtype, torch.float32)
    xf, w = x.to(ct), weight.to(ct)
    y = xf * w[:, -1]
    for s in range(1, min(width, T + 1)):
        shifted = F.pad(xf[:, :T - s], (0, 0, s, 0))
        if docs is not None:
            same = F.pad(docs[:, s:] == docs[:, :T - s], (s, 0), value=False)
            shifted = shifted * same[..., None]
        y = y + shifted * w[:, -1 - s]
    return (F.silu(y) if silu else y).to(x.dtype)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Qwen3.5's (g, β) from the projections a, b (B, T, Hv): g = −exp(A_log)·softplus(a + dt_bias) in float32 (or a's
    dtype if wider), β = σ(b)."""
    ct = torch.promote_types(a.dtype, torch.float32)
    return -A_log.to(ct).exp() * F.softplus(a.to(ct) + dt_bias), b.sigmoid()


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    "RMS-normalise x over its last dim (float32, or x's dtype if wider), scale by weight in x's dtype, gate by silu(z)."
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * xn) * F.silu(z.to(ct))).to(x.dtype)


# %% [markdown]
# Check the convolution against transformers' `causal_conv1d_fn` on one document and against `F.conv1d` run on
# each document alone; the gates and the norm against transformers' module and expressions.

# %%
torch.set_default_device("cpu")  # these checks are plain torch
gen = torch.Generator().manual_seed(40)
x, w = torch.randn(2, 63, 12, generator=gen), torch.randn(12, 4, generator=gen)
y_hf = hf.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
assert rel_err(causal_conv1d(x, w), y_hf) < 1e-6
y = causal_conv1d(x, w, DOCS.cpu())   # DOCS was made on the default device, CUDA on a GPU
for r, lens_r in enumerate([[1, 15, 16, 3, 1, 1, 20, 2, 4], [40, 1, 22]]):
    pieces = [F.silu(F.conv1d(p.T[None], w[:, None], padding=3, groups=12)[0, :, :p.shape[0]].T)
              for p in x[r].split(lens_r)]
    assert rel_err(y[r], torch.cat(pieces)) < 1e-6
a, bb = torch.randn(2, 5, 4, generator=gen), torch.randn(2, 5, 4, generator=gen)
o_, zz = torch.randn(2, 5, 4, 8, generator=gen), torch.randn(2, 5, 4, 8, generator=gen)
A_log, dt_bias, wn = torch.randn(4, generator=gen), torch.randn(4, generator=gen), torch.randn(8, generator=gen)
g_, b_ = gdn_gates(a, bb, A_log, dt_bias)
assert torch.equal(g_, -A_log.float().exp() * F.softplus(a.float() + dt_bias)) and torch.equal(b_, bb.sigmoid())
norm = hf.Qwen3_5MoeRMSNormGated(8, eps=1e-6)
norm.weight.data.copy_(wn)
assert rel_err(gated_rms_norm(o_, zz, wn), norm(o_, zz)) < 1e-6
print("convolution, gates and gated norm agree with transformers")
if torch.cuda.is_available():
    torch.set_default_device("cuda")

# %% [markdown]
# ## Cost against causal attention
#
# FLOPs of the chunked form per head and token, counting each product `2·m·n·k` as the kernels run them (the
# forward: `A`, the inverse, `W`, `U`, the state pass and the output; the backward: the recomputation of `W`, `U`,
# `T` and the states, the reverse pass and the per-chunk gradients). Causal attention counts the two forward and
# five backward products over `T²/2` pairs (flash attention's convention). Memory: what the backward keeps
# (saved inputs) and what exists only while a layer's backward runs (the states and float32 buffers), against
# flash attention's saved `q, k, v, o` and `lse`. Both at Qwen3.5-35B-A3B's layers: Gated DeltaNet with 16 key and
# 32 value heads of 128 (`C = 64`), full attention with 16 query and 2 KV heads of 256. Computed, not measured.

# %%
def gdr_costs(T: int, Hk: int = 16, Hv: int = 32, K: int = 128, V: int = 128, C: int = 64) -> dict:
    "FLOPs and bytes of one gated-delta-rule layer on one sequence of T tokens (bf16 inputs), as the kernels run."
    per_chunk_wy = 2 * C * C * K + (int(math.log2(C)) - 1) * 4 * C ** 3 + 2 * C * C * (K + V)
    per_chunk_state = 4 * C * K * V
    per_chunk_out = 2 * C * C * K + 2 * C * K * V + 2 * C * C * V
    fwd = per_chunk_wy + per_chunk_state + per_chunk_out
    state_bwd = 2 * C * C * K + 2 * C * C * V + 2 * C * K * V + 4 * C * K * V
    chunk_bwd = 6 * C * K * V + 6 * C * C * V + 8 * C * C * K + 8 * C * C * K + 4 * C ** 3
    bwd = per_chunk_wy + per_chunk_state + state_bwd + chunk_bwd
    n = math.ceil(T / C) * Hv
    saved = 2 * T * (2 * Hk * K + Hv * V) + 4 * 2 * T * Hv               # q, k, v (bf16), g, β (float32)
    transient = 4 * Hv * (2 * math.ceil(T / C) * K * V + T * (K + 2 * V + C) + 2 * T * K)
    return dict(fwd=fwd * n, bwd=bwd * n, saved=saved, transient=transient)


def attention_costs(T: int, Hq: int = 16, Hkv: int = 2, D: int = 256) -> dict:
    "FLOPs and bytes of one causal flash-attention layer on T tokens (bf16): T²/2 pairs."
    pairs = T * T / 2
    return dict(fwd=2 * Hq * pairs * 2 * D, bwd=2 * Hq * pairs * 5 * D,
                saved=2 * T * D * (2 * Hq + 2 * Hkv) + 4 * T * Hq, transient=4 * T * Hq)


# %%
print(f"{'T':>6} {'layer':>22} {'fwd GFLOP':>10} {'fwd+bwd GFLOP':>14} {'saved MB':>9} {'transient MB':>13}")
for T in (4096, 32768):
    for name, c in (("gated delta rule", gdr_costs(T)), ("causal attention", attention_costs(T))):
        print(f"{T:>6} {name:>22} {c['fwd'] / 1e9:>10.1f} {(c['fwd'] + c['bwd']) / 1e9:>14.1f} "
              f"{c['saved'] / 2**20:>9.0f} {c['transient'] / 2**20:>13.0f}")

# %% [markdown]
# At 4K tokens a Gated DeltaNet layer does about a quarter of the FLOPs of a Qwen3.5 full-attention layer, at 32K
# about a thirtieth: its cost grows linearly with `T`, attention's quadratically. A third of the forward's FLOPs
# is the `C × C` inverse by repeated squaring (`4·(log₂C − 1)·C³` per chunk, against `C³/3` by substitution), which
# buys tensor-core products instead of `C` dependent row updates. What the backward keeps is the same order as
# attention's (the inputs); the recomputed states and the float32 buffers (`W`, `U`, `U'`, `T`, their gradients)
# exist only while one layer's backward runs and are freed before the next.

# %%
print(f"notebook checks took {time.time() - T0:.1f} s")

# %% [markdown]
# The GPU cell: bf16 kernels against the float32 torch chunked form on the same inputs, at Qwen3.5's head dims with
# documents and an initial state, forward and every gradient (errors relative to the largest value; bf16
# operands in the products, so about 1e-2). Speed is measured by `benchmarks/gdr_bench.py`.

# %%
#| cuda
def gpu_check(B, T, Hk, Hv, D, docs, seed):
    q, k, v, g, beta, s0 = make_inputs(B, T, Hk, Hv, D, D, seed, state=True)
    leaves = [t.bfloat16().requires_grad_() for t in (q, k, v)] + [t.requires_grad_() for t in (g, beta, s0)]
    o, s = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, docs=docs)
    do, ds = torch.randn_like(o.float()), torch.randn_like(s)
    got = torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), leaves)
    l32 = [t.detach().float().requires_grad_() for t in leaves]
    o_r, s_r = chunk_gated_delta_rule_torch(*l32[:5], initial_state=l32[5], output_final_state=True, docs=docs)
    want = torch.autograd.grad((o_r * do).sum() + (s_r * ds).sum(), l32)
    errs = [rel_err(o, o_r), rel_err(s, s_r)] + [rel_err(a, b) for a, b in zip(got, want)]
    print((B, T, Hk, Hv, D), "docs" if docs is not None else "", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 3e-2, errs


gpu_check(2, 1000, 16, 32, 128, None, 50)
gpu_check(2, 777, 2, 4, 128, doc_ids_from_lengths([1, 300, 63, 1, 412], [777]).cuda(), 51)
