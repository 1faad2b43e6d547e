"""The output folder: checked and locked before any work, replaced atomically at the very end.

One lifecycle for `tsenor prune` and `tsenor finetune` outputs: `output_run` (an `OutputRun`). What is
written into the folder is `runfiles/write.py`'s.

Before a model is loaded: the location must be creatable and writable (`check_output_location`, the one
check every command's output gets: `tsenor_cli/outputs.py`) with room for the checkpoint and the resume
state (`check_free_space`). For the whole run, including the
final swap, an exclusive lock (`outputs.output_lock`) keeps a second run off the same folder; under it the
leftovers of a killed run are recovered (`atomic.recover`) and what the folder holds is checked
(`prepare_output`): ``--force`` replaces only a tsenor run or an empty folder.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from tsenor_cli import atomic
from tsenor_cli.errors import (
    EXIT_RESUMABLE,
    EXIT_SIGINT,
    Interrupted,
    OutputExistsError,
    UsageError,
)
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.outputs import check_output_location, check_room, human_bytes, output_lock, output_path
from tsenor_cli.progress import Progress
from tsenor_cli.runfiles import (
    EVAL_FILE,
    FINETUNE_FILE,
    INDEX_NAME,
    PRUNE_FILE,
    RESUME_DIR,
    ContextRecord,
    EvalReport,
    FinetuneReport,
    PruneReport,
    read_json,
)
from tsenor_cli.runfiles.resume import ResumeStore

# What marks a folder as a tsenor run that --force may replace: a finished run's report (prune and
# finetune both write it) or an interrupted run's resume state.
RUN_MARKERS = (PRUNE_FILE, RESUME_DIR)


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
    return replace(report, found_finished=True) if report.result_hash == result_hash else None


def finished_evaluation(
    output: Path, command: str | None, context: ContextRecord, identity: str | None
) -> EvalReport | None:
    """The eval.json of `output` when it holds the evaluation this command asks for, else None: written by
    this command line (`command`, which holds every evaluation setting) under the same data folder and hub
    policy (`context`), of the checkpoint whose identity is `identity` (`models.identity.identity_digest`; None:
    it has none, and nothing matches). A rerun of the command (a batch job requeued after it was killed past
    the evaluation, a script run again) is then a no-op, as a finished prune's is, instead of the whole
    evaluation again or a refusal; a checkpoint written again since, or any other command, evaluates anew."""
    path = output / EVAL_FILE
    if command is None or identity is None or not path.is_file():
        return None
    record = EvalReport.from_json(read_json(path), str(path))
    same = record.command == command and record.context == context and record.model_identity == identity
    return replace(record, found_finished=True) if same else None


def finished_distillation(output: Path, result_hash: str, settings: dict[str, Any]) -> FinetuneReport | None:
    """The distillation's record when `output` holds a finished `tsenor prune --distill-steps` run: the prune of
    `result_hash` (`finished_run`) distilled with `settings` (`FinetuneConfig.result_fields`, as finetune.json
    holds them), else None."""
    if finished_run(output, result_hash) is None:
        return None
    return _finetuned_with(output, settings)


def finished_finetune(output: Path, run_dir: Path, settings: dict[str, Any]) -> FinetuneReport | None:
    """The record of a finished `tsenor finetune` of `run_dir` in `output` with `settings`
    (`FinetuneConfig.result_fields`, as finetune.json holds them), else None. Rerunning the command of a
    finished run (a batch job requeued after the final rename) is then a no-op, as a prune's is. The
    output's copy of the prune's report must be `run_dir`'s, byte for byte: a source pruned again since is
    another input, which the settings (its path) do not tell apart."""
    prune_report = run_dir / PRUNE_FILE
    if not prune_report.is_file() or not (output / PRUNE_FILE).is_file():
        return None
    if (output / PRUNE_FILE).read_bytes() != prune_report.read_bytes():
        return None
    return _finetuned_with(output, settings)


def _finetuned_with(output: Path, settings: dict[str, Any]) -> FinetuneReport | None:
    """finetune.json of `output` when its run finished (no resume state) with `settings`, else None."""
    path = output / FINETUNE_FILE
    if not path.is_file() or (output / RESUME_DIR).exists():
        return None
    record = FinetuneReport.from_json(read_json(path), str(path))
    same = {key: record.settings.get(key) for key in settings} == json.loads(json.dumps(settings))
    return replace(record, found_finished=True) if same else None


def remove_stage(stage: Path) -> None:
    """Delete a distilling prune's pruned checkpoint (`pruned_stage`) once the distilled output is in place,
    with what a killed writer of it left (`atomic.recover`); the caller holds the output's lock."""
    atomic.recover(stage)
    if stage.exists():
        atomic.remove_dir(stage)


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
    check_output_contents(output, force=force, resume=resume, continue_hint=continue_hint)
    if store.exists() and not resume:  # --force (checked above): the interrupted run's state goes now
        store.discard()
    return store


def check_output_contents(
    output: Path, *, force: bool, resume: bool, continue_hint: str = "pass --resume to continue it"
) -> None:
    """`prepare_output`'s refusals, deleting nothing: for a command that checks the folder it writes last
    before its earlier stages run (`tsenor prune --distill-steps`: the distillation's output before the prune)."""
    output = output_path(output)
    store = ResumeStore(output)
    if not output.exists():
        return
    if not output.is_dir():
        raise OutputExistsError(f"--output {output} is a file; choose a directory path for the checkpoint")
    entries = [p.name for p in output.iterdir()]
    if not entries:
        return
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
    elif not force and entries != [RESUME_DIR]:
        raise OutputExistsError(
            f"output directory {output} already holds a tsenor run; pass --force to replace it "
            "or choose another --output"
        )


def interruption(signal_name: str | None, where: str, saved: str) -> Interrupted:
    """The `Interrupted` error of a run stopped `where` ("at block 3/8"), saying what was `saved` and how
    to continue: by `signal_name` (exit 75, the run can be continued) or by Ctrl-C (None, exit 130)."""
    verb = f"stopped by {signal_name}" if signal_name is not None else "interrupted"
    return Interrupted(f"{verb} {where}; {saved}", EXIT_RESUMABLE if signal_name is not None else EXIT_SIGINT)


class OutputRun:
    """The output folder of one prune or finetune run, for the run's whole life (`output_run`): its location
    checked before any work (`check_location`), the lock held (`locked`) and a killed run's leftovers
    recovered (`recover`), what it holds checked (`prepare`). The process that owns
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
