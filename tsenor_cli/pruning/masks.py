"""One place that turns a score matrix into a mask of the requested pattern.

Transposable masks come from the TSENOR solver API (paper Section 3), row-wise N:M and unstructured
masks from the plain top-k helpers. Scores are "keep" scores: larger means more important.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.phases import phase
from tsenor_cli.pruning.types import MaskSolveInfo
from tsenor_cli.solver import SolveResult, from_blocks, nm_mask, solve, to_blocks, unstructured_mask


@dataclass(frozen=True)
class MaskChoice:
    """mask: (R, C) bool; result: the solver's result (transposable only), for warm starts and the gap."""

    mask: torch.Tensor
    result: SolveResult | None


def choose_mask(
    scores: torch.Tensor,
    pattern: SparsityPattern,
    solver: str,
    *,
    init: SolveResult | None = None,
    unstructured_scope: Literal["row", "matrix"] = "row",
    solver_options: Mapping[str, object] | None = None,
) -> MaskChoice:
    """scores: (R, C) non-negative → mask (R, C) bool of `pattern`.

    unstructured_scope picks the comparison group of unstructured sparsity: each output row (Wanda)
    or the whole matrix (magnitude, ALPS). solver_options go to the transposable solver.
    """
    with phase("mask solver"):
        if pattern.kind == "transposable":
            result = solve(scores, pattern.n, pattern.m, method=solver, init=init, **(solver_options or {}))
            return MaskChoice(result.mask, result)
        if pattern.kind == "nm":
            return MaskChoice(nm_mask(scores, pattern.n, pattern.m), None)
        if pattern.kind == "unstructured":
            per_row = unstructured_scope == "row"
            return MaskChoice(unstructured_mask(scores, pattern.sparsity, per_row=per_row), None)
    raise ValueError(f"unknown pattern kind {pattern.kind!r}")


def keep_better_tiles(
    scores: torch.Tensor, new: SolveResult, previous_mask: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The per-tile safeguard of Assumption 1 (Appendix A.1.3).

    scores: (R, C) current scores; new: the solver's result on them; previous_mask: (R, C) bool, a
    feasible transposable mask. Returns (mask (R, C) bool, block_objective (B,) float64 of that mask on
    `scores`, number of tiles where the previous mask was kept because the new one scored lower).
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
    return from_blocks(mask_blocks, rows, cols), block_obj, int(keep_prev.sum())


def solve_info(objectives: list[float], bounds: list[float], seconds: list[float]) -> MaskSolveInfo:
    """Aggregate several solver calls of one layer: gap = 1 − Σobjective / Σupper_bound."""
    obj, ub = float(sum(objectives)), float(sum(bounds))
    gap = (ub - obj) / ub if ub > 0 else 0.0
    return MaskSolveInfo(
        objective=obj, upper_bound=ub, gap=max(gap, 0.0), seconds=float(sum(seconds)), calls=len(objectives)
    )
