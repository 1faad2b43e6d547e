"""Certified upper bounds on the optimum of the block LP (paper eq. (4)) by weak LP duality.

For one block with scores w (M×M) the LP  max <S, w>  s.t.  S1 = n1, Sᵀ1 = n1, 0 ≤ S ≤ 1  has the dual
    min  n·Σ_i u_i + n·Σ_j v_j + Σ_ij z_ij   s.t.  u_i + v_j + z_ij ≥ w_ij,  z ≥ 0.
Any potentials (u, v) give a feasible dual with z_ij = max(0, w_ij − u_i − v_j), hence the bound
    UB(u, v) = n·Σu + n·Σv + Σ_ij max(0, w_ij − u_i − v_j)  ≥  LP optimum  =  integer optimum
(the LP is integral, Section 3.1). So every bound here is certified whatever (u, v) are.
"""

from __future__ import annotations

import torch


def dual_upper_bound(blocks: torch.Tensor, row: torch.Tensor, col: torch.Tensor, n: int) -> torch.Tensor:
    """blocks: (B, M, M), row: (B, M), col: (B, M) → (B,) float64 upper bound on each block's optimum."""
    w = blocks.double()
    u = row.double()
    v = col.double()
    slack = (w - u[:, :, None] - v[:, None, :]).clamp_min(0)  # (B, M, M)
    return n * (u.sum(1) + v.sum(1)) + slack.sum((1, 2))


def _nth_largest(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    return x.topk(n, dim=dim).values.select(dim, n - 1)


def coordinate_upper_bound(
    blocks: torch.Tensor,
    n: int,
    row: torch.Tensor | None = None,
    col: torch.Tensor | None = None,
    rounds: int = 2,
) -> torch.Tensor:
    """blocks: (B, M, M) → (B,) float64 bound, improving (row, col) by exact dual coordinate descent.

    For fixed v the bound is minimized over u_i by the n-th largest of (w_ij − v_j) over j (the
    function n·u + Σ_j max(0, a_j − u) is convex piecewise linear with that breakpoint), and likewise
    for v. Starting from v = 0 the first step gives the row-wise top-n bound. Each step can only
    lower the bound, so it is evaluated once at the end; the potentials may be computed in the
    scores' precision because the bound is valid for any (u, v) and is evaluated in float64.
    """
    B, M, _ = blocks.shape
    v = blocks.new_zeros(B, M) if col is None else col.to(blocks.dtype)
    u = blocks.new_zeros(B, M) if row is None else row.to(blocks.dtype)
    for _ in range(rounds):
        u = _nth_largest(blocks - v[:, None, :], n, dim=2)  # (B, M)
        v = _nth_largest(blocks - u[:, :, None], n, dim=1)  # (B, M)
    return dual_upper_bound(blocks, u, v, n)
