"""Graceful stops: a scheduler's signal asks a long run to finish its current step, save and exit.

SLURM sends SIGTERM on preemption and at the time limit (then SIGKILL after KillWait, 30 s by default),
and can send SIGUSR1/SIGUSR2 ahead of the limit (``#SBATCH --signal=USR1@300``); submitit uses SIGUSR2.
Inside `stop_on_signals` the first of these only records the request (`StopRequest`); the run polls it
at safe points (after a block's resume state is saved), stops there and exits with
`errors.EXIT_RESUMABLE`. A second such signal, or Ctrl-C at any time, raises KeyboardInterrupt at once:
the current step is abandoned, and what was saved before it stays consistent because every save is an
atomic rename.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

GRACEFUL_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopRequest:
    """Which graceful signal asked the run to stop (`name`, e.g. "SIGTERM"), None while none has."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._at_once = 0

    @property
    def requested(self) -> bool:
        return self.name is not None

    def request(self, name: str) -> None:
        """Record a stop request; a second one, or one inside `at_once`, means "stop now" and raises
        KeyboardInterrupt (`name` keeps the first signal's)."""
        if self.name is not None:
            raise KeyboardInterrupt
        self.name = name
        if self._at_once:
            raise KeyboardInterrupt

    @contextmanager
    def at_once(self) -> Iterator[None]:
        """Within the block a stop signal stops at once, as Ctrl-C does: for work with no safe point to
        stop at and nothing to save part-way (an evaluation), which would outlast the scheduler's
        KillWait. A request made before the block stops at its start."""
        if self.name is not None:
            raise KeyboardInterrupt
        self._at_once += 1
        try:
            yield
        finally:
            self._at_once -= 1


@contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = GRACEFUL_SIGNALS) -> Iterator[StopRequest]:
    """Within the block, `signals` set the yielded `StopRequest` instead of ending the process; the
    previous handlers come back on exit. Outside the main thread (where Python delivers signals) no
    handler can be installed, so the request is never set and the signals keep their usual effect."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        stop.request(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield stop
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
