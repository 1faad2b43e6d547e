"""The output folder: checked and locked before any work, replaced atomically at the very end.

One lifecycle for `tsenor prune` and `tsenor finetune` outputs: `output_run` (an `OutputRun`).

Before a model is loaded: the location must be creatable and writable (`check_output_location`, the one
check every command's output gets: `tsenor_cli/outputs.py`) with room for the checkpoint and the resume
state (`check_free_space`). For the whole run, including the
final swap, an exclusive lock (`output_lock`) keeps a second run off the same folder; under it the
leftovers of a killed run are recovered (`atomic.recover`) and what the folder holds is checked
(`prepare_output`): ``--force`` replaces only a tsenor run or an empty folder.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tsenor_cli import atomic
from tsenor_cli.errors import (
    EXIT_RESUMABLE,
    EXIT_SIGINT,
    Interrupted,
    OutputBusyError,
    OutputExistsError,
    OutputUnwritableError,
    UsageError,
)
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.locks import folder_lock
from tsenor_cli.models.saving import drop_stray_keys, save_streamed, save_tokenizer
from tsenor_cli.outputs import check_output_location, check_room, free_bytes, human_bytes, output_path
from tsenor_cli.packed.files import record_patterns
from tsenor_cli.progress import Progress
from tsenor_cli.pruning.run.card import card_text
from tsenor_cli.runfiles.resume import ResumeStore
from tsenor_cli.pruning.settings.table import FIELDS
from tsenor_cli.report.markdown import prune_markdown
from tsenor_cli.runfiles import (
    INDEX_NAME,
    MODEL_CARD,
    PRUNE_FILE,
    PRUNE_MARKDOWN,
    RESUME_DIR,
    SPARSITY_FILE,
    SPARSITY_KEY,
    LayerRecord,
    PruneReport,
    SparsityRecord,
    read_json,
)

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.settings.config import PruneConfig

# The output's default shard size (`--max-shard-size`): transformers' own default is 50GB; tsenor has
# written 2GB shards since its first release.
MAX_SHARD_SIZE: str = FIELDS["max_shard_size"].default  # declared with the other settings (settings/table.py)
# What marks a folder as a tsenor run that --force may replace: a finished run's report (prune and
# finetune both write it) or an interrupted run's resume state.
RUN_MARKERS = (PRUNE_FILE, RESUME_DIR)


@contextmanager
def output_lock(output: Path) -> Iterator[None]:
    """Hold an exclusive lock on `output` for the block; OutputBusyError when another process holds it.

    `locks.folder_lock` (flock on ``.NAME.lock`` beside the folder, dropped by the kernel when its
    holder dies; folders created for it removed again when the run leaves no `output`)."""

    def busy(holder: str) -> OutputBusyError:
        return OutputBusyError(
            f"--output {output} is in use by another tsenor run ({holder}); wait for it to finish "
            "or choose another --output"
        )

    with folder_lock(output, busy):
        yield


def copied_bytes(source: str) -> int:
    """Bytes of what the output copies from a local checkpoint folder `source` besides its weights: the
    tokenizer (a Llama-3 tokenizer.json alone is 9 MB), the processor and generation settings, the model
    card; 0 for a hub id (its files are not on disk yet)."""
    folder = Path(source)
    if not folder.is_dir():
        return 0
    weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
    return sum(
        p.stat().st_size
        for p in folder.iterdir()
        if p.is_file() and not p.name.endswith(weights) and p.name != INDEX_NAME
    )


def check_free_space(
    output: Path, checkpoint_bytes: int, resume_bytes: int, blocks_bytes: int = 0, *, copied: int = 0
) -> None:
    """OutputUnwritableError unless the file system of `output` has room for the run's writes.

    checkpoint_bytes: the checkpoint's weights (built beside the old folder, which stays until the swap);
    resume_bytes: what the resume state still has to write (0 without one); blocks_bytes: the pruned
    blocks a streamed run without a resume state keeps on disk until the write (`pruning/run/writer.py`);
    copied: the tokenizer and other files written beside the weights (`copied_bytes`).
    """
    saving = f"; --no-resume-state saves {human_bytes(resume_bytes)}" if resume_bytes else ""
    blocks = f", pruned blocks kept until the write {human_bytes(blocks_bytes)}" if blocks_bytes else ""
    files = f", tokenizer and other files {human_bytes(copied)}" if copied else ""
    check_room(
        output,
        checkpoint_bytes + resume_bytes + blocks_bytes + copied,
        parts=f"checkpoint {human_bytes(checkpoint_bytes)}, resume state {human_bytes(resume_bytes)}{blocks}{files}",
        hint=saving,
    )


def _listing(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def finished_run(output: Path, result_hash: str) -> PruneReport | None:
    """The report of a finished run in `output` whose settings hash is `result_hash`, else None.

    Rerunning a command whose run already finished (a batch job requeued after it was killed past the
    final swap, or a sweep restarted) is then a no-op that exits 0, instead of an "output exists" error.
    A folder with a resume state is not finished; a report without the hash (older tsenor) is not taken.
    """
    report_path = output / PRUNE_FILE
    if not report_path.is_file() or (output / RESUME_DIR).exists():
        return None
    report = PruneReport.from_json(read_json(report_path), str(report_path))
    return report if report.result_hash == result_hash else None


def prepare_output(
    output: Path, *, force: bool, resume: bool, continue_hint: str = "pass --resume to continue it"
) -> ResumeStore:
    """Check what `output` holds before any work; returns its resume store (whose state the caller
    continues, refuses or discards). continue_hint: how the command's user continues a resume state.

    Allowed: a missing or empty folder; a folder holding a resume state when `resume` (continue it) or
    `force` (its state is deleted now when not `resume`); a tsenor run (a report or a resume state,
    `RUN_MARKERS`) with `force`, replaced at the very end, never earlier. A folder without a marker is
    refused even with `force`: it is not tsenor's to delete.
    """
    output = output_path(output)
    store = ResumeStore(output)
    if not output.exists():
        return store
    if not output.is_dir():
        raise OutputExistsError(f"--output {output} is a file; choose a directory path for the checkpoint")
    entries = [p.name for p in output.iterdir()]
    if not entries:
        return store
    if not any(marker in entries for marker in RUN_MARKERS):
        raise OutputExistsError(
            f"--output {output} holds files that are not a tsenor run ({_listing(entries)}); "
            "--force replaces only a tsenor run or an empty folder: choose another --output"
        )
    if store.exists() and not resume:
        if not force:
            raise OutputExistsError(
                f"{output} holds an interrupted run; {continue_hint}, or pass --force to start over"
            )
        store.discard()
    elif not force and entries != [RESUME_DIR]:
        raise OutputExistsError(
            f"output directory {output} already holds a tsenor run; pass --force to replace it "
            "or choose another --output"
        )
    return store


def interruption(signal_name: str | None, where: str, saved: str) -> Interrupted:
    """The `Interrupted` error of a run stopped `where` ("at block 3/8"), saying what was `saved` and how
    to continue: by `signal_name` (exit 75, the run can be continued) or by Ctrl-C (None, exit 130)."""
    verb = f"stopped by {signal_name}" if signal_name is not None else "interrupted"
    return Interrupted(f"{verb} {where}; {saved}", EXIT_RESUMABLE if signal_name is not None else EXIT_SIGINT)


class OutputRun:
    """The output folder of one prune or finetune run, for the run's whole life (`output_run`): its location
    checked before any work (`check_location`), the lock held (`locked`) and a killed run's leftovers
    recovered (`recover`), what it holds checked (`prepare`) or found finished (`finished`). The process that owns
    the folder (rank 0 of several) locks, recovers and writes; the others only read it."""

    def __init__(self, output: Path, say: Progress) -> None:
        self.output = output_path(output)
        self.say = say

    def check_location(self) -> None:
        check_output_location(self.output)

    @contextmanager
    def locked(self, *, owner: bool = True) -> Iterator[None]:
        """Hold the folder's lock (`output_lock`) when `owner`; a process that does not own the folder
        goes on without it."""
        with output_lock(self.output) if owner else nullcontext():
            yield

    def recover(self) -> None:
        """Put back or clear what a killed run left half-swapped (`atomic.recover`); under the lock."""
        for line in atomic.recover(self.output):
            self.say(line)

    def prepare(self, *, force: bool, resume: bool, continue_hint: str = "pass --resume to continue it") -> ResumeStore:
        return prepare_output(self.output, force=force, resume=resume, continue_hint=continue_hint)

    def finished(self, result_hash: str) -> PruneReport | None:
        return finished_run(self.output, result_hash)


@contextmanager
def output_run(
    output: Path,
    interrupted: Callable[[str | None], Interrupted],
    *,
    say: Progress,
    stop: StopRequest | None = None,
    remove_empty: Sequence[Path] = (),
) -> Iterator[OutputRun]:
    """The lifecycle of a run's output folder, one for `tsenor prune` and `tsenor finetune`.

    Ctrl-C inside becomes `interrupted(signal name or None)`: the run's line saying where it stopped and
    what it saved (`interruption`). A run that does not finish removes the folders of `remove_empty`
    that it left empty, and the output folder itself when it made it and left nothing in it, so that a
    rerun is not taken for the continuation of an interrupted run (finetune's Trainer creates its folders
    before the first checkpoint).
    """
    run = OutputRun(output, say)
    existed = run.output.exists()
    finished = False
    try:
        yield run
        finished = True
    except KeyboardInterrupt:
        raise interrupted(stop.name if stop is not None else None) from None
    finally:
        if not finished and remove_empty:
            for folder in (*remove_empty, *(() if existed else (run.output,))):
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()


def check_not_input(output: Path, source: str) -> None:
    """The input checkpoint is never touched: refuse an output that is, contains or lies inside it (a
    checkpoint written into its input folder would change what that folder holds)."""
    src = Path(source)
    if not src.exists():
        return
    out, src = output.resolve(), src.resolve()
    if out == src or out in src.parents:
        raise UsageError(f"--output {output} would overwrite the input checkpoint {src}; choose another directory")
    if src in out.parents:
        raise UsageError(f"--output {output} is inside the input checkpoint {src}; choose a directory outside it")


def sparsity_record(cfg: PruneConfig, records: list[LayerRecord], solver: str | None) -> SparsityRecord:
    """The checkpoint's sparsity record (`runfiles.SparsityRecord`: `SPARSITY_FILE`, summarised in config.json).

    solver: the transposable solver that ran (`PruneConfig.solver_that_runs`), None for other patterns;
    the record keeps the name asked for ("auto") beside it."""
    p = cfg.pattern
    return SparsityRecord.of(
        cfg.method, p, records, solver=solver, solver_requested=cfg.layer.solver if p.transposable else None
    )


@contextmanager
def _disk_full_is_one_line(output: Path) -> Iterator[None]:
    """A full disk (or quota) while the checkpoint is written → OutputUnwritableError; `atomic.atomic_dir`
    has removed the partial copy by then, so `output` is as it was (and a resume state in it stays)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OutputUnwritableError(
            f"the disk holding --output {output} filled up while the checkpoint was written "
            f"({exc.strerror or exc}); nothing was changed in {output}: free some space (about "
            f"{human_bytes(free_bytes(output))} are free now) and rerun, or choose another --output"
        ) from exc


def write_model_folder(
    model: Any,
    tokenizer: Any,
    output: Path,
    sparsity: SparsityRecord,
    files: Mapping[str, str | bytes] | Callable[[], Mapping[str, str | bytes]],
    *,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    max_shard_size: str = MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    layout: Mapping[str, str] | None = None,
    save_format: str = "dense",
) -> None:
    """save_pretrained's files (safetensors, sharded; written tensor by tensor by `models.saving.save_streamed`,
    byte for byte what save_pretrained writes) + tokenizer + `files` ({name: content}, or a function giving
    them once the weights are written), built in a temp sibling and renamed into place (replacing an
    existing `output`: prepare_output allowed it).

    tensors: the weights as (key, tensor) one at a time (`pruning/run/writer.py`: a model whose blocks are on
    the meta device); None: `model`'s own. dtype: the dtype the floating weights are written in
    (`models.loading.output_dtype`: --dtype, else the checkpoint's own); None: the model's.
    What the source's conversion or our loading left in the config and the tokenizer's settings
    (`models.saving.STRAY_CONFIG_KEYS`, `STRAY_TOKENIZER_KEYS`) is not written.

    layout: {the model's own key: the key to write} (`LoadedModel.layout`, `models.saving.source_layout`):
    the tensors are saved under the source checkpoint's own names, so every class that loaded the source
    loads the output with the same keys (Mllama's ``language_model.model.layers…`` loads as
    ``MllamaForConditionalGeneration`` and, text only, as ``MllamaForCausalLM``; written under the
    model's names ``model.language_model.layers…`` the second finds none of its weights). None: the
    model's own names (``save_original_format=False``), which load with the model's own class: a hub
    source, pickle weights, or a layout transformers converts (Mixtral's per-expert ``w1/w2/w3`` merged
    into fused stacks) rather than renames. `tsenor_sparsity.json` lists the model's own parameter names;
    `tsenor verify` maps them to the files' keys the same way. save_format: dense, or packed (the pruned
    matrices of `sparsity` packed, `tsenor_cli.packed`).
    `atomic.atomic_dir` gives every file 0644 and every folder 0755 (the temporary folder is made
    private; a checkpoint is meant to be shared)."""
    with _disk_full_is_one_line(output), atomic.atomic_dir(output, replace=True) as tmp:
        setattr(model.config, SPARSITY_KEY, sparsity.summary())
        drop_stray_keys(model.config)
        packed = record_patterns(sparsity) if save_format == "packed" else None
        save_streamed(tmp, model, tensors, max_shard_size=max_shard_size, dtype=dtype, layout=layout, packed=packed)
        save_tokenizer(tokenizer, tmp)
        (tmp / SPARSITY_FILE).write_text(json.dumps(sparsity.to_json(), indent=1) + "\n", encoding="utf-8")
        for name, content in (files() if callable(files) else files).items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                (tmp / name).write_text(content, encoding="utf-8")


def write_checkpoint(
    model: Any,
    tokenizer: Any,
    output: Path,
    report: PruneReport | Callable[[], PruneReport],
    sparsity: SparsityRecord,
    processor_files: Mapping[str, bytes] | None = None,
    *,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    max_shard_size: str = MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    layout: Mapping[str, str] | None = None,
    save_format: str = "dense",
) -> None:
    """The pruned checkpoint with its reports (tsenor_report.json / .md) and model card, written atomically.

    report: the report, or a function making it once the weights are written (a streamed run counts the
    nonzeros of the tensors as they pass). processor_files: {name: content} of the source's processor
    files (`models.loading.PROCESSOR_FILES`: a multimodal model's image processor and processor
    settings), copied unchanged. tensors, max_shard_size, dtype, layout, save_format: `write_model_folder`'s."""

    def files() -> dict[str, str | bytes]:
        made = report() if callable(report) else report
        found: dict[str, str | bytes] = {**(processor_files or {})}
        return found | {
            PRUNE_FILE: json.dumps(made.to_json(), indent=2) + "\n",
            PRUNE_MARKDOWN: prune_markdown(made),
            MODEL_CARD: card_text(made, packed=save_format == "packed"),
        }

    write_model_folder(
        model,
        tokenizer,
        output,
        sparsity,
        files,
        tensors=tensors,
        max_shard_size=max_shard_size,
        dtype=dtype,
        layout=layout,
        save_format=save_format,
    )
