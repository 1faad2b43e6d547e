"""One place that turns a score matrix into a mask of the requested pattern.

Transposable masks come from the TSENOR solver API (paper Section 3), row-wise N:M and unstructured
masks from the plain top-k helpers. Scores are "keep" scores: larger means more important.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.phases import phase
from tsenor_cli.pruning.methods.types import MaskSolveInfo, MatrixPruneConfig, PruneOutcome, split_outcomes
from tsenor_cli.solver import SolveResult, from_blocks, nm_mask, solve, to_blocks, unstructured_mask


@dataclass(frozen=True)
class MaskChoice:
    """mask: (..., R, C) bool; result: the solver's result (transposable only) on the scores flattened to
    (L·R, C), L the number of matrices, for warm starts and the gap."""

    mask: torch.Tensor
    result: SolveResult | None


def choose_mask(
    scores: torch.Tensor,
    pattern: SparsityPattern,
    solver: str,
    *,
    init: SolveResult | None = None,
    unstructured_scope: Literal["row", "matrix"] | Sequence[int] = "row",
    solver_options: Mapping[str, object] | None = None,
) -> MaskChoice:
    """scores: (..., R, C) non-negative, one (R, C) matrix or a stack of them → mask (..., R, C) bool of
    `pattern` for each matrix.

    A stack goes to the solver as one call: its matrices are flattened to (L·R, C), which for R
    divisible by M puts every M×M tile (transposable) and every group of M inputs (N:M) inside one
    matrix, so each matrix gets exactly the mask it would get alone. unstructured_scope picks the
    comparison group of unstructured sparsity: each output row (Wanda), each whole matrix (magnitude,
    ALPS), or each part of a whole matrix: the row counts (summing to R) of matrices stacked along R that
    share their statistics (`PrunerSpec.prune_rows`), each keeping the mask it would get alone (`parts`
    of `matrix_scope`). A transposable tile spans M rows of one part (parts are multiples of M), an N:M
    group one row, so only the whole-matrix comparison needs them. solver_options go to the
    transposable solver.
    """
    rows, cols = scores.shape[-2:]
    if not isinstance(unstructured_scope, str):
        if len(unstructured_scope) > 1 and pattern.kind == "unstructured":
            # One comparison group per part; a stack of at most a few linears (q/k/v), so a loop over parts.
            split = scores.split(list(unstructured_scope), -2)
            masks = [choose_mask(part, pattern, solver, unstructured_scope="matrix").mask for part in split]
            return MaskChoice(torch.cat(masks, -2), None)
        unstructured_scope = "matrix"
    flat = scores.reshape(-1, cols)  # (L·R, C)
    with phase("solver"):
        if pattern.kind == "transposable":
            result = solve(flat, pattern.n, pattern.m, method=solver, init=init, **(solver_options or {}))
            return MaskChoice(result.mask.view(scores.shape), result)
        if pattern.kind == "nm":
            return MaskChoice(nm_mask(flat, pattern.n, pattern.m).view(scores.shape), None)
        if pattern.kind == "unstructured":
            if unstructured_scope == "row" or scores.ndim == 2:
                per_row = unstructured_scope == "row"
                return MaskChoice(unstructured_mask(flat, pattern.sparsity, per_row=per_row).view(scores.shape), None)
            # One comparison group per matrix: each matrix becomes one row of (L, R·C).
            mats = scores.reshape(-1, rows * cols)  # (L, R·C)
            return MaskChoice(unstructured_mask(mats, pattern.sparsity, per_row=True).view(scores.shape), None)
    raise ValueError(f"unknown pattern kind {pattern.kind!r}")


def matrix_scope(parts: Sequence[int] | None) -> Literal["matrix"] | Sequence[int]:
    """`choose_mask`'s whole-matrix comparison group: each of the `parts` stacked along the rows, or
    the whole matrix without them."""
    return "matrix" if parts is None else parts


def keep_top_scores(
    weights: torch.Tensor,
    scores: torch.Tensor,
    cfg: MatrixPruneConfig,
    *,
    unstructured_scope: Literal["row", "matrix"],
    parts: Sequence[int] | None = None,
) -> list[PruneOutcome]:
    """weights: (..., out, in) float32, one matrix or a stack; scores: the same shape, larger = keep → one
    `PruneOutcome` per matrix (and part) keeping the largest scores under `cfg.pattern` and zeroing the
    rest (no weight update), from one solver call for the stack: the methods that score each weight once
    (magnitude, Wanda). unstructured_scope as `choose_mask`'s; parts: the row counts of linears stacked
    along `out` (`PrunerSpec.prune_rows`), each its own outcome and whole-matrix comparison group."""
    scope = matrix_scope(parts) if unstructured_scope == "matrix" else unstructured_scope
    choice = choose_mask(scores, cfg.pattern, cfg.solver, unstructured_scope=scope)
    tally = SolveTally(weights[..., 0, 0].numel(), weights.device, parts)
    if choice.result is not None:
        tally.add_result(choice.result)
    return split_outcomes(weights * choice.mask, choice.mask, tally.infos(), parts=parts)


class SolveTally:
    """The certificates of a method's solver calls on a stack of L matrices, summed per matrix.

    Every call covers all L matrices flattened to (L·R, C) (`choose_mask`), so each call's per-tile values
    split into L equal runs of tiles, one per matrix. With `parts` (row counts summing to R, each a
    multiple of M: linears stacked along their outputs, `PrunerSpec.prune_rows`) each run splits again
    into consecutive runs of (rows/M)·(C/M) tiles (`to_blocks` numbers tiles row-major), one per part, so
    every part gets the sums it would get alone. Seconds cannot be split by matrix: each matrix is
    credited an equal share of every call, and each part its share of rows of its matrix's share (a
    call's work grows with its tiles, which grow with the rows).
    """

    def __init__(self, matrices: int, device: torch.device, parts: Sequence[int] | None = None) -> None:
        self.matrices = matrices
        self.parts = tuple(parts) if parts is not None else (1,)
        count = matrices * len(self.parts)
        self.objective = torch.zeros(count, dtype=torch.float64, device=device)  # (L·P,)
        self.upper_bound = torch.zeros(count, dtype=torch.float64, device=device)  # (L·P,)
        self.seconds = 0.0
        self.calls = 0

    def per_matrix(self, tiles: torch.Tensor) -> torch.Tensor:
        """tiles: (B,) per-tile values of one call, B = L·tiles per matrix → (L·P,) float64 sums, matrix
        by matrix, part by part."""
        runs = tiles.to(torch.float64).view(self.matrices, -1)  # (L, tiles per matrix)
        total = sum(self.parts)
        sizes = [runs.shape[1] * part // total for part in self.parts]
        return torch.stack([run.sum(1) for run in runs.split(sizes, 1)], 1).reshape(-1)

    def add(self, block_objective: torch.Tensor, block_upper_bound: torch.Tensor, seconds: float) -> None:
        """block_objective, block_upper_bound: (B,) of one call (the objective of the mask kept, which the
        safeguard may have changed from the solver's)."""
        self.objective += self.per_matrix(block_objective)
        self.upper_bound += self.per_matrix(block_upper_bound)
        self.seconds += seconds
        self.calls += 1

    def add_result(self, result: SolveResult) -> None:
        self.add(result.block_objective, result.block_upper_bound, result.seconds)

    def infos(self) -> list[MaskSolveInfo] | None:
        """One certificate per matrix and part (gap = 1 − Σobjective / Σupper_bound), None without any
        call; `calls` is the calls every matrix and part took part in."""
        if not self.calls:
            return None
        total = sum(self.parts)
        shares = [self.seconds * part / total / self.matrices for part in self.parts] * self.matrices
        return [
            solve_info([float(obj)], [float(ub)], [share], calls=self.calls)
            for obj, ub, share in zip(self.objective.tolist(), self.upper_bound.tolist(), shares, strict=True)
        ]


def keep_better_tiles(
    scores: torch.Tensor, new: SolveResult, previous_mask: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-tile safeguard of Assumption 1 (Appendix A.1.3).

    scores: (R, C) current scores; new: the solver's result on them; previous_mask: (R, C) bool, a
    feasible transposable mask. Returns (mask (R, C) bool, block_objective (B,) float64 of that mask on
    `scores`, kept (B,) bool: the tiles where the previous mask was kept because the new one scored lower).
    Keeping the better tile per tile makes the mask's objective never drop below the previous one's,
    which is what the ADMM convergence proof needs.
    """
    rows, cols = scores.shape
    blocks = to_blocks(scores.double(), m)  # (B, M, M)
    prev_blocks = to_blocks(previous_mask, m)  # (B, M, M)
    new_blocks = to_blocks(new.mask, m)  # (B, M, M)
    prev_obj = (blocks * prev_blocks).sum((1, 2))  # (B,)
    keep_prev = prev_obj > new.block_objective  # (B,)
    mask_blocks = torch.where(keep_prev[:, None, None], prev_blocks, new_blocks)  # (B, M, M)
    block_obj = torch.where(keep_prev, prev_obj, new.block_objective)  # (B,)
    return from_blocks(mask_blocks, rows, cols), block_obj, keep_prev


def solve_info(
    objectives: list[float], bounds: list[float], seconds: list[float], *, calls: int | None = None
) -> MaskSolveInfo:
    """Aggregate several solver calls of one layer: gap = 1 − Σobjective / Σupper_bound; calls: how many
    calls the values come from (default: one per objective)."""
    obj, ub = float(sum(objectives)), float(sum(bounds))
    gap = (ub - obj) / ub if ub > 0 else 0.0
    return MaskSolveInfo(
        objective=obj,
        upper_bound=ub,
        gap=max(gap, 0.0),
        seconds=float(sum(seconds)),
        calls=len(objectives) if calls is None else calls,
    )
