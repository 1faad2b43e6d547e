"""The log handler that prints above tqdm bars (`progress._BarSafeHandler`)."""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Iterator

import pytest
from tqdm.auto import tqdm

from tsenor_cli.progress import configure_logging, logger


class _InterruptedLock:
    """A lock whose acquire is cut short by Ctrl-C, as a SIGINT arriving inside it does; its release,
    like threading.RLock's, refuses a lock this thread does not hold."""

    def __init__(self) -> None:
        self.inner = threading.RLock()

    def acquire(self, *args: object, **kwargs: object) -> bool:
        raise KeyboardInterrupt

    def release(self) -> None:
        self.inner.release()


@pytest.fixture
def interrupted_lock() -> Iterator[None]:
    before = tqdm.get_lock()
    tqdm.set_lock(_InterruptedLock())
    try:
        yield
    finally:
        tqdm.set_lock(before)


def test_a_line_goes_to_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging(logging.INFO)
    logger.info("block 1/8")
    assert stream.getvalue() == "block 1/8\n"


def test_ctrl_c_while_a_line_is_written_stays_a_keyboard_interrupt(
    monkeypatch: pytest.MonkeyPatch, interrupted_lock: None
) -> None:
    """tqdm.write alone released its lock in a `finally` after an interrupted acquire: the Ctrl-C became
    "RuntimeError: cannot release un-acquired lock" (exit 1 instead of 130)."""
    monkeypatch.setattr("sys.stderr", io.StringIO())
    configure_logging(logging.INFO)
    with pytest.raises(RuntimeError, match="un-acquired"):
        tqdm.write("what tqdm alone does")  # the failure this handler avoids, shown on tqdm itself
    with pytest.raises(KeyboardInterrupt):
        logger.info("block 2/8")
