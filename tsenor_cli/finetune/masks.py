"""The fixed mask of a pruned checkpoint: its zeros, checked against the pattern its run recorded.

A run directory written by `tsenor prune` records the pattern twice: its sparsity record
(`runfiles.read_sparsity`: tsenor_sparsity.json, or config.json's `tsenor_sparsity` before v0.3; what
`tsenor verify` reads) and tsenor_report.json (`PruneReport.pattern`, `sparsity`). Fine-tuning needs both
to agree and the weights' zeros to satisfy them, so that what it keeps fixed is the pattern the run was
pruned to. Weights that were already zero before pruning stay zero (they cannot be told apart from pruned
ones); `tsenor verify` counts them as "fewer than N".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tsenor_cli.errors import InputNotFoundError, UsageError, VerificationError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.run.verify import check_weight
from tsenor_cli.runfiles import (
    CONFIG_FILE,
    PRUNE_FILE,
    SPARSITY_KEY,
    PruneReport,
    SchemaError,
    SparsityRecord,
    read_json,
    read_sparsity,
)


@dataclass(frozen=True)
class RunSparsity:
    """A run directory's recorded sparsity: its sparsity record (`record`, and the `pattern` it names) and
    its tsenor_report.json (`report`)."""

    directory: Path
    record: SparsityRecord
    report: PruneReport

    @property
    def pattern(self) -> SparsityPattern:
        return self.record.pattern

    @property
    def label(self) -> str:
        return f"{self.pattern.label} ({self.pattern.kind})"

    @property
    def modules(self) -> tuple[str, ...]:
        return self.record.pruned_modules


def _report_pattern(report: PruneReport) -> SparsityPattern | None:
    """The pattern tsenor_report.json records (`pattern`, or `sparsity` for unstructured), None when it names none."""
    if report.pattern is not None:
        return report.pattern
    return SparsityPattern.unstructured(report.sparsity) if 0.0 < report.sparsity < 1.0 else None


def read_run_sparsity(run_dir: Path) -> RunSparsity:
    """The recorded pattern of `run_dir`; one-line errors for a missing folder, a dense checkpoint,
    a folder without a pattern, and a sparsity record and tsenor_report.json that disagree."""
    config_path, report_path = run_dir / CONFIG_FILE, run_dir / PRUNE_FILE
    if not run_dir.is_dir():
        raise InputNotFoundError(f"run directory {run_dir} does not exist; pass the --output folder of tsenor prune")
    if not config_path.is_file():
        raise InputNotFoundError(
            f"{run_dir} holds no checkpoint (no config.json); pass the --output folder of tsenor prune"
        )
    try:
        record = read_sparsity(run_dir)
        report = PruneReport.from_json(read_json(report_path), str(report_path)) if report_path.is_file() else None
    except SchemaError as exc:
        raise UsageError(f"{exc}; re-run tsenor prune to rewrite it") from exc
    if record is None and report is None:
        raise UsageError(
            f"{run_dir} is a dense checkpoint (no {SPARSITY_KEY} in config.json, no {PRUNE_FILE}); prune it "
            f"first with `tsenor prune {run_dir} --nm 16:32 --output PRUNED`, then fine-tune PRUNED"
        )
    if record is None or report is None:
        missing = PRUNE_FILE if record is not None else f"{SPARSITY_KEY} in config.json"
        raise InputNotFoundError(
            f"{run_dir} records no sparsity pattern ({missing} is missing); pass a folder written by tsenor prune"
        )
    if _report_pattern(report) != record.pattern:
        raise VerificationError(
            f"{report_path} (pattern {report.pattern.label if report.pattern else None}, sparsity {report.sparsity}) "
            f"and the sparsity record ({record.pattern.label} {record.pattern.kind}) record different patterns; "
            "re-run tsenor prune"
        )
    if not record.pruned:
        raise VerificationError(f"{run_dir} records no pruned weights; there is no mask to keep fixed")
    return RunSparsity(run_dir, record, report)


def pruned_masks(model: nn.Module, sparsity: RunSparsity) -> dict[str, torch.Tensor]:
    """{parameter name: bool mask of its shape, True where a pruned matrix's weight is 0} for every parameter
    holding a recorded pruned matrix: a module's weight, or a stack of experts, whose experts the run left
    dense stay False (trained freely), as `fixedmask.FixedMask` takes them.

    Raises VerificationError when a parameter is missing or does not hold its matrix, or a matrix's zeros
    contradict the recorded pattern (a tile row/column, N:M group or layer keeps more weights than it allows).
    """
    masks: dict[str, torch.Tensor] = {}
    for entry in sparsity.record.pruned:
        try:
            param = model.get_parameter(entry.param)
        except AttributeError as exc:
            raise VerificationError(
                f"{sparsity.directory}: pruned weight {entry.name} ({entry.param}) is not in the model; "
                "re-run tsenor prune"
            ) from exc
        weight = entry.matrix_of(param.detach())
        if weight is None:
            raise VerificationError(
                f"{sparsity.directory}: {entry.param} {tuple(param.shape)} does not hold the pruned matrix "
                f"{entry.name} {entry.shape}; re-run tsenor prune"
            )
        _, over, _ = check_weight(weight, sparsity.pattern)
        if over:
            raise VerificationError(
                f"{sparsity.directory}: the zeros of {entry.name} contradict the recorded {sparsity.label} pattern "
                f"({over} groups keep too many weights); the checkpoint was modified after pruning, re-run tsenor prune"
            )
        mask = masks.setdefault(entry.param, torch.zeros(param.shape, dtype=torch.bool, device=param.device))
        view = entry.matrix_of(mask)  # a view of the mask: its matrix's positions only
        assert view is not None  # the mask has the parameter's shape, which holds the matrix
        view.copy_(weight == 0)
    return masks
