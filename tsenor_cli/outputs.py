"""Every output is checked before the work: the one check of where a command writes (torch-free).

`tsenor prune --output` checked its folder before reading a weight; `tsenor eval --output` checked it
only after the evaluation (a read-only file system or ``/dev/null/x`` lost an evaluation of hours to
"unexpected OSError"), and so did `report` and `make gpu-check OUT=`. Each now runs the same
check before any work (exit 4, `OutputExistsError` / `OutputUnwritableError`):

- `check_output_location`: the folder is not a file, and its parent (or nearest existing ancestor) is a
  folder where a file can be created, probed with a temporary named like the atomic writer's (so a kill
  there leaves nothing `atomic.recover` does not remove); an existing folder must be writable;
- `check_room`: the file system has room for what the command writes;
- `check_output_folder` (both, for a folder: prune's checkpoint, eval's eval.json, report's tables and
  plots, gpu-check's OUT) and `check_output_file` (a file path: `tsenor bench --output`).

While it is written, an output folder is held by one process (`output_lock`, prune's and finetune's for
the whole run); a folder written whole and swapped in (`replacing`: `tsenor pack`/`unpack`, `report`)
first gets back what a killed writer of it left (`atomic.recover`), as a prune's output does: a killed
pack of a large model once left its tens of GB in a hidden temporary for good.

Torch-free (only `atomic`, `errors` and `locks`), so `scripts/gpu_check.py` checks OUT with a Python that lacks
torch before it says anything else.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tsenor_cli import atomic
from tsenor_cli.errors import OutputBusyError, OutputExistsError, OutputUnwritableError
from tsenor_cli.locks import folder_lock


def output_path(output: Path) -> Path:
    """`output` absolute with symlinks resolved: "." and "x/.." get a name and a parent, and every spelling
    of one folder gets the same lock."""
    return Path(output).expanduser().resolve()


def existing_ancestor(path: Path) -> Path:
    """`path` itself when it exists, else its nearest existing ancestor."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor)


def human_bytes(n: float) -> str:
    """`n` bytes for a person: "1.5 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_bytes(output: Path) -> int:
    """Free bytes on the file system that holds (or will hold) `output`."""
    return shutil.disk_usage(existing_ancestor(output_path(output))).free


def check_output_location(output: Path, *, option: str = "--output", what: str = "the checkpoint") -> None:
    """Refuse an `option` folder that cannot be created or written, before any work, leaving nothing behind.

    The folder's parent (or, when missing, its nearest existing ancestor) must be a folder where files
    can be created: outputs are built beside their place and renamed into it, and a run's lock file lives
    there. That is probed by creating and removing a temporary (named as `atomic.recover` cleans up), which
    also catches what permission bits do not show (read-only or pseudo file systems). An existing folder
    must be writable too (a resume state, or a file added beside others, goes into it). what: what the
    folder is for, in the line about a file in its place.
    """
    output = output_path(output)
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"{option} {output} is a file; choose a directory path for {what}")
    base = existing_ancestor(output.parent)
    if not base.is_dir():
        raise OutputUnwritableError(f"{option} {output} cannot be created: {base} is a file; choose another {option}")
    try:
        fd, probe = tempfile.mkstemp(prefix=atomic.temp_prefix(output), dir=base)
    except OSError as exc:
        raise OutputUnwritableError(
            f"{option} {output} is not writable: cannot create files in {base} ({exc.strerror or exc}); "
            f"choose an {option} in a writable folder"
        ) from exc
    os.close(fd)
    Path(probe).unlink()
    if output.is_dir() and not os.access(output, os.W_OK | os.X_OK):
        raise OutputUnwritableError(
            f"{option} {output} is not writable (files are written into it); make it writable or choose "
            f"another {option}"
        )


def check_room(output: Path, need: int, *, option: str = "--output", parts: str = "", hint: str = "") -> None:
    """OutputUnwritableError unless the file system of `output` has `need` bytes free. parts: what the
    bytes are, for the line ("checkpoint 1.0 GiB, resume state 2.0 GiB"); hint: more of the fix, after
    it ("; --no-resume-state saves 2.0 GiB")."""
    free = free_bytes(output)
    if need > free:
        detail = f" ({parts})" if parts else ""
        raise OutputUnwritableError(
            f"not enough free space for {option} {output_path(output)}: the run writes about {human_bytes(need)}"
            f"{detail}, {human_bytes(free)} are free; free some space or choose another {option}{hint}"
        )


def check_output_folder(output: Path, need: int, *, option: str = "--output", what: str, parts: str = "") -> None:
    """The folder `output` (`option`) can take what the command writes: `check_output_location`, then
    `check_room` for `need` bytes (`what` the folder is for, `parts` what the bytes are)."""
    check_output_location(output, option=option, what=what)
    check_room(output, need, option=option, parts=parts)


def check_output_file(path: Path, need: int, *, option: str = "--output", force: bool = False) -> None:
    """The file `path` (`option`) can be written at the end of the run: not a folder, not an existing file
    unless `force` (it is replaced), its folder able to take a new file (the atomic writer's temporary
    beside it: `check_output_location`) and room for `need` bytes."""
    path = Path(path)
    if path.is_dir():
        raise OutputExistsError(f"{option} {path} is a folder; pass a file path, e.g. {path / 'result.json'}")
    if path.exists() and not force:
        raise OutputExistsError(f"{option} {path} exists; pass --force to overwrite it")
    # The file's own path stands for a folder to create when it is missing: its parents must take files.
    check_output_location(path.parent if path.exists() else path, option=option, what=str(path.name))
    check_room(path, need, option=option)


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


@contextmanager
def replacing(output: Path, say: Callable[[str], None], check: Callable[[], None]) -> Iterator[Path]:
    """The temporary folder of `output`, renamed into place over the old one when the block ends without
    error (`atomic.atomic_dir(replace=True)`), under the output's lock, after what a killed writer of it
    left is put back or removed (`atomic.recover`, each line to `say`) and `check` (the caller's refusal
    of an existing output without --force) passes on the folder as recovered."""
    with output_lock(output):
        for line in atomic.recover(output):
            say(line)
        check()
        with atomic.atomic_dir(output, replace=True) as tmp:
            yield tmp
