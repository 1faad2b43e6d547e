"""`exhaustive`: provably optimal for M = 4 by enumerating every transposable mask.

There are 90 transposable 2:4 masks and 24 for 1:4 and 3:4 (permutation matrices and their
complements). Scoring all of them is one matmul per batch: (B, 16) @ (16, P) (Hu et al. 2024).
"""

from __future__ import annotations

import itertools
from functools import cache

import torch

from tsenor_cli.solver.registry import register
from tsenor_cli.solver.types import BlockSolution, DualState

EXHAUSTIVE_MAX_M = 4


@cache
def _patterns(n: int, m: int) -> tuple[tuple[int, ...], ...]:
    """Every m×m 0/1 matrix with n ones per row and column, flattened row-major."""
    rows = [r for r in itertools.product((0, 1), repeat=m) if sum(r) == n]
    out = []
    for combo in itertools.product(rows, repeat=m):
        if all(sum(col) == n for col in zip(*combo, strict=True)):
            out.append(tuple(x for r in combo for x in r))
    return tuple(out)


def all_transposable_masks(n: int, m: int, *, like: torch.Tensor) -> torch.Tensor:
    """→ (P, m, m) bool on `like`'s device: every transposable n:m mask of one tile."""
    pats = torch.tensor(_patterns(n, m), dtype=torch.bool, device=like.device)
    return pats.view(-1, m, m)


@register(
    "exhaustive",
    "optimal for M<=4: scores every transposable mask with one matmul",
    exact=True,
    max_m=EXHAUSTIVE_MAX_M,
)
def exhaustive(blocks: torch.Tensor, n: int, *, init: DualState | None = None, chunk: int = 1 << 20) -> BlockSolution:
    """blocks: (B, M, M), M <= 4 → mask (B, M, M) bool, the optimal transposable n:M mask per block."""
    B, M, _ = blocks.shape
    pats = all_transposable_masks(n, M, like=blocks)  # (P, M, M)
    flat = pats.view(pats.shape[0], M * M).to(blocks.dtype)  # (P, M*M)
    best = torch.empty(B, dtype=torch.long, device=blocks.device)
    for start in range(0, B, chunk):
        part = blocks[start : start + chunk].reshape(-1, M * M)  # (b, M*M)
        best[start : start + chunk] = (part @ flat.T).argmax(dim=1)  # (b, P) → (b,)
    mask = pats[best]  # (B, M, M)
    # Optimal, so the objective itself is a certified bound.
    upper = (blocks.double() * mask).sum((1, 2))
    return BlockSolution(mask=mask, upper_bound=upper)
