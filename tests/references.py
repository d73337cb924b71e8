"""Plain-torch references that only checks use (the tests, the notebooks' check cells and benchmarks/ops.py), kept
out of the exported package. A notebook imports them as `from tests.references import ...` (nbdev_test puts the
repository root on sys.path); a test as `from references import ...` (pytest puts tests/ on sys.path)."""
import torch
import torch.nn.functional as F


def cross_entropy_ref(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      ignore_index: int = -100) -> torch.Tensor:
    "Sum of token cross-entropies of `h @ weight^T` against `labels` (eager: full logits in fp32, or fp64)."
    logits = h @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


def doc_ids(cu_seqlens: torch.Tensor, B: int, S: int) -> torch.Tensor:
    "(B, S) int32 document ids from `cu_seqlens` over the flattened B·S tokens (0 = c_0 ≤ c_1 ≤ … ≤ c_n = B·S)."
    cu = torch.as_tensor(cu_seqlens).to(torch.int64)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries; got shape {tuple(cu.shape)}")
    if not cu.is_cuda and (cu[0] != 0 or cu[-1] != B * S or (cu.diff() < 0).any()):  # no sync on the GPU
        raise ValueError(f"cu_seqlens must rise from 0 to B·S = {B * S}; got {cu.tolist()[:8]}...")
    tokens = torch.arange(B * S, device=cu.device)
    return (torch.searchsorted(cu, tokens, right=True) - 1).view(B, S).to(torch.int32)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    "Sum of cross-entropy over the non-ignored tokens, in fp32: `logits (T, V)`, `labels (T,)`."
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def unit_duration(action, rank: int = 0) -> float:
    "DualPipeV's idealised costs, the same on every rank: F 1, B 2 (1 with zero bubble, then W 1), F&B 3."
    match action:
        case ("F", *_): return 1.0
        case ("B", _, _, zb): return 1.0 if zb else 2.0
        case ("W", *_): return 1.0
        case ("FB", *_): return 3.0


def check_across_ranks(rank: int, world_size: int, init_method: str, seed: int = 0):
    """Worker for a multi-process check of `LoadBalance(level='global', group=...)` against one process (gloo):
    each rank's loss, gradient (`coef · E · f / T`, so it exposes `f`) and statistics equal those of one process
    that sees all ranks' shares of each micro-batch, and a deferred one gives the same gradients and, settled,
    the same value."""
    import torch.distributed as dist
    from pith_lit.train.load_balance import LoadBalance
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    T, E, k, coef, micro_batches, layers = 6, 8, 2, 0.1, 3, (3, 5)
    g = torch.Generator().manual_seed(seed)   # the same data on every rank: all ranks' shares of all steps
    logits = torch.randn(micro_batches, len(layers), world_size, T, E, dtype=torch.float64, generator=g)
    logits[..., 0] += 2.0                     # an unbalanced router, so f is not uniform
    mine, ref = LoadBalance(E, coef, "global", group=dist.group.WORLD), LoadBalance(E, coef, "global")
    lazy = LoadBalance(E, coef, "global", group=dist.group.WORLD, deferred=True)
    value = 0.0
    for m in range(micro_batches):
        for l, key in enumerate(layers):
            probs = logits[m, l].softmax(-1)                      # (world, T, E)
            ids = probs.topk(k, -1).indices
            p_mine = probs[rank].clone().requires_grad_()
            out = mine.loss(key, p_mine, ids[rank])
            out.backward()
            p_all = probs.reshape(-1, E).clone().requires_grad_()
            out_ref = ref.loss(key, p_all, ids.reshape(-1, k))
            out_ref.backward()
            f_mine, f_ref = p_mine.grad[0] * T / (coef * E), p_all.grad[0] * world_size * T / (coef * E)
            assert torch.allclose(f_mine, f_ref, rtol=1e-12, atol=0), (rank, m, key, f_mine, f_ref)
            total = out.detach().clone()
            dist.all_reduce(total)                # P of the whole micro-batch is the mean of the ranks' P
            assert torch.allclose(total / world_size, out_ref, rtol=1e-12), (rank, m, key)
            p_lazy = probs[rank].clone().requires_grad_()
            lazy.loss(key, p_lazy, ids[rank]).backward()          # waits for its all-reduce here
            assert torch.allclose(p_lazy.grad, p_mine.grad, rtol=1e-12, atol=0), (rank, m, key)
            value += out.item()
    assert abs(lazy.settle().item() - value) < 1e-12, (rank, value)
    s_mine, s_ref = mine.stats(), ref.stats()
    assert s_mine.keys() == s_ref.keys() and all(abs(s_mine[x] - s_ref[x]) < 1e-12 for x in s_ref), (s_mine, s_ref)
    dist.destroy_process_group()


def bf16_errors(model_class, cfg, seed: int, device="cuda") -> tuple[list[str], list[float], list[float]]:
    """Relative errors against the fp32 model of the bf16 logits and then of every gradient (parameter names in
    the same order), for the five-stage forward and for the plain sequential one (`reference_forward`), with two
    packed documents per row: models/24's GPU check and benchmarks/decay_grad_error.py."""
    rel_err = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    torch.manual_seed(seed)
    ref_model = model_class(cfg).to(device)
    bf_model = model_class(cfg).to(device).bfloat16()
    bf_model.load_state_dict(ref_model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (4, 256), device=device)
    pos = torch.cat([torch.arange(100), torch.arange(156)]).expand(4, 256).to(device)
    ref = ref_model.reference_forward(ids, pos)
    g_ref = torch.autograd.grad(ref.square().mean(), list(ref_model.parameters()))
    errs = {}
    for name, fwd in (("five", lambda: bf_model(ids, pos)[0]), ("plain", lambda: bf_model.reference_forward(ids, pos))):
        out = fwd()
        g = torch.autograd.grad(out.float().square().mean(), list(bf_model.parameters()))
        errs[name] = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(g, g_ref)]
    return [n for n, _ in bf_model.named_parameters()], errs["five"], errs["plain"]
