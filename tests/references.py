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
