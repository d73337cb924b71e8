# ---
# jupyter:
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Ring attention over zigzag chunks (context parallelism)
#
# Context parallelism splits one sequence over `cp` ranks. Every operation of a layer except attention works
# token by token, so each rank runs it on its own tokens; attention needs every earlier key of the sequence. Ring
# attention passes the keys and values around the ranks: at step `i` rank `r` holds the keys and values of rank
# `r − i`, attends its queries to them, and merges the result into what it has so far through the log-sum-exp
# (ops/14 returns it). After `cp` steps every query has seen every key once, and no rank ever holds more than
# two ranks' keys and values.
#
# **Zigzag.** Causal attention does more work for late queries than for early ones. The sequence is cut into
# `2·cp` chunks and rank `r` holds chunks `r` and `2·cp − 1 − r`: an early chunk and a late one, so every rank
# does the same causal work. Its tokens are the two chunks one after the other; `zigzag_index` gives their
# places in the sequence, which RoPE and the masks use (the models take explicit positions).
#
# **One step** attends each of the two local query chunks to each of the two chunks received: four blocks, of
# which a block whose keys all come after its queries is skipped, a block of the same chunk is causal on the
# diagonal, and a block of an earlier chunk is fully visible — all three are ops/14's causal kernel with the
# chunks' offsets, which also applies the sliding window and the documents. A block whose chunk lies wholly
# outside the window is skipped without a call, so with a window shorter than a chunk most steps cost nothing.
#
# **Merging.** Two partial results `(o₁, ℓ₁)` and `(o₂, ℓ₂)` over disjoint keys combine as
# `ℓ = log(e^ℓ₁ + e^ℓ₂)`, `o = o₁·e^(ℓ₁−ℓ) + o₂·e^(ℓ₂−ℓ)`. Learned **sinks** (GPT-OSS) enter once, after the
# ring: a sink is one more logit with a zero value, so `o ← o·σ(ℓ − sink)`, written in plain autograd.
#
# **Backward** runs the ring again. Each rank keeps its queries, the merged output and log-sum-exp, and only its
# own keys and values; the keys and values travel around once more, and beside them the gradient of each
# rank's keys and values, to which every rank adds its share before passing it on. After `cp` steps and one
# last hop, each gradient is back with its owner. ops/14's backward computes a block's share from the merged
# output and log-sum-exp alone (`P = exp(S − ℓ)`), so no per-step result is kept.
#
# **What travels** is a *payload* from which each rank expands the keys and values it attends to. For GQA the
# payload is the keys and values themselves. DeepSeek's multi-head latent attention sends its normalised latent
# and the shared rotary key (`kv_lora_rank + qk_rope_head_dim` numbers per token) and expands them through
# `kv_b_proj` on arrival; backward expands again and sends the latent's gradient. `expand_bytes` below gives
# what that saves at the real shapes.
#
# **Overlap.** Each step starts the next step's transfer (a batched `isend`/`irecv` to the next and from the
# previous rank) before its own four blocks run, and waits for it after. On NCCL the transfers run on NCCL's
# own stream, so they can run under the attention kernels (not yet measured on GPUs); in backward the gradient that arrives for the next
# step's keys is added after that step's own blocks ran, so it too travels under compute.

# %%
#| default_exp ops.ring_attention

# %%
#| export
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from pith_lit.ops.attention import Mask, attention_bwd, attention_fwd, attention_mask, attention_reference

# %% [markdown]
# ## Zigzag chunks
#
# `zigzag_shard` cuts a sequence dimension into this rank's two chunks; `zigzag_index` says where its tokens
# sit in the whole sequence. With packed documents the positions restart at each document, so a token's place
# minus its position is the place where its document starts: a document id that every rank computes the same
# way (`zigzag_documents`), non-decreasing within a chunk as ops/14's kernel wants.

# %%
#| export
def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    "The two chunks (of 2·cp) that rank `rank` of `cp` holds: an early one and its mirror."
    return rank, 2 * cp - 1 - rank


def zigzag_shard(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    "This rank's tokens of `x`: chunks `rank` and `2·cp − 1 − rank` of the 2·cp chunks along `dim`, concatenated."
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"a sequence of {x.shape[dim]} tokens cannot be cut into 2·cp = {2 * cp} equal chunks; "
                         f"choose a length divisible by {2 * cp}")
    chunks = x.chunk(2 * cp, dim)
    a, b = zigzag_chunks(cp, rank)
    return torch.cat((chunks[a], chunks[b]), dim)


def zigzag_index(n_local: int, cp: int, rank: int, device=None) -> Tensor:
    "(n_local,) int64: the places in the whole sequence of this rank's `n_local` tokens."
    c = n_local // 2
    a, b = zigzag_chunks(cp, rank)
    return torch.cat((torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)))


def zigzag_documents(positions: Tensor, cp: int, rank: int) -> Tensor | None:
    """(B, n_local) int32 document ids, equal on every rank for the same document, from this rank's (B, n_local)
    positions (restarting at each document); None for (n_local,) positions, one document per row."""
    if positions.dim() == 1:
        return None
    return (zigzag_index(positions.shape[1], cp, rank, positions.device) - positions).to(torch.int32).contiguous()

# %%
def zigzag_unshard(pieces: list[Tensor], dim: int = 1) -> Tensor:
    "The whole sequence from every rank's `zigzag_shard`, in rank order (the inverse, for the checks)."
    cp = len(pieces)
    chunks = [None] * (2 * cp)
    for r, p in enumerate(pieces):
        chunks[r], chunks[2 * cp - 1 - r] = p.chunk(2, dim)
    return torch.cat(chunks, dim)


x = torch.arange(24).view(1, 24)
pieces = [zigzag_shard(x, 3, r) for r in range(3)]
print([p.tolist()[0] for p in pieces])
assert torch.equal(zigzag_unshard(pieces), x)
assert all(torch.equal(p[0], zigzag_index(8, 3, r)) for r, p in enumerate(pieces))
pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6]])            # documents of 3, 2 and 7 tokens
docs = [zigzag_documents(zigzag_shard(pos, 2, r), 2, r) for r in range(2)]
assert torch.equal(zigzag_unshard(docs), torch.tensor([[0, 0, 0, 3, 3, 5, 5, 5, 5, 5, 5, 5]], dtype=torch.int32))

# %% [markdown]
# ## One block, forward and backward
#
# A block is one query chunk (global chunk `qi`) against one key chunk (`kj`), each `c` tokens. On CUDA it is
# ops/14's kernel with offsets `qi·c` and `kj·c`; on the CPU the same rules by explicit scores
# (`attention_reference`), and a backward written out the same way: `P = exp(S − ℓ)` with the merged `ℓ`,
# `dV = Pᵀ dO`, `dS = P ∘ (dO Vᵀ − δ)` with `δ = rowsum(dO ∘ O) − dℓ`, `dQ = dS K`, `dK = dSᵀ Q` (times the
# scale), summed over the query heads that share a key head.

# %%
#| export
def visible(qi: int, kj: int, c: int, window: int | None) -> bool:
    "Whether any query of chunk `qi` sees any key of chunk `kj` (chunks of `c` tokens): causal, then the window."
    return kj <= qi and (window is None or qi * c - (kj * c + c - 1) < window)


def _mask(qi: int, kj: int, c: int, window: int | None) -> Mask:
    return Mask(True, window, qi * c, kj * c)


def block_forward(q, k, v, m: Mask, scale: float, q_doc, k_doc) -> tuple[Tensor, Tensor]:
    "(out, lse) of q over k, v under mask `m`: the Triton kernel on CUDA, explicit scores on the CPU."
    if q.is_cuda:
        return attention_fwd(q, k, v, None, m, scale, q_doc, k_doc)
    return attention_reference(q, k, v, causal=m.causal, window=m.window, scale=scale, q_doc=q_doc, k_doc=k_doc,
                               q_offset=m.q_offset, k_offset=m.k_offset)


def _block_backward_torch(q, k, v, out, lse, dout, dlse, m: Mask, scale: float, q_doc, k_doc):
    (B, Hq, Sq, D), (Hkv, Sk) = q.shape, k.shape[1:3]
    ct, rep = torch.promote_types(q.dtype, torch.float32), Hq // Hkv
    qf, dof, of = q.to(ct), dout.to(ct), out.to(ct)
    kf, vf = k.to(ct).repeat_interleave(rep, 1), v.to(ct).repeat_interleave(rep, 1)
    keep = attention_mask(Sq, Sk, causal=m.causal, window=m.window, q_doc=q_doc, k_doc=k_doc, q_offset=m.q_offset,
                          k_offset=m.k_offset, device=q.device)
    s = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    p = torch.exp(s - lse.to(ct).masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    delta = (dof * of).sum(-1) - (dlse.to(ct) if dlse is not None else 0)
    ds = p * (dof @ vf.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = ds @ kf * scale
    dk = (ds.transpose(-1, -2) @ qf * scale).view(B, Hkv, rep, Sk, D).sum(2)
    dv = (p.transpose(-1, -2) @ dof).view(B, Hkv, rep, Sk, -1).sum(2)
    return dq, dk, dv


def block_backward(q, k, v, out, lse, dout, dlse, m: Mask, scale: float, q_doc, k_doc):
    """(dq, dk, dv) of one block, given the *merged* out and lse of its query rows and their gradients (dlse may
    be None)."""
    if q.is_cuda:
        return attention_bwd(q, k, v, None, out, lse.contiguous(), dout, dlse, m, scale, q_doc, k_doc)[:3]
    return _block_backward_torch(q, k, v, out, lse, dout, dlse, m, scale, q_doc, k_doc)


def merge(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:
    "Combine two partial results over disjoint keys; rows that saw nothing have lse = -inf and add nothing."
    new = torch.logaddexp(lse, l)
    safe = new.masked_fill(new == float("-inf"), 0)
    return out * torch.exp(lse - safe).unsqueeze(-1) + o.to(out.dtype) * torch.exp(l - safe).unsqueeze(-1), new

# %% [markdown]
# The check cuts the keys of a sequence into chunks, computes every visible block and merges them, and compares
# with attention over the whole sequence, forward and the gradients of every block summed — the ring's
# arithmetic without the ring.

# %%
def chunked_attention(q, k, v, n_chunks, window=None, docs=None):
    "(out, lse) by blocks of chunks merged one at a time, and a function for the blocks' gradients."
    B, H, S, _ = q.shape
    c, scale = S // n_chunks, q.shape[-1] ** -0.5
    sl = lambda t, i: t[:, :, i * c:(i + 1) * c]
    dl = lambda i: None if docs is None else docs[:, i * c:(i + 1) * c].contiguous()
    outs, lses, acc = [], [], torch.promote_types(q.dtype, torch.float32)
    for qi in range(n_chunks):
        o = torch.zeros(B, H, c, v.shape[-1], dtype=acc, device=q.device)
        l = torch.full((B, H, c), float("-inf"), dtype=acc, device=q.device)
        for kj in range(n_chunks):
            if visible(qi, kj, c, window):
                o, l = merge(o, l, *block_forward(sl(q, qi), sl(k, kj), sl(v, kj), _mask(qi, kj, c, window), scale,
                                                  dl(qi), dl(kj)))
        outs.append(o), lses.append(l)
    out, lse = torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)

    def grads(dout, dlse):
        dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
        for qi in range(n_chunks):
            for kj in range(n_chunks):
                if visible(qi, kj, c, window):
                    g = block_backward(sl(q, qi), sl(k, kj), sl(v, kj), sl(out, qi), lse[:, :, qi * c:(qi + 1) * c],
                                       sl(dout, qi), dlse[:, :, qi * c:(qi + 1) * c], _mask(qi, kj, c, window),
                                       scale, dl(qi), dl(kj))
                    sl(dq, qi).add_(g[0]), sl(dk, kj).add_(g[1]), sl(dv, kj).add_(g[2])
        return dq, dk, dv
    return out, lse, grads


torch.manual_seed(0)
doc_case = torch.tensor([[0] * 5 + [5] * 14 + [19] * 5, [0] * 24])
for window, docs in ((None, None), (5, None), (None, doc_case)):
    q, k, v = (torch.randn(2, 4 if i == 0 else 2, 24, 8, dtype=torch.float64, requires_grad=True) for i in range(3))
    ref, ref_lse = attention_reference(q, k, v, window=window, q_doc=docs, k_doc=docs)
    dout, dlse = torch.randn_like(ref), torch.randn_like(ref_lse)
    want = torch.autograd.grad((ref, ref_lse), (q, k, v), (dout, dlse))
    out, lse, grads = chunked_attention(q.detach(), k.detach(), v.detach(), 4, window, docs)
    got = grads(dout, dlse)
    errs = [(out - ref).abs().max().item(), (lse - ref_lse).abs().max().item()] + \
           [(a - b).abs().max().item() for a, b in zip(got, want)]
    print(f"window {window}, docs {docs is not None}: max error {max(errs):.1e}")
    assert max(errs) < 1e-12

# %% [markdown]
# On the GPU the blocks run ops/14's kernels with their offsets; the same check at the real shapes, in bf16,
# against ops/14 over the whole sequence (the window of GPT-OSS's sliding layers shorter than a chunk):

# %%
#| cuda
from pith_lit.ops.attention import flash_attention

rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
for name, (Hq, Hkv, D, Dv, window) in {"qwen3": (32, 4, 128, 128, None), "gpt-oss window": (64, 8, 64, 64, 128),
                                       "deepseek mla": (16, 16, 192, 128, None)}.items():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 8192, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv)))
    ref, ref_lse = flash_attention(q, k, v, window=window)
    dout, dlse = torch.randn_like(ref), torch.randn_like(ref_lse)
    want = torch.autograd.grad((ref, ref_lse), (q, k, v), (dout, dlse))
    out, lse, grads = chunked_attention(q.detach(), k.detach(), v.detach(), 4, window)
    errs = [rel(out, ref), rel(lse, ref_lse)] + [rel(a, b) for a, b in zip(grads(dout, dlse), want)]
    print(f"{name}: 4 chunks of 2048 against the whole sequence, max relative error {max(errs):.1e}")
    assert max(errs) < 2e-2

# %% [markdown]
# ## Payloads
#
# `kv_payload` packs keys and values for the ring and `split_kv` unpacks them; DeepSeek-V2's attention passes its
# own `expand` (models/22). An `expand(payload, *weights) -> (k, v)` must be differentiable in the payload and
# the weights: backward calls it again under autograd to turn the gradients of `k` and `v` into those of the
# payload (which travels) and of the weights (which stay).

# %%
#| export
def kv_payload(k: Tensor, v: Tensor) -> Tensor:
    "Keys (B, Hkv, S, Dk) and values (B, Hkv, S, Dv) as one (B, Hkv, S, Dk + Dv) tensor to send."
    return torch.cat((k, v), -1)


def split_kv(payload: Tensor, dk: int) -> tuple[Tensor, Tensor]:
    "The inverse of `kv_payload` for keys of width `dk`."
    return payload[..., :dk], payload[..., dk:]

# %%
def expand_bytes(tokens: int, heads: int, qk_head_dim: int, v_head_dim: int, kv_lora_rank: int, rope_dim: int,
                 bytes_per: int = 2) -> dict:
    "Bytes one ring step sends for `tokens` tokens: MLA's expanded keys and values against its latent payload."
    expanded = tokens * heads * (qk_head_dim + v_head_dim) * bytes_per
    latent = tokens * (kv_lora_rank + rope_dim) * bytes_per
    return dict(expanded=expanded, latent=latent, ratio=expanded / latent)


for name, heads in (("DeepSeek-V2-Lite", 16), ("DeepSeek-V2", 128)):
    b = expand_bytes(16384, heads, 192, 128, 512, 64)
    print(f"{name}: 16K tokens per step send {b['expanded'] / 2**20:.0f} MiB expanded, {b['latent'] / 2**20:.0f} MiB "
          f"as latent ({b['ratio']:.1f}x less)")

# %% [markdown]
# At DeepSeek-V2-Lite's 16 heads the latent is 8.9 times smaller than the keys and values it expands to, at
# DeepSeek-V2's 128 heads 71 times: its keys and values per token (`heads × (192 + 128)`) grow with the heads, the
# latent (`512 + 64`) does not. The price is `kv_b_proj` run again on every rank for every step, and in backward
# once more (a `T × 512 × heads·320` matmul per step).

# %% [markdown]
# ## The ring
#
# `_shift` starts sending tensors to the next rank and receiving the same shapes from the previous one. The
# autograd function runs the steps of the forward and of the backward described at the top; the sink correction
# and the choice of payload are outside it, in plain autograd.

# %%
#| export
def _shift(group, tensors: list[Tensor]) -> tuple[list[Tensor], list]:
    "Start sending `tensors` to the next rank of `group` and receiving their likes from the previous one."
    cp, r = group.size(), group.rank()
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=(r + 1) % cp) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, group=group, group_peer=(r - 1) % cp) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _pairs(group, n_local: int, src: int, window):
    "The visible (local query half, source key half, mask) blocks of one step, keys from rank `src`."
    cp, r, c = group.size(), group.rank(), n_local // 2
    for a, qi in enumerate(zigzag_chunks(cp, r)):
        for b, kj in enumerate(zigzag_chunks(cp, src)):
            if visible(qi, kj, c, window):
                yield slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), _mask(qi, kj, c, window)


def _doc(docs, s):
    return None if docs is None else docs[:, s].contiguous()


class RingAttention(torch.autograd.Function):
    "Causal attention of this rank's zigzag queries over the whole sequence's keys: (out, lse), see `ring_attention`."

    @staticmethod
    def forward(ctx, q, payload, docs, group, expand, window, scale, *weights):
        cp, (B, H, n, _) = group.size(), q.shape
        out = lse = None
        cur, cur_docs = payload, docs
        for step in range(cp):
            if step < cp - 1:   # the next step's keys travel while this step computes
                nxt, works = _shift(group, [cur] + ([cur_docs] if docs is not None else []))
            k, v = expand(cur, *weights)
            if out is None:
                out = q.new_zeros(B, H, n, v.shape[-1], dtype=torch.promote_types(q.dtype, torch.float32))
                lse = torch.full((B, H, n), float("-inf"), dtype=out.dtype, device=q.device)
            for qs, ks, m in _pairs(group, n, (group.rank() - step) % cp, window):
                o, l = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], m, scale, _doc(docs, qs), _doc(cur_docs, ks))
                out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, l)
            if step < cp - 1:
                _wait(works)
                cur, cur_docs = nxt[0], nxt[1] if docs is not None else None
        out = out.to(q.dtype)
        ctx.save_for_backward(q, payload, docs, out, lse, *weights)
        ctx.group, ctx.expand, ctx.window, ctx.scale = group, expand, window, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, payload, docs, out, lse, *weights = ctx.saved_tensors
        group, cp, n = ctx.group, ctx.group.size(), q.shape[2]
        if dout is None:
            dout = torch.zeros_like(out)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros_like(q, dtype=acc)
        dweights = [torch.zeros_like(w, dtype=acc) for w in weights]
        cur, cur_docs, cur_grad, grad_works = payload, docs, None, []
        for step in range(cp):
            if step < cp - 1:
                nxt, works = _shift(group, [cur] + ([cur_docs] if docs is not None else []))
            with torch.enable_grad():
                leaf = cur.detach().requires_grad_()
                wleaves = [w.detach().requires_grad_() for w in weights]
                k, v = ctx.expand(leaf, *wleaves)
            dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
            for qs, ks, m in _pairs(group, n, (group.rank() - step) % cp, ctx.window):
                g = block_backward(q[:, :, qs], k[:, :, ks].detach(), v[:, :, ks].detach(), out[:, :, qs],
                                   lse[:, :, qs], dout[:, :, qs], None if dlse is None else dlse[:, :, qs], m,
                                   ctx.scale, _doc(docs, qs), _doc(cur_docs, ks))
                dq[:, :, qs] += g[0]
                dk[:, :, ks] += g[1]
                dv[:, :, ks] += g[2]
            grads = torch.autograd.grad((k, v), [leaf] + wleaves, (dk.to(k.dtype), dv.to(v.dtype)), allow_unused=True)
            for d, gw in zip(dweights, grads[1:]):
                if gw is not None:
                    d += gw
            mine = grads[0].to(acc)
            _wait(grad_works)   # the sum of the ranks before for these keys, sent during this step's blocks
            total = mine if cur_grad is None else cur_grad[0] + mine
            # pass the keys' gradient on with them; after the last step it goes to the keys' owner
            cur_grad, grad_works = _shift(group, [total])
            if step < cp - 1:
                _wait(works)
                cur, cur_docs = nxt[0], nxt[1] if docs is not None else None
        _wait(grad_works)
        dpayload = cur_grad[0]
        return (dq.to(q.dtype), dpayload.to(payload.dtype), None, None, None, None, None,
                *(d.to(w.dtype) for d, w in zip(dweights, weights)))

# %% [markdown]
# `ring_attention` is what the models call. `cp_group` is the context-parallel process group of this rank
# (engine/30's `mesh.cp`): `ring_group(mesh.cp)` gives it at cp > 1 and None at cp 1, a model takes it as
# `Options.cp_group` (models/20) when it is built, and its attention modules call this function when it is set. It
# is not traced by `torch.compile`: with `parallel.cp > 1` the trainer compiles stage 1 around it.

# %%
#| export
@torch.compiler.disable
def ring_attention(q: Tensor, payload: Tensor, cp_group, positions: Tensor, expand, weights: tuple = (),
                   sinks: Tensor | None = None, window: int | None = None, scale: float | None = None) -> Tensor:
    """Causal attention of this rank's zigzag shard of the queries, q (B, Hq, n, Dqk), over the keys and values of
    the whole sequence, each rank's given as `payload` and turned into (k, v) by `expand(payload, *weights)`.
    `positions` (n,) or (B, n) are this rank's positions (restarting per document when 2-D: attention stays within
    documents); `sinks` (Hq,) per-head sink logits; `window` a sliding window. Returns (B, Hq, n, Dv)."""
    cp, n = cp_group.size(), q.shape[2]
    if n % 2:
        raise ValueError(f"a rank's zigzag shard holds two equal chunks; got {n} tokens")
    docs = zigzag_documents(positions, cp, cp_group.rank())
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = RingAttention.apply(q, payload, docs, cp_group, expand, window, scale, *weights)
    if sinks is not None:   # a sink is one more logit of zero value: it rescales each row once
        out = out * torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
    return out


def ring_group(cp_group):
    """The process group a model's attention rings over (`Options.cp_group`): `cp_group` when it has more than one
    rank, else None (each rank attends within its own sequence). The group's first operation is a barrier, as
    batched point-to-point transfers need: call it on every rank of the group."""
    if cp_group is None or cp_group.size() == 1:
        return None
    dist.barrier(group=cp_group)
    return cp_group

# %% [markdown]
# The multi-process checks of the ring — every model at cp 2 and 4 against one process, with documents crossing
# the chunks, and composed with expert parallelism, DualPipeV and FSDP — run on several gloo processes through
# `python -m pith_lit.testing context` (engine/39; tests/test_context.py).
