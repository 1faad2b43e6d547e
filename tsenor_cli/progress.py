"""Progress of long work: `logging` lines, and tqdm bars when stderr is a terminal.

The library reports to the ``tsenor`` logger: INFO for one line per step a user follows (model
loaded, block i/L, each layer's error), DEBUG for the inner detail (ALPS's ADMM iterations). Its
block and ADMM loops are wrapped in `bar`, a tqdm bar with ``disable=None``: drawn when stderr is a
terminal, silent otherwise, so a batch job's log holds only the plain lines. The CLI attaches the
handler (`configure_logging`), which prints log lines above the bars (`tqdm.write`).

Library calls that take a ``progress`` callable send their status lines there instead, for callers
that route them elsewhere; `sink` turns the ``None`` default into the logger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from tqdm.auto import tqdm

logger = logging.getLogger("tsenor")

Progress = Callable[[str], None]
T = TypeVar("T")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and its noun, singular for one: "1 window", "8 windows", "1 matrix" (`plural` "matrices")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def sink(progress: Progress | None) -> Progress:
    """`progress`, or the ``tsenor`` logger's INFO when None."""
    return progress if progress is not None else logger.info


def bar(
    iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str, unit: str, leave: bool = True
) -> Any:
    """A tqdm bar on stderr, drawn only when stderr is a terminal (``disable=None``)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, disable=None, dynamic_ncols=True)


class _BarSafeHandler(logging.Handler):
    """Writes each record through `tqdm.write`, so a line never lands in the middle of a drawn bar, to the
    stderr of the moment (as `logging.lastResort` does): a stream bound once outlived the invocation that
    set it (typer's CliRunner closes its capture after the command; CI's log then showed "Logging error:
    I/O operation on closed file" for a later library call in the same process)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        # The lock is taken here, outside the try, and tqdm.write told not to take it: tqdm's own write
        # releases its lock in a `finally` even when acquiring it was interrupted, so a Ctrl-C landing
        # there turned into "RuntimeError: cannot release un-acquired lock" (exit 1, not 130; seen in CI,
        # test_real_kill_int_and_term_then_resume_equals_an_uninterrupted_run).
        lock = tqdm.get_lock()
        lock.acquire()
        try:
            tqdm.write(message, file=sys.stderr, nolock=True)
        except (OSError, ValueError):  # a closed or broken stream, as logging.StreamHandler handles it
            self.handleError(record)
        finally:
            lock.release()


def configure_logging(level: int = logging.INFO) -> None:
    """Plain ``%(message)s`` lines of the ``tsenor`` logger on stderr (``sys.stderr`` when each line is
    written: a test runner's captured stream too), at `level`.

    Called by the CLI's root callback for every command; it replaces the handler of any earlier invocation.
    """
    for handler in [h for h in logger.handlers if isinstance(h, _BarSafeHandler)]:
        logger.removeHandler(handler)
    handler = _BarSafeHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def quiet_libraries() -> None:
    """`tsenor -q`: hide the progress bars, info lines and warnings of the libraries tsenor calls too
    (transformers' "Loading weights" bar, hub downloads, datasets' preparation, lm-eval's notes), leaving
    their errors; lm-eval's own bars and subprocesses are silenced around its call (`quiet_foreign_output`)."""
    import datasets
    import huggingface_hub.utils
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    huggingface_hub.utils.disable_progress_bars()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    # lm-eval logs through the standard logging tree under "lm_eval" (its warnings about passing an
    # in-memory model and overriding num_fewshot come on every run).
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


def is_quiet() -> bool:
    """Whether this invocation runs with `-q`: `configure_logging` set the ``tsenor`` logger to warnings
    only (a library caller that configured nothing is not quiet)."""
    return logger.level > logging.INFO


@contextlib.contextmanager
def quiet_foreign_output() -> Iterator[None]:
    """Under `-q`, the process's stderr (file descriptor 2) goes to /dev/null within the block; otherwise
    nothing changes.

    For a library call that writes to stderr past every logging switch: lm-eval draws its tqdm bars with
    an explicit ``disable=False`` (so neither ``TQDM_DISABLE`` nor a logger level reaches them) and runs
    ``git describe`` in the working directory with stderr not captured ("fatal: not a git repository"
    outside a checkout; lm_eval/loggers/utils.py). Its failures are exceptions, raised after the block has
    put stderr back, so the error line still shows. Nothing of tsenor's own runs inside such a call.
    """
    if not is_quiet():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
