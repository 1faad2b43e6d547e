"""The run folder, defined once: every file name and every file's schema.

A run folder (`tsenor prune --output`, `tsenor finetune --output`) holds the checkpoint (`CONFIG_FILE`
with a short summary of the sparsity under `SPARSITY_KEY`, the weights in `WEIGHTS_NAME` or the shards
`INDEX_NAME` names, the model card `MODEL_CARD`), the per-weight sparsity record `SPARSITY_FILE`
(`SparsityRecord`), the reports ``tsenor_report.json`` (`PruneReport`) and ``tsenor_report.md``
(`PRUNE_REPORTS`; the Markdown is rendered by `tsenor_cli.report.markdown`), ``eval.json`` (`EvalReport`),
``finetune.json`` (`FinetuneReport`), and while a run is unfinished its resume state in `RESUME_DIR`: a
prune's `RESUME_STATE_FILE` (`ResumeState`, beside the `block_file` and `hidden_file` it names;
`runfiles/resume.ResumeStore` checks it against those files) or a finetune's `FINETUNE_STATE_FILE`
(`FinetuneState`). The sweep folder's files are in `runfiles/sweep.py`.

Every file is written through `tsenor_cli.atomic` (the one writer).

`tsenor prune`, `tsenor eval` and `tsenor finetune` write these dataclasses with ``to_json()``; `tsenor report`
reads them back with ``from_json()``, so every field has one name and one type (docs/reference/run-files.md).
Each file carries ``schema_version``; ``to_json()`` always writes the current format
(`SCHEMA_VERSION`), and the dataclasses' ``schema_version`` says which version a record was read from.
A file without the field is version 1, as written before the field existed; it still loads:

- v1 layer records carry the relative error twice, as ``recon_error`` and ``reconstruction_error``
  (either is read); v2 writes ``recon_error`` only.
- v1 records where a dataset came from only as a flag (``perplexity.<d>.offline``,
  ``zeroshot.tasks.<t>.source``); it is read as a `DataSource` of that kind with no files. v2 records
  the files read (path and sha256) or the hub dataset, and the calibration data's source too.
- v1 has no ``context`` (data folder, offline policy) and no ``command`` in eval.json: read as None.

Reading checks every field against its annotation and the value ranges `tsenor report` relies on; a
missing field or a wrong type is one `SchemaError` line naming the file and the field.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from tsenor_cli import atomic
from tsenor_cli.errors import InputNotFoundError, VerificationError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.runfiles.schema import (
    SCHEMA_VERSION,
    ContextRecord,
    DataSource,
    SchemaError,
    TaskSource,
    _field,
    _flat_json,
    _object,
    _optional,
    _read,
    _typed,
    _version,
    read_json,
    read_json_file,
)

# ---------------------------------------------------------------- the files of a run folder
CONFIG_FILE = "config.json"
SPARSITY_KEY = "tsenor_sparsity"  # config.json's summary of the sparsity (before v0.3: the whole record)
SPARSITY_FILE = "tsenor_sparsity.json"  # the per-weight sparsity record (`SparsityRecord`)
MODEL_CARD = "README.md"  # the Hub's model card (pruning/run/card.py)
# The checkpoint's weights: one file, or shards named by the index (transformers' names, the order in
# which from_pretrained looks for them).
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def pruned_stage(output: Path) -> Path:
    """Where `tsenor prune --distill-steps N --output OUTPUT` keeps the pruned checkpoint that the distillation
    reads (`tsenor_cli/compress.py`): the hidden folder ``.OUTPUT.pruned`` beside OUTPUT, a prune run folder
    of its own (its resume state, lock and report), deleted once OUTPUT holds the distilled model."""
    return output.parent / f".{output.name}{PRUNED_STAGE_SUFFIX}"


def shard_names(count: int) -> list[str]:
    """transformers' shard file names: model.safetensors alone, else model-0000k-of-0000n.safetensors."""
    if count == 1:
        return [WEIGHTS_NAME]
    stem = WEIGHTS_NAME.removesuffix(".safetensors")
    return [f"{stem}-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


GENERATION_CONFIG_FILE = "generation_config.json"
EVAL_FILE = "eval.json"
PRUNE_FILE = "tsenor_report.json"
PRUNE_MARKDOWN = "tsenor_report.md"
PRUNE_REPORTS = (PRUNE_FILE, PRUNE_MARKDOWN)
FINETUNE_FILE = "finetune.json"
FINETUNE_LOSS_PLOT_FILE = "finetune_loss.png"  # the training loss against steps
FINETUNE_PPL_PLOT_FILE = "finetune_ppl.png"  # the perplexity against steps
RESUME_DIR = ".tsenor-resume"
RESUME_STATE_FILE = "state.json"  # a prune's resume state (runfiles/resume.py)
FINETUNE_STATE_FILE = "finetune_state.json"  # a finetune's, beside Trainer's checkpoint-N folders
PRUNED_STAGE_SUFFIX = ".pruned"  # `pruned_stage`: a distilling prune's checkpoint before the distillation
# Versions of the small state files (each carries its own `schema_version`).
FINETUNE_STATE_VERSION = 1
# 3: the block files and hidden-state files are named by block and listed with their sizes. Files of this
# format written before `schema_version` carry the same number as ``version``. 4: and with their sha256
# (`digests`: a file damaged at the same size is seen), keyed by the input checkpoint's identity too.
PRUNE_STATE_VERSION = 4
SPARSITY_VERSION = 1  # tsenor_sparsity.json's
LAYER_STATUSES = ("pruned", "skipped", "idle", "ignored")


# ---------------------------------------------------------------- tsenor_report.json


@dataclass(frozen=True)
class LayerRecord:
    """One prunable linear of the model, as the report shows it.

    block: the decoder block, −1 for a linear outside the language model that --targets selected
    (pruning/block/outside.py).
    name: full module name ("model.layers.3.mlp.down_proj"), or for a matrix that is not an nn.Linear
    the parameter's ("model.layers.3.mlp.experts.gate_up_proj", with ``[e]`` for expert e of a stack);
    status "pruned", "skipped" (with reason: the pattern does not fit), "idle" (with reason: a matrix of
    an idle block, one the model's forward does not run, that no forward of its own reaches as a linear)
    or "ignored" (with reason: left dense by choice or by a rule: routers, gates, weights that are not
    matmul weights); a pruned record's
    reason notes how its statistics were gathered when that is not the default.
    param: the parameter that holds the matrix (v3; None in older files: ``name + ".weight"``); expert:
    its index in a stack of experts; tokens: the calibration tokens routed to that expert; transposed:
    the parameter stores (in, out) matrices.
    recon_error: ‖X(Ŵ−W)ᵀ‖²/‖XWᵀ‖² on the calibration inputs the layer saw; gap: the solver's certified
    relative gap (transposable only); seconds: wall time of the method on this layer.
    """

    block: int
    name: str
    out_features: int
    in_features: int
    status: str
    reason: str | None = None
    recon_error: float | None = None
    density: float | None = None
    gap: float | None = None
    solver_objective: float | None = None
    solver_upper_bound: float | None = None
    solver_seconds: float | None = None
    solver_calls: int = 0
    seconds: float = 0.0
    iterations: int = 0
    safeguard_tiles: int = 0
    param: str | None = None
    expert: int | None = None
    tokens: int | None = None
    transposed: bool = False

    def to_json(self) -> dict[str, Any]:
        return _flat_json(self)

    @classmethod
    def from_json(cls, obj: Any, where: str, version: int = SCHEMA_VERSION) -> LayerRecord:
        obj = _object(obj, where)
        given: dict[str, Any] = {}
        if version == 1 and "recon_error" not in obj:
            given["recon_error"] = _typed(obj.get("reconstruction_error"), float | None, "reconstruction_error", where)
        record = cls(**_read(cls, obj, where, **given))
        if record.status not in LAYER_STATUSES:
            raise SchemaError(f"{where}: status {record.status!r} is not one of {', '.join(LAYER_STATUSES)}")
        return record


@dataclass(frozen=True)
class BlockRefinement:
    """One decoder block's refinement (`tsenor prune --refine block`, pruning/block/refine.py).

    error_before / error_after: the block output's relative squared error against the dense block's
    output on the dense inputs, Σ‖f(x)−y‖²/Σ‖y‖² over the calibration samples, with the pruned weights
    and with the refined ones; kept: the refined weights were kept (they lowered the error), else the
    pruned weights stayed; steps: Adam steps taken; seconds: wall time of the block's refinement.
    mask_solves, mask_seconds, mask_changed (`--refine-mask-every`, pruning/block/joint.py; 0 with the mask
    fixed): the re-solves of the block's masks, their seconds, and how many kept positions they moved
    (summed over the re-solves).
    """

    block: int
    error_before: float
    error_after: float
    kept: bool
    steps: int
    seconds: float
    mask_solves: int = 0
    mask_seconds: float = 0.0
    mask_changed: int = 0

    def to_json(self) -> dict[str, Any]:
        return _flat_json(self)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> BlockRefinement:
        return cls(**_read(cls, _object(obj, where), where))


@dataclass(frozen=True)
class PruneReport:
    """``tsenor_report.json``: how the model was pruned and the per-layer records.

    settings: the run's result-deciding settings (`PruneConfig.result_fields`) plus device and seqlen.
    calibration: a description of the calibration text; calibration_source: where it came from.
    seconds: the whole run's wall time; output: the checkpoint folder; command: the command line.
    model_params / model_nonzero: entries and nonzero entries of every parameter of the written model
    (tied weights once); linear_params / linear_nonzero: the same over the decoder blocks' linear weights.
    The file's ``totals`` are computed from these (`totals()`), not stored separately.
    phases: wall seconds per phase of the run (`phases.PHASES`), each exclusive of those nested in it, so that
    with what is left (`seconds` minus their sum, "other") they add up to `seconds`.
    found_finished: the report was read back from a finished run's folder by a rerun of its command (a no-op
    that wrote nothing: `runfiles.output.finished_run`); not a field of the file.
    """

    method: str
    pattern: SparsityPattern | None
    sparsity: float
    settings: dict[str, Any]
    layers: tuple[LayerRecord, ...]
    calibration: str
    seconds: float
    output: str | None
    command: str | None
    versions: dict[str, str]
    resumed_from_block: int | None = None
    calibration_source: DataSource | None = None
    context: ContextRecord | None = None
    model_params: int | None = None
    model_nonzero: int | None = None
    linear_params: int | None = None
    linear_nonzero: int | None = None
    refinement: tuple[BlockRefinement, ...] = ()
    phases: dict[str, float] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    found_finished: bool = field(default=False, compare=False)

    @property
    def result_hash(self) -> str | None:
        """The sha256 of the result-deciding settings (`PruneConfig.result_hash`), None in a report of a
        tsenor that did not record it."""
        value = self.settings.get("result_hash")
        return value if isinstance(value, str) else None

    @property
    def pruned(self) -> list[LayerRecord]:
        return [r for r in self.layers if r.status == "pruned"]

    def totals(self) -> dict[str, Any]:
        pruned = self.pruned
        errors = [r.recon_error for r in pruned if r.recon_error is not None]
        gaps = [r.gap for r in pruned if r.gap is not None]
        return {
            "layers_pruned": len(pruned),
            "layers_skipped": sum(r.status == "skipped" for r in self.layers),
            "layers_idle": sum(r.status == "idle" for r in self.layers),
            "layers_ignored": sum(r.status == "ignored" for r in self.layers),
            "mean_recon_error": statistics.fmean(errors) if errors else None,
            "max_recon_error": max(errors) if errors else None,
            "max_gap": max(gaps) if gaps else None,
            "mean_gap": statistics.fmean(gaps) if gaps else None,
            "method_seconds": sum(r.seconds for r in pruned),
            "solver_seconds": sum(r.solver_seconds or 0.0 for r in pruned),
            "total_seconds": self.seconds,
            "admm_iterations": sum(r.iterations for r in pruned),
            "safeguard_tiles": sum(r.safeguard_tiles for r in pruned),
            "model_params": self.model_params,
            "model_nonzero": self.model_nonzero,
            "model_density": _ratio(self.model_nonzero, self.model_params),
            "linear_params": self.linear_params,
            "linear_nonzero": self.linear_nonzero,
            "linear_density": _ratio(self.linear_nonzero, self.linear_params),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            # The summary `tsenor report` reads first (docs/reference/run-files.md).
            "method": self.method,
            "pattern": self.pattern.report_json() if self.pattern is not None else None,
            "sparsity": self.sparsity,
            "settings": self.settings,
            "calibration": self.calibration,
            "calibration_source": self.calibration_source.to_json() if self.calibration_source is not None else None,
            "context": _flat_json(self.context) if self.context is not None else None,
            "output": self.output,
            "command": self.command,
            "versions": self.versions,
            "resumed_from_block": self.resumed_from_block,
            "totals": self.totals(),
            "layers": [r.to_json() for r in self.layers],
            "refinement": [r.to_json() for r in self.refinement],
            "phases": self.phases,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = PRUNE_FILE) -> PruneReport:
        obj = _object(obj, where)
        version = _version(obj, where)
        totals = _object(_field(obj, "totals", dict, where), f"{where}: totals")
        raw_pattern = _field(obj, "pattern", dict | None, where)
        raw_layers = _field(obj, "layers", list, where)
        report = cls(
            **_read(
                cls,
                obj,
                where,
                schema_version=version,
                found_finished=False,
                pattern=SparsityPattern.from_report_json(raw_pattern, f"{where}: pattern")
                if raw_pattern is not None
                else None,
                layers=tuple(
                    LayerRecord.from_json(layer, f"{where}: layers[{i}]", version) for i, layer in enumerate(raw_layers)
                ),
                seconds=_field(totals, "total_seconds", float, f"{where}: totals"),
                model_params=_typed(totals.get("model_params"), int | None, "model_params", f"{where}: totals"),
                model_nonzero=_typed(totals.get("model_nonzero"), int | None, "model_nonzero", f"{where}: totals"),
                linear_params=_typed(totals.get("linear_params"), int | None, "linear_params", f"{where}: totals"),
                linear_nonzero=_typed(totals.get("linear_nonzero"), int | None, "linear_nonzero", f"{where}: totals"),
                calibration_source=_optional(obj, "calibration_source", DataSource.from_json, where),
                context=_optional(obj, "context", ContextRecord.from_json, where),
                refinement=tuple(
                    BlockRefinement.from_json(block, f"{where}: refinement[{i}]")
                    for i, block in enumerate(_typed(obj.get("refinement", []), list, "refinement", where))
                ),
                phases={
                    str(name): _typed(seconds, float, f"phases.{name}", where)
                    for name, seconds in _typed(obj.get("phases", {}), dict, "phases", where).items()
                },
            )
        )
        if not 0.0 <= report.sparsity < 1.0:
            raise SchemaError(f"{where}: sparsity {report.sparsity} must lie in [0, 1)")
        return report


def _ratio(part: int | None, whole: int | None) -> float | None:
    return None if part is None or not whole else part / whole


# ---------------------------------------------------------------- tsenor_sparsity.json (+ config.json's summary)


@dataclass(frozen=True)
class PrunedWeight:
    """One pruned matrix of the checkpoint.

    name: its layer record's name; param: the parameter (= the checkpoint key) holding it; expert: its
    index in a stack of experts, else None; transposed: the parameter stores (in, out) matrices; shape:
    [out, in], None for a record of a checkpoint that listed module names only (the whole ``param``).
    """

    name: str
    param: str
    expert: int | None = None
    transposed: bool = False
    shape: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {**_flat_json(self), "shape": list(self.shape) if self.shape is not None else None}

    def matrix_of(self, tensor: Any) -> Any | None:
        """The (out, in) matrix this record names in `tensor`, its parameter (a torch tensor; a view where
        reshaping allows, so that writing it writes the parameter), or None when the tensor's size cannot
        hold it: the whole tensor for a module's weight; expert `expert` of a stack, (E, out, in), (E·out,
        in) or transposed (E, in, out); a transposed weight's transpose."""
        if self.shape is None:  # a module's weight, (out, in)
            return tensor
        out_features, in_features = self.shape
        stored = (in_features, out_features) if self.transposed else (out_features, in_features)
        if tensor.numel() % (stored[0] * stored[1]):
            return None
        matrix = tensor.reshape(-1, *stored)[self.expert if self.expert is not None else 0]
        return matrix.T if self.transposed else matrix

    @classmethod
    def from_json(cls, obj: Any, where: str) -> PrunedWeight:
        obj = _object(obj, where)
        shape = _typed(obj.get("shape"), list | None, "shape", where)
        if shape is not None and (len(shape) != 2 or not all(isinstance(s, int) and s > 0 for s in shape)):
            raise SchemaError(f"{where}: field 'shape' must be [out, in], got {shape!r}")
        return cls(**_read(cls, obj, where, shape=tuple(shape) if shape is not None else None))


DenseStatus = Literal["skipped", "idle", "ignored"]


@dataclass(frozen=True)
class DenseWeight:
    """A weight the run left dense: status "skipped" (the pattern does not fit), "idle" (in a block the
    model's forward does not run) or "ignored" (by choice or by a rule), with the layer record's reason
    (None in older checkpoints)."""

    name: str
    status: DenseStatus
    reason: str | None = None

    @classmethod
    def from_json(cls, obj: Any, where: str) -> DenseWeight:
        return cls(**_read(cls, _object(obj, where), where))


@dataclass(frozen=True)
class SparsityRecord:
    """A pruned checkpoint's sparsity: the pattern, how it was reached and every weight pruned or left dense.

    Written to `SPARSITY_FILE` (the whole record) with a short `summary` in config.json under
    `SPARSITY_KEY`; checkpoints of tsenor before v0.3 hold the whole record in config.json, with
    ``pruned_weights`` (v0.2) or ``pruned_modules`` only: `read_sparsity` reads all three.
    solver: the transposable solver that ran, solver_requested the one asked for ("auto"); None for
    other patterns.
    """

    method: str
    pattern: SparsityPattern
    solver: str | None
    solver_requested: str | None
    pruned: tuple[PrunedWeight, ...]
    dense: tuple[DenseWeight, ...]
    tsenor_version: str | None
    schema_version: int = SPARSITY_VERSION

    @classmethod
    def of(
        cls,
        method: str,
        pattern: SparsityPattern,
        records: Sequence[LayerRecord],
        *,
        solver: str | None,
        solver_requested: str | None,
    ) -> SparsityRecord:
        """The record of a run that pruned `records` (its layer records, every status)."""
        from tsenor_cli.version import __version__

        return cls(
            method=method,
            pattern=pattern,
            solver=solver,
            solver_requested=solver_requested,
            pruned=tuple(
                PrunedWeight(
                    r.name, r.param or f"{r.name}.weight", r.expert, r.transposed, (r.out_features, r.in_features)
                )
                for r in records
                if r.status == "pruned"
            ),
            dense=tuple(
                DenseWeight(r.name, cast(DenseStatus, r.status), r.reason) for r in records if r.status != "pruned"
            ),
            tsenor_version=__version__,
        )

    @property
    def pruned_modules(self) -> tuple[str, ...]:
        """The names of the pruned matrices (a module's name for an nn.Linear weight)."""
        return tuple(w.name for w in self.pruned)

    def summary(self) -> dict[str, Any]:
        """config.json's `SPARSITY_KEY`: the pattern, method, solver and counts, and where the record is."""
        return {
            "method": self.method,
            **self.pattern.metadata(),
            "solver": self.solver,
            "solver_requested": self.solver_requested,
            "weights_pruned": len(self.pruned),
            "weights_dense": len(self.dense),
            "record": SPARSITY_FILE,
            "tsenor_version": self.tsenor_version,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SPARSITY_VERSION,
            **{k: v for k, v in self.summary().items() if k not in ("weights_pruned", "weights_dense", "record")},
            "pruned": [w.to_json() for w in self.pruned],
            "dense": [_flat_json(w) for w in self.dense],
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = SPARSITY_FILE) -> SparsityRecord:
        obj = _object(obj, where)
        version = obj.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= SPARSITY_VERSION:
            raise SchemaError(
                f"{where}: schema_version {version!r} is not one this tsenor reads (1 to {SPARSITY_VERSION}); "
                "upgrade tsenor or re-create the run"
            )
        pruned = _field(obj, "pruned", list, where)
        dense = _field(obj, "dense", list, where)
        return cls(
            **_read(
                cls,
                obj,
                where,
                schema_version=version,
                pattern=SparsityPattern.from_metadata(obj, where),
                pruned=tuple(PrunedWeight.from_json(w, f"{where}: pruned[{i}]") for i, w in enumerate(pruned)),
                dense=tuple(DenseWeight.from_json(w, f"{where}: dense[{i}]") for i, w in enumerate(dense)),
            )
        )

    @classmethod
    def from_config(cls, meta: Mapping[str, Any], where: str) -> SparsityRecord:
        """The whole record as config.json held it before v0.3 (``pruned_weights`` entries, or
        ``pruned_modules`` names whose weight is ``<module>.weight``; the dense ones by name only)."""
        entries = meta.get("pruned_weights")
        if isinstance(entries, list):
            pruned = tuple(PrunedWeight.from_json(e, f"{where}: pruned_weights[{i}]") for i, e in enumerate(entries))
        else:
            names = _typed(meta.get("pruned_modules", []), list, "pruned_modules", where)
            pruned = tuple(PrunedWeight(str(name), f"{name}.weight") for name in names)
        dense = tuple(
            DenseWeight(str(name), status)
            for status in ("skipped", "ignored")
            for name in _typed(meta.get(f"{status}_modules", []), list, f"{status}_modules", where)
        )
        version = meta.get("tsenor_version")
        return cls(
            method=str(meta.get("method", "unknown")),
            pattern=SparsityPattern.from_metadata(meta, where),
            solver=_typed(meta.get("solver"), str | None, "solver", where),
            solver_requested=_typed(meta.get("solver_requested"), str | None, "solver_requested", where),
            pruned=pruned,
            dense=dense,
            tsenor_version=str(version) if version is not None else None,
            schema_version=0,
        )


def read_sparsity(directory: Path) -> SparsityRecord | None:
    """The sparsity record of the checkpoint in `directory`: `SPARSITY_FILE`, or the whole record in
    config.json (checkpoints before v0.3); None when config.json records no sparsity (a dense checkpoint).

    InputNotFoundError without config.json, or when config.json's summary names a record file that is
    missing; SchemaError for a file that is not a record; VerificationError when the file and config.json
    name different patterns.
    """
    config_path, record_path = directory / CONFIG_FILE, directory / SPARSITY_FILE
    if not config_path.is_file():
        raise InputNotFoundError(
            f"{directory} has no {CONFIG_FILE}; pass a checkpoint directory written by tsenor prune"
        )
    meta = read_json(config_path).get(SPARSITY_KEY)
    if meta is None:
        return None
    where = f"{config_path} {SPARSITY_KEY}"
    meta = _object(meta, where)
    if "record" not in meta:
        return SparsityRecord.from_config(meta, where)
    if not record_path.is_file():
        raise InputNotFoundError(
            f"{directory} lacks {SPARSITY_FILE}, which its {CONFIG_FILE} names; copy the whole checkpoint folder "
            f"(a model re-saved with save_pretrained: copy {SPARSITY_FILE} from the folder it was loaded from)"
        )
    record = SparsityRecord.from_json(read_json(record_path), str(record_path))
    if SparsityPattern.from_metadata(meta, where) != record.pattern:
        raise VerificationError(
            f"{record_path} ({record.pattern.label} {record.pattern.kind}) and {CONFIG_FILE} "
            f"({meta.get('pattern')} {meta.get('kind')}) record different patterns; re-run tsenor prune"
        )
    return record


# ---------------------------------------------------------------- eval.json


@dataclass(frozen=True)
class PerplexityRecord:
    """``eval.json → perplexity.<dataset>``: ppl = exp(nll_sum / tokens) over `windows` windows of
    `seqlen` (inf allowed: a diverged model); data: a description of the text; seconds: wall time."""

    ppl: float
    nll_sum: float
    tokens: int
    windows: int
    seqlen: int
    data: str
    data_source: DataSource | None
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {**_flat_json(self), "data_source": self.data_source.to_json() if self.data_source else None}

    @classmethod
    def from_json(cls, obj: Any, where: str, version: int = SCHEMA_VERSION) -> PerplexityRecord:
        obj = _object(obj, where)
        if version == 1:
            offline = _field(obj, "offline", bool, where)
            source: DataSource | None = DataSource(kind="offline" if offline else "hub")
        else:
            source = _optional(obj, "data_source", DataSource.from_json, where)
        record = cls(**_read(cls, obj, where, data_source=source))
        if math.isnan(record.ppl) or record.ppl <= 0:
            raise SchemaError(f"{where}: ppl {record.ppl} must be a positive number")
        return record


@dataclass(frozen=True)
class TaskScore:
    """One zero-shot task's lm-eval metrics (fractions in [0, 1]); acc_norm is None for tasks that do
    not define it (WinoGrande, RTE, BoolQ). doc_acc: each document's `acc` in lm-eval's document order,
    and docs_sha256: the digest of those documents (lm-eval's per-document hashes), so that two runs
    scored on the same documents are compared document by document (`report.paired`); None in files
    written before they were kept."""

    name: str
    acc: float
    acc_stderr: float | None
    acc_norm: float | None
    acc_norm_stderr: float | None
    n_samples: int
    data_source: DataSource | None
    version: str
    doc_acc: tuple[float, ...] | None = None
    docs_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        body = {k: v for k, v in _flat_json(self).items() if k not in ("name", "doc_acc")}
        return {
            **body,
            "data_source": self.data_source.to_json() if self.data_source else None,
            "doc_acc": None if self.doc_acc is None else list(self.doc_acc),
        }

    @classmethod
    def from_json(cls, name: str, obj: Any, where: str, version: int = SCHEMA_VERSION) -> TaskScore:
        obj = _object(obj, where)
        if version == 1:
            source: DataSource | None = DataSource(kind=_field(obj, "source", TaskSource, where))
        else:
            source = _optional(obj, "data_source", DataSource.from_json, where)
        score = cls(**_read(cls, obj, where, name=name, data_source=source, doc_acc=_doc_acc(obj, where)))
        for key in ("acc", "acc_norm"):
            value = getattr(score, key)
            if value is not None and not 0.0 <= value <= 1.0:
                raise SchemaError(f"{where}: {key} {value} must be a fraction in [0, 1]")
        if score.doc_acc is not None and len(score.doc_acc) != score.n_samples:
            raise SchemaError(f"{where}: doc_acc has {len(score.doc_acc)} documents, n_samples {score.n_samples}")
        return score


def _doc_acc(obj: Mapping[str, Any], where: str) -> tuple[float, ...] | None:
    """``doc_acc``: absent or null (files before it), or a list of fractions in [0, 1]."""
    values = obj.get("doc_acc")
    if values is None:
        return None
    if not isinstance(values, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0.0 <= v <= 1.0 for v in values
    ):
        raise SchemaError(f"{where}: doc_acc must be a list of fractions in [0, 1]")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class ZeroShotResult:
    """``eval.json → zeroshot``: per-task scores and the unweighted mean of `average_metric` over them.

    source: which task definitions ran ("hub": lm-eval's own, "offline": the data-folder twins).
    """

    tasks: tuple[TaskScore, ...]
    average: float
    average_metric: Literal["acc"]
    num_fewshot: int
    limit: int | float | None
    source: TaskSource
    lm_eval_version: str

    def to_json(self) -> dict[str, Any]:
        return {**_flat_json(self), "tasks": {t.name: t.to_json() for t in self.tasks}}

    @classmethod
    def from_json(cls, obj: Any, where: str, version: int = SCHEMA_VERSION) -> ZeroShotResult:
        obj = _object(obj, where)
        raw = _field(obj, "tasks", dict, where)
        metric = _field(obj, "average_metric", str, where)
        if metric != "acc":
            raise SchemaError(f"{where}: average_metric {metric!r} is not 'acc'; re-run `tsenor eval`")
        tasks = tuple(TaskScore.from_json(str(k), v, f"{where}: task {k}", version) for k, v in raw.items())
        return cls(**_read(cls, obj, where, tasks=tasks))


@dataclass(frozen=True)
class EvalReport:
    """``eval.json``: the model evaluated, perplexity per dataset and (optionally) zero-shot accuracy.

    model: what the user passed; source: the resolved folder or hub id; seconds: the whole evaluation.
    model_identity: the sha256 of the evaluated checkpoint's identity (`models.identity.identity_digest`: its
    files' sizes, times and safetensors headers, or a cached hub snapshot's commit), None where it has none
    (an embedded model) and in files written before it was recorded: what a rerun of the command compares.
    found_finished: read back by a rerun of the command that wrote it (`runfiles.output.finished_evaluation`;
    nothing evaluated or written); not a field of the file.
    """

    model: str
    source: str
    model_type: str
    dtype: str
    device: str
    seqlen: int
    max_windows: int | None
    perplexity: dict[str, PerplexityRecord]
    zeroshot: ZeroShotResult | None
    versions: dict[str, str]
    seconds: float
    command: str | None = None
    context: ContextRecord | None = None
    model_identity: str | None = None
    schema_version: int = SCHEMA_VERSION
    found_finished: bool = field(default=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            **{k: v for k, v in _flat_json(self).items() if k not in ("schema_version", "found_finished")},
            "perplexity": {name: entry.to_json() for name, entry in self.perplexity.items()},
            "zeroshot": self.zeroshot.to_json() if self.zeroshot is not None else None,
            "context": _flat_json(self.context) if self.context is not None else None,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = EVAL_FILE) -> EvalReport:
        obj = _object(obj, where)
        version = _version(obj, where)
        raw_ppl = _field(obj, "perplexity", dict, where)
        perplexity = {
            str(name): PerplexityRecord.from_json(entry, f"{where}: perplexity.{name}", version)
            for name, entry in raw_ppl.items()
        }
        raw_zs = _field(obj, "zeroshot", dict | None, where)
        return cls(
            **_read(
                cls,
                obj,
                where,
                schema_version=version,
                found_finished=False,
                perplexity=perplexity,
                zeroshot=ZeroShotResult.from_json(raw_zs, f"{where}: zeroshot", version)
                if raw_zs is not None
                else None,
                context=_optional(obj, "context", ContextRecord.from_json, where),
            )
        )


@dataclass(frozen=True)
class FinetuneReport:
    """``finetune.json`` (`tsenor finetune`). Curves are [step, value] pairs; step 0 is the pruned checkpoint.

    eval_before / eval_after: `EvalReport.to_json()` (None when nothing was evaluated).
    loss_curve: the training objective per step; with a teacher (`--teacher`) that is the
    distillation loss, and ce_curve holds the cross-entropy part (empty without a teacher, where
    loss_curve is the cross-entropy).
    tokens: tokens trained on (steps × windows per step × seqlen); epochs: passes over the windows.
    seconds_per_step: median wall time of the optimizer steps this process ran (forward, backward,
    optimizer; without evaluation, checkpoints and batch loading). pruned_nonzero: weights outside the
    mask that are nonzero after training (0 unless the mask was broken). found_finished: read back from a
    finished run's folder by a rerun of its command (a no-op that wrote nothing); not a field of the file.
    """

    settings: dict[str, Any]
    run_dir: str
    pattern: dict[str, Any]
    data: str
    data_source: dict[str, Any]
    windows: int
    steps: int
    tokens: int
    epochs: float
    world_size: int
    loss_curve: list[tuple[int, float]]
    ppl_curve: dict[str, list[tuple[int, float]]]
    eval_before: dict[str, Any] | None
    eval_after: dict[str, Any] | None
    pruned_nonzero: int
    seconds: float
    seconds_per_step: float
    resumed_from_step: int | None
    output: str
    command: str | None
    context: dict[str, Any] | None = None
    versions: dict[str, str] = field(default_factory=dict)
    ce_curve: list[tuple[int, float]] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    found_finished: bool = field(default=False, compare=False)

    def ppl(self, when: Literal["before", "after"]) -> dict[str, float]:
        """{dataset: ppl} of eval_before ("before") or eval_after ("after")."""
        record = self.eval_before if when == "before" else self.eval_after
        return {name: entry["ppl"] for name, entry in (record or {}).get("perplexity", {}).items()}

    def to_json(self) -> dict[str, Any]:
        """The file's object; ppl_before / ppl_after are derived from the evaluations (not read back)."""
        body = {k: v for k, v in _flat_json(self).items() if k not in ("schema_version", "found_finished")}
        body["loss_curve"] = [[step, value] for step, value in self.loss_curve]
        body["ce_curve"] = [[step, value] for step, value in self.ce_curve]
        body["ppl_curve"] = {name: [[s, v] for s, v in curve] for name, curve in self.ppl_curve.items()}
        return {
            "schema_version": SCHEMA_VERSION,
            **body,
            "ppl_before": self.ppl("before"),
            "ppl_after": self.ppl("after"),
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = FINETUNE_FILE) -> FinetuneReport:
        obj = _object(obj, where)
        version = _version(obj, where)
        raw_ppl = _field(obj, "ppl_curve", dict, where)
        return cls(
            **_read(
                cls,
                obj,
                where,
                schema_version=version,
                found_finished=False,
                loss_curve=_curve(_field(obj, "loss_curve", list, where), f"{where}: loss_curve"),
                ce_curve=_curve(obj.get("ce_curve", []), f"{where}: ce_curve"),
                ppl_curve={str(k): _curve(v, f"{where}: ppl_curve.{k}") for k, v in raw_ppl.items()},
            )
        )


def _curve(value: Any, where: str) -> list[tuple[int, float]]:
    """[[step, value], ...] → [(step, value), ...]; anything else is a SchemaError."""
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], int | float) for p in value
    ):
        raise SchemaError(f"{where}: expected a list of [step, value] pairs")
    return [(int(step), float(v)) for step, v in value]


# ---------------------------------------------------------------- run directories


@dataclass(frozen=True)
class Run:
    """One run directory: its eval.json and, when it was pruned, its tsenor_report.json. name: the row's
    label where the folder's name is not enough (`report.table.distinct_labels`), else None."""

    path: Path
    eval: EvalReport
    prune: PruneReport | None
    name: str | None = None

    @property
    def label(self) -> str:
        return self.name if self.name is not None else self.path.name


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
        eval=EvalReport.from_json(read_json(eval_path), str(eval_path)),
        prune=PruneReport.from_json(read_json(prune_path), str(prune_path)) if prune_path.is_file() else None,
    )


def resume_progress(run_folder: Path) -> int | None:
    """How many blocks the prune resume state in `run_folder` holds (its `next_block`), None without one."""
    data = read_json_file(run_folder / RESUME_DIR / RESUME_STATE_FILE)
    if data is None:
        return None
    blocks = data.get("next_block")
    return blocks if isinstance(blocks, int) and not isinstance(blocks, bool) else None


# ---------------------------------------------------------------- .tsenor-resume/finetune_state.json


@dataclass(frozen=True)
class FinetuneState:
    """``finetune_state.json``: the settings hash of an unfinished finetune and its evaluation before training
    (so a resumed run does not evaluate again). Files before `schema_version` wrote ``version``."""

    config_hash: str
    eval_before: dict[str, Any] | None
    schema_version: int = FINETUNE_STATE_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": FINETUNE_STATE_VERSION,
            "config_hash": self.config_hash,
            "eval_before": self.eval_before,
        }

    @classmethod
    def read(cls, state_dir: Path) -> FinetuneState | None:
        """The state in `state_dir`, None without one. Its `schema_version` is the file's (0 when it has
        none), for the caller to compare with `FINETUNE_STATE_VERSION`."""
        data = read_json_file(state_dir / FINETUNE_STATE_FILE)
        if data is None:
            return None
        version = data.get("schema_version", data.get("version"))
        return cls(
            config_hash=str(data.get("config_hash")),
            eval_before=data.get("eval_before"),
            schema_version=version if isinstance(version, int) else 0,
        )

    def write(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_json(state_dir / FINETUNE_STATE_FILE, self.to_json(), indent=1)


# ---------------------------------------------------------------- .tsenor-resume/state.json (a prune's)


def block_range(done: int) -> str:
    """The first `done` blocks for a person: "block 1", "blocks 1-3" (never "blocks 1-1")."""
    return "block 1" if done == 1 else f"blocks 1-{done}"


def block_file(index: int) -> str:
    """The resume state's file of block `index`'s pruned parameters."""
    return f"block_{index:04d}.safetensors"


def hidden_file(index: int) -> str:
    """The resume state's file of the hidden states leaving block `index`."""
    return f"hidden_{index:04d}.safetensors"


@dataclass(frozen=True)
class ResumeState:
    """``.tsenor-resume/state.json``: a prune's commit point, blocks 0..next_block-1 done.

    config_hash: the settings it belongs to; hidden: the file holding the (S, T, H) input of block
    next_block, None once every block is done; files: {file name: size in bytes} of every file the state
    relies on; records: the layer records so far; calibration: the calibration's description and
    calibration_source its `DataSource`; refinement: the records of the blocks refined so far
    (`--refine block`); digests: {file name: sha256} of the same files.
    """

    config_hash: str
    next_block: int
    blocks: int
    hidden: str | None
    files: dict[str, int]
    records: list[LayerRecord]
    calibration: str
    calibration_source: DataSource
    refinement: tuple[BlockRefinement, ...] = ()
    digests: dict[str, str] = field(default_factory=dict)
    schema_version: int = PRUNE_STATE_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": PRUNE_STATE_VERSION,
            "config_hash": self.config_hash,
            "next_block": self.next_block,
            "blocks": self.blocks,
            "hidden": self.hidden,
            "files": self.files,
            "records": [asdict(record) for record in self.records],
            "calibration": self.calibration,
            "calibration_source": self.calibration_source.to_json(),
            "refinement": [block.to_json() for block in self.refinement],
            "digests": self.digests,
        }

    @staticmethod
    def version_of(raw: Mapping[str, Any]) -> Any:
        """The format version `raw` says it has (``schema_version``, or ``version`` as written before it)."""
        return raw.get("schema_version", raw.get("version"))

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> ResumeState:
        """The state in `raw`; SchemaError naming `where` when a field is missing or mistyped."""
        try:
            return cls(
                config_hash=str(raw["config_hash"]),
                next_block=int(raw["next_block"]),
                blocks=int(raw["blocks"]),
                hidden=None if raw["hidden"] is None else str(raw["hidden"]),
                files={str(name): int(size) for name, size in dict(raw["files"]).items()},
                records=[LayerRecord(**record) for record in raw["records"]],
                calibration=str(raw["calibration"]),
                calibration_source=DataSource.from_json(raw["calibration_source"], where),
                refinement=tuple(BlockRefinement.from_json(block, where) for block in raw.get("refinement", [])),
                digests={str(name): str(digest) for name, digest in dict(raw["digests"]).items()},
                schema_version=int(cls.version_of(raw)),
            )
        except SchemaError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise SchemaError(f"{where} lacks or mistypes {exc}") from exc
