"""Atomic output: a file or folder is either the old one or the complete new one, never half-written.

Every writer builds its output under a temporary name in the destination's own folder (so the final
rename never crosses a file system), flushes and fsyncs it, sets ordinary permissions (files 0644,
folders 0755, whatever the umask or mkstemp's private 0600), renames it over the destination and
fsyncs the folder so the rename itself survives a crash. On any error the temporary is removed and the
destination is left as it was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FILE_MODE = 0o644
DIR_MODE = 0o755


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_prefix(path: Path, kind: str = "tmp") -> str:
    """The name prefix of this process's temporaries of `path` (``.NAME.tmp-<pid>-``), which `recover` removes."""
    return f".{path.name}.{kind}-{os.getpid()}-"


@contextmanager
def _temp_file(path: Path) -> Iterator[Path]:
    """A temporary file next to `path`; on exit without error it replaces `path` (fsynced, mode 0644)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with tmp.open("rb+") as handle:
            os.fsync(handle.fileno())
        tmp.chmod(FILE_MODE)
        tmp.replace(path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (mode 0644)."""
    with _temp_file(Path(path)) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str) -> None:
    """Write UTF-8 `text` to `path` atomically (mode 0644)."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, payload: Any, *, indent: int | None = 2) -> None:
    """Write `payload` as JSON (with a final newline) to `path` atomically (mode 0644)."""
    write_text(path, json.dumps(payload, indent=indent) + "\n")


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Save `tensors` as a safetensors file at `path` atomically, tensor by tensor from their memory
    (`tensorfile.write_file`: safetensors' bytes without its in-memory copy of them)."""
    from tsenor_cli.tensorfile import write_file

    with _temp_file(Path(path)) as tmp:
        write_file(tmp, tensors, metadata)


def _finish_tree(root: Path) -> None:
    """fsync every file under `root` and give files 0644, folders 0755 (save_pretrained and mkdtemp
    leave some private)."""
    for folder, dirs, files in os.walk(root):
        for name in files:
            file = Path(folder, name)
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
            file.chmod(FILE_MODE)
        for name in dirs:
            Path(folder, name).chmod(DIR_MODE)
        _fsync_dir(Path(folder))
    root.chmod(DIR_MODE)


@contextmanager
def atomic_dir(path: Path, *, replace: bool = False) -> Iterator[Path]:
    """Build a folder at the yielded temporary path (``.NAME.tmp-<pid>-…`` next to `path`); on exit
    without error it is moved to `path`.

    replace=False: an existing `path` is kept and the new folder discarded (another process won a
    race to build the same thing). replace=True: an existing `path` is moved aside, the new folder
    renamed into place, then the old one deleted.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), dir=path.parent))
    try:
        yield tmp
        _finish_tree(tmp)
        if path.exists():
            if not replace:
                return
            old = Path(tempfile.mkdtemp(prefix=temp_prefix(path, "old"), dir=path.parent))
            path.replace(old / path.name)
            tmp.replace(path)
            shutil.rmtree(old)
        else:
            tmp.replace(path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_dir(path: Path) -> None:
    """Delete the folder `path` so that a kill leaves it whole or gone: it is first renamed to this process's
    temporary of it (``.NAME.tmp-<pid>-…/NAME``, which `recover` deletes), then deleted."""
    path = Path(path)
    trash = Path(tempfile.mkdtemp(prefix=temp_prefix(path), dir=path.parent))
    path.replace(trash / path.name)
    _fsync_dir(path.parent)
    shutil.rmtree(trash)


def _leftovers(path: Path) -> list[tuple[str, Path]]:
    """(kind, entry) of the temporaries of writers of `path`: kind "tmp" for ``.NAME.tmp-<pid>-…`` (a new
    file or folder being built), "old" for ``.NAME.old-<pid>-…`` (an old folder moved aside); newest first."""
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-[0-9]+-[A-Za-z0-9_]+")
    found = [(m.group(1), entry) for entry in path.parent.iterdir() if (m := pattern.fullmatch(entry.name))]
    return sorted(found, key=lambda item: item[1].lstat().st_mtime, reverse=True)


def recover(path: Path) -> list[str]:
    """Clean up after writers of `path` that were killed; one line per thing done.

    Call it only while no other process writes `path` (the caller holds a lock on it): every temporary
    found is then a dead writer's. A kill inside ``atomic_dir(replace=True)`` between moving the old
    folder aside and renaming the new one in leaves `path` missing and the old folder at
    ``.NAME.old-<pid>-…/NAME``: it is moved back, so `path` is the old folder as if the write had not
    started. Then every temporary of `path` (unfinished new folders and files, moved-aside old ones) is
    deleted.
    """
    path = Path(path)
    done: list[str] = []
    leftovers = _leftovers(path)
    if not path.exists() and not path.is_symlink():
        for kind, entry in leftovers:
            moved_aside = entry / path.name
            if kind == "old" and moved_aside.exists():
                moved_aside.replace(path)
                _fsync_dir(path.parent)
                done.append(f"restored {path} from an interrupted replacement ({entry.name})")
                break
    for _kind, entry in leftovers:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        done.append(f"removed {entry.name}, left by an interrupted write of {path.name}")
    return done
