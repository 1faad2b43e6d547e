"""The fixed mask of a pruned checkpoint: its zeros, checked against the pattern its run recorded.

A run directory written by `tsenor prune` records the pattern twice: config.json `tsenor_sparsity`
(kind, N, M, the pruned modules; what `tsenor verify` reads) and tsenor_report.json (`pattern`,
`sparsity`). Fine-tuning needs both to agree and the weights' zeros to satisfy them, so that what
it keeps fixed is the pattern the run was pruned to. Weights that were already zero before pruning
stay zero (they cannot be told apart from pruned ones); `tsenor verify` counts them as "fewer than N".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tsenor_cli.errors import InputNotFoundError, UsageError, VerificationError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.verify import check_weight
from tsenor_cli.runfiles import CONFIG_FILE, PRUNE_FILE, SPARSITY_KEY


@dataclass(frozen=True)
class RunSparsity:
    """A run directory's recorded sparsity: config.json `tsenor_sparsity` (`meta`, and the `pattern` it
    names) and the raw tsenor_report.json."""

    directory: Path
    meta: dict[str, Any]
    report: dict[str, Any]
    pattern: SparsityPattern

    @property
    def label(self) -> str:
        return f"{self.pattern.label} ({self.pattern.kind})"

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self.meta.get("pruned_modules", ()))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON ({exc.msg}); re-run tsenor prune to rewrite it") from exc
    if not isinstance(data, dict):
        raise UsageError(f"{path} does not hold a JSON object; re-run tsenor prune to rewrite it")
    return data


def _report_pattern(report: dict[str, Any], where: str) -> SparsityPattern | None:
    """The pattern tsenor_report.json records (`pattern`, or `sparsity` for unstructured), None when it names none."""
    raw = report.get("pattern")
    if raw is not None:
        return SparsityPattern.from_report_json(raw, where)
    sparsity = report.get("sparsity")
    if isinstance(sparsity, bool) or not isinstance(sparsity, int | float) or not 0.0 < sparsity < 1.0:
        return None
    return SparsityPattern.unstructured(float(sparsity))


def read_run_sparsity(run_dir: Path) -> RunSparsity:
    """The recorded pattern of `run_dir`; one-line errors for a missing folder, a dense checkpoint,
    a folder without a pattern, and config.json and tsenor_report.json that disagree."""
    config_path, report_path = run_dir / CONFIG_FILE, run_dir / PRUNE_FILE
    if not run_dir.is_dir():
        raise InputNotFoundError(f"run directory {run_dir} does not exist; pass the --output folder of tsenor prune")
    if not config_path.is_file():
        raise InputNotFoundError(
            f"{run_dir} holds no checkpoint (no config.json); pass the --output folder of tsenor prune"
        )
    meta = _read_json(config_path).get(SPARSITY_KEY)
    if meta is None and not report_path.is_file():
        raise UsageError(
            f"{run_dir} is a dense checkpoint (no {SPARSITY_KEY} in config.json, no {PRUNE_FILE}); prune it "
            f"first with `tsenor prune --model {run_dir} --nm 16:32 --output PRUNED`, then fine-tune PRUNED"
        )
    if not isinstance(meta, dict) or not report_path.is_file():
        missing = PRUNE_FILE if isinstance(meta, dict) else f"{SPARSITY_KEY} in config.json"
        raise InputNotFoundError(
            f"{run_dir} records no sparsity pattern ({missing} is missing); pass a folder written by tsenor prune"
        )
    report = _read_json(report_path)
    pattern = SparsityPattern.from_metadata(meta, f"{config_path} {SPARSITY_KEY}")
    if _report_pattern(report, str(report_path)) != pattern:
        raise VerificationError(
            f"{report_path} (pattern {report.get('pattern')}, sparsity {report.get('sparsity')}) and config.json "
            f"({meta.get('pattern')} {meta.get('kind')}) record different patterns; re-run tsenor prune"
        )
    if not meta.get("pruned_modules"):
        raise VerificationError(f"{config_path} lists no pruned modules; there is no mask to keep fixed")
    return RunSparsity(run_dir, meta, report, pattern)


def pruned_masks(model: nn.Module, sparsity: RunSparsity) -> dict[str, torch.Tensor]:
    """{module name: (out, in) bool, True where the weight is pruned} for every recorded pruned module.

    Raises VerificationError when a module is missing or its zeros contradict the recorded pattern
    (a tile row/column, N:M group or layer keeps more weights than the pattern allows).
    """
    masks: dict[str, torch.Tensor] = {}
    for module in sparsity.modules:
        try:
            weight = model.get_parameter(f"{module}.weight")
        except AttributeError as exc:
            raise VerificationError(
                f"{sparsity.directory}: pruned module {module} is not in the model; re-run tsenor prune"
            ) from exc
        _, over, _ = check_weight(weight.detach(), sparsity.pattern)
        if over:
            raise VerificationError(
                f"{sparsity.directory}: the zeros of {module} contradict the recorded {sparsity.label} pattern "
                f"({over} groups keep too many weights); the checkpoint was modified after pruning, re-run tsenor prune"
            )
        masks[module] = weight.detach() == 0
    return masks
