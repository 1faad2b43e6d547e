"""Magnitude pruning: keep the largest |W_ij| under the pattern (no calibration data needed)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tsenor_cli.pruning.masks import SolveTally, choose_mask
from tsenor_cli.pruning.stats import Statistics
from tsenor_cli.pruning.types import LayerPruneConfig, PruneOutcome, split_outcomes

NEEDS_GRAM = False


def prune_batch(
    weights: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig, *, parts: Sequence[int] | None = None
) -> list[PruneOutcome]:
    """weights: (..., out, in), one matrix or a stack → one `PruneOutcome` per matrix with the
    largest-magnitude entries kept, from one solver call for the whole stack; `stats` is unused.
    parts: row counts of linears stacked along `out` (`PrunerSpec.prune_rows`), one outcome each."""
    w = weights.to(torch.float32)
    choice = choose_mask(w.abs(), cfg.pattern, cfg.solver, unstructured_scope="matrix", parts=parts)
    tally = SolveTally(w[..., 0, 0].numel(), w.device, parts)
    if choice.result is not None:
        tally.add_result(choice.result)
    return split_outcomes(w * choice.mask, choice.mask, tally.infos(), parts=parts)


def prune(weight: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig) -> PruneOutcome:
    """weight: (out, in) → `PruneOutcome` with the largest-magnitude entries kept; `stats` is unused."""
    return prune_batch(weight, stats, cfg)[0]
