"""Where a prune run spends its time and device memory, phase by phase (for `tsenor bench prune`).

The engine marks its phases with `phase(name)`. Outside `record_phases()` a mark costs one context
variable read and nothing else, so `tsenor prune` pays nothing for it. Inside, every phase's wall time
is summed *exclusive* of the phases nested in it (the mask solver and CG run inside a method's
updates; the updates are what is left), so the phases add up to the time they cover. On CUDA each
boundary synchronizes the device (else an asynchronous kernel's time lands in whichever phase next
waits for it) and the peak of `torch.cuda.max_memory_allocated` is kept per phase (a phase's peak
includes its nested phases); on other devices peaks are None.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

# The phases the engine marks, in the order a block meets them.
PHASES = ("calibration", "capture", "statistics", "factorize", "mask solver", "updates", "cg", "rerun", "save")
# The phases only `--refine block` has (pruning/refine.py): the dense block's forward on the dense stream,
# and the refinement (its error passes and its training).
REFINE_PHASES = ("dense stream", "refine")


@dataclass
class _Open:
    name: str
    start: float
    layer: str | None
    nested: float = 0.0  # seconds spent in phases nested inside this one


@dataclass
class PhaseRecorder:
    """Sums of exclusive seconds per phase (`seconds`), per phase and layer (`layers`, for the phases
    run under `phase(..., layer=NAME)` and those nested in them), and the peak device bytes per phase
    (`peaks`) and over the whole recording (`peak`); peaks stay empty/None off CUDA."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)
    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    peak: int | None = None
    _stack: list[_Open] = field(default_factory=list)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _fold_peak(self) -> None:
        """Credit the device's peak since the last reset to every open phase, then reset it."""
        if not self.on_cuda:
            return
        torch.cuda.synchronize(self.device)
        high = int(torch.cuda.max_memory_allocated(self.device))
        self.peak = high if self.peak is None else max(self.peak, high)
        for open_phase in self._stack:
            self.peaks[open_phase.name] = max(self.peaks.get(open_phase.name, 0), high)
        torch.cuda.reset_peak_memory_stats(self.device)

    def start(self) -> None:
        """Begin the recording: the device's peak counter starts from what is allocated now."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def finish(self) -> None:
        """End the recording: fold the last peak (call once the recorded work is done)."""
        self._fold_peak()

    @contextlib.contextmanager
    def phase(self, name: str, layer: str | None = None) -> Iterator[None]:
        self._fold_peak()
        parent_layer = self._stack[-1].layer if self._stack else None
        opened = _Open(name, time.perf_counter(), layer if layer is not None else parent_layer)
        self._stack.append(opened)
        try:
            yield
        finally:
            self._fold_peak()
            self._stack.pop()
            elapsed = time.perf_counter() - opened.start
            own = elapsed - opened.nested
            self.seconds[name] = self.seconds.get(name, 0.0) + own
            if opened.layer is not None:
                per_layer = self.layers.setdefault(opened.layer, {})
                per_layer[name] = per_layer.get(name, 0.0) + own
            if self._stack:
                self._stack[-1].nested += elapsed


_ACTIVE: contextvars.ContextVar[PhaseRecorder | None] = contextvars.ContextVar("tsenor_phases", default=None)


def phase(name: str, layer: str | None = None) -> contextlib.AbstractContextManager[None]:
    """Mark the code under `with` as phase `name` (one of PHASES or REFINE_PHASES) of the active recording, if any.

    layer: the full module name of the linear this phase works on; phases nested inside inherit it.
    """
    recorder = _ACTIVE.get()
    if recorder is None:
        return contextlib.nullcontext()
    return recorder.phase(name, layer)


@contextlib.contextmanager
def record_phases(device: torch.device) -> Iterator[PhaseRecorder]:
    """Record the phases marked on this thread under `with` (seconds, and peak memory on CUDA)."""
    recorder = PhaseRecorder(device)
    token = _ACTIVE.set(recorder)
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.finish()
        _ACTIVE.reset(token)
