"""The one timing system of a prune run: where it spends its time (and, for `tsenor bench prune`, its
device and host memory), phase by phase, under one set of names (`PHASES`).

Code marks a phase with `phase(name)`; the marks go to the recording active on this thread (a context
variable), and cost one variable read when none is. `prune_model` opens one for every run
(`recording()`, or joins the one `tsenor bench prune` opened around it), prints its `line` and keeps
its seconds in the report (`PruneReport.phases`). Every phase's wall time is summed *exclusive* of the
phases nested in it (the statistics pass around a method's updates, the mask solver and CG inside
them), so the phases add up to the time they cover and what is left of the run's total is "other".
A recording made for a device (`Timings(device)`, the bench's) also synchronizes a CUDA device at each
boundary (else an asynchronous kernel's time lands in whichever phase next waits for it) and keeps the
peak of `torch.cuda.max_memory_allocated` per phase (a phase's peak includes its nested phases), and
the host's: the process's resident-set high-water mark (VmHWM) read and reset (`reset_host_peak`) at each
boundary, where the kernel allows it. The host peaks tell which phase a run's host peak fell in: the
first GPU run of the 70B shape peaked at 1.24 × its dry-run host estimate with nothing to say where
(docs/measurements/gpu-check-*-h200.md). A plain run's recording does neither, so the marks cost
it nothing on the device and nothing in system calls.

Work on another thread (the background writer's) is not marked: it overlaps the phases, and its seconds
are shown beside their sum (`Timings.background`), never in it. What it allocates is in the host peak
of whichever phase the run's own thread is in at the time.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Every phase, in the order a run meets them (`Timings.line` prints them in this order):
# plan: the checks, the plan, the lock; load: the model (less its calibration text); calibration: the
# calibration text read and tokenized; capture: the first block's inputs captured, or restored from
# the resume state; watch: the dense forwards that settle the weight matrices; statistics: each block's
# input statistics (and what else `BlockPruner.prune` does around the method); factorize, solver (the
# mask solver), method (the method's own updates), cg: inside the method; dense stream and refine:
# `--refine block` (dense stream also `--loss-aware`'s dense forward and backward before the
# blocks); rerun: the pruned block run for the next block's inputs; save: the resume state and
# the sinks' blocks (the snapshot, waiting for the background writer); write: the sinks' last step.
PHASES = (
    "plan",
    "load",
    "calibration",
    "capture",
    "watch",
    "statistics",
    "factorize",
    "solver",
    "method",
    "cg",
    "dense stream",
    "refine",
    "rerun",
    "save",
    "write",
)
# The phases only `--refine block` has (pruning/block/refine.py).
REFINE_PHASES = ("dense stream", "refine")


def _status_bytes(field_name: str) -> int:
    """A "VmXXX:  N kB" line of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field_name}")


def reset_host_peak() -> int | None:
    """Reset this process's resident-set high-water mark (VmHWM) to its resident set now and return that
    (bytes), so the next `host_peak` is the peak of what runs in between, not of what ran before (the
    random model's build); None where the kernel offers no reset (Linux before 4.0, another system)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set (proc(5))
        return _status_bytes("VmHWM")
    except OSError:
        return None


def host_peak() -> int:
    """This process's resident-set high-water mark (VmHWM) in bytes."""
    return _status_bytes("VmHWM")


@dataclass
class _Open:
    name: str
    start: float
    layer: str | None
    nested: float = 0.0  # seconds spent in phases nested inside this one


@dataclass
class Timings:
    """Exclusive seconds per phase (`seconds`), per phase and layer (`layers`, for the phases run under
    `phase(..., layer=NAME)` and those nested in them), seconds of work on other threads (`background`),
    and with a `device` the peak device bytes per phase (`peaks`) and over the recording (`peak`), which
    stay empty/None off CUDA and without a device, and the peak resident bytes of the process per phase
    (`host_peaks`) and over the recording (`host_peak`), which stay empty/None without a device or where
    the kernel cannot reset the high-water mark (the recording's start resets it)."""

    device: torch.device | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    peak: int | None = None
    background: dict[str, float] = field(default_factory=dict)
    host_peaks: dict[str, int] = field(default_factory=dict)
    host_peak: int | None = None
    _stack: list[_Open] = field(default_factory=list)

    @property
    def on_cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _fold_host_peak(self) -> None:
        """Credit the process's resident-set peak since the last reset to every open phase, then reset it."""
        if self.host_peak is None:
            return
        high = host_peak()
        self.host_peak = max(self.host_peak, high)
        for open_phase in self._stack:
            self.host_peaks[open_phase.name] = max(self.host_peaks.get(open_phase.name, 0), high)
        reset_host_peak()

    def _fold_peak(self) -> None:
        """Credit the device's and the host's peaks since the last reset to every open phase, then reset them."""
        self._fold_host_peak()
        if not self.on_cuda:
            return
        torch.cuda.synchronize(self.device)
        high = int(torch.cuda.max_memory_allocated(self.device))
        self.peak = high if self.peak is None else max(self.peak, high)
        for open_phase in self._stack:
            self.peaks[open_phase.name] = max(self.peaks.get(open_phase.name, 0), high)
        torch.cuda.reset_peak_memory_stats(self.device)

    def start(self) -> None:
        """Begin the recording: the device's peak counter starts from what is allocated now, and with a
        device the host's from the resident set now."""
        if self.device is not None:
            self.host_peak = reset_host_peak()
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
            self.add(name, own)
            if opened.layer is not None:
                per_layer = self.layers.setdefault(opened.layer, {})
                per_layer[name] = per_layer.get(name, 0.0) + own
            if self._stack:
                self._stack[-1].nested += elapsed

    def add(self, name: str, seconds: float) -> None:
        """`seconds` more of phase `name`, measured elsewhere (the plan's, made before the recording)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def line(self, total: float) -> str:
        """ "time 12.3 s: load 1.0 s, capture 0.5 s, …, other 0.1 s" (phases that took no time left out)."""
        parts = [(name, self.seconds[name]) for name in (*PHASES, "eval") if self.seconds.get(name)]
        other = total - sum(seconds for _, seconds in parts)
        shown = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in (*parts, ("other", max(other, 0.0))))
        beside = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.background.items() if seconds)
        return f"time {total:.1f} s: {shown}" + (f" (in the background, overlapping them: {beside})" if beside else "")


_ACTIVE: contextvars.ContextVar[Timings | None] = contextvars.ContextVar("tsenor_phases", default=None)


def phase(name: str, layer: str | None = None) -> contextlib.AbstractContextManager[None]:
    """Mark the code under `with` as phase `name` (one of `PHASES`) of the active recording, if any.

    layer: the full module name of the linear this phase works on; phases nested inside inherit it.
    """
    recorder = _ACTIVE.get()
    if recorder is None:
        return contextlib.nullcontext()
    return recorder.phase(name, layer)


@contextlib.contextmanager
def record_phases(device: torch.device | None = None) -> Iterator[Timings]:
    """Record the phases marked on this thread under `with` (seconds, and with `device` peak memory on CUDA)."""
    recorder = Timings(device)
    token = _ACTIVE.set(recorder)
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.finish()
        _ACTIVE.reset(token)


@contextlib.contextmanager
def recording() -> Iterator[Timings]:
    """The recording active on this thread (a bench's around the run), else a new one for the `with`."""
    active = _ACTIVE.get()
    if active is not None:
        yield active
        return
    with record_phases() as recorder:
        yield recorder
