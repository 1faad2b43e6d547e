"""The output folder: checked and locked before any work, replaced atomically at the very end.

Before a model is loaded: the location must be creatable and writable (`check_output_location`) with
room for the checkpoint and the resume state (`check_free_space`). For the whole run, including the
final swap, an exclusive lock (`output_lock`) keeps a second run off the same folder; under it the
leftovers of a killed run are recovered (`atomic.recover`) and what the folder holds is checked
(`prepare_output`): ``--force`` replaces only a tsenor run or an empty folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tsenor_cli import atomic
from tsenor_cli.errors import OutputBusyError, OutputExistsError, OutputUnwritableError, UsageError
from tsenor_cli.locks import folder_lock
from tsenor_cli.models.saving import save_streamed
from tsenor_cli.pruning.resume import ResumeStore
from tsenor_cli.report.markdown import prune_markdown
from tsenor_cli.runfiles import PRUNE_FILE, PRUNE_MARKDOWN, RESUME_DIR, SPARSITY_KEY, PruneReport, read_json

if TYPE_CHECKING:
    import torch

# The output's default shard size (`--max-shard-size`): transformers' own default is 50GB; tsenor has
# written 2GB shards since its first release.
MAX_SHARD_SIZE = "2GB"
# What marks a folder as a tsenor run that --force may replace: a finished run's report (prune and
# finetune both write it) or an interrupted run's resume state.
RUN_MARKERS = (PRUNE_FILE, RESUME_DIR)


def output_path(output: Path) -> Path:
    """`output` absolute with symlinks resolved: "." and "x/.." get a name and a parent, and every spelling
    of one folder gets the same lock."""
    return Path(output).expanduser().resolve()


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


def _existing_ancestor(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor)


def check_output_location(output: Path) -> None:
    """Refuse an --output that cannot be created or written, before any work, leaving nothing behind.

    The folder's parent (or, when missing, its nearest existing ancestor) must be a folder where files
    can be created: the checkpoint is built beside the output and renamed into place, and the lock file
    lives there. That is probed by creating and removing a temporary (named as `atomic.recover` cleans
    up), which also catches what permission bits do not show (read-only or pseudo file systems). An
    existing output folder must be writable too: the resume state goes into it.
    """
    output = output_path(output)
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"--output {output} is a file; choose a directory path for the checkpoint")
    base = _existing_ancestor(output.parent)
    if not base.is_dir():
        raise OutputUnwritableError(f"--output {output} cannot be created: {base} is a file; choose another --output")
    try:
        fd, probe = tempfile.mkstemp(prefix=atomic.temp_prefix(output), dir=base)
    except OSError as exc:
        raise OutputUnwritableError(
            f"--output {output} is not writable: cannot create files in {base} ({exc.strerror or exc}); "
            "choose an --output in a writable folder"
        ) from exc
    os.close(fd)
    Path(probe).unlink()
    if output.is_dir() and not os.access(output, os.W_OK | os.X_OK):
        raise OutputUnwritableError(
            f"--output {output} is not writable (the resume state goes into it); make it writable "
            "or choose another --output"
        )


def free_bytes(output: Path) -> int:
    """Free bytes on the file system that holds (or will hold) `output`."""
    return shutil.disk_usage(_existing_ancestor(output_path(output))).free


def human_bytes(n: float) -> str:
    """`n` bytes for a person: "1.5 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_free_space(output: Path, checkpoint_bytes: int, resume_bytes: int, blocks_bytes: int = 0) -> None:
    """OutputUnwritableError unless the file system of `output` has room for the run's writes.

    checkpoint_bytes: the checkpoint (built beside the old folder, which stays until the swap);
    resume_bytes: what the resume state still has to write (0 without one); blocks_bytes: the pruned
    blocks a streamed run without a resume state keeps on disk until the write (`pruning/writer.py`).
    """
    need, free = checkpoint_bytes + resume_bytes + blocks_bytes, free_bytes(output)
    if need > free:
        saving = f"; --no-resume-state saves {human_bytes(resume_bytes)}" if resume_bytes else ""
        blocks = f", pruned blocks kept until the write {human_bytes(blocks_bytes)}" if blocks_bytes else ""
        raise OutputUnwritableError(
            f"not enough free space for --output {output}: the run writes about {human_bytes(need)} "
            f"(checkpoint {human_bytes(checkpoint_bytes)}, resume state {human_bytes(resume_bytes)}{blocks}), "
            f"{human_bytes(free)} are free; free some space or choose another --output{saving}"
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
    return report if report.settings.get("result_hash") == result_hash else None


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


def write_model_folder(
    model: Any,
    tokenizer: Any,
    output: Path,
    sparsity: dict[str, Any],
    files: Mapping[str, str | bytes] | Callable[[], Mapping[str, str | bytes]],
    *,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    max_shard_size: str = MAX_SHARD_SIZE,
) -> None:
    """save_pretrained's files (safetensors, sharded; written tensor by tensor by `models.saving.save_streamed`,
    byte for byte what save_pretrained writes) + tokenizer + `files` ({name: content}, or a function giving
    them once the weights are written), built in a temp sibling and renamed into place (replacing an
    existing `output`: prepare_output allowed it).

    tensors: the weights as (key, tensor) one at a time (`pruning/writer.py`: a model whose blocks are on
    the meta device); None: `model`'s own.

    The tensors are saved under the model's own parameter names (what ``save_original_format=False``
    writes, see the comment below), the names `tsenor_sparsity` lists and `tsenor verify` reads:
    transformers 5 would otherwise write some families' legacy names (LLaVA, Gemma-3 and Mllama's
    ``language_model.model.layers…`` for the module ``model.language_model.layers…``, Mixtral's
    per-expert ``w1/w2/w3`` for the fused stacks). It loads back with the same class either way; for
    the LLaMA-like families the two are the same.
    `atomic.atomic_dir` gives every file 0644 and every folder 0755 (the temporary folder is made
    private; a checkpoint is meant to be shared)."""
    with atomic.atomic_dir(output, replace=True) as tmp:
        setattr(model.config, SPARSITY_KEY, sparsity)
        # save_pretrained's default (save_original_format=True, transformers 5.24) runs
        # `revert_weight_conversion` on the state dict: the checkpoint conversion mapping backwards,
        # applied to any model whose class has one, however it was loaded (Mixtral's fused gate_up_proj
        # split into per-expert w1/w3, LLaVA's model.language_model.* renamed language_model.model.*).
        # from_pretrained applies the mapping only to keys that match it, so both layouts load with the
        # same class bit for bit (checked on tiny Mixtral, LLaVA and DBRX). Keeping the model's own names
        # (what save_streamed writes, byte for byte save_pretrained(save_original_format=False)) keeps
        # each file key equal to the parameter name that `tsenor_sparsity.pruned_weights` lists, so
        # `tsenor verify` reads each pruned matrix straight from the files; with the legacy layout it
        # would have to build the whole model through the mapping. The cost: for families with a
        # mapping the files are transformers-5 names, which transformers 4 and tools that read the
        # published per-expert layout do not load.
        save_streamed(tmp, model, tensors, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
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
    sparsity: dict[str, Any],
    processor_files: Mapping[str, bytes] | None = None,
    *,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    max_shard_size: str = MAX_SHARD_SIZE,
) -> None:
    """The pruned checkpoint with its reports (tsenor_report.json / .md), written atomically.

    report: the report, or a function making it once the weights are written (a streamed run counts the
    nonzeros of the tensors as they pass). processor_files: {name: content} of the source's processor
    files (`models.loading.PROCESSOR_FILES`: a multimodal model's image processor and processor
    settings), copied unchanged. tensors, max_shard_size: `write_model_folder`'s."""

    def files() -> dict[str, str | bytes]:
        made = report() if callable(report) else report
        found: dict[str, str | bytes] = {**(processor_files or {})}
        return found | {PRUNE_FILE: json.dumps(made.to_json(), indent=2) + "\n", PRUNE_MARKDOWN: prune_markdown(made)}

    write_model_folder(model, tokenizer, output, sparsity, files, tensors=tensors, max_shard_size=max_shard_size)
