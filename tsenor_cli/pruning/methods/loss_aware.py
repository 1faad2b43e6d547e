"""The loss-aware objective around any method (`--loss-aware λ`; docs/design/loss-aware.md).

A layer's reconstruction objective ‖X(Ŵ−W)ᵀ‖² = Σ_i ‖X(ŵ_i−w_i)‖² counts every output row alike. The
language-model loss does not: to second order its change under ΔW is ½ vec(ΔW)ᵀ F vec(ΔW), with F the
Fisher of the layer's weights, which K-FAC factors as E[δδᵀ] ⊗ E[xxᵀ] (δ the loss gradient at the
layer's output, x its input). Keeping the diagonal g of E[δδᵀ] and adding the Taylor term to the
reconstruction, each normalized by its own scale, gives

    Σ_i (1 + λ·g_i/mean g) ‖X(ŵ_i−w_i)‖²  =  ‖X(D^½Ŵ − D^½W)ᵀ‖²,   D = diag(1 + λ·g/mean g).

So the weighted problem is the plain one on the rows scaled by D^½: a row scaling keeps the support, so
any method pruning D^½W on the same statistics solves it, and dividing its result by D^½ gives the
pruned weights. Every method (and every pattern and solver) thus takes the objective unchanged. The row
weights matter where rows compete: in a transposable M×M tile every column keeps N of M rows, so the
high-curvature rows keep more of their weights; an unstructured comparison across the matrix too. A
row-wise N:M mask and the rows' own updates (SparseGPT's, ALPS's) are the same problem per row, up to
the scale, so those results move only through the mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.methods.method import PrunerSpec
    from tsenor_cli.pruning.methods.stats import Statistics
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig, PruneOutcome


def row_weights(curvature: torch.Tensor, weight: float) -> torch.Tensor:
    """curvature: (out,) float32 g_i = Σ_t δ_ti² ≥ 0 → (out,) 1 + λ·g_i/mean g; all ones for λ = 0 or a
    layer whose outputs the loss never reached (g all zero: nothing to weigh them by)."""
    import torch

    mean = curvature.mean()
    if weight == 0 or not bool(mean > 0):
        return torch.ones_like(curvature)
    return 1 + weight * (curvature / mean)


def prune_weighted(
    spec: PrunerSpec,
    weight: torch.Tensor,
    stats: Statistics | None,
    cfg: MatrixPruneConfig,
    rows: torch.Tensor | None,
    parts: Sequence[int] | None = None,
) -> list[PruneOutcome]:
    """weight: (out, in) float32, one matrix or linears stacked along their outputs (`parts`, with
    `spec.fuses_rows`); rows: (out,) the row weights D (`row_weights`), None for the plain objective →
    the method's outcomes (one per part) on the weighted objective (module docstring).

    An entry the method returned as it was given (magnitude and Wanda keep the kept weights unchanged) is
    returned as the dense weight itself, so that scaling and unscaling cost no rounding."""
    if rows is None:
        return spec.prune_batch(weight, stats, cfg) if parts is None else spec.prune_rows(weight, parts, stats, cfg)
    root = rows.to(weight).sqrt()[:, None]  # (out, 1)
    scaled = weight * root
    if parts is None:
        outcomes, sizes = spec.prune_batch(scaled, stats, cfg), [weight.shape[0]]
    else:
        outcomes, sizes = spec.prune_rows(scaled, parts, stats, cfg), list(parts)
    pieces = zip(outcomes, weight.split(sizes), scaled.split(sizes), root.split(sizes), strict=True)
    return [_unscaled(outcome, dense, given, scale) for outcome, dense, given, scale in pieces]


def _unscaled(outcome: PruneOutcome, dense: torch.Tensor, given: torch.Tensor, root: torch.Tensor) -> PruneOutcome:
    """One outcome of the scaled problem back in the layer's units: (part, in) each, root (part, 1)."""
    import torch

    weight = torch.where(outcome.weight == given, dense, outcome.weight / root)
    weight.masked_fill_(~outcome.mask, 0.0)  # +0.0 where pruned, as `split_outcomes` leaves it
    return dataclasses.replace(outcome, weight=weight)
