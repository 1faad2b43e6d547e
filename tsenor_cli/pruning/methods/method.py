"""What a pruning method declares: `PrunerSpec` (its name, options, memory cost, whether it needs data and
its `prune_batch`) and `MethodOptions` (its typed options).

A method is one module (`magnitude.py`, `wanda.py`, `sparsegpt.py`, `alps.py`, or one outside the package:
`registry.get_pruner`) ending in one `PrunerSpec`. Everything else comes from that declaration: the
`--method` choice, each option's CLI flag, recipe key, Python keyword and report field
(`table.method_fields`: option `x` of method `m` is `--m-x` / `m_x`), the plan's memory estimate
(`workspace`, through `memory.MethodCost`) and whether the run reads calibration data (`needs_data`).

No torch here, and none in a method module's imports: `tsenor --help` reads every declaration, so a
method imports torch inside the functions that run it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, get_type_hints

from tsenor_cli.errors import UsageError

# The transposable mask solver a layer's masks come from when none is named (`--solver`'s default in
# `pruning/settings/table.py`): `auto` picks the exact flow on the CPU and the entropic solver on CUDA.
DEFAULT_SOLVER = "auto"

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.block.memory import MethodCost
    from tsenor_cli.pruning.methods.stats import Statistics
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig, PruneOutcome

# The kinds an option's value may have, by the name its annotation spells.
OPTION_KINDS: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str}


def option(default: Any, help: str, *, minimum: float | None = None, choices: Sequence[str] | None = None) -> Any:
    """A method option (a field of a `MethodOptions` subclass): its default, help line, least value (numbers)
    and accepted strings (text), checked when the options are built."""
    meta = {"help": help, "minimum": minimum, "choices": tuple(choices) if choices is not None else None}
    return dataclasses.field(default=default, metadata=meta)


def option_kinds(options: type[MethodOptions]) -> dict[str, type]:
    """{option: its kind (int, float, bool or str)} of an options class, from its annotations."""
    hints = get_type_hints(options)
    kinds = {}
    for item in dataclasses.fields(options):
        kind = hints[item.name]
        if kind not in OPTION_KINDS.values():
            raise TypeError(f"{options.__name__}.{item.name}: an option is an int, float, bool or str, not {kind}")
        kinds[item.name] = kind
    return kinds


@dataclass(frozen=True)
class MethodOptions:
    """The base of every method's options (a frozen dataclass of `option` fields); a method without options
    uses it as is. Each value is checked against its kind, least value and choices when built."""

    def __post_init__(self) -> None:
        kinds = option_kinds(type(self))
        for item in dataclasses.fields(self):
            _check_option(item, kinds[item.name], getattr(self, item.name))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_option(item: dataclasses.Field[Any], kind: type, value: Any) -> None:
    """One option's value against its kind (ints pass for floats, bools for nothing else), least value and
    choices: one UsageError line."""
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and isinstance(value, float)):
            raise UsageError(f"method option {item.name} must be a {kind.__name__}, got {value!r}; pass a number")
        least = item.metadata.get("minimum")
        if not math.isfinite(value) or (least is not None and value < least):
            raise UsageError(
                f"method option {item.name} {value} must be finite and >= {least:g}; pass e.g. {item.default}"
            )
        return
    if not isinstance(value, kind):
        raise UsageError(f"method option {item.name} must be a {kind.__name__}, got {value!r}")
    choices = item.metadata.get("choices")
    if choices is not None and value not in choices:
        raise UsageError(f"method option {item.name} {value!r} is not one of: {', '.join(choices)}")


class PruneFn(Protocol):
    """weight: (out, in), statistics of the layer inputs, config → `PruneOutcome` (`PrunerSpec.prune`)."""

    def __call__(self, weight: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig, /) -> PruneOutcome: ...


class PruneBatchFn(Protocol):
    """weights: (..., out, in), one matrix or a stack; the statistics of each matrix's inputs (a stack's
    with matching leading shape); config; parts: row counts of linears stacked along `out` that share
    these statistics (only for a method with `fuses_rows`) → one `PruneOutcome` per matrix (and part).

    It must not modify `stats`: linears that read one input share one `InputStats`."""

    def __call__(
        self,
        weights: torch.Tensor,
        stats: Statistics | None,
        cfg: MatrixPruneConfig,
        /,
        *,
        parts: Sequence[int] | None = None,
    ) -> list[PruneOutcome]: ...


def no_workspace(out_features: int, in_features: int, cost: MethodCost) -> int:
    """The working set of a method that declares none: the engine's own error check."""
    return cost.record(out_features, in_features)


def top_scores_workspace(out_features: int, in_features: int, cost: MethodCost) -> int:
    """The working set of a method that keeps the largest scores (`masks.keep_top_scores`: magnitude,
    Wanda): the dense copy, the scores and the solver: 2F + S (F = 4·out·in bytes, S the solver's)."""
    return 2 * 4 * out_features * in_features + cost.solver(out_features, in_features)


@dataclass(frozen=True)
class PrunerSpec:
    """A pruning method, declared once in its module.

    name: the --method value; description: its line in the docs. prune_batch: the method itself
    (`PruneBatchFn`), the same on a stack of matrices as on each alone, within round-off. options: its
    options class (`MethodOptions`; the run's instance reaches `prune_batch` as `cfg.options`, read with
    `cfg.method_options(ITS_OPTIONS)`). workspace(out, in, cost): the peak bytes it allocates while pruning
    one (out, in) matrix beyond the matrix's statistics (`memory.matrix_workspace`; `cost` gives the
    solver's and the engine's shares). needs_data: whether calibration data change its result.
    iterative: its outcomes count iterations, printed with each matrix's line.

    fuses_rows: each output row's result depends on the statistics and that row alone (besides the
    whole-matrix comparison of unstructured sparsity, which `prune_batch` keeps per part), so linears
    sharing one statistics object can go through `prune_rows` as one matrix, with the masks each would get
    alone: SparseGPT (every row's OBS update uses the shared H⁻¹ only), Wanda, magnitude. Not ALPS: its
    ρ schedule and stopping test read the whole matrix's support change (alps.py `_grow_rho`), so
    stacking q/k/v would change every matrix's iterations."""

    name: str
    description: str
    prune_batch: PruneBatchFn
    needs_data: bool
    options: type[MethodOptions] = MethodOptions
    workspace: Callable[[int, int, MethodCost], int] = no_workspace
    iterative: bool = False
    fuses_rows: bool = False

    def prune(self, weight: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig) -> PruneOutcome:
        """weight: (out, in), one matrix → its `PruneOutcome`."""
        return self.prune_batch(weight, stats, cfg)[0]

    def prune_rows(
        self, weight: torch.Tensor, parts: Sequence[int], stats: Statistics | None, cfg: MatrixPruneConfig
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
        return self.prune_batch(weight, stats, cfg, parts=parts)
