"""Check a pruned checkpoint against its sparsity record (`tsenor verify`; `runfiles.read_sparsity`:
tsenor_sparsity.json, or config.json's ``tsenor_sparsity`` in checkpoints before v0.3).

For transposable N:M every M×M tile of every pruned weight may keep at most N per row and per column;
our solvers always keep exactly N, so fewer than N only happens where weights were already zero before
pruning (reported as info), while more than N is a violation. A packed checkpoint's matrices are checked
from the positions their stored code marks (`packed.layout.stored_mask`): no dense weight is built.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tsenor_cli.errors import InputNotFoundError, PackedFormatError, UsageError, VerificationError
from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.namefold import fold_names, template
from tsenor_cli.packed.files import declares_packed
from tsenor_cli.packed.layout import stored_mask
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.finite import check_finite
from tsenor_cli.runfiles import (
    CONFIG_FILE,
    INDEX_NAME,
    SPARSITY_KEY,
    WEIGHTS_NAME,
    DenseWeight,
    PrunedWeight,
    SparsityRecord,
    read_json,
    read_sparsity,
)
from tsenor_cli.solver import to_blocks


@dataclass(frozen=True)
class LayerCheck:
    """One pruned weight. groups: tiles (transposable), row groups (nm) or rows (unstructured).
    over: rows+columns (or groups) keeping more than allowed — violations; under: keeping fewer (info)."""

    name: str
    shape: tuple[int, int]
    groups: int
    over: int
    under: int
    density: float
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.over == 0 and self.problem is None


@dataclass(frozen=True)
class ClassLoad:
    """How one transformers class loads the checkpoint: the weights it expects and finds under no key of
    the files (`missing`: they would be initialised at random), and the layout it reads them through
    ({its parameter name: the files' key}; None when transformers converts the keys rather than renames)."""

    name: str
    missing: tuple[str, ...]
    layout: dict[str, str] | None

    @property
    def ok(self) -> bool:
        return not self.missing


@dataclass(frozen=True)
class VerifyReport:
    """directory: the checkpoint; sparsity: its sparsity record; layers: the check of each pruned weight."""

    directory: str
    sparsity: SparsityRecord
    layers: tuple[LayerCheck, ...]
    loads: tuple[ClassLoad, ...] = ()

    @property
    def pattern(self) -> SparsityPattern:
        return self.sparsity.pattern

    @property
    def dense(self) -> tuple[DenseWeight, ...]:
        """The weights the run left dense, with their status and reason."""
        return self.sparsity.dense

    @property
    def ok(self) -> bool:
        return all(layer.ok for layer in self.layers) and all(load.ok for load in self.loads)

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "ok": self.ok,
            "sparsity": self.sparsity.summary(),
            "layers": [asdict(c) for c in self.layers],
            "dense": [asdict(w) for w in self.dense],
            "loads": [{"class": load.name, "missing": list(load.missing)} for load in self.loads],
        }


def _weight_files(directory: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} from the index of a sharded checkpoint or its single file."""
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_NAME
    if not single.is_file():
        raise InputNotFoundError(
            f"{directory} holds no {WEIGHTS_NAME} nor {INDEX_NAME}; pass a checkpoint written by tsenor prune"
        )
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}  # noqa: SIM118  (safe_open has no __iter__)


class _Parameters:
    """The model's parameters as tsenor pruned them, read from a checkpoint folder.

    A parameter is read from its safetensors file under the key its class's conversion mapping renames
    to its name (`layout`: the output is written in its source's layout, e.g. Mllama's
    ``language_model.model.layers…``), or under its own name. When the files hold another layout that
    is not a renaming (a checkpoint of an older tsenor saved fused experts back in their per-expert keys),
    the model is loaded once with its own class, which applies transformers' conversion, and the
    parameters are taken from it.
    """

    def __init__(self, directory: Path, files: dict[str, Path], layout: dict[str, str] | None) -> None:
        self.directory = directory
        self.files = files
        self.layout = layout or {}
        self.loaded: dict[str, torch.Tensor] | None = None
        # A packed checkpoint's matrices are checked from their stored code (`packed_mask`), never decoded.
        self.packed = Checkpoint.open(directory) if declares_packed(directory) else None

    def packed_mask(self, name: str) -> torch.Tensor | None:
        """The (out, in) bool mask of the positions a packed matrix's code stores, as stored (not checked
        against its pattern: `check_weight` counts its tiles); None for a tensor that is not packed."""
        key = self.layout.get(name, name)
        info = self.packed.tensors.get(key) if self.packed is not None else None
        if info is None or info.pattern is None or info.code is None:
            return None
        path = self.directory / info.file
        with safe_open(str(path), framework="pt") as handle:
            code = handle.get_tensor(info.code)
        try:
            return stored_mask(code, info.pattern)
        except PackedFormatError as exc:
            raise PackedFormatError(f"{path}: packed tensor {key}: {exc}; the file is damaged: re-copy it") from exc

    def tensor(self, name: str) -> torch.Tensor | None:
        key = self.layout.get(name, name)
        if self.packed is not None and key in self.packed.tensors:
            return self.packed.read([key])[key]
        if key in self.files:
            with safe_open(str(self.files[key]), framework="pt") as handle:
                return handle.get_tensor(key)
        if self.loaded is None:
            self.loaded = _load_parameters(self.directory)
        return self.loaded.get(name)

    def matrix(self, entry: PrunedWeight) -> torch.Tensor | None:
        """The (out, in) matrix of one pruned weight (a packed one's stored mask), or None when the checkpoint
        lacks it."""
        # A packed mask is each matrix as pruned: (out, in); (E, out, in) for a stack; (E·out, in) for a
        # stack kept in one 2-D parameter.
        mask = self.packed_mask(entry.param)
        if mask is not None and entry.expert is None:
            return mask
        if mask is not None and entry.expert is not None and mask.dim() == 3:
            return mask[entry.expert]
        if mask is not None and entry.expert is not None and entry.shape is not None:
            start = entry.expert * entry.shape[0]
            return mask[start : start + entry.shape[0]]
        tensor = self.tensor(entry.param)
        return None if tensor is None else entry.matrix_of(tensor)


def _load_parameters(directory: Path) -> dict[str, torch.Tensor]:
    """{parameter name: tensor} of the checkpoint loaded with the class its config.json names."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise VerificationError(
            f"{directory}/config.json names no transformers class in 'architectures' ({names or 'none'}) to read "
            "its parameters back with; pass a checkpoint written by tsenor prune"
        )
    model = cls.from_pretrained(str(directory), dtype="auto", local_files_only=True)
    return {name: param.detach() for name, param in model.named_parameters()}


def check_weight(weight: torch.Tensor, pattern: SparsityPattern) -> tuple[int, int, int]:
    """weight: (out, in), its shape compatible with `pattern`, or the bool mask of its kept positions (a
    packed matrix's code) → (groups, over, under) for that pattern."""
    kept = weight != 0  # (out, in) bool
    n, m = pattern.n, pattern.m
    if pattern.kind == "transposable":
        tiles = (
            to_blocks(kept, m).sum(2, dtype=torch.int64),
            to_blocks(kept, m).sum(1, dtype=torch.int64),
        )  # (B, M)
        counts = torch.cat(tiles, 1)  # (B, 2M): row counts then column counts
        return int(counts.shape[0]), int((counts > n).sum()), int((counts < n).sum())
    rows, cols = kept.shape
    if pattern.kind == "nm":
        counts = kept.reshape(rows, cols // m, m).sum(2, dtype=torch.int64)  # (out, in/M)
        return int(counts.numel()), int((counts > n).sum()), int((counts < n).sum())
    s = pattern.sparsity
    allowed = max(rows * (cols - round(s * cols)), rows * cols - round(s * rows * cols))
    nnz = int(kept.sum())
    return 1, int(nnz > allowed), int(nnz < allowed)


def verify_checkpoint(directory: Path) -> VerifyReport:
    """Read the checkpoint's sparsity record and check every pruned weight; raises only on unusable input."""
    if not directory.exists():
        raise InputNotFoundError(f"{directory} does not exist; pass a checkpoint directory written by tsenor prune")
    if not directory.is_dir():
        raise UsageError(f"{directory} is a file; pass the checkpoint directory written by tsenor prune")
    record = read_sparsity(directory)
    if record is None:
        # Not a failed verification (exit 6): there is nothing to verify against, the wrong folder was passed.
        raise UsageError(
            f"{directory} is not a tsenor checkpoint (its {CONFIG_FILE} records no {SPARSITY_KEY}); "
            "pass a folder written by tsenor prune"
        )
    files = _weight_files(directory)
    _check_conformance(directory)
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as handle:
            check_finite(
                ((name, handle.get_tensor(name)) for name in handle.keys()),  # noqa: SIM118  (no __iter__)
                where=str(path),
                fix="the checkpoint is corrupt; re-run tsenor prune",
            )
    if not record.pruned:
        raise VerificationError(f"{directory} records no pruned weights; nothing to verify")
    loads = _class_loads(directory, list(files))
    params = _Parameters(directory, files, loads[0].layout if loads else None)
    checks = [_check(entry, params.matrix(entry), record.pattern) for entry in record.pruned]
    return VerifyReport(str(directory), record, tuple(checks), tuple(loads))


def _check_conformance(directory: Path) -> None:
    """The weights against the model config.json describes (`models/conformance.py`, exit 7), as every
    command that reads a checkpoint checks them: a block the config lacks or names in vain, a tensor of
    another shape. A checkpoint with its own model code is not built (verify runs no code it brings)."""
    import transformers

    from tsenor_cli.models.conformance import check_checkpoint
    from tsenor_cli.models.loading import meta_model

    if read_json(directory / CONFIG_FILE).get("auto_map"):
        return
    config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    check_checkpoint(directory, meta_model(config))


def _class_loads(directory: Path, keys: list[str]) -> list[ClassLoad]:
    """How each class that loads a checkpoint of this config (`loading.loading_classes`; the class its
    config.json names first) maps the files' keys: the weights it would find missing."""
    import transformers

    from tsenor_cli.models.loading import loading_classes
    from tsenor_cli.models.saving import saved_tensors, source_layout

    if read_json(directory / CONFIG_FILE).get("auto_map"):
        return []  # its own model code: verify runs no code it brings (`load_lines` says it was not checked)
    config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    named = [getattr(transformers, n, None) for n in getattr(config, "architectures", None) or ()]
    loads = []
    for cls in dict.fromkeys([c for c in named if c is not None] + loading_classes(config)):
        with torch.device("meta"):
            model = cls(config)
        layout = source_layout(model, keys)
        if layout is None:  # not a renaming: transformers converts these keys when it loads them
            loads.append(ClassLoad(cls.__name__, (), None))
            continue
        missing = tuple(spec.key for spec in saved_tensors(model) if spec.key not in layout)
        loads.append(ClassLoad(cls.__name__, missing, {own: key for own, key in layout.items()}))
    return loads


def _check(entry: PrunedWeight, weight: torch.Tensor | None, pattern: SparsityPattern) -> LayerCheck:
    """The check of one pruned weight (`weight`: its (out, in) matrix, None when the checkpoint lacks it)."""
    if weight is None:
        return LayerCheck(entry.name, (0, 0), 0, 0, 0, 0.0, "weight missing from the checkpoint")
    rows, cols = weight.shape
    problem = pattern.incompatibility(rows, cols)
    if problem is not None:
        return LayerCheck(entry.name, (rows, cols), 0, 0, 0, 0.0, problem)
    groups, over, under = check_weight(weight, pattern)
    density = float((weight != 0).float().mean())
    return LayerCheck(entry.name, (int(rows), int(cols)), groups, over, under, density)


def table_lines(report: VerifyReport) -> list[str]:
    """The check as a table: a row per weight, the weights whose rows say the same and whose names differ
    only in their numbers folded into one ("model.layers.{0-29}.mlp.up_proj"; `namefold`); `--json`
    keeps a row per weight."""
    unit = {"transposable": "tiles", "nm": "groups", "unstructured": "layer"}[report.pattern.kind]
    groups: dict[tuple[str, ...], list[str]] = {}
    for check in report.layers:
        status = "ok" if check.ok else (check.problem or "VIOLATION")
        shape = f"{check.shape[0]}×{check.shape[1]}"
        cells = (shape, str(check.groups), str(check.over), str(check.under), f"{check.density:.4f}", status)
        groups.setdefault((template(check.name), *cells), []).append(check.name)
    rows = []
    for (_, shape, count, over, under, density, status), names in groups.items():
        for name in fold_names(names):
            rows.append(f"{name:<44} {shape:>11} {count:>8} {over:>11} {under:>10} {density:>8}  {status}")
    header = f"{'layer':<44} {'shape':>11} {unit:>8} {'>N (error)':>11} {'<N (info)':>10} {'density':>8}  status"
    return [header, *rows]


def load_lines(report: VerifyReport) -> list[str]:
    """One line per class that loads the checkpoint: it finds every weight, or how many are missing."""
    if not report.loads:
        return ["loads: not checked (the checkpoint brings its own model code, which verify does not run)"]
    return [
        f"loads as {load.name}: every weight found"
        if load.ok
        else f"loads as {load.name}: {len(load.missing)} weight(s) missing, e.g. {load.missing[0]}"
        for load in report.loads
    ]


def dense_lines(report: VerifyReport) -> list[str]:
    """One line per (status, reason) of the weights the run left dense: how many, the first two names."""
    groups: dict[tuple[str, str], list[str]] = {}
    for weight in report.dense:
        groups.setdefault((weight.status, weight.reason or "no reason recorded"), []).append(weight.name)
    lines = []
    for (status, reason), names in groups.items():
        shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
        lines.append(f"dense: {len(names)} {status} ({reason}): {shown}")
    return lines
