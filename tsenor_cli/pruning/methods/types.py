"""Small frozen types shared by the pruning methods and the engine.

Orientation: every weight here is an `nn.Linear` weight, (out, in); the calibration inputs X are
(tokens, in) and the Gram matrix H = XᵀX is (in, in). The paper writes W as (in, out); a transposable
N:M mask is the same set of tiles in either orientation, so only the row-wise N:M pattern (groups of M
along the input dimension of each output row) depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, TypeVar

import torch

# The pattern (tsenor_cli/pattern.py) and LayerRecord (the run files it is written to) are defined where
# they are read and written; the engine and resume code import them from here.
from tsenor_cli.pattern import SparsityPattern as SparsityPattern
from tsenor_cli.pruning.methods.method import DEFAULT_SOLVER, MethodOptions
from tsenor_cli.runfiles import LayerRecord as LayerRecord

O = TypeVar("O", bound=MethodOptions)


@dataclass(frozen=True)
class MatrixPruneConfig:
    """Everything a method's `prune` reads besides the weight and the statistics.

    solver: a `tsenor_cli.solver.METHODS` name, used for transposable masks; "auto" picks by device
      (exact `flow` on the CPU, `tsenor` on CUDA, `exhaustive` for M = 4; solver/auto.py).
    options: the method's own options, declared in its module (`sparsegpt.SparseGPTOptions`: percdamp and
      blocksize; `alps.ALPSOptions`: the ADMM schedule); None: the method's defaults.
    """

    pattern: SparsityPattern
    solver: str = DEFAULT_SOLVER
    options: MethodOptions | None = None

    def method_options(self, kind: type[O]) -> O:
        """The options of the method that reads them (`kind`): `options`, or its defaults when None."""
        if self.options is None:
            return kind()
        if not isinstance(self.options, kind):
            raise TypeError(f"{type(self.options).__name__} given to a method that reads {kind.__name__}")
        return self.options


class SolverColumns(TypedDict):
    """The solver's columns of a `LayerRecord` (`MaskSolveInfo.record_fields`)."""

    gap: float | None
    solver_objective: float | None
    solver_upper_bound: float | None
    solver_seconds: float | None
    solver_calls: int


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

    @staticmethod
    def record_fields(solve: MaskSolveInfo | None) -> SolverColumns:
        """A `LayerRecord`'s solver columns for `solve` (no certificate, no calls for other patterns)."""
        return {
            "gap": solve.gap if solve else None,
            "solver_objective": solve.objective if solve else None,
            "solver_upper_bound": solve.upper_bound if solve else None,
            "solver_seconds": solve.seconds if solve else None,
            "solver_calls": solve.calls if solve else 0,
        }


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
    parts: Sequence[int] | None = None,
) -> list[PruneOutcome]:
    """weight: (..., out, in) float32 (its pruned entries set to +0.0 in place), mask: (..., out, in) bool,
    per-matrix certificates and counts → one
    `PruneOutcome` per matrix (views of `weight` and `mask`), in the order of the flattened leading dims.
    parts: row counts summing to out, the linears stacked along their outputs (`PrunerSpec.prune_rows`):
    one outcome per matrix and part (rows [Σ parts before, + part)), certificates and counts in that
    order."""
    # A pruned weight is +0.0: `w * mask` leaves -0.0 where a negative weight is pruned, and the packed
    # checkpoint stores no sign for the zeros it drops, so dense and packed outputs would differ in those bits.
    weight.masked_fill_(~mask, 0.0)
    rows, cols = weight.shape[-2:]
    sizes = list(parts) if parts is not None else [rows]
    weights = [piece for w in weight.reshape(-1, rows, cols) for piece in w.split(sizes)]  # L·P × (part, in)
    masks = [piece for m in mask.reshape(-1, rows, cols) for piece in m.split(sizes)]  # L·P × (part, in)
    return [
        PruneOutcome(
            weight=weights[i],
            mask=masks[i],
            solve=solves[i] if solves is not None else None,
            iterations=iterations[i] if iterations is not None else 0,
            safeguard_tiles=safeguard_tiles[i] if safeguard_tiles is not None else 0,
        )
        for i in range(len(weights))
    ]
