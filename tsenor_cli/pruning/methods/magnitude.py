"""Magnitude pruning: keep the largest |W_ij| under the pattern (no calibration data needed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tsenor_cli.pruning.methods.method import PrunerSpec, top_scores_workspace

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.methods.stats import Statistics
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig, PruneOutcome


def prune_batch(
    weights: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig, *, parts: Sequence[int] | None = None
) -> list[PruneOutcome]:
    """weights: (..., out, in), one matrix or a stack → one `PruneOutcome` per matrix with the
    largest-magnitude entries kept, from one solver call for the whole stack; `stats` is unused.
    parts: row counts of linears stacked along `out` (`PrunerSpec.prune_rows`), one outcome each."""
    import torch

    from tsenor_cli.pruning.methods.masks import keep_top_scores

    w = weights.to(torch.float32)
    return keep_top_scores(w, w.abs(), cfg, unstructured_scope="matrix", parts=parts)


METHOD = PrunerSpec(
    "magnitude",
    "keep the largest |W|",
    prune_batch,
    needs_data=False,
    workspace=top_scores_workspace,
    fuses_rows=True,
)


def prune(weight: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig) -> PruneOutcome:
    """weight: (out, in), one matrix → its `PruneOutcome` (`PrunerSpec.prune`)."""
    return METHOD.prune(weight, stats, cfg)
