"""Wanda (Sun et al. 2023) with transposable masks (paper Section 4, "Integration with Wanda").

Score S_oi = |W_oi|·‖X_:,i‖₂ for the (out, in) weight; the transposable mask is the solver's answer on
that score matrix, and the weights outside it are zeroed (no weight update).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tsenor_cli.pruning.masks import SolveTally, choose_mask
from tsenor_cli.pruning.stats import Statistics
from tsenor_cli.pruning.types import LayerPruneConfig, PruneOutcome, split_outcomes

NEEDS_GRAM = False


def scores(weight: torch.Tensor, stats: Statistics) -> torch.Tensor:
    """weight: (..., out, in), statistics of the inputs of each matrix ((..., in) norms) → scores
    (..., out, in) = |W_oj|·‖X_j‖₂."""
    return weight.to(torch.float32).abs() * stats.col_norms.to(weight.device)[..., None, :]


def prune_batch(
    weights: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig, *, parts: Sequence[int] | None = None
) -> list[PruneOutcome]:
    """weights: (..., out, in), one matrix or a stack with statistics of matching leading shape → one
    `PruneOutcome` per matrix keeping the largest Wanda scores, from one solver call for the stack.
    parts: row counts of linears stacked along `out` sharing these statistics (`PrunerSpec.prune_rows`),
    one outcome each."""
    if stats is None:
        raise ValueError("wanda needs input statistics; run the calibration data through the layer first")
    w = weights.to(torch.float32)
    choice = choose_mask(scores(w, stats), cfg.pattern, cfg.solver, unstructured_scope="row")
    tally = SolveTally(w[..., 0, 0].numel(), w.device, parts)
    if choice.result is not None:
        tally.add_result(choice.result)
    return split_outcomes(w * choice.mask, choice.mask, tally.infos(), parts=parts)


def prune(weight: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig) -> PruneOutcome:
    """weight: (out, in) → `PruneOutcome` keeping the largest Wanda scores under the pattern."""
    return prune_batch(weight, stats, cfg)[0]
