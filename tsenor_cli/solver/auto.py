"""`auto`, the default mask method: the fastest exact-or-certified solver for the device, by name.

It solves nothing itself; `resolve_method` (registry.py) turns it into the method it picks, so a
result, a report or a checkpoint's metadata names the solver that ran (`SolveResult.method`) beside
the one asked for (`SolveResult.requested`).

- M = 4: `exhaustive`, optimal by enumeration of at most 90 masks and faster than any iteration.
- CUDA, a weight matrix: `tsenor`, the paper's entropic pipeline with fused Triton kernels: 0.012 s (8:16)
  and 0.026 s (16:32) on a 2048² matrix on an H100 (docs/measurements/benchmarks-cuda.md), 0.06 s /
  0.12 s at 8192² (docs/design/solver.md), mean error vs the optimum 0.0007% / 0.0019%, certified gap
  near 0.016%. `flow` has no GPU kernel: it copies the tiles to the host and solves them on its CPU
  cores, where 2 cores take 0.18 s at 2048² 8:16, 15× the GPU's `tsenor` (not measured on a GPU host's CPU).
- CUDA, a few tiles (at most `HOST_SCORES` scores: transposable SparseGPT's slabs of M columns, small
  experts): `flow` on the host. Such a call costs the GPU solver its launches and host syncs, not its
  arithmetic: on the H100, SparseGPT's transposable 16:32 solves of one slab (64 tiles of 32², or 16 for
  k_proj) each took about 16 ms, whatever their number of tiles (a 2048-wide attention linear 1.2-2.2 s
  transposable against 0.2-0.3 s ordinary, 64 slabs: docs/measurements/gpu.md). `flow` takes about
  70 ns a score on 2 CPU cores (2048² in 0.29 s at 16:32, 0.18 s at 8:16:
  docs/measurements/bench-solver.json) plus a copy each way of a few hundred KiB, exact, so it is the
  cheaper call up to about 2^18 scores (256 tiles of 32², 18 ms on 2 cores; a GPU host has more cores).
- anywhere else (the CPU): `flow`, exact and faster there: 0.24 s (8:16) and 0.36 s (16:32) at 2048²
  on 2 cores against 1.1 s and 1.4 s for the entropic pipeline (`make bench`, docs/design/solver.md).
"""

from __future__ import annotations

import torch

from tsenor_cli.solver.registry import get_method, register
from tsenor_cli.solver.types import BlockSolution, DualState

# The most scores a CUDA solve sends to `flow` on the host rather than to `tsenor` (module docstring).
HOST_SCORES = 1 << 18


def pick(device: torch.device, m: int, scores: int | None = None) -> str:
    """The method `auto` runs for `scores` scores (None: a whole weight matrix) on `device` with M×M
    tiles (see the module docstring)."""
    enumerable = get_method("exhaustive").max_m
    if enumerable is not None and m <= enumerable:
        return "exhaustive"
    if device.type != "cuda":
        return "flow"
    return "flow" if scores is not None and scores <= HOST_SCORES else "tsenor"


@register(
    "auto",
    "the default: exhaustive for M=4, else flow (exact) on the CPU and for a few tiles on CUDA, tsenor for a "
    "matrix on CUDA; reports which ran",
    supports_init=True,
    choose=pick,
)
def auto(blocks: torch.Tensor, n: int, *, init: DualState | None = None, **options: object) -> BlockSolution:
    """blocks: (B, M, M) → the solution of the method `pick` chooses for their device and M.

    `solve` resolves `auto` before calling a method (so results name the one that ran); this is the
    same choice for callers of the block-level functions.
    """
    return get_method(pick(blocks.device, blocks.shape[1], blocks.numel())).fn(blocks, n, init=init, **options)
