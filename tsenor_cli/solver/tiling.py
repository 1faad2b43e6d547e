"""Cutting a score matrix into M×M tiles and back, and validating solver inputs once."""

from __future__ import annotations

import torch


def validate_scores(scores: torch.Tensor, n: int, m: int) -> None:
    """Raise `ValueError` naming the problem and the fix for any input the solvers cannot take."""
    if not isinstance(scores, torch.Tensor):
        raise ValueError(f"scores must be a torch.Tensor, got {type(scores).__name__}; pass torch.as_tensor(x)")
    if scores.ndim != 2:
        raise ValueError(
            f"scores must be a 2-D matrix (rows, cols), got shape {tuple(scores.shape)}; "
            "reshape or pass one weight matrix at a time"
        )
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a float tensor, got dtype {scores.dtype}; convert with .float()")
    if not isinstance(m, int) or m < 2:
        raise ValueError(f"M must be an integer >= 2, got {m!r}; use e.g. m=4 or m=32")
    if not isinstance(n, int) or not 1 <= n <= m - 1:
        raise ValueError(f"N must be an integer in 1..M-1 = 1..{m - 1}, got {n!r}; e.g. n={m // 2} for {m // 2}:{m}")
    rows, cols = scores.shape
    if rows % m or cols % m:
        raise ValueError(
            f"scores of shape ({rows}, {cols}) cannot be cut into {m}x{m} tiles; both dimensions must be "
            f"divisible by M={m} (pad the matrix or skip this layer)"
        )
    if rows == 0 or cols == 0:
        raise ValueError(f"scores of shape ({rows}, {cols}) are empty; pass a non-empty matrix")
    # Both checks in one device read: a host sync per check is a cost of every small solve on CUDA
    # (SparseGPT's per-slab calls).
    nonfinite, negative = torch.stack([~torch.isfinite(scores).all(), (scores < 0).any()]).tolist()
    if nonfinite:
        raise ValueError("scores contain NaN or Inf; clean the input (e.g. torch.nan_to_num) before solving")
    if negative:
        raise ValueError("scores must be non-negative (e.g. |W| or W**2); pass scores.abs()")


def to_blocks(scores: torch.Tensor, m: int) -> torch.Tensor:
    """scores: (R, C) → blocks (B, M, M) with B = (R/M)·(C/M), tiles in row-major tile order."""
    rows, cols = scores.shape
    tiles = scores.reshape(rows // m, m, cols // m, m)  # (R/M, M, C/M, M)
    return tiles.permute(0, 2, 1, 3).reshape(-1, m, m)  # (B, M, M)


def from_blocks(blocks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """blocks: (B, M, M) → (R, C), the inverse of `to_blocks`."""
    _, m, _ = blocks.shape
    tiles = blocks.reshape(rows // m, cols // m, m, m)  # (R/M, C/M, M, M)
    return tiles.permute(0, 2, 1, 3).reshape(rows, cols)
