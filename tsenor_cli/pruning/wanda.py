"""Wanda (Sun et al. 2023) with transposable masks (paper Section 4, "Integration with Wanda").

Score S_oi = |W_oi|·‖X_:,i‖₂ for the (out, in) weight; the transposable mask is the solver's answer on
that score matrix, and the weights outside it are zeroed (no weight update).
"""

from __future__ import annotations

import torch

from tsenor_cli.pruning.masks import choose_mask, solve_info
from tsenor_cli.pruning.stats import InputStats
from tsenor_cli.pruning.types import LayerPruneConfig, PruneOutcome

NEEDS_GRAM = False


def scores(weight: torch.Tensor, stats: InputStats) -> torch.Tensor:
    """weight: (out, in), statistics of inputs (tokens, in) → scores (out, in) = |W_oj|·‖X_j‖₂."""
    return weight.to(torch.float32).abs() * stats.col_norms.to(weight.device)[None, :]


def prune(weight: torch.Tensor, stats: InputStats | None, cfg: LayerPruneConfig) -> PruneOutcome:
    """weight: (out, in) → `PruneOutcome` keeping the largest Wanda scores under the pattern."""
    if stats is None:
        raise ValueError("wanda needs input statistics; run the calibration data through the layer first")
    w = weight.to(torch.float32)
    choice = choose_mask(scores(w, stats), cfg.pattern, cfg.solver, unstructured_scope="row")
    info = None
    if choice.result is not None:
        info = solve_info([choice.result.objective], [choice.result.upper_bound], [choice.result.seconds])
    return PruneOutcome(weight=w * choice.mask, mask=choice.mask, solve=info)
