"""Weights outside the language model that `--targets` selects: a multimodal model's vision tower and projector.

They stay dense unless a `--targets` pattern names them. The
calibration is text run through the language model, so it never reaches them: no activation statistics
exist for them, and they are pruned from their magnitudes alone, whatever `--method` the decoder blocks
get (magnitude needs no data: `pruning/methods/magnitude.py`). The report says so on each of their records, and
the run says it on stderr. Only `nn.Linear` modules are selectable there (a patch embedding's convolution
is not a matrix the pattern applies to); the token embedding and the output head are not part of the
vision tower (`ModelStructure.outside`) and stay refused by `--targets` (`selection.excluded_layers`).

They are pruned after the block loop, in memory, on every rank (a few matrices, no data): a resumed run
reloads them dense from the checkpoint and prunes them again to the same result, so the resume state
needs nothing of them. Their records carry ``block`` −1 (`OUTSIDE_BLOCK`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.progress import Progress
from tsenor_cli.pruning.methods import magnitude
from tsenor_cli.pruning.methods.types import LayerRecord, MatrixPruneConfig
from tsenor_cli.pruning.settings.selection import matches

OUTSIDE_BLOCK = -1
REASON = "outside the language model: pruned by magnitude (the text calibration never reaches it)"


@dataclass(frozen=True)
class OutsideWeight:
    """One selected linear outside the language model: its full module name, shape, and why the pattern
    cannot take it (None when it can)."""

    name: str
    out_features: int
    in_features: int
    incompatible: str | None


def outside_linears(model: nn.Module, structure: ModelStructure) -> dict[str, nn.Linear]:
    """{full module name: module} of the nn.Linear modules of `structure.outside` (vision tower, projector)."""
    found: dict[str, nn.Linear] = {}
    for root in structure.outside:
        for name, module in model.get_submodule(root).named_modules():
            if isinstance(module, nn.Linear):
                found[f"{root}.{name}" if name else root] = module
    return found


def selected_outside(
    linears: dict[str, nn.Linear], targets: Sequence[str], ignore: Sequence[str], pattern: SparsityPattern
) -> tuple[OutsideWeight, ...]:
    """The linears of `linears` some `--targets` pattern names and no `--ignore` pattern does, in model order."""
    chosen = []
    for name, module in linears.items():
        if any(matches(p, name) for p in targets) and not any(matches(p, name) for p in ignore):
            out_features, in_features = module.weight.shape
            why = pattern.incompatibility(out_features, in_features)
            chosen.append(OutsideWeight(name, int(out_features), int(in_features), why))
    return tuple(chosen)


def check_outside(chosen: Sequence[OutsideWeight], pattern: SparsityPattern, *, skip: bool) -> None:
    """IncompatibleModelError naming the first `chosen` linear `pattern` cannot tile, unless `skip`
    (--skip-incompatible: it is then recorded skipped)."""
    unfit = [w for w in chosen if w.incompatible]
    if unfit and not skip:
        raise IncompatibleModelError(
            f"--targets selects {unfit[0].name}, which cannot take {pattern.label}: {unfit[0].incompatible}; "
            "choose an M that divides its dimensions or pass --skip-incompatible (or --ignore) to leave it dense"
        )


@torch.no_grad()
def prune_outside(
    linears: dict[str, nn.Linear], chosen: Sequence[OutsideWeight], cfg: MatrixPruneConfig, say: Progress
) -> list[LayerRecord]:
    """Prune each compatible `chosen` linear in place by magnitude under `cfg`'s pattern; one record each
    (status "skipped" with the reason where the pattern does not fit, as `--skip-incompatible` would)."""
    records = []
    for weight in chosen:
        if weight.incompatible is not None:
            records.append(_record(weight, "skipped", weight.incompatible))
            continue
        start = time.perf_counter()
        param = linears[weight.name].weight
        outcome = magnitude.METHOD.prune(param.detach(), None, cfg)  # (out, in) float32
        param.copy_(outcome.weight.to(dtype=param.dtype))
        density = float(outcome.mask.float().mean())
        gap = outcome.solve.gap if outcome.solve is not None else None
        record = _record(weight, "pruned", REASON, density=density, gap=gap, seconds=time.perf_counter() - start)
        say(f"  {weight.name}: {REASON.split(':')[0]}, density {density:.4f}")
        records.append(record)
    return records


def _record(
    weight: OutsideWeight,
    status: str,
    reason: str,
    *,
    density: float | None = None,
    gap: float | None = None,
    seconds: float = 0.0,
) -> LayerRecord:
    return LayerRecord(
        block=OUTSIDE_BLOCK,
        name=weight.name,
        out_features=weight.out_features,
        in_features=weight.in_features,
        status=status,
        reason=reason,
        density=density,
        gap=gap,
        seconds=seconds,
        param=f"{weight.name}.weight",
    )
