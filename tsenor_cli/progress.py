"""Progress of long work: `logging` lines, and tqdm bars when stderr is a terminal.

The library reports to the ``tsenor`` logger: INFO for one line per step a user follows (model
loaded, block i/L, each layer's error), DEBUG for the inner detail (ALPS's ADMM iterations). Its
block and ADMM loops are wrapped in `bar`, a tqdm bar with ``disable=None``: drawn when stderr is a
terminal, silent otherwise, so a batch job's log holds only the plain lines. The CLI attaches the
handler (`setup_logging`) and prints log lines above the bars (`tqdm.contrib.logging`).

Library calls that take a ``progress`` callable send their status lines there instead, for callers
that route them elsewhere; `sink` turns the ``None`` default into the logger.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

logger = logging.getLogger("tsenor")

Progress = Callable[[str], None]
T = TypeVar("T")


def sink(progress: Progress | None) -> Progress:
    """`progress`, or the ``tsenor`` logger's INFO when None."""
    return progress if progress is not None else logger.info


def bar(
    iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str, unit: str, leave: bool = True
) -> Any:
    """A tqdm bar on stderr, drawn only when stderr is a terminal (``disable=None``)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, disable=None, dynamic_ncols=True)


@contextmanager
def setup_logging(level: int = logging.INFO) -> Iterator[None]:
    """Plain ``%(message)s`` lines of the ``tsenor`` logger on stderr, printed above any tqdm bar."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        with logging_redirect_tqdm(loggers=[logger]):
            yield
    finally:
        logger.removeHandler(handler)
