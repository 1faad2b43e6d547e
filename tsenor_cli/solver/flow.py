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
    potentials of the normalized tiles; paths: (B,) int64 augmenting paths each tile needed."""

    mask: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    paths: torch.Tensor


def exact_flow(w: torch.Tensor, n: int, col: torch.Tensor | None = None, rounds: int = 2) -> FlowResult:
    """w: (B, M, M) non-negative scores (any float dtype, any device), col: (B, M) starting column
    potentials in w's units or None for zeros → `FlowResult` on w's device.

    `rounds` of dual coordinate descent run before the paths: each costs about a third of a
    selection pass and removes most of the remaining excess from a cold start (v = 0); a warm start
    from a previous solve's potentials needs none. Runs on as many threads as torch uses.
    """
    # Imported here: numba's import (~0.5 s) and the first compile (~7 s) are paid by the first solve, not
    # by every start of the CLI.
    import numba

    from tsenor_cli.solver import _flow_jit

    B, M, _ = w.shape
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    w64 = np.ascontiguousarray(w.detach().to("cpu", torch.float64).numpy())  # (B, M, M)
    v = (
        np.zeros((B, M)) if col is None else np.ascontiguousarray(col.detach().to("cpu", torch.float64).numpy()).copy()
    )  # (B, M)
    u = np.empty((B, M))
    mask = np.empty((B, M, M), dtype=np.bool_)
    paths = np.zeros(B, dtype=np.int64)
    most = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # set at import from the machine
    numba.set_num_threads(max(1, min(torch.get_num_threads(), most)))
    _flow_jit.solve_tiles(w64, n, u, v, mask, rounds, paths)
    device = w.device
    return FlowResult(
        mask=torch.from_numpy(mask).to(device),
        row=torch.from_numpy(u).to(device),
        col=torch.from_numpy(v).to(device),
        paths=torch.from_numpy(paths).to(device),
    )
