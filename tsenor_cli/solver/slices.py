"""Solving a batch of independent tiles in slices, so a solver's temporaries have a fixed size."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tsenor_cli.solver.types import BlockSolution, DualState


def blocks_per_slice(max_elements: int | None, default_elements: int, m: int) -> int:
    """How many M×M tiles a slice of at most `max_elements` scores (None: `default_elements`) holds, ≥ 1."""
    if max_elements is not None and max_elements < 1:
        raise ValueError(f"max_elements must be a positive number of scores, got {max_elements}")
    return max(1, (max_elements or default_elements) // (m * m))


def _slice_state(state: DualState | None, start: int, size: int) -> DualState | None:
    if state is None:
        return None
    sl = slice(start, start + size)
    return DualState(
        row=state.row[sl],
        col=state.col[sl],
        scale=state.scale[sl],
        mask=None if state.mask is None else state.mask[sl],
    )


def _concat_solutions(parts: list[BlockSolution]) -> BlockSolution:
    uppers = [p.upper_bound for p in parts]
    states = [p.state for p in parts]
    state = None
    if all(s is not None for s in states):
        masks = [s.mask for s in states if s is not None]
        state = DualState(
            row=torch.cat([s.row for s in states if s is not None]),
            col=torch.cat([s.col for s in states if s is not None]),
            scale=torch.cat([s.scale for s in states if s is not None]),
            mask=torch.cat([m for m in masks if m is not None]) if all(m is not None for m in masks) else None,
        )
    return BlockSolution(
        mask=torch.cat([p.mask for p in parts]),
        upper_bound=torch.cat([u for u in uppers if u is not None]) if all(u is not None for u in uppers) else None,
        state=state,
        iterations=max(p.iterations for p in parts),
    )


def in_slices(
    solve_slice: Callable[[torch.Tensor, DualState | None], BlockSolution],
    blocks: torch.Tensor,
    init: DualState | None,
    per_slice: int,
) -> BlockSolution:
    """blocks: (B, M, M) → one `BlockSolution` for all of them, from `solve_slice(blocks[s], init[s])` on
    consecutive slices of `per_slice` tiles (tiles are independent, so the answer is the same as one call)."""
    B = blocks.shape[0]
    parts = [solve_slice(blocks[s : s + per_slice], _slice_state(init, s, per_slice)) for s in range(0, B, per_slice)]
    return _concat_solutions(parts)
