"""`auto`, the default mask method: the fastest exact-or-certified solver for the device, by name.

It solves nothing itself; `resolve_method` (registry.py) turns it into the method it picks, so a
result, a report or a checkpoint's metadata names the solver that ran (`SolveResult.method`) beside
the one asked for (`SolveResult.requested`).

- M = 4: `exhaustive`, optimal by enumeration of at most 90 masks and faster than any iteration.
- CUDA: `tsenor`, the paper's entropic pipeline with fused Triton kernels: 0.012 s (8:16) and 0.026 s
  (16:32) on a 2048² matrix on an H100 (docs/measurements/benchmarks-cuda.md), 0.06 s / 0.12 s at 8192²
  (docs/design/solver.md), mean error vs the optimum 0.0007% / 0.0019%, certified gap near 0.016%.
  `flow` has no GPU kernel: it would copy the tiles to the host and solve them on its CPU cores, where
  2 cores take 0.24 s at 2048² 8:16, 20× the GPU's `tsenor` (not measured on a GPU host's CPU).
- anywhere else (the CPU): `flow`, exact and faster there: 0.24 s (8:16) and 0.36 s (16:32) at 2048²
  on 2 cores against 1.1 s and 1.4 s for the entropic pipeline (`make bench` runs of 2026-11-23,
  docs/design/solver.md).
"""

from __future__ import annotations

import torch

from tsenor_cli.solver.registry import get_method, register
from tsenor_cli.solver.types import BlockSolution, DualState


def pick(device: torch.device, m: int) -> str:
    """The method `auto` runs for scores on `device` with M×M tiles (see the module docstring)."""
    enumerable = get_method("exhaustive").max_m
    if enumerable is not None and m <= enumerable:
        return "exhaustive"
    return "tsenor" if device.type == "cuda" else "flow"


@register(
    "auto",
    "the default: exhaustive for M=4, else flow (exact) on the CPU and tsenor on CUDA; reports which ran",
    supports_init=True,
    choose=pick,
)
def auto(blocks: torch.Tensor, n: int, *, init: DualState | None = None, **options: object) -> BlockSolution:
    """blocks: (B, M, M) → the solution of the method `pick` chooses for their device and M.

    `solve` resolves `auto` before calling a method (so results name the one that ran); this is the
    same choice for callers of the block-level functions.
    """
    return get_method(pick(blocks.device, blocks.shape[1])).fn(blocks, n, init=init, **options)
