"""The pruned checkpoint's contents: its sparsity record, reports and model card, handed to the run folder's
writer (`runfiles.write.write_model_folder`) with the model's files (`models.saving.save_model`).

The output folder's life (checks, lock, recovery, interruption) is `runfiles/output.py`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tsenor_cli.errors import OutputExistsError
from tsenor_cli.models.saving import SavedModel, save_model
from tsenor_cli.packed.files import declares_packed
from tsenor_cli.pruning.run.card import card_text
from tsenor_cli.pruning.settings.table import FIELDS
from tsenor_cli.report.markdown import prune_markdown
from tsenor_cli.runfiles import MODEL_CARD, PRUNE_FILE, PRUNE_MARKDOWN, LayerRecord, PruneReport, SparsityRecord
from tsenor_cli.runfiles.output import finished_run
from tsenor_cli.runfiles.write import write_model_folder

if TYPE_CHECKING:
    from tsenor_cli.pruning.settings.config import PruneConfig

# The output's default shard size (`--max-shard-size`): transformers' own default is 50GB; tsenor has
# written 2GB shards since its first release.
MAX_SHARD_SIZE: str = FIELDS["max_shard_size"].default  # declared with the other settings (settings/table.py)


def sparsity_record(cfg: PruneConfig, records: list[LayerRecord], solver: str | None) -> SparsityRecord:
    """The checkpoint's sparsity record (`runfiles.SparsityRecord`: `SPARSITY_FILE`, summarised in config.json).

    solver: the transposable solver that ran (`PruneConfig.solver_that_runs`), None for other patterns;
    the record keeps the name asked for ("auto") beside it."""
    p = cfg.pattern
    return SparsityRecord.of(
        cfg.method, p, records, solver=solver, solver_requested=cfg.matrix.solver if p.transposable else None
    )


def write_checkpoint(
    saved: SavedModel,
    output: Path,
    report: PruneReport | Callable[[], PruneReport],
    sparsity: SparsityRecord,
    processor_files: Mapping[str, bytes] | None = None,
) -> None:
    """The pruned checkpoint with its reports (tsenor_report.json / .md) and model card, written atomically.

    saved: the model's files (`models.saving.SavedModel`: the weights, their dtype, key layout and format).
    report: the report, or a function making it once the weights are written (a streamed run counts the
    nonzeros of the tensors as they pass). processor_files: {name: content} of the source's processor
    files (`models.loading.PROCESSOR_FILES`: a multimodal model's image processor and processor
    settings), copied unchanged."""

    def files() -> dict[str, str | bytes]:
        made = report() if callable(report) else report
        found: dict[str, str | bytes] = {**(processor_files or {})}
        return found | {
            PRUNE_FILE: json.dumps(made.to_json(), indent=2) + "\n",
            PRUNE_MARKDOWN: prune_markdown(made),
            MODEL_CARD: card_text(made, packed=saved.packed),
        }

    write_model_folder(output, sparsity, files, partial(save_model, saved=saved, sparsity=sparsity))


def finished_prune(output: Path, result_hash: str, save_format: str) -> PruneReport | None:
    """The report of the run of settings hash `result_hash` when `output` holds it finished (a rerun is then
    a no-op), else None. The format is not in the hash (the weights are the same), so a finished run stored
    in another format than `save_format` is refused (exit 4) rather than left as it is: the rerun would
    otherwise say "nothing to do" over a checkpoint not in the format asked for."""
    report = finished_run(output, result_hash)
    if report is None:
        return None
    stored = "packed" if declares_packed(output) else "dense"
    if stored != save_format:
        convert = "unpack" if stored == "packed" else "pack"
        raise OutputExistsError(
            f"{output} holds this run finished, stored {stored}, not {save_format} as --save-format asks; "
            f"tsenor {convert} {output} -o NEW converts it without pruning again, or pass --force to prune again"
        )
    return report
