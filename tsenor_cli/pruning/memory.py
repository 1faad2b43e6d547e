"""Whether a run fits the machine, from the plan's own estimates, before anything is allocated.

A prune whose calibration set cannot fit (``--nsamples 1000000000``) would otherwise allocate for
minutes and die inside torch's allocator. `check_fits` compares the plan's host estimate
(`HostEstimate`) with the memory this process may still take (`available_host_bytes`: the kernel's
MemAvailable, or the cgroup's remaining limit under SLURM or a container when that is smaller) and
the device estimate with the device's total memory; an estimate beyond its limit is refused with one
line (`UsageError`, exit 2: the fix is a smaller option value).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tsenor_cli.errors import UsageError
from tsenor_cli.pruning.output import human_bytes

if TYPE_CHECKING:
    from tsenor_cli.pruning.plan import MemoryEstimate

TOKEN_BYTES = 8  # int64 token ids


@dataclass(frozen=True)
class HostEstimate:
    """Peak host (CPU) memory of one process of a run (its largest rank's), in bytes.

    model: the model's parameters every process holds (the whole model, or with --stream what lies
    outside the decoder blocks and the largest block: `streamed`); tokens: the calibration token
    ids (S, T) and the (S, T) index that cuts them out of the text (every process reads all samples);
    activations: the calibration activations when they live on the CPU: on a CPU run the device
    estimate's (`MemoryEstimate.activations`), with --offload-activations the rank's hidden states
    entering and leaving a block, (S_r, T, H) twice (a distributed group's kept inputs not counted: an
    estimate that errs low refuses no run that fits), and with --refine the dense stream (S_r, T, H) too;
    work: on a CPU run, the rank's statistics, method buffers and refinement
    (`MemoryEstimate.statistics` + `workspace` + `refine`).
    """

    model: int
    tokens: int
    activations: int
    work: int
    streamed: bool = False

    @property
    def total(self) -> int:
        return self.model + self.tokens + self.activations + self.work

    def describe(self) -> str:
        """The parts for a person: "model 12.3 MiB, calibration tokens 1.0 MiB, ..."."""
        weights = "weights outside the blocks + one block" if self.streamed else "model"
        return (
            f"{weights} {human_bytes(self.model)}, calibration tokens {human_bytes(self.tokens)}, "
            f"activations {human_bytes(self.activations)}, work {human_bytes(self.work)}"
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "model": self.model,
            "tokens": self.tokens,
            "activations": self.activations,
            "work": self.work,
            "total": self.total,
            "streamed": int(self.streamed),
        }


def host_estimate(
    device_estimate: MemoryEstimate,
    *,
    device: torch.device,
    params: int,
    nsamples: int,
    seqlen: int,
    hidden_size: int,
    width: int,
    rows: int,
    offload_activations: bool,
    streamed: bool = False,
    refine: bool = False,
) -> HostEstimate:
    """The `HostEstimate` of the process whose device estimate is `device_estimate` (the largest rank's).
    width: bytes per element of the model's dtype; rows: that rank's calibration samples (S_r); params:
    the parameters the process holds (streamed: outside the blocks and the largest block)."""
    on_cpu = device.type == "cpu"
    if on_cpu:
        activations = device_estimate.activations
    elif offload_activations:
        activations = (3 if refine else 2) * rows * seqlen * hidden_size * width
    else:
        activations = 0
    return HostEstimate(
        model=params * width,
        tokens=2 * nsamples * seqlen * TOKEN_BYTES,
        activations=activations,
        work=device_estimate.statistics + device_estimate.workspace + device_estimate.refine if on_cpu else 0,
        streamed=streamed,
    )


def _cgroup_remaining() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), None without a limit."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    folder = Path("/sys/fs/cgroup") / line.partition("::")[2].lstrip("/")
    try:
        limit = (folder / "memory.max").read_text().strip()
        current = int((folder / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)


def available_host_bytes() -> int:
    """What this process may still allocate without swapping or being killed: /proc/meminfo's
    MemAvailable (free memory plus reclaimable caches), capped by the cgroup's remaining limit; where
    neither exists, the free physical pages."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # reported in KiB
    except OSError:
        available = None
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = _cgroup_remaining()
    return available if cgroup is None else min(available, cgroup)


def device_total_bytes(device: torch.device) -> int | None:
    """The total memory of a CUDA device, None for the CPU (its memory is the host's)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def check_fits(
    host: HostEstimate,
    device_bytes: int,
    device: torch.device,
    *,
    nsamples: int,
    seqlen: int,
    offload_activations: bool,
    processes: int = 1,
    host_available: int | None = None,
    device_total: int | None = None,
) -> None:
    """UsageError (one line: the estimate, the limit, the fix) when the run cannot fit.

    host: one process's estimate; processes: how many of them run on this machine at once (a dry run of
    --nproc K: K; each process of a run checks its own share); device_bytes: the largest rank's device
    peak (`PrunePlan.device_bytes`). host_available and device_total default to this machine's
    (`available_host_bytes`, `device_total_bytes`); tests pass their own.
    """
    sizes = f"--nsamples {nsamples} × --seqlen {seqlen}"
    limit = available_host_bytes() if host_available is None else host_available
    if host.total * processes > limit:
        each = f" in each of {processes} processes" if processes > 1 else ""
        raise UsageError(
            f"{sizes} needs about {human_bytes(host.total * processes)} of host memory ({host.describe()}{each}), but "
            f"{human_bytes(limit)} are available; pass a smaller --nsamples or --seqlen (nothing was written)"
        )
    total = device_total_bytes(device) if device_total is None else device_total
    if total is not None and device_bytes > total:
        fix = "pass a smaller --nsamples or --seqlen" + ("" if offload_activations else ", or --offload-activations")
        raise UsageError(
            f"{sizes} needs about {human_bytes(device_bytes)} of {device} memory per process, but the device "
            f"has {human_bytes(total)}; {fix} (nothing was written)"
        )
