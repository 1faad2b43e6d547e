"""Simulated kills for the reliability tests: a process that dies just before one of its file-system changes.

`KillSwitch` wraps os.replace / os.rename / os.unlink / os.rmdir, the calls that change what a folder
holds (pathlib's replace/unlink/rmdir and shutil.rmtree go through them). The n-th such call under
`root` raises `Killed` instead of running, and from then on every such call does nothing: a SIGKILLed
process runs no `finally` block, so the temporaries and moved-aside folders it was about to clean up
stay, as they would after a real kill. File contents written before the kill stay as written; the OS
lock a killed process held is released when its file descriptor is closed, as the kernel does.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MUTATIONS = ("replace", "rename", "unlink", "rmdir")


class Killed(BaseException):
    """The simulated SIGKILL: a BaseException, so no `except Exception` in the code under test stops it."""


class KillSwitch:
    """Counts the file-system changes under `root`; kills the process at change number `at` (1-based),
    or at the first change for which `when(op, path)` is true; None: never (counting only).

    ops: (op, path) of every change counted before the kill, the kill's own last.
    """

    def __init__(self, root: Path, at: int | None = None, when: Callable[[str, str], bool] | None = None) -> None:
        self.root = str(root)
        self.at = at
        self.when = when
        self.ops: list[tuple[str, str]] = []
        self.dead = False

    def _counts(self, path: Any, dir_fd: int | None) -> bool:
        if dir_fd is not None:  # shutil.rmtree's relative names, inside a folder it opened
            return True
        text = os.fspath(path)
        return text.startswith(self.root) and os.path.lexists(text)

    def _wrap(self, op: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.dead:
                return None
            if self._counts(args[0], kwargs.get("dir_fd")):
                self.ops.append((op, os.fspath(args[0])))
                if len(self.ops) == self.at or (self.when is not None and self.when(op, os.fspath(args[0]))):
                    self.dead = True
                    raise Killed(f"killed before {op} {args[0]}")
            return real(*args, **kwargs)

        return call

    @contextmanager
    def armed(self) -> Iterator[KillSwitch]:
        """Within: the wrapped os functions are in place (put back on exit, however the block ends)."""
        real = {op: getattr(os, op) for op in MUTATIONS}
        for op, function in real.items():
            setattr(os, op, self._wrap(op, function))
        try:
            yield self
        finally:
            for op, function in real.items():
                setattr(os, op, function)


class FullDisk:
    """A file system that fills up: files opened for writing under `root` (builtins.open, io.open and so
    pathlib's open) raise OSError(ENOSPC) once `budget` bytes were written to them in all, as a write to a
    full disk does. `written` counts the bytes that went through."""

    def __init__(self, root: Path, budget: int) -> None:
        self.root = str(root)
        self.budget = budget
        self.written = 0

    def _wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        disk = self

        class Filling:
            def __init__(self, handle: Any) -> None:
                self._handle = handle

            def write(self, data: Any) -> int:
                size = len(data) if not isinstance(data, memoryview) else data.nbytes
                if disk.written + size > disk.budget:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.written += size
                return int(self._handle.write(data))

            def __enter__(self) -> Filling:
                return self

            def __exit__(self, *exc: object) -> None:
                self._handle.close()

            def __getattr__(self, name: str) -> Any:
                return getattr(self._handle, name)

        def opened(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = real(file, mode, *args, **kwargs)
            writing = any(flag in mode for flag in "wax+")
            if writing and isinstance(file, str | os.PathLike) and os.fspath(file).startswith(self.root):
                return Filling(handle)
            return handle

        return opened

    @contextmanager
    def armed(self) -> Iterator[FullDisk]:
        """Within: writes under `root` count against the budget (the real open is put back on exit)."""
        import builtins
        import io

        real = io.open
        builtins.open = io.open = self._wrap(real)  # type: ignore[assignment]
        try:
            yield self
        finally:
            builtins.open = io.open = real
