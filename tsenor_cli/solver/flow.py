"""Exact transposable N:M masks by successive shortest paths, compiled for the CPU (`tsenor`'s CPU path).

Each M×M tile is a bipartite b-matching (paper eq. (2); its LP eq. (4) is integral, Section 3.1), a
small min-cost flow. Starting from dual potentials (u, v), every row keeps its n best entries by
w − v, which satisfies complementary slackness but leaves some columns over and some under n; the
excess is then moved along cheapest alternating paths (Dijkstra on reduced costs, potentials updated
after each path) until every column holds n. The result is an optimal mask and optimal potentials, so
the certified bound equals the objective up to round-off.

Why this and not the entropic iteration on CPU: on 2-core CPUs the torch pipeline (Sinkhorn, greedy,
cycle cancelling) is hundreds of small tensor operations whose cost is dispatch, not arithmetic; a
compiled per-tile loop has none of that, and the paths it needs are few once the potentials are
close (two rounds of exact dual coordinate descent from v = 0, or a previous solve's potentials for
a warm start). Measured in docs/solver.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class FlowResult:
    """mask: (B, M, M) bool, exactly n per row and column, optimal; row, col: (B, M) float64 optimal
    potentials of each tile divided by its max, which is scale (B,) float64; upper_bound: (B,) float64
    the certified bound in the scores' units (= the optimum up to round-off); paths: (B,) int64
    augmenting paths each tile needed."""

    mask: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    scale: torch.Tensor
    upper_bound: torch.Tensor
    paths: torch.Tensor


def exact_flow(
    blocks: torch.Tensor,
    n: int,
    col: torch.Tensor | None = None,
    rounds: int = 1,
    retry_excess: int | None = None,
    init_mask: torch.Tensor | None = None,
    sweeps: int = 2,
) -> FlowResult:
    """blocks: (B, M, M) non-negative scores (float32 or float64, any device), col: (B, M) starting
    column potentials in the scores' units or None for zeros, init_mask: (B, M, M) bool a previous
    mask with n per row and column or None → `FlowResult` on the blocks' device.

    Each tile is divided by its max inside the kernel (one temperature-free scale for every layer).
    `rounds` of dual coordinate descent run before the paths: each costs about 1.5 row selections and
    removes most of the remaining excess from a cold start (v = 0); a warm start from a previous
    solve's potentials often needs none. A tile whose row selection leaves more than `retry_excess`
    entries to move (None: never) runs one more round first: ALPS's scores change too much between
    iterations for its previous potentials alone (docs/solver.md). With `init_mask` (a warm start),
    `sweeps` of mask-fixed centring move the potentials off the previous solve's tight arcs and every
    row of the previous mask that still satisfies complementary slackness is kept, so only the tiles
    and rows that the new scores really changed need paths. Runs on as many threads as torch uses.
    """
    # Imported here: numba's import (~0.5 s) and the first compile (a few seconds per dtype) are paid
    # by the first solve, not by every start of the CLI.
    import numba

    from tsenor_cli.solver import _flow_jit

    B, M, _ = blocks.shape
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if sweeps < 0:
        raise ValueError(f"sweeps must be >= 0, got {sweeps}")
    if init_mask is not None and tuple(init_mask.shape) != (B, M, M):
        raise ValueError(f"init_mask has shape {tuple(init_mask.shape)}, expected {(B, M, M)}")
    if blocks.dtype not in (torch.float32, torch.float64):
        blocks = blocks.float()
    # Zero-copy for contiguous CPU tensors: the kernel normalizes each tile into its own buffer.
    w = np.ascontiguousarray(blocks.detach().cpu().numpy())  # (B, M, M)
    v = np.zeros((B, M)) if col is None else col.detach().to("cpu", torch.float64).numpy().copy()  # (B, M)
    u = np.zeros((B, M))  # read by the centring sweeps before any row sets it
    if init_mask is None:
        mask = np.empty((B, M, M), dtype=np.bool_)
    else:
        # A copy: the kernel rewrites the mask in place and the caller's previous result stays intact.
        mask = init_mask.detach().to("cpu", torch.bool).numpy().copy()
    scale = np.empty(B)
    bound = np.empty(B)
    paths = np.zeros(B, dtype=np.int64)
    most = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # set at import from the machine
    numba.set_num_threads(max(1, min(torch.get_num_threads(), most)))
    retry = B * M * M if retry_excess is None else retry_excess  # above any excess: never
    _flow_jit.solve_tiles(w, n, u, v, mask, init_mask is not None, rounds, sweeps, retry, scale, bound, paths)
    device = blocks.device
    return FlowResult(
        mask=torch.from_numpy(mask).to(device),
        row=torch.from_numpy(u).to(device),
        col=torch.from_numpy(v).to(device),
        scale=torch.from_numpy(scale).to(device),
        upper_bound=torch.from_numpy(bound).to(device),
        paths=torch.from_numpy(paths).to(device),
    )
