"""`PruneConfig`: the frozen description of one pruning run, built by the CLI (or by library users)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from tsenor_cli.errors import UsageError
from tsenor_cli.fields import default_of, validate_settings
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.settings.table import FIELDS, PRUNE_FIELDS

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.methods.method_options import MethodOptions


# Declared with the other settings (pruning/settings/table.PRUNE_FIELDS); the defaults were chosen by the pilot of
# docs/results.md ("Block refinement: pilot").
REFINE_MODES: tuple[str, ...] = tuple(FIELDS["refine"].choice_list() or ())
DEFAULT_EPOCHS: int = FIELDS["refine_epochs"].default
DEFAULT_LR: float = FIELDS["refine_lr"].default
DEFAULT_MASK_EVERY: int = FIELDS["refine_mask_every"].default
REFINE_REGIONS: tuple[str, ...] = tuple(FIELDS["refine_regions"].choice_list() or ())
REFINE_SCHEDULES: tuple[str, ...] = tuple(FIELDS["refine_schedule"].choice_list() or ())
REFINE_DTYPES: tuple[str, ...] = tuple(FIELDS["refine_dtype"].choice_list() or ())
# Samples per Adam step: a setting, never derived from the number of processes, so that a run's steps
# are the same with any --nproc.
SAMPLES_PER_STEP: int = FIELDS["refine_samples_per_step"].default


@dataclass(frozen=True)
class RefineConfig:
    """mode: "none" (default) or "block"; epochs: passes over the calibration samples per block; lr:
    Adam's learning rate; mask_every: 0 (the mask fixed) or re-solve the masks every that many Adam steps
    (pruning/block/joint.py) with `pattern` and `solver`, the run's own; regions: "block" (train towards the
    block's output) or "sub-blocks" (each region in turn towards the dense residual stream after it,
    pruning/block/regions.py); samples_per_step: calibration samples per Adam step; schedule: "constant"
    or "cosine" (the learning rate along a half cosine from `lr` towards 0 over each stage's steps); dtype:
    "fp32" or "bf16" (the forwards and backwards under bf16 autocast, `refine.py`)."""

    mode: str = "none"
    epochs: int = DEFAULT_EPOCHS
    lr: float = DEFAULT_LR
    mask_every: int = DEFAULT_MASK_EVERY
    regions: str = "block"
    samples_per_step: int = SAMPLES_PER_STEP
    schedule: str = "constant"
    dtype: str = "fp32"
    # The run's own pattern and solver (not settings of their own: the run's result fields hold them).
    pattern: SparsityPattern | None = field(default=None, compare=False)
    solver: str = field(default="auto", compare=False)

    def __post_init__(self) -> None:
        if self.mode not in REFINE_MODES:
            raise UsageError(f"--refine {self.mode!r} is not one of {', '.join(REFINE_MODES)}; use none or block")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise UsageError(f"--refine-epochs {self.epochs} must be a whole number >= 1 (default {DEFAULT_EPOCHS})")
        if isinstance(self.lr, bool) or not math.isfinite(self.lr) or self.lr <= 0:
            raise UsageError(f"--refine-lr {self.lr} must be a positive number (default {DEFAULT_LR:g})")
        if isinstance(self.mask_every, bool) or not isinstance(self.mask_every, int) or self.mask_every < 0:
            raise UsageError(f"--refine-mask-every {self.mask_every} must be a whole number >= 0 (0: the mask fixed)")
        if self.mask_every and (self.pattern is None or self.pattern.kind == "unstructured"):
            raise UsageError("--refine-mask-every needs an N:M pattern (--nm N:M)")
        if self.regions not in REFINE_REGIONS:
            raise UsageError(f"--refine-regions {self.regions!r} is not one of {', '.join(REFINE_REGIONS)}")
        per_step = self.samples_per_step
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
            raise UsageError(
                f"--refine-samples-per-step {self.samples_per_step} must be a whole number >= 1 "
                f"(default {SAMPLES_PER_STEP})"
            )
        if self.schedule not in REFINE_SCHEDULES:
            raise UsageError(f"--refine-schedule {self.schedule!r} is not one of {', '.join(REFINE_SCHEDULES)}")
        if self.dtype not in REFINE_DTYPES:
            raise UsageError(f"--refine-dtype {self.dtype!r} is not one of {', '.join(REFINE_DTYPES)}")
        if self.mask_every and self.regions != "block":
            # A region's stage freezes the other regions' weights, whose masks a re-solve would still move.
            raise UsageError("--refine-mask-every needs --refine-regions block; drop one of the two")

    @property
    def on(self) -> bool:
        return self.mode != "none"

    @property
    def streams(self) -> int:
        """The dense (S_r, T, H) streams the run holds beside the pruned one: the dense stream, and with
        sub-blocks the dense values at the block's region boundary (one in every family observed)."""
        return 0 if not self.on else 1 if self.regions == "block" else 2

    def result_fields(self) -> dict[str, object]:
        fields: dict[str, object] = {"mode": self.mode, "epochs": self.epochs, "lr": self.lr}
        fields["samples_per_step"] = self.samples_per_step
        fields |= {"mask_every": self.mask_every} if self.mask_every else {}
        # Absent when constant: runs made before the setting existed keep their resume key.
        fields |= {"schedule": self.schedule} if self.schedule != "constant" else {}
        fields |= {"dtype": self.dtype} if self.dtype != "fp32" else {}
        return fields | ({"regions": self.regions} if self.regions != "block" else {})


@dataclass(frozen=True)
class DistillConfig:
    """The whole-model distillation after the prune (`tsenor_cli/compress.py`, `--distill-steps`): steps (0:
    off), lr, warmup, batch_size (windows a step), dtype ("fp32" or "bf16" autocast), freeze_embeddings,
    save_every (its resume state every K steps; 0: none). The teacher is the run's model, the windows are
    --seqlen tokens of the calibration text drawn with the run's seed. Not part of the prune's result
    fields: the pruned checkpoint before it is the run without it, and the distillation's own record
    (finetune.json) keys the rest."""

    steps: int = default_of(PRUNE_FIELDS, "distill_steps")
    lr: float = default_of(PRUNE_FIELDS, "distill_lr")
    warmup: int = default_of(PRUNE_FIELDS, "distill_warmup")
    batch_size: int = default_of(PRUNE_FIELDS, "distill_batch_size")
    dtype: str = default_of(PRUNE_FIELDS, "distill_dtype")
    freeze_embeddings: bool = default_of(PRUNE_FIELDS, "distill_freeze_embeddings")
    save_every: int = default_of(PRUNE_FIELDS, "distill_save_every")

    def __post_init__(self) -> None:
        if self.on and self.warmup > self.steps:
            raise UsageError(
                f"--distill-warmup {self.warmup} exceeds --distill-steps {self.steps}; pass fewer warm-up steps"
            )

    @property
    def on(self) -> bool:
        return self.steps > 0


@dataclass(frozen=True)
class PruneConfig:
    """Everything `prune_model` needs.

    model: embedded name, local checkpoint folder or hub id; calib_data: c4 | wikitext2 | ptb | a file.
    seqlen is capped by the model's context length. output None is only valid for a dry run.
    matrix: what pruning each weight matrix reads, the same for every matrix (pattern, solver, the
      method's options: dampening, the ALPS schedule).
    ignore / targets: patterns on full module names (globs, or `re:` regexes) of the linears to leave
    dense / to restrict pruning to (`tsenor_cli.pruning.settings.selection`); empty targets means all.
    command: the command line, recorded in the report.
    offload_activations: keep the calibration activations on the CPU between blocks and move one sample
    at a time to the device (same result, less device memory); not a result field.
    moe_calibration / moe_min_tokens: how expert matrices get their statistics (gather.MoeOptions).
    stream: read each decoder block from the checkpoint's safetensors when the loop reaches it, and write
    the output from the pruned blocks' files (host memory of one block, not one model; pruning/run/writer.py);
    max_shard_size: the output's safetensors shard size ("2GB"; `models.saving.parse_size`). Neither is a
    result field: both give the same weights. save_format: dense, or packed (`tsenor_cli.packed`), not a
    result field either.
    refine: block-wise reconstruction after each block is pruned (pruning/block/refine.py); off by default.
    distill: the whole-model distillation after the prune (`DistillConfig`); off by default.
    resume: save a resume state after each block and continue an interrupted run of the same
    settings found in `output` (runfiles/resume.py); False saves none. force: replace a tsenor run
    in `output`, and discard a resume state that is damaged or from other settings.
    """

    model: str
    matrix: MatrixPruneConfig
    method: str = default_of(PRUNE_FIELDS, "method")
    calib_data: str = default_of(PRUNE_FIELDS, "calib_data")
    nsamples: int = default_of(PRUNE_FIELDS, "nsamples")
    seqlen: int = default_of(PRUNE_FIELDS, "seqlen")
    seed: int = default_of(PRUNE_FIELDS, "seed")
    dtype: str | None = None  # the recipe's "auto" is None here
    device: str = default_of(PRUNE_FIELDS, "device")
    trust_remote_code: bool = default_of(PRUNE_FIELDS, "trust_remote_code")
    sequential: bool = default_of(PRUNE_FIELDS, "sequential")
    loss_aware: float = default_of(PRUNE_FIELDS, "loss_aware")
    loss_aware_fraction: float = default_of(PRUNE_FIELDS, "loss_aware_fraction")
    skip_incompatible: bool = default_of(PRUNE_FIELDS, "skip_incompatible")
    ignore: tuple[str, ...] = default_of(PRUNE_FIELDS, "ignore")
    targets: tuple[str, ...] = default_of(PRUNE_FIELDS, "targets")
    output: Path | None = None
    force: bool = False
    resume: bool = True
    command: str | None = None
    offload_activations: bool = default_of(PRUNE_FIELDS, "offload_activations")
    moe_calibration: str = default_of(PRUNE_FIELDS, "moe_calibration")
    moe_min_tokens: int | None = default_of(PRUNE_FIELDS, "moe_min_tokens")
    stream: bool = default_of(PRUNE_FIELDS, "stream")
    max_shard_size: str = default_of(PRUNE_FIELDS, "max_shard_size")
    save_format: str = default_of(PRUNE_FIELDS, "save_format")
    refine: RefineConfig = field(default_factory=RefineConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        """Each setting's own checks (`table.PRUNE_FIELDS`), the solver's, and the method's options."""
        validate_settings(self)
        FIELDS["solver"].validate(self.matrix.solver)
        spec = get_pruner(self.method)
        if self.matrix.options is not None and not isinstance(self.matrix.options, spec.options):
            raise UsageError(
                f"{type(self.matrix.options).__name__} are not the options of --method {self.method}; "
                f"pass {spec.options.__name__}"
            )

    @property
    def curvature_samples(self) -> int:
        """The calibration samples `--loss-aware`'s pass reads, the first ⌈loss_aware_fraction · nsamples⌉
        (the first of a shuffled draw: `data/calibration.py`)."""
        return max(1, math.ceil(self.loss_aware_fraction * self.nsamples))

    def check_samples(self, processes: int, ran_as: str) -> None:
        """UsageError when a phase would leave a process without a calibration sample: the blocks' loop
        shares --nsamples among the processes, `--loss-aware`'s pass its own samples. ran_as: how the
        processes were asked for, for the message ("--nproc 4")."""
        if self.nsamples < processes:
            raise UsageError(
                f"--nsamples {self.nsamples} is fewer than {ran_as}; pass at least one calibration sample per process"
            )
        if self.loss_aware and self.curvature_samples < processes:
            raise UsageError(
                f"--loss-aware-fraction {self.loss_aware_fraction:g} leaves the loss pass {self.curvature_samples} "
                f"samples, fewer than {ran_as}; pass a fraction of at least {processes / self.nsamples:.3g}"
            )

    @property
    def options_kind(self) -> type[MethodOptions]:
        """The options dataclass of this run's method."""
        return get_pruner(self.method).options

    @property
    def pattern(self) -> SparsityPattern:
        return self.matrix.pattern

    def solver_that_runs(self, device: torch.device) -> str | None:
        """The transposable mask solver that runs on `device`: `layer.solver`, or for "auto" the method it
        picks there (solver/auto.py); None for patterns that need no solver."""
        if not self.pattern.transposable:
            return None
        from tsenor_cli.solver import resolve_method

        return resolve_method(self.matrix.solver, device, self.pattern.m).name

    def result_fields(self) -> dict[str, object]:
        """The fields that decide the pruned weights (what a resumed run must share). `refine` only when on,
        so runs without it keep the hash they had before it existed."""
        refine = {"refine": self.refine.result_fields()} if self.refine.on else {}
        # The table's result fields carried by this dataclass (PRUNE_FIELDS, `Field.result`).
        settings = {
            item.name: _plain(getattr(self, item.name))
            for item in fields(self)
            if item.metadata.get("setting") is not None and item.metadata["setting"].result
        }
        if not self.loss_aware:  # off: the hash runs had before the setting existed
            settings.pop("loss_aware")
        if not self.loss_aware or self.curvature_samples == self.nsamples:  # all samples: the hash before it
            settings.pop("loss_aware_fraction")
        pattern = self.pattern
        return {
            "model": self.model,
            "dtype": self.dtype,
            "layer": {"solver": self.matrix.solver, "options": self.matrix.method_options(self.options_kind).to_dict()},
            "pattern": {"kind": pattern.kind, "n": pattern.n, "m": pattern.m, "sparsity": pattern.sparsity},
            **settings,
            **refine,
        }

    def result_hash(self) -> str:
        """sha256 of `result_fields` and the input checkpoint's identity (`models/identity.checkpoint_identity`: its
        files' sizes, times and safetensors headers), the key of a resume state and of a finished run: a
        checkpoint replaced at the same path is another input, whose run is neither continued nor taken
        for done."""
        from tsenor_cli.models.identity import checkpoint_identity

        identity = checkpoint_identity(self.model)
        key = self.result_fields() if identity is None else {**self.result_fields(), "model_identity": identity}
        blob = json.dumps(key, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()


def _plain(value: object) -> object:
    """A setting's value as JSON has it (the ignore/targets tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value
