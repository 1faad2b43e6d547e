"""`FinetuneConfig`: one fine-tuning run, its settings declared once in `FINETUNE_FIELDS`.

The `tsenor finetune` flags are generated from the same table (`cli/options.with_fields`), and the
dataclass's defaults and checks come from it (`fields.default_of`, `fields.validate_settings`). No
torch here: `tsenor --help` reads it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tsenor_cli.data.sources import DATASET_NAMES, DatasetName
from tsenor_cli.errors import UsageError
from tsenor_cli.fields import Field, default_of, validate_settings
from tsenor_cli.kernels import KERNELS
from tsenor_cli.pruning.settings.table import FIELDS as PRUNE


def _check_share(value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise UsageError(
            f"--distill-weight {value} must be in (0, 1] (1: distillation only; drop --teacher for plain fine-tuning)"
        )


TRAIN, DATA, DISTILL, MODEL = "Training", "Data", "Distillation (--teacher)", "Model"
# `--data calibration`: the pruning run's own calibration windows, made again from what its report
# records (finetune/data.calibration_windows); `--seqlen` does not apply to them.
CALIBRATION_DATA = "calibration"
FINETUNE_FIELDS: tuple[Field, ...] = (
    Field("data", str, "c4", "Training text: c4, wikitext2, ptb, a text/jsonl file, or calibration (the prune's "
          "own calibration windows).", DATA),
    Field("seqlen", int, 512, "Tokens per training window (--data calibration: the prune's --seqlen).", DATA,
          minimum=2),
    Field("max_steps", int, 200, "Optimizer steps.", TRAIN, minimum=1),
    Field("lr", float, 2e-5, "Peak learning rate (AdamW, linear decay to 0).", TRAIN, positive=True),
    Field("batch_size", int, 4, "Windows per micro-batch (per process).", TRAIN, minimum=1),
    Field("grad_accum", int, 1, "Micro-batches per optimizer step.", TRAIN, minimum=1),
    Field("warmup", int, 0, "Linear warm-up steps.", TRAIN, minimum=0),
    Field("seed", int, 0, "Seed of the document order, data order and Trainer.", TRAIN),
    Field("dtype", str, "fp32", "Compute dtype: fp32, or bf16 autocast (weights stay fp32 while training).", MODEL,
          choices=("fp32", "bf16")),
    PRUNE["device"],  # the same settings as prune's: one flag, help and default
    PRUNE["trust_remote_code"],
    KERNELS,  # the same setting as eval's
    PRUNE["max_shard_size"],  # the output's shards, as the prune's
    Field("freeze_embeddings", bool, False, "Keep the input embeddings and the output layer fixed (they are not "
          "pruned): train the decoder blocks only.", TRAIN),
    Field("eval_every", int, 0, "Perplexity every K steps (0: before/after).", TRAIN, minimum=0),
    Field("save_every", int, 100, "Checkpoint for --resume every K steps (0: never).", TRAIN, minimum=0,
          result=False),
    Field("teacher", str, None, "Distil from this dense model (the one pruned): hub id, folder or embedded name.",
          DISTILL),
    Field("distill_weight", float, 1.0, "Share of the distillation loss; the rest is cross-entropy.", DISTILL,
          check=_check_share),
    Field("distill_temperature", float, 1.0, "Softmax temperature of the distillation loss.", DISTILL,
          positive=True),
    Field("distill_hidden", float, 0.0, "Weight of a term matching every layer's output to the teacher's "
          "(normalized squared error, SquareHead); 0: off.", DISTILL, minimum=0.0),
)  # fmt: skip


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tuning run. data: c4 | wikitext2 | ptb | a text file; seqlen: training window length.

    Each optimizer step sees batch_size × grad_accum windows per process. eval_every K > 0 adds the
    perplexity of `ppl_datasets` every K steps to the curve (0: before and after only). save_every K > 0
    writes Trainer's checkpoint every K steps into OUTPUT/.tsenor-resume/ (0: never; then `resume`
    has nothing to continue from). device: cpu or cuda (Trainer's; under torchrun, each rank's GPU).
    dtype: fp32, or bf16 autocast with fp32 master weights. trust_remote_code: run the checkpoint's (and
    the teacher's) own model code (config.json auto_map). kernels: "sparse" trains the 2:4-pruned linears
    on the GPU's sparse tensor cores under bf16 autocast (`kernels/sparse.py`). max_shard_size: the output's
    largest safetensors shard ("2GB", as the prune's).
    """

    run_dir: Path
    output: Path
    data: str = default_of(FINETUNE_FIELDS, "data")
    seqlen: int = default_of(FINETUNE_FIELDS, "seqlen")
    max_steps: int = default_of(FINETUNE_FIELDS, "max_steps")
    lr: float = default_of(FINETUNE_FIELDS, "lr")
    batch_size: int = default_of(FINETUNE_FIELDS, "batch_size")
    grad_accum: int = default_of(FINETUNE_FIELDS, "grad_accum")
    warmup: int = default_of(FINETUNE_FIELDS, "warmup")
    seed: int = default_of(FINETUNE_FIELDS, "seed")
    dtype: str = default_of(FINETUNE_FIELDS, "dtype")
    ppl_datasets: tuple[DatasetName, ...] = DATASET_NAMES
    max_windows: int | None = None
    tasks: tuple[str, ...] = ()
    limit: int | float | None = None
    freeze_embeddings: bool = default_of(FINETUNE_FIELDS, "freeze_embeddings")
    eval_every: int = default_of(FINETUNE_FIELDS, "eval_every")
    save_every: int = default_of(FINETUNE_FIELDS, "save_every")
    device: str = default_of(FINETUNE_FIELDS, "device")
    trust_remote_code: bool = default_of(FINETUNE_FIELDS, "trust_remote_code")
    kernels: str = default_of(FINETUNE_FIELDS, "kernels")
    max_shard_size: str = default_of(FINETUNE_FIELDS, "max_shard_size")
    teacher: str | None = default_of(FINETUNE_FIELDS, "teacher")
    distill_weight: float = default_of(FINETUNE_FIELDS, "distill_weight")
    distill_temperature: float = default_of(FINETUNE_FIELDS, "distill_temperature")
    distill_hidden: float = default_of(FINETUNE_FIELDS, "distill_hidden")
    force: bool = False
    resume: bool = False
    command: str | None = None

    @property
    def bf16(self) -> bool:
        """Train under bf16 autocast."""
        return self.dtype == "bf16"

    def __post_init__(self) -> None:
        """Each setting's own checks (`FINETUNE_FIELDS`), then the checks across settings."""
        validate_settings(self)
        if self.warmup > self.max_steps:
            raise UsageError(f"--warmup {self.warmup} exceeds --max-steps {self.max_steps}; pass fewer warm-up steps")
        unknown = [d for d in self.ppl_datasets if d not in DATASET_NAMES]
        if unknown:
            raise UsageError(f"unknown --ppl dataset(s) {', '.join(unknown)}; use {','.join(DATASET_NAMES)} or none")
        if self.eval_every and not self.ppl_datasets:
            raise UsageError("--eval-every needs perplexity datasets; pass --ppl wikitext2 or drop --eval-every")
        if self.max_windows is not None and self.max_windows < 1:
            raise UsageError(f"--max-windows {self.max_windows} must be positive")
        if self.device not in ("cpu", "cuda"):
            raise UsageError(
                f"--device {self.device!r}: use cpu or cuda (pick GPUs with CUDA_VISIBLE_DEVICES, or torchrun)"
            )
        if self.teacher is None and (
            self.distill_weight != 1.0 or self.distill_temperature != 1.0 or self.distill_hidden != 0.0
        ):
            raise UsageError(
                "--distill-weight/--distill-temperature/--distill-hidden need --teacher; pass the dense model"
            )

    def result_fields(self) -> dict[str, Any]:
        """What decides the fine-tuned weights and the recorded curves (what a resumed run must share);
        `freeze_embeddings` only when set, so that the runs before it keep their hash."""
        frozen = {"freeze_embeddings": True} if self.freeze_embeddings else {}
        return {
            **frozen,
            "run_dir": str(self.run_dir.resolve()),
            "data": self.data,
            "seqlen": self.seqlen,
            "max_steps": self.max_steps,
            "lr": self.lr,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "warmup": self.warmup,
            "seed": self.seed,
            "bf16": self.bf16,
            "ppl_datasets": list(self.ppl_datasets),
            "max_windows": self.max_windows,
            "tasks": list(self.tasks),
            "limit": self.limit,
            "eval_every": self.eval_every,
            "teacher": self.teacher,
            "distill_weight": self.distill_weight,
            "distill_temperature": self.distill_temperature,
            "distill_hidden": self.distill_hidden,
        }

    def result_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.result_fields(), sort_keys=True).encode()).hexdigest()
