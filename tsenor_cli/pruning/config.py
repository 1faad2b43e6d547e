"""`PruneConfig`: the frozen description of one pruning run, built by the CLI (or by library users)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tsenor_cli.errors import UsageError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.output import MAX_SHARD_SIZE
from tsenor_cli.pruning.refine import RefineConfig
from tsenor_cli.pruning.registry import get_pruner
from tsenor_cli.pruning.selection import check_patterns
from tsenor_cli.pruning.types import LayerPruneConfig

if TYPE_CHECKING:
    import torch


MOE_CALIBRATIONS = ("routed", "all")


@dataclass(frozen=True)
class PruneConfig:
    """Everything `prune_model` needs.

    model: embedded name, local checkpoint folder or hub id; calib_data: c4 | wikitext2 | ptb | a file.
    seqlen is capped by the model's context length. output None is only valid for a dry run.
    layer: the per-layer method options (pattern, solver, dampening, ALPS schedule).
    ignore / targets: patterns on full module names (globs, or `re:` regexes) of the linears to leave
    dense / to restrict pruning to (`tsenor_cli.pruning.selection`); empty targets means all.
    command: the command line, recorded in the report.
    offload_activations: keep the calibration activations on the CPU between blocks and move one sample
    at a time to the device (same result, less device memory); not a result field.
    moe_calibration / moe_min_tokens: how expert matrices get their statistics (gather.MoeOptions).
    stream: read each decoder block from the checkpoint's safetensors when the loop reaches it, and write
    the output from the pruned blocks' files (host memory of one block, not one model; pruning/writer.py);
    max_shard_size: the output's safetensors shard size ("2GB"; `models.saving.parse_size`). Neither is a
    result field: both give the same weights.
    refine: block-wise reconstruction after each block is pruned (pruning/refine.py); off by default.
    resume: save a resume state after each block and continue an interrupted run of the same
    settings found in `output` (pruning/resume.py); False saves none. force: replace a tsenor run
    in `output`, and discard a resume state that is damaged or from other settings.
    """

    model: str
    layer: LayerPruneConfig
    method: str = "alps"
    calib_data: str = "c4"
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    dtype: str | None = None
    device: str = "cpu"
    trust_remote_code: bool = False
    sequential: bool = True
    skip_incompatible: bool = False
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    output: Path | None = None
    force: bool = False
    resume: bool = True
    command: str | None = None
    offload_activations: bool = False
    moe_calibration: str = "routed"
    moe_min_tokens: int | None = None
    stream: bool = True
    max_shard_size: str = MAX_SHARD_SIZE
    refine: RefineConfig = field(default_factory=RefineConfig)

    def __post_init__(self) -> None:
        get_pruner(self.method)
        from tsenor_cli.solver import METHODS

        if self.layer.solver not in METHODS:
            raise UsageError(f"unknown --solver {self.layer.solver!r}; choose one of: {', '.join(METHODS)}")
        if self.nsamples < 1:
            raise UsageError(f"--nsamples {self.nsamples} must be >= 1; the paper uses 128")
        if self.seqlen < 1:
            raise UsageError(f"--seqlen {self.seqlen} must be >= 1; the paper uses 2048")
        if self.moe_calibration not in MOE_CALIBRATIONS:
            raise UsageError(
                f"--moe-calibration {self.moe_calibration!r} is not one of {', '.join(MOE_CALIBRATIONS)}; "
                "use routed (default) or all"
            )
        if self.moe_min_tokens is not None and self.moe_min_tokens < 1:
            raise UsageError(f"--moe-min-tokens {self.moe_min_tokens} must be >= 1 (default: the input dimension)")
        from tsenor_cli.models.saving import parse_size

        parse_size(self.max_shard_size)
        check_patterns(self.ignore, "--ignore")
        check_patterns(self.targets, "--targets")

    @property
    def pattern(self) -> SparsityPattern:
        return self.layer.pattern

    def solver_that_runs(self, device: torch.device) -> str | None:
        """The transposable mask solver that runs on `device`: `layer.solver`, or for "auto" the method it
        picks there (solver/auto.py); None for patterns that need no solver."""
        if not self.pattern.transposable:
            return None
        from tsenor_cli.solver import resolve_method

        return resolve_method(self.layer.solver, device, self.pattern.m).name

    def result_fields(self) -> dict[str, object]:
        """The fields that decide the pruned weights (what a resumed run must share). `refine` only when on,
        so runs without it keep the hash they had before it existed."""
        refine = {"refine": self.refine.result_fields()} if self.refine.on else {}
        return {
            "model": self.model,
            "layer": {k: getattr(self.layer, k) for k in self.layer.__dataclass_fields__ if k != "pattern"},
            "pattern": {
                "kind": self.pattern.kind,
                "n": self.pattern.n,
                "m": self.pattern.m,
                "sparsity": self.pattern.sparsity,
            },
            "method": self.method,
            "calib_data": self.calib_data,
            "nsamples": self.nsamples,
            "seqlen": self.seqlen,
            "seed": self.seed,
            "dtype": self.dtype,
            "sequential": self.sequential,
            "skip_incompatible": self.skip_incompatible,
            "ignore": list(self.ignore),
            "targets": list(self.targets),
            "moe_calibration": self.moe_calibration,
            "moe_min_tokens": self.moe_min_tokens,
            **refine,
        }

    def result_hash(self) -> str:
        """sha256 of `result_fields`, the key of a resume state."""
        blob = json.dumps(self.result_fields(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()
