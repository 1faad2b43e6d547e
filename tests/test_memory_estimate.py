"""The device-memory estimate (`pruning/block/memory.py`) against what the code allocates.

torch.profiler's memory events count every allocation of torch's CPU allocator, the workspaces that
LAPACK routines take inside a kernel included, so a CPU run can be accounted byte by byte. A run on the
CPU holds its block and activations in the same memory as the rest of the process; the device part is
what the block loop adds to what was live when the calibration capture began, plus the block (which a
GPU run copies to the device). Each prune of a tiny LLaMA-shaped model must then peak at or below the
plan's estimate, and the estimate stay within 1.25× of that peak (issue 42: the H100 measured 1.34× the
other way).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers_tiny import LOCAL_CTX
from torch.profiler import ProfilerActivity, profile, record_function

from tsenor_cli import phases
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.memory import SOLVER_COPIES, MethodCost, matrix_workspace
from tsenor_cli.pruning.methods.method_options import ALPSOptions
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.plan.plan import plan_model
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.settings.config import PruneConfig

# Within this of the measured peak (issue 42's bound for the GPU; the CPU's accounting is exact).
SLACK = 1.25
# The block loop's phases (`phases.py`): what the device holds between the capture and the write.
LOOP = ("statistics", "factorize", "solver", "method", "cg", "rerun")


@pytest.fixture(scope="module")
def model(tiny_llama: Callable[..., Path]) -> Path:
    """LLaMA-3.2-1B's proportions at 1/16 of its width: hidden 128, MLP 4× wider (512), 4 query heads
    sharing one key/value head; wide enough that the method's buffers, not Python's small objects,
    make the peak."""
    return tiny_llama(hidden_size=128, intermediate_size=512, num_heads=4, num_kv_heads=1)


class _Marking(phases.Timings):
    """A phase recorder whose phases are also profiler ranges, so allocations can be placed in them."""

    @contextlib.contextmanager
    def phase(self, name: str, layer: str | None = None) -> Iterator[None]:
        with record_function(f"phase:{name}"), super().phase(name, layer):
            yield


def _live_bytes(run: Callable[[], object]) -> tuple[list[int], list[int], list[tuple[int, int, str]]]:
    """Run `run` under the profiler → (event times, live bytes after each allocation or free, the
    phases as (start, end, name)), all on the profiler's clock."""
    recorder = _Marking(torch.device("cpu"))
    token = phases._ACTIVE.set(recorder)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
    finally:
        phases._ACTIVE.reset(token)
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    spans = sorted((e.start_ns(), e.end_ns(), e.name()[6:]) for e in events if e.name().startswith("phase:"))
    times, live, total = [], [], 0
    for time, size in memory:
        total += size
        times.append(time)
        live.append(total)
    return times, live, spans


def _loop_peak(times: list[int], live: list[int], spans: list[tuple[int, int, str]]) -> int:
    """The most bytes live from the loop's first phase to its last (the error check after each method
    runs outside any phase) beyond those live when the capture began."""
    capture = next(start for start, _end, name in spans if name == "capture")
    base = live[bisect.bisect_right(times, capture) - 1]
    loop = [(start, end) for start, end, name in spans if name in LOOP]
    lo, hi = bisect.bisect_left(times, loop[0][0]), bisect.bisect_right(times, max(end for _start, end in loop))
    return max(live[lo:hi]) - base


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt", "alps"])
@pytest.mark.parametrize("transposable", [True, False], ids=["transposable", "ordinary"])
def test_the_device_estimate_bounds_what_a_run_allocates(
    method: str, transposable: bool, model: Path, calibration_text: Path, tmp_path: Path
) -> None:
    pattern = SparsityPattern.from_nm(4, 8, transposable=transposable)
    cfg = PruneConfig(
        model=str(model),
        matrix=MatrixPruneConfig(pattern, options=ALPSOptions(max_iter=30) if method == "alps" else None),
        method=method,
        calib_data=str(calibration_text),
        nsamples=4,
        seqlen=64,
        output=tmp_path / "out",
        resume=False,
        # The device estimate, on a whole load: a streamed run's block reads are host memory, which
        # `tsenor bench memory` measures as RSS (the profiler counted 247 MB more here when streamed: to
        # be explained, see issue 42's note).
        stream=False,
    )
    estimate = plan_model(cfg, LOCAL_CTX).device_memory[0]
    measured = _loop_peak(*_live_bytes(lambda: prune_model(cfg, LOCAL_CTX))) + estimate.block
    assert measured <= estimate.total <= SLACK * measured, (estimate.to_dict(), measured)


@pytest.mark.parametrize("solver", sorted(SOLVER_COPIES))
@pytest.mark.parametrize(("rows", "cols", "n", "m"), [(64, 128, 2, 4), (128, 256, 8, 16), (256, 256, 16, 32)])
def test_each_solvers_working_set_is_bounded(solver: str, rows: int, cols: int, n: int, m: int) -> None:
    """Magnitude pruning alone measures the solver: its dense copy, the scores and the solver's peak."""
    if solver == "exhaustive" and m > 4:
        pytest.skip("exhaustive solves M <= 4 only")
    spec = get_pruner("magnitude")
    cfg = MatrixPruneConfig(SparsityPattern.from_nm(n, m, transposable=True), solver=solver)
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    times, live, _spans = _live_bytes(lambda: spec.prune(weight.clone(), None, cfg))
    measured = max(live)
    cost = MethodCost.of(spec, cfg.pattern, solver, device=torch.device("cpu"), width=4)
    estimate = matrix_workspace(rows, cols, cost)
    # tsenor's working set varies most with the shape (16-26 copies of the scores): its entry is its worst.
    assert measured <= estimate <= (1.5 if solver == "tsenor" else SLACK) * measured, (measured, estimate)


# Run in a fresh interpreter: what glibc keeps of freed blocks depends on the heap's history (its dynamic mmap
# threshold, the arenas earlier tests' threads left), and in a full CI run the trim once gave back 15 of the
# 32 MiB freed here while the same test alone gives back all of it.
_FREED_SCENARIO = """
import threading, psutil, torch
from tsenor_cli.pruning.block import memory
if memory._malloc_trim() is None:
    print("skip: this C library has no malloc_trim"); raise SystemExit
process = psutil.Process()
large, small = [], []
def allocate():
    for _ in range(128):
        large.append(torch.ones(1 << 16))  # 256 KiB
        small.append(torch.ones(16))
worker = threading.Thread(target=allocate)
worker.start()
worker.join()
before = process.memory_info().rss
large.clear()
kept = process.memory_info().rss - (before - 32 * 2**20)
if kept < 24 * 2**20:
    print("skip: this C library gave the freed pages back by itself"); raise SystemExit
memory.return_free_memory()
print(before, process.memory_info().rss)
"""


def test_freed_memory_the_allocator_kept_goes_back_to_the_system() -> None:
    """`return_free_memory` gives back the pages of blocks a worker thread allocated and freed, which glibc
    keeps in that thread's arena (what held 0.4-0.5 GB past each block's method work in the 16:32 recipe):
    128 tensors of 256 KiB, each followed by a small one that keeps it off the arena's top, freed."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FREED_SCENARIO], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("skip: "):
        pytest.skip(done.stdout.strip().removeprefix("skip: "))
    before, after = (int(value) for value in done.stdout.split())
    assert after <= before - 24 * 2**20
