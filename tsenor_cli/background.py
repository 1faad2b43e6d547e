"""The run's background writer: a block's files are written while the next block is pruned.

The resume state's writes (each block's pruned weights, the next block's inputs, their
sha256s and the state JSON, `runfiles/resume.py`) and the checkpoint took 34.9 of the 124.0 s of a whole
LLaMA-3.2-1B-shaped run on an H100 (docs/measurements/benchmarks-e2e.md), with the GPU idle meanwhile.
`BackgroundWriter` runs those writes on one thread, in the order they were submitted, so what lands on
disk, and when it is committed, is what the synchronous writes did, one block later at most:

- `submit(snapshot, write)` waits for a free slot, takes `snapshot()` in the caller's thread (the tensors
  the write needs, copied where the loop changes them later) and queues `write(payload)`. The writer
  holds at most `depth` payloads, queued or being written (`memory.host_estimate` counts them), and the
  loop waits for a slot, timed as "save", when the disk is slower than the blocks.
- A write that fails (a full disk, a permission) stops the writer: the writes queued after it are
  skipped (the state JSON of a later block would name a file that is missing) and its exception is
  raised, the same object, in the caller's thread at the next `submit` or `drain`: the same one line
  the synchronous write gave, one block later.
- `drain()` waits for every queued write (before the checkpoint is written or read back, before an
  interruption's line names what is committed); leaving the writer's `with` drains too, however the
  block ends, so a run stopped by an exception keeps every block it finished.
- `depth` 0 writes in the caller's thread, as before (the tests compare the two bit for bit).

The writer thread is a daemon: a second Ctrl-C during a drain ends the process at once, abandoning the
write in flight, which is atomic (`tsenor_cli.atomic`) and named by no committed state until it lands,
so resuming stays exact.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from tsenor_cli.progress import logger

# One payload held: block i's files are written while block i+1 is pruned, and the loop waits at block
# i+1's save until they are. One payload is the host memory the synchronous save took on a GPU run (its
# copy of the hidden states); a second would let the loop run two blocks ahead of a slow disk for as
# much again (`memory.host_estimate`).
WRITER_DEPTH = 1

T = TypeVar("T")


class BackgroundWriter:
    """Writes submitted by one thread, run in order on another (module docstring); `busy`: the seconds
    the writer thread spent writing, which overlap the caller's work and are not a phase of its own."""

    def __init__(self, depth: int = WRITER_DEPTH, name: str = "tsenor-writer") -> None:
        if depth < 0:
            raise ValueError(f"depth {depth} < 0")
        self.depth = depth
        self.name = name
        self.busy = 0.0
        self.error: BaseException | None = None
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._slots = threading.Semaphore(depth)
        self._thread: threading.Thread | None = None

    def submit(self, snapshot: Callable[[], T], write: Callable[[T], None]) -> None:
        """Queue `write(snapshot())`, `snapshot` run here once a slot is free; a failed earlier write is raised."""
        self._raise_error()
        if self.depth == 0:
            write(snapshot())
            return
        self._slots.acquire()  # blocks while `depth` payloads are held
        try:
            self._raise_error()
            payload = snapshot()
        except BaseException:
            self._slots.release()
            raise
        self._start()
        self._jobs.put(lambda: write(payload))

    def drain(self) -> None:
        """Wait until every queued write is done; raise the error of a failed one."""
        self._jobs.join()
        self._raise_error()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            start = time.perf_counter()
            try:
                if self.error is None:
                    job()
            # Handed to the caller's thread, which raises it (`_raise_error`): a thread's exception is
            # otherwise only printed, and the run would go on as if the block were saved.
            except BaseException as exc:  # noqa: BLE001
                self.error = exc
            finally:
                job = None  # the payload is freed before its slot is
                self.busy += time.perf_counter() - start
                self._slots.release()
                self._jobs.task_done()

    def close(self, exc: BaseException | None = None) -> None:
        """Drain and end the thread. exc: the exception the caller is leaving with (None: none); a
        writer's error is then logged instead of raised, unless it is that exception. Interrupted while
        draining (a second Ctrl-C), the daemon thread is left to the process's exit."""
        self._jobs.join()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        if exc is None:
            self._raise_error()
        elif self.error is not None and self.error is not exc:
            logger.error("the background writer failed too: %s", self.error)

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> Any:
        self.close(exc)
        return None
