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
