"""The registry of pruning methods; the CLI's `--method` choices and method flags come from `PRUNERS`.

Torch-free: each method's module (`prune`, `prune_batch`, `NEEDS_GRAM`) is imported when first used,
so `tsenor --help` lists the methods and their options without loading torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from tsenor_cli.errors import UsageError
from tsenor_cli.pruning.method_options import ALPSOptions, MethodOptions, SparseGPTOptions

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.stats import Statistics
    from tsenor_cli.pruning.types import LayerPruneConfig, PruneOutcome


class PruneFn(Protocol):
    """weight: (out, in), statistics of the layer inputs, config → `PruneOutcome`."""

    def __call__(self, weight: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig, /) -> PruneOutcome: ...


class PrunePartsFn(Protocol):
    """weights: (Σ parts, in), linears stacked along their outputs (`parts`: their out_features), the
    statistics they share, config → one `PruneOutcome` per part (`prune_batch(..., parts=...)`)."""

    def __call__(
        self, weights: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig, /, *, parts: Sequence[int]
    ) -> list[PruneOutcome]: ...


class PruneBatchFn(Protocol):
    """weights: (L, out, in), statistics of each matrix's inputs ((L, in, in) Gram), config → one
    `PruneOutcome` per matrix, computed for the stack at once (the experts of one MoE parameter)."""

    def __call__(
        self, weights: torch.Tensor, stats: Statistics | None, cfg: LayerPruneConfig, /
    ) -> list[PruneOutcome]: ...


@dataclass(frozen=True)
class PrunerSpec:
    """name: the --method value; module: `tsenor_cli.pruning.<module>`, holding `prune`, `prune_batch` and
    `NEEDS_GRAM` (whether `prune` reads XᵀX, else only ‖X_j‖ or nothing); needs_data: whether calibration
    data changes the result; iterative: reports ADMM iterations; options: the method's options dataclass
    (`pruning/method_options.py`). `prune_batch` gives the same method on a stack of matrices at once
    (each with its own statistics), within round-off of `prune` on each matrix alone.

    `prune(weight, stats, cfg)` must not modify `stats`: linears that read one input share one
    `InputStats` (`gather.group_input_stats`, `Team.ordered_statistics`).

    fuses_rows: each output row's result depends on the statistics and that row alone (besides the
    whole-matrix comparison of unstructured sparsity, which `prune_batch` keeps per part), so linears
    sharing one statistics object can go through `prune_rows` as one matrix, with the masks each would get
    alone: SparseGPT (every row's OBS update uses the shared H⁻¹ only), Wanda, magnitude. Not ALPS: its
    ρ schedule and stopping test read the whole matrix's support change (alps.py `_grow_rho`), so
    stacking q/k/v would change every matrix's iterations."""

    name: str
    description: str
    module: str
    needs_data: bool
    iterative: bool = False
    options: type[MethodOptions] = field(default=MethodOptions)
    fuses_rows: bool = False

    @property
    def _module(self) -> ModuleType:
        return importlib.import_module(f"tsenor_cli.pruning.{self.module}")

    @property
    def prune(self) -> PruneFn:
        fn: PruneFn = self._module.prune
        return fn

    @property
    def prune_batch(self) -> PruneBatchFn:
        fn: PruneBatchFn = self._module.prune_batch
        return fn

    @property
    def needs_gram(self) -> bool:
        return bool(self._module.NEEDS_GRAM)

    def prune_rows(
        self, weight: torch.Tensor, parts: Sequence[int], stats: Statistics | None, cfg: LayerPruneConfig
    ) -> list[PruneOutcome]:
        """weight: (Σ parts, in), the linears sharing `stats` (q/k/v, gate/up) stacked along their outputs,
        parts: their out_features in order → one `PruneOutcome` per part, pruned as one matrix: one
        factorization and one solver call per slab for all of them.

        For a transposable pattern every part must be a multiple of M, so that no M×M tile straddles two
        matrices (`SparsityPattern.incompatibility` refuses other shapes before a run); the row-wise N:M
        and unstructured patterns group or compare within a row, or within each part (`choose_mask`)."""
        if not self.fuses_rows:
            raise ValueError(f"{self.name} cannot prune linears stacked along their outputs (fuses_rows=False)")
        if sum(parts) != weight.shape[0]:
            raise ValueError(f"parts {list(parts)} do not add up to the {weight.shape[0]} rows of the stacked weight")
        if cfg.pattern.kind == "transposable" and any(part % cfg.pattern.m for part in parts):
            raise ValueError(
                f"out_features {list(parts)} are not all multiples of M = {cfg.pattern.m}; prune them apart"
            )
        fn: PrunePartsFn = self._module.prune_batch
        return fn(weight, stats, cfg, parts=parts)


PRUNERS: dict[str, PrunerSpec] = {
    spec.name: spec
    for spec in (
        PrunerSpec("magnitude", "keep the largest |W|", "magnitude", needs_data=False, fuses_rows=True),
        PrunerSpec("wanda", "keep the largest |W|·‖X_j‖ (Wanda)", "wanda", needs_data=True, fuses_rows=True),
        PrunerSpec(
            "sparsegpt",
            "OBS with lazy updates (SparseGPT)",
            "sparsegpt",
            needs_data=True,
            options=SparseGPTOptions,
            fuses_rows=True,
        ),
        PrunerSpec(
            "alps",
            "ADMM + conjugate gradient (ALPS, Proposition 1)",
            "alps",
            needs_data=True,
            iterative=True,
            options=ALPSOptions,
        ),
    )
}


def get_pruner(name: str) -> PrunerSpec:
    try:
        return PRUNERS[name]
    except KeyError:
        raise UsageError(f"unknown pruning method {name!r}; choose one of: {', '.join(PRUNERS)}") from None
