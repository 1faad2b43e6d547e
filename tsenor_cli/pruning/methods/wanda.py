"""Wanda (Sun et al. 2023) with transposable masks (paper Section 4, "Integration with Wanda").

Score S_oi = |W_oi|·‖X_:,i‖₂ for the (out, in) weight; the transposable mask is the solver's answer on
that score matrix, and the weights outside it are zeroed (no weight update).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tsenor_cli.pruning.methods.method import PrunerSpec, top_scores_workspace

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.methods.stats import Statistics
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig, PruneOutcome


def scores(weight: torch.Tensor, stats: Statistics) -> torch.Tensor:
    """weight: (..., out, in), statistics of the inputs of each matrix ((..., in) norms) → scores
    (..., out, in) = |W_oj|·‖X_j‖₂."""
    import torch

    return weight.to(torch.float32).abs() * stats.col_norms.to(weight.device)[..., None, :]


def prune_batch(
    weights: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig, *, parts: Sequence[int] | None = None
) -> list[PruneOutcome]:
    """weights: (..., out, in), one matrix or a stack with statistics of matching leading shape → one
    `PruneOutcome` per matrix keeping the largest Wanda scores, from one solver call for the stack.
    parts: row counts of linears stacked along `out` sharing these statistics (`PrunerSpec.prune_rows`),
    one outcome each."""
    import torch

    from tsenor_cli.pruning.methods.masks import keep_top_scores

    if stats is None:
        raise ValueError("wanda needs input statistics; run the calibration data through the layer first")
    w = weights.to(torch.float32)
    return keep_top_scores(w, scores(w, stats), cfg, unstructured_scope="row", parts=parts)


METHOD = PrunerSpec(
    "wanda",
    "keep the largest |W|·‖X_j‖ (Wanda)",
    prune_batch,
    needs_data=True,
    workspace=top_scores_workspace,
    fuses_rows=True,
)


def prune(weight: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig) -> PruneOutcome:
    """weight: (out, in), one matrix → its `PruneOutcome` (`PrunerSpec.prune`)."""
    return METHOD.prune(weight, stats, cfg)
