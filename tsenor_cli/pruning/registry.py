"""The registry of pruning methods; the CLI's `--method` choices come from `PRUNERS`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tsenor_cli.errors import UsageError
from tsenor_cli.pruning import alps, magnitude, sparsegpt, wanda
from tsenor_cli.pruning.stats import Statistics
from tsenor_cli.pruning.types import LayerPruneConfig, PruneOutcome


class PruneFn(Protocol):
    """weight: (out, in), statistics of the layer inputs, config → `PruneOutcome`."""

    def __call__(self, weight: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig, /) -> PruneOutcome: ...


class PruneBatchFn(Protocol):
    """weights: (L, out, in), statistics of each matrix's inputs ((L, in, in) Gram), config → one
    `PruneOutcome` per matrix, computed for the stack at once (the experts of one MoE parameter)."""

    def __call__(
        self, weights: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig, /
    ) -> list[PruneOutcome]: ...


@dataclass(frozen=True)
class PrunerSpec:
    """name: the --method value; needs_gram: whether `prune` reads XᵀX (else only ‖X_j‖ or nothing);
    needs_data: whether calibration data changes the result; iterative: reports ADMM iterations;
    prune_batch: the same method on a stack of matrices at once (each with its own statistics), the
    results within round-off of `prune` on each matrix alone.

    `prune(weight, stats, cfg)` must not modify `stats`: linears that read one input share one
    `InputStats` (`gather.group_input_stats`, `Team.ordered_statistics`)."""

    name: str
    description: str
    prune: PruneFn
    prune_batch: PruneBatchFn
    needs_gram: bool
    needs_data: bool
    iterative: bool = False


PRUNERS: dict[str, PrunerSpec] = {
    spec.name: spec
    for spec in (
        PrunerSpec(
            "magnitude", "keep the largest |W|", magnitude.prune, magnitude.prune_batch, magnitude.NEEDS_GRAM, False
        ),
        PrunerSpec(
            "wanda", "keep the largest |W|·‖X_j‖ (Wanda)", wanda.prune, wanda.prune_batch, wanda.NEEDS_GRAM, True
        ),
        PrunerSpec(
            "sparsegpt",
            "OBS with lazy updates (SparseGPT)",
            sparsegpt.prune,
            sparsegpt.prune_batch,
            sparsegpt.NEEDS_GRAM,
            True,
        ),
        PrunerSpec(
            "alps",
            "ADMM + conjugate gradient (ALPS, Proposition 1)",
            alps.prune,
            alps.prune_batch,
            alps.NEEDS_GRAM,
            True,
            True,
        ),
    )
}


def get_pruner(name: str) -> PrunerSpec:
    try:
        return PRUNERS[name]
    except KeyError:
        raise UsageError(f"unknown pruning method {name!r}; choose one of: {', '.join(PRUNERS)}") from None
