"""The two run files `tsenor report` reads, as frozen dataclasses (JSON examples: docs/report-format.md).

A run directory holds ``eval.json`` (written by ``tsenor eval``) and, for a pruned model,
``tsenor_report.json`` (written by ``tsenor prune``). Only the fields below are read; unknown fields
are ignored and optional ones may be absent, so both writers can add fields freely.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tsenor_cli.errors import InputNotFoundError, UsageError

EVAL_FILE = "eval.json"
PRUNE_FILE = "tsenor_report.json"


class SchemaError(UsageError):
    """A run file that is not valid JSON or lacks a required field (exit 2)."""


def _get(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, *, optional: bool = False) -> Any:
    """obj[key] checked against `kind`; None when optional and absent or null."""
    if key not in obj or obj[key] is None:
        if optional:
            return None
        raise SchemaError(f"{where}: missing field {key!r}")
    value = obj[key]
    # JSON has one number type: accept ints where floats are expected, never bools as numbers.
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and kind is not bool:
        raise SchemaError(f"{where}: field {key!r} must be {getattr(kind, '__name__', kind)}, got a boolean")
    if not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise SchemaError(f"{where}: field {key!r} must be {name}, got {type(value).__name__}")
    return value


def _finite(value: float, key: str, where: str) -> float:
    if not math.isfinite(value):
        raise SchemaError(f"{where}: field {key!r} is {value}, expected a finite number")
    return value


@dataclass(frozen=True)
class Perplexity:
    """``eval.json → perplexity.<dataset>``: only ``ppl`` is read (inf allowed: a broken model)."""

    ppl: float

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> Perplexity:
        value = _get(obj, "ppl", float, where)
        if math.isnan(value) or value <= 0:
            raise SchemaError(f"{where}: ppl {value} must be a positive number")
        return cls(ppl=value)


@dataclass(frozen=True)
class TaskMetrics:
    """``eval.json → zeroshot.tasks.<task>``: accuracies are fractions in [0, 1]."""

    acc: float
    acc_norm: float | None = None
    acc_stderr: float | None = None
    n_samples: int | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> TaskMetrics:
        acc = _finite(_get(obj, "acc", float, where), "acc", where)
        acc_norm = _get(obj, "acc_norm", float, where, optional=True)
        for key, value in (("acc", acc), ("acc_norm", acc_norm)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise SchemaError(f"{where}: {key} {value} must be a fraction in [0, 1]")
        return cls(
            acc=acc,
            acc_norm=acc_norm,
            acc_stderr=_get(obj, "acc_stderr", float, where, optional=True),
            n_samples=_get(obj, "n_samples", int, where, optional=True),
        )


@dataclass(frozen=True)
class ZeroShotSummary:
    """``eval.json → zeroshot``: per-task metrics and the recorded average of `average_metric`."""

    tasks: dict[str, TaskMetrics]
    average: float | None
    average_metric: str

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> ZeroShotSummary:
        raw = _get(obj, "tasks", dict, where)
        tasks = {str(k): TaskMetrics.from_json(_get(raw, k, dict, where), f"{where}: task {k}") for k in raw}
        metric = _get(obj, "average_metric", str, where, optional=True) or "acc"
        if metric != "acc":
            raise SchemaError(f"{where}: average_metric {metric!r} is not 'acc'; re-run `tsenor eval`")
        return cls(tasks=tasks, average=_get(obj, "average", float, where, optional=True), average_metric=metric)


@dataclass(frozen=True)
class EvalRecord:
    """``eval.json``: the model evaluated, perplexity per dataset and (optionally) zero-shot accuracy."""

    model: str
    perplexity: dict[str, Perplexity]
    zeroshot: ZeroShotSummary | None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = EVAL_FILE) -> EvalRecord:
        raw_ppl = _get(obj, "perplexity", dict, where, optional=True) or {}
        perplexity = {
            str(name): Perplexity.from_json(_get(raw_ppl, name, dict, where), f"{where}: perplexity.{name}")
            for name in raw_ppl
        }
        raw_zs = _get(obj, "zeroshot", dict, where, optional=True)
        return cls(
            model=_get(obj, "model", str, where),
            perplexity=perplexity,
            zeroshot=ZeroShotSummary.from_json(raw_zs, f"{where}: zeroshot") if raw_zs is not None else None,
        )


@dataclass(frozen=True)
class PatternInfo:
    """``tsenor_report.json → pattern``: null for dense or unstructured pruning."""

    n: int
    m: int
    transposable: bool

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> PatternInfo:
        n, m = _get(obj, "n", int, where), _get(obj, "m", int, where)
        if not 1 <= n < m:
            raise SchemaError(f"{where}: pattern {n}:{m} needs 1 <= n < m")
        return cls(n=n, m=m, transposable=_get(obj, "transposable", bool, where))


@dataclass(frozen=True)
class LayerRecord:
    """``tsenor_report.json → layers[i]``: one linear layer, in pruning order (error null: skipped)."""

    name: str
    block: int
    reconstruction_error: float | None
    gap: float | None = None
    seconds: float | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str) -> LayerRecord:
        return cls(
            name=_get(obj, "name", str, where),
            block=_get(obj, "block", int, where),
            reconstruction_error=_get(obj, "reconstruction_error", float, where, optional=True),
            gap=_get(obj, "gap", float, where, optional=True),
            seconds=_get(obj, "seconds", float, where, optional=True),
        )


@dataclass(frozen=True)
class PruneReport:
    """``tsenor_report.json``: how the model was pruned and the per-layer records."""

    method: str
    pattern: PatternInfo | None
    sparsity: float
    layers: tuple[LayerRecord, ...]

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = PRUNE_FILE) -> PruneReport:
        raw_pattern = _get(obj, "pattern", dict, where, optional=True)
        sparsity = _get(obj, "sparsity", float, where)
        if not 0.0 <= sparsity < 1.0:
            raise SchemaError(f"{where}: sparsity {sparsity} must lie in [0, 1)")
        raw_layers = _get(obj, "layers", list, where, optional=True) or []
        return cls(
            method=_get(obj, "method", str, where),
            pattern=PatternInfo.from_json(raw_pattern, f"{where}: pattern") if raw_pattern is not None else None,
            sparsity=sparsity,
            layers=tuple(LayerRecord.from_json(layer, f"{where}: layers[{i}]") for i, layer in enumerate(raw_layers)),
        )


@dataclass(frozen=True)
class Run:
    """One run directory: its eval.json and, when it was pruned, its tsenor_report.json."""

    path: Path
    eval: EvalRecord
    prune: PruneReport | None

    @property
    def label(self) -> str:
        return self.path.name


def _read_json(path: Path) -> Mapping[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); re-create the run") from exc
    if not isinstance(obj, dict):
        raise SchemaError(f"{path} holds a JSON {type(obj).__name__}, expected an object; re-create the run")
    return obj


def load_run(path: Path) -> Run:
    """Read a run directory; no directory or no eval.json → InputNotFoundError."""
    if not path.is_dir():
        raise InputNotFoundError(f"run directory {path} does not exist; pass directories made by `tsenor eval`")
    eval_path = path / EVAL_FILE
    if not eval_path.is_file():
        raise InputNotFoundError(
            f"{path} has no {EVAL_FILE}; evaluate the model into it first (`tsenor eval` writes it)"
        )
    prune_path = path / PRUNE_FILE
    return Run(
        path=path,
        eval=EvalRecord.from_json(_read_json(eval_path), str(eval_path)),
        prune=PruneReport.from_json(_read_json(prune_path), str(prune_path)) if prune_path.is_file() else None,
    )
