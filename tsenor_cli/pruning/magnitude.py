"""Magnitude pruning: keep the largest |W_ij| under the pattern (no calibration data needed)."""

from __future__ import annotations

import torch

from tsenor_cli.pruning.masks import choose_mask, solve_info
from tsenor_cli.pruning.stats import InputStats
from tsenor_cli.pruning.types import LayerPruneConfig, PruneOutcome

NEEDS_GRAM = False


def prune(weight: torch.Tensor, stats: InputStats | None, cfg: LayerPruneConfig) -> PruneOutcome:
    """weight: (out, in) → `PruneOutcome` with the largest-magnitude entries kept; `stats` is unused."""
    w = weight.to(torch.float32)
    choice = choose_mask(w.abs(), cfg.pattern, cfg.solver, unstructured_scope="matrix")
    info = None
    if choice.result is not None:
        info = solve_info([choice.result.objective], [choice.result.upper_bound], [choice.result.seconds])
    return PruneOutcome(weight=w * choice.mask, mask=choice.mask, solve=info)
