"""Non-transposable masks used by the pruning frameworks: row-wise N:M and unstructured."""

from __future__ import annotations

import torch


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """scores: (R, C), C divisible by m → mask (R, C) bool keeping the n largest of every m consecutive
    entries of each row (ordinary N:M sparsity along the input dimension)."""
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D (rows, cols), got shape {tuple(scores.shape)}")
    if not 1 <= n <= m - 1:
        raise ValueError(f"N must be in 1..M-1 = 1..{m - 1}, got {n}")
    rows, cols = scores.shape
    if cols % m:
        raise ValueError(
            f"scores of shape ({rows}, {cols}) cannot be cut into groups of M={m} along the columns; "
            f"the number of columns must be divisible by {m}"
        )
    groups = scores.reshape(rows, cols // m, m)  # (R, C/M, M)
    keep = groups.topk(n, dim=2).indices  # (R, C/M, n)
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(2, keep, True)  # (R, C/M, M)
    return mask.reshape(rows, cols)


def unstructured_mask(scores: torch.Tensor, sparsity: float, *, per_row: bool = True) -> torch.Tensor:
    """scores: (R, C) → mask (R, C) bool keeping the largest (1 − sparsity) share.

    per_row=True keeps the same count in every output row (Wanda's per-output comparison group);
    per_row=False compares across the whole matrix.
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D (rows, cols), got shape {tuple(scores.shape)}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}; e.g. 0.5 keeps half the weights")
    rows, cols = scores.shape
    if per_row:
        keep = cols - round(sparsity * cols)
        idx = scores.topk(keep, dim=1).indices  # (R, keep)
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
    flat = scores.reshape(-1)
    keep = flat.numel() - round(sparsity * flat.numel())
    idx = flat.topk(keep).indices
    return torch.zeros_like(flat, dtype=torch.bool).scatter_(0, idx, True).reshape(rows, cols)
