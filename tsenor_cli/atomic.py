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


def _temp_name(path: Path) -> str:
    return f".{path.name}.tmp-{os.getpid()}-"


@contextmanager
def _temp_file(path: Path) -> Iterator[Path]:
    """A temporary file next to `path`; on exit without error it replaces `path` (fsynced, mode 0644)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=_temp_name(path), dir=path.parent)
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
    """Save `tensors` (moved to the CPU, made contiguous) as a safetensors file at `path` atomically."""
    from safetensors.torch import save_file

    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    with _temp_file(Path(path)) as tmp:
        save_file(cpu, str(tmp), metadata=metadata)


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
    tmp = Path(tempfile.mkdtemp(prefix=_temp_name(path), dir=path.parent))
    try:
        yield tmp
        _finish_tree(tmp)
        if path.exists():
            if not replace:
                return
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-{os.getpid()}-", dir=path.parent))
            path.replace(old / path.name)
            tmp.replace(path)
            shutil.rmtree(old)
        else:
            tmp.replace(path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
