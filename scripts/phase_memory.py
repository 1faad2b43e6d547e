"""Where a prune's resident memory goes: a diagnostic run of `tsenor prune` in this process.

Two instruments (docs/results.md, "Where the peak memory is: the allocator"):
- a sampler thread reads /proc/self/statm about every millisecond and keeps, for each set of open phases
  (`tsenor_cli.phases`, e.g. "statistics/method/solver"), the highest RSS seen while they were open; the
  running maximum and a series every 0.2 s go to OUT.json and OUT.series;
- a census at each block's start and around each refinement: RSS, its anonymous part, the bytes of every
  live CPU tensor (each storage once, found through the garbage collector) and the RSS after glibc's
  `malloc_trim(0)`, the memory the allocator held for no tensor (suffix .census). The census trims, so it
  changes what it measures afterwards: use its numbers at its own instants.

Linux only. Stop it with SIGKILL once it has seen the blocks you need (a plain SIGTERM finishes the block).

    PYTHONPATH=. python scripts/phase_memory.py OUT.json -- prune smollm2-135m --config configs/quality-16x32.yaml \\
        --distill-steps 0 --output DIR --force
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import tsenor_cli.pruning.block.refine as refine
import tsenor_cli.pruning.run.run as run
from tsenor_cli import phases
from tsenor_cli.cli import main

PAGE = os.sysconf("SC_PAGE_SIZE")
STATM = Path("/proc/self/statm")
START = time.time()
RECORDINGS: list[phases.Timings] = []


def statm() -> tuple[int, int]:
    """(RSS, its anonymous part) in bytes."""
    fields = STATM.read_text().split()
    return int(fields[1]) * PAGE, (int(fields[1]) - int(fields[2])) * PAGE


def open_phases() -> str:
    return "/".join(o.name for o in RECORDINGS[-1]._stack) if RECORDINGS else ""


def sample(out: Path) -> None:
    """The sampler thread (module docstring)."""
    peaks: dict[str, tuple[int, int, float]] = {}
    rises: list[tuple[float, int, int, str]] = []
    best = last_dump = last_series = 0.0
    with out.with_suffix(".series").open("w") as series:
        while True:
            rss, anon = statm()
            now, where = time.time(), open_phases()
            if rss > peaks.get(where, (0, 0, 0.0))[0]:
                peaks[where] = (rss, anon, round(now - START, 3))
            if rss > best:
                best = rss
                rises = [*rises[-39:], (round(now - START, 3), rss, anon, where)]
            if now - last_series > 0.2:
                last_series = now
                series.write(f"{now - START:.2f} {rss} {anon} {where}\n")
            if now - last_dump > 5:
                last_dump = now
                partial = out.with_suffix(".tmp")
                partial.write_text(json.dumps({"peak_by_phases": peaks, "rises": rises}, indent=1))
                partial.replace(out)
            time.sleep(0.001)


def census(log: Any, label: str) -> None:
    """One census line (module docstring) and the twelve largest live tensors."""
    storages: dict[int, tuple[int, tuple[int, ...], str]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), tuple(obj.shape), str(obj.dtype))
    live = sum(size for size, _, _ in storages.values())
    rss, anon = statm()
    ctypes.CDLL(None).malloc_trim(0)
    trimmed, trimmed_anon = statm()
    log.write(
        f"{time.time() - START:.1f} {label}: RSS {rss / 1e6:.0f} MB (anonymous {anon / 1e6:.0f}), live tensors "
        f"{live / 1e6:.0f} MB in {len(storages)} storages; after malloc_trim RSS {trimmed / 1e6:.0f} MB "
        f"(anonymous {trimmed_anon / 1e6:.0f})\n"
    )
    for size, shape, dtype in sorted(storages.values(), reverse=True)[:12]:
        log.write(f"    {size / 1e6:.1f} MB {shape} {dtype}\n")
    log.flush()


def instrument(out: Path) -> None:
    log = out.with_suffix(".census").open("w")  # open for the life of the run
    timings_start = phases.Timings.start

    def start(self: phases.Timings) -> None:
        RECORDINGS.append(self)
        timings_start(self)

    train = refine._train_stages

    def train_stages(*args: Any, **kwargs: Any) -> int:
        census(log, "refinement starts")
        steps = train(*args, **kwargs)
        census(log, "refinement ends")
        return steps

    prune = run.BlockLoop.prune

    def prune_block(self: run.BlockLoop, block: Any) -> None:
        census(log, f"block {block.index} starts")
        prune(self, block)

    phases.Timings.start = start  # type: ignore[method-assign]
    refine._train_stages = train_stages
    run.BlockLoop.prune = prune_block  # type: ignore[method-assign]


if __name__ == "__main__":
    out_path, args = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1 :]
    instrument(out_path)
    threading.Thread(target=sample, args=(out_path,), daemon=True).start()
    sys.argv = ["tsenor", *args]
    main()
