"""Exclusive folder locks: one process at a time works in a folder.

`folder_lock` is the one implementation; `outputs.output_lock` (a prune's or finetune's --output, a
folder `tsenor pack`/`unpack` or `report` writes) and the local sweep executor (each run directory,
`sweep.executors.run_local`) hold it, each with its own error for a folder another process holds. Kept
free of heavy imports: the process that runs a sweep takes these locks.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def lock_path(folder: Path) -> Path:
    """The lock file of `folder`: ``.NAME.lock`` beside it, so it outlives a swap of the folder itself.

    The folder is resolved first (absolute, symlinks followed): every spelling of one folder, "." and
    "x/.." included, gets the same lock file.
    """
    folder = Path(folder).expanduser().resolve()
    return folder.parent / f".{folder.name}.lock"


def _remove_empty(folders: list[Path]) -> None:
    """rmdir each folder, deepest first, stopping at the first that is not empty (another run's)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


@contextmanager
def folder_lock(folder: Path, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold an exclusive lock on `folder` for the block; raises ``busy(holder)`` when another process
    holds it, `holder` saying which ("pid 12 on node1").

    An OS lock (flock) on ``.NAME.lock`` beside the folder: the kernel drops it when the holder exits or
    is killed, so no stale lock outlives a run. The holder writes "pid@host" into the file for the
    error line. On exit the file is removed while still locked; a process that opened it just before
    then holds a lock on a deleted file, so each acquirer checks that the path still names the file it
    locked and retries otherwise.

    Folders created here to hold the lock (a new a/b/OUT) are removed again, when empty, if the block
    leaves no `folder` behind: a failed first run leaves the file system as it found it.
    """
    path = lock_path(folder)
    created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]  # deepest first
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # another run's cleanup removed the empty parent just now
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            pid, _, host = holder.partition("@")
            raise busy(f"pid {pid} on {host}" if host else f"pid {pid}") from None
        try:
            same = path.stat().st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        # The holder's identity goes into the locked file itself (not an atomic replacement, which
        # would be a different, unlocked file).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}@{os.uname().nodename}\n".encode(), 0)
        yield
    finally:
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # releases the lock, whatever happened to the file
        if not Path(folder).exists():
            _remove_empty(created)
