"""Results and the block-solver protocol shared by every mask method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class DualState:
    """What a solve leaves for a warm start on similar scores (ALPS re-solves every iteration).

    row: (B, M), col: (B, M) dual potentials of the block LP, in the units of the per-block
    normalized scores the method solved; scale: (B,) that per-block normalization;
    mask: (B, M, M) bool, the mask found, or None.
    """

    row: torch.Tensor
    col: torch.Tensor
    scale: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class BlockSolution:
    """What a block solver returns.

    mask: (B, M, M) bool, exactly n per row and column of every block.
    upper_bound: (B,) float64 certified upper bound on each block's optimum, or None to let `solve`
      compute the generic row/column bound.
    state: dual potentials for a warm start, or None.
    iterations: iterations of the method's main loop (0 for direct methods).
    """

    mask: torch.Tensor
    upper_bound: torch.Tensor | None = None
    state: DualState | None = None
    iterations: int = 0


@dataclass(frozen=True)
class SinkhornSchedule:
    """The budget of an ε-scaled capped Sinkhorn (`tsenor.capped_sinkhorn` and its fused kernel).

    taus: the inverse temperatures, in order; iterations: the budget at each one (a tile leaves a
    temperature early once max_i |Σ_j S_ij − n| ≤ tol·n); absorb_every: iterations between two absorptions
    of the scalings into the potentials (so nothing overflows), and between two reads of the violation.
    """

    taus: tuple[float, ...]
    iterations: int
    tol: float
    absorb_every: int = 10


class BlockSolver(Protocol):
    """blocks: (B, M, M) non-negative float → `BlockSolution`; `init` is a previous state or None."""

    def __call__(
        self, blocks: torch.Tensor, n: int, *, init: DualState | None = None, **options: object
    ) -> BlockSolution: ...


@dataclass(frozen=True)
class SolveResult:
    """Result of `tsenor_cli.solver.solve` on one (R, C) score matrix.

    mask: (R, C) bool, same device as the scores.
    objective: sum of kept scores (float64).
    upper_bound: certified upper bound on the optimal objective (LP duality); equals `objective`
      for `exact`, `exhaustive` and `flow` (up to round-off).
    gap: (upper_bound - objective) / upper_bound, a certified bound on the relative error.
    block_objective, block_upper_bound: (B,) float64 per-tile values, tiles in `to_blocks` order.
    method: the method that ran; requested: the one asked for, which differs for `auto` (it names
      the method it picked, e.g. requested "auto", method "flow" on the CPU).
    state: dual potentials for `solve(..., init=result)`; None for methods without duals.
    """

    mask: torch.Tensor
    objective: float
    upper_bound: float
    gap: float
    block_objective: torch.Tensor
    block_upper_bound: torch.Tensor
    iterations: int
    seconds: float
    method: str
    requested: str
    n: int
    m: int
    state: DualState | None = None
