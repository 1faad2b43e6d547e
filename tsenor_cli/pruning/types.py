"""Small frozen types shared by the pruning methods and the engine.

Orientation: every weight here is an `nn.Linear` weight, (out, in); the calibration inputs X are
(tokens, in) and the Gram matrix H = XᵀX is (in, in). The paper writes W as (in, out); a transposable
N:M mask is the same set of tiles in either orientation, so only the row-wise N:M pattern (groups of M
along the input dimension of each output row) depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# The pattern (tsenor_cli/pattern.py) and LayerRecord (the run files it is written to) are defined where
# they are read and written; the engine and resume code import them from here.
from tsenor_cli.pattern import SparsityPattern as SparsityPattern
from tsenor_cli.runfiles import LayerRecord as LayerRecord


@dataclass(frozen=True)
class LayerPruneConfig:
    """Everything a method's `prune` reads besides the weight and the statistics.

    solver: a `tsenor_cli.solver.METHODS` name, used for transposable masks; "auto" picks by device
      (exact `flow` on the CPU, `tsenor` on CUDA, `exhaustive` for M = 4; solver/auto.py).
    percdamp: Hessian dampening as a share of mean diag(H) (SparseGPT and ALPS use 1%).
    blocksize: SparseGPT's lazy-update block width (rounded to a multiple of M).
    alps_*: the ALPS ADMM schedule (mazumder-lab/ALPS): ρ₀, iteration cap, ρ-update period,
      earliest stop, stop threshold on the support change, and conjugate-gradient refinement steps;
      alps_inner_sweeps, alps_inner_iterations: the `tsenor` cycle-cancelling sweeps and Sinkhorn
        iterations of the intermediate projections where `tsenor` runs (`auto` on CUDA); with `flow`
        (`auto` on the CPU) every projection is exact (alps.inner_solver_options).
    """

    pattern: SparsityPattern
    solver: str = "auto"
    percdamp: float = 0.01
    blocksize: int = 128
    alps_rho0: float = 0.1
    alps_max_iter: int = 300
    alps_update_iter: int = 3
    alps_switch_iter: int = 30
    alps_stop_change: float = 3e-4
    alps_cg_iters: int = 10
    alps_inner_sweeps: int = 2
    alps_inner_iterations: int = 0


@dataclass(frozen=True)
class MaskSolveInfo:
    """Certified quality of the transposable mask(s) of one layer (summed over all solver calls).

    objective / upper_bound: sum of kept scores and its LP-duality bound; gap = 1 − objective/upper_bound.
    """

    objective: float
    upper_bound: float
    gap: float
    seconds: float
    calls: int


@dataclass(frozen=True)
class PruneOutcome:
    """weight: (out, in) float32 pruned weight (zero outside mask); mask: (out, in) bool kept entries.

    solve: the transposable solver's certificate for the final mask, None for other patterns.
    iterations: the method's main-loop iterations (ADMM steps for ALPS, 0 otherwise).
    safeguard_tiles: tiles where Assumption 1's safeguard kept the previous mask (ALPS only).
    """

    weight: torch.Tensor
    mask: torch.Tensor
    solve: MaskSolveInfo | None
    iterations: int = 0
    safeguard_tiles: int = 0


def split_outcomes(
    weight: torch.Tensor,
    mask: torch.Tensor,
    solves: Sequence[MaskSolveInfo] | None,
    iterations: Sequence[int] | None = None,
    safeguard_tiles: Sequence[int] | None = None,
) -> list[PruneOutcome]:
    """weight: (..., out, in) float32, mask: (..., out, in) bool, per-matrix certificates and counts → one
    `PruneOutcome` per matrix (views of `weight` and `mask`), in the order of the flattened leading dims."""
    rows, cols = weight.shape[-2:]
    weights = weight.reshape(-1, rows, cols)  # (L, out, in)
    masks = mask.reshape(-1, rows, cols)  # (L, out, in)
    count = weights.shape[0]
    return [
        PruneOutcome(
            weight=weights[i],
            mask=masks[i],
            solve=solves[i] if solves is not None else None,
            iterations=iterations[i] if iterations is not None else 0,
            safeguard_tiles=safeguard_tiles[i] if safeguard_tiles is not None else 0,
        )
        for i in range(count)
    ]
