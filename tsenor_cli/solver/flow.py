"""`flow`: exact transposable N:M masks by successive shortest paths, compiled for the CPU.

Each M×M tile is a bipartite b-matching (paper eq. (2); its LP eq. (4) is integral, Section 3.1), a
small min-cost flow. Starting from dual potentials (u, v), every row keeps its n best entries by
w − v, which satisfies complementary slackness but leaves some columns over and some under n; the
excess is then moved along cheapest alternating paths (Dijkstra on reduced costs, potentials updated
after each path) until every column holds n. The result is an optimal mask and optimal potentials, so
the certified bound equals the objective up to round-off.

This is not the paper's algorithm (that is `tsenor`, solver/tsenor.py): it is an exact solver that is
faster than the entropic pipeline on CPUs. On 2-core CPUs the torch pipeline (Sinkhorn, greedy, cycle
cancelling) is hundreds of small tensor operations whose cost is dispatch, not arithmetic; a compiled
per-tile loop has none of that, and the paths it needs are few once the potentials are close (a round
of exact dual coordinate descent from v = 0, or a previous solve's potentials and mask for a warm
start). Measured in docs/design/solver.md; `auto` picks this solver on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from tsenor_cli.solver.registry import register
from tsenor_cli.solver.slices import blocks_per_slice, in_slices
from tsenor_cli.solver.types import BlockSolution, DualState

# A warm-started tile whose row selection leaves more than this × M kept entries to move runs one round
# of coordinate descent from the handed-in potentials and selects afresh. ALPS's scores change far more
# between ADMM iterations than 1% noise: its middle iterations leave 10-30 entries to move per 32×32
# tile from the previous state, more than a round leaves. `scripts/flow_study.py` (docs/design/solver.md).
RETRY_EXCESS_PER_M = 0.25
# Mask-fixed centring sweeps of a warm start (solver/_flow_jit.py `_center`): on 2048² real tiles with
# 1% noise, 2 sweeps leave 0.6 (8:16) and 2.2 (16:32) paths per tile where the previous potentials alone
# leave 2.6 and 7.5; a third saves little at 1% noise and costs ALPS, whose stale tiles retry (docs/design/solver.md).
WARM_CENTRING_SWEEPS = 2
# Scores per kernel call: bounds the float64 potentials and the mask buffers the kernel fills (in host
# memory whatever the input's device) to a fixed size on large matrices.
SLICE_ELEMENTS = 1 << 22


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


@dataclass(frozen=True)
class FlowOptions:
    """How `exact_flow` starts. rounds: dual coordinate descent rounds before the paths: each costs about 1.5
    row selections and removes most of the remaining excess from a cold start (v = 0); a warm start from a
    previous solve's potentials often needs none. retry_excess: a tile whose row selection leaves more than
    this many entries to move (None: never) runs one more round first: ALPS's scores change too much
    between iterations for its previous potentials alone (docs/design/solver.md). sweeps: with a previous
    mask, mask-fixed centring sweeps of the potentials (off the previous solve's tight arcs)."""

    rounds: int = 1
    retry_excess: int | None = None
    sweeps: int = 2

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")
        if self.sweeps < 0:
            raise ValueError(f"sweeps must be >= 0, got {self.sweeps}")


@contextmanager
def _kernel_threads() -> Iterator[None]:
    """numba's threads set to torch's (at most the machine's), and torch's put back afterwards."""
    # Imported here: numba's import (~0.5 s) and the first compile (a few seconds per dtype) are paid
    # by the first solve, not by every start of the CLI.
    import numba

    most = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # set at import from the machine
    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, most)))
    try:
        yield
    finally:
        # The first parallel kernel starts numba's OpenMP pool, which sets the process's OpenMP thread
        # count, torch's too, to all of the machine's threads. Put torch's back: float results must not
        # depend on whether a solve ran earlier in the process (a resumed prune would differ from an
        # uninterrupted one in the blocks it computes before its first solve).
        torch.set_num_threads(threads)


def exact_flow(
    blocks: torch.Tensor,
    n: int,
    col: torch.Tensor | None = None,
    init_mask: torch.Tensor | None = None,
    options: FlowOptions | None = None,
) -> FlowResult:
    """blocks: (B, M, M) non-negative scores (float32 or float64, any device), col: (B, M) starting
    column potentials in the scores' units or None for zeros, init_mask: (B, M, M) bool a previous
    mask with n per row and column or None → `FlowResult` on the blocks' device.

    Each tile is divided by its max inside the kernel (one temperature-free scale for every layer); then
    `options.rounds` of dual coordinate descent and the paths (`FlowOptions`). With `init_mask` (a warm
    start), `options.sweeps` of mask-fixed centring move the potentials off the previous solve's tight arcs
    and every row of the previous mask that still satisfies complementary slackness is kept, so only the
    tiles and rows that the new scores really changed need paths. Runs on as many threads as torch uses.
    """
    from tsenor_cli.solver import _flow_jit

    opts = FlowOptions() if options is None else options
    B, M, _ = blocks.shape
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
    scale, bound, paths = np.empty(B), np.empty(B), np.zeros(B, dtype=np.int64)
    retry = B * M * M if opts.retry_excess is None else opts.retry_excess  # above any excess: never
    warm = init_mask is not None
    with _kernel_threads():
        _flow_jit.solve_tiles(w, n, u, v, mask, warm, opts.rounds, opts.sweeps, retry, scale, bound, paths)
    device = blocks.device
    return FlowResult(
        mask=torch.from_numpy(mask).to(device),
        row=torch.from_numpy(u).to(device),
        col=torch.from_numpy(v).to(device),
        scale=torch.from_numpy(scale).to(device),
        upper_bound=torch.from_numpy(bound).to(device),
        paths=torch.from_numpy(paths).to(device),
    )


def load_kernels(dtype: torch.dtype) -> None:
    """Load what the first solve on `dtype` scores loads, by solving one 2×2 tile: numba, llvmlite and the
    kernels compiled for that dtype (from numba's cache, or compiled now). On the CPU they add about
    0.1 GB to the process's resident memory (0.25 GB → 0.4 GB after one float32 solve, fifteenth
    session), which a dry run measuring the process without them would miss (`MethodInfo.prepare`)."""
    exact_flow(torch.ones(1, 2, 2, dtype=dtype), 1)


@register(
    "flow",
    "exact per tile: min-cost flow by successive shortest paths from dual potentials (compiled, runs on the CPU)",
    exact=True,
    supports_init=True,
    prepare=load_kernels,
)
def flow(
    blocks: torch.Tensor,
    n: int,
    *,
    init: DualState | None = None,
    dual_rounds: int | None = None,
    max_elements: int | None = None,
) -> BlockSolution:
    """blocks: (B, M, M) non-negative → the optimal mask (B, M, M) bool per tile, exactly n per row and
    column, with optimal potentials (so the certified bound equals the objective up to round-off).

    Runs on the CPU: tiles on another device (CUDA) are copied to host memory for the compiled kernel
    and the answer is copied back, which is correct but slower there than `tsenor` on the GPU (`auto`
    picks by device). `dual_rounds`: rounds of dual coordinate descent before the paths (default 1
    cold, 0 warm). `max_elements`: scores per kernel call (default 2²²), which bounds its buffers.

    A warm start reuses the previous column potentials (in score units; the kernel divides them by the
    new per-tile max) and, when the state has one, the previous mask: after a few mask-fixed centring
    sweeps of the potentials, every row of it that still satisfies complementary slackness is kept,
    so a tile the new scores did not change needs no path (docs/design/solver.md, warm start).
    """
    if dual_rounds is not None and dual_rounds < 0:
        raise ValueError(f"dual_rounds must be >= 0, got {dual_rounds}")
    B, M, _ = blocks.shape
    per_slice = blocks_per_slice(max_elements, SLICE_ELEMENTS, M)
    if per_slice < B:
        return in_slices(
            lambda part, state: flow(part, n, init=state, dual_rounds=dual_rounds, max_elements=max_elements),
            blocks,
            init,
            per_slice,
        )
    col = None
    init_mask = None
    if init is not None:
        col = init.col.to(blocks.device, torch.float64) * init.scale.to(blocks.device, torch.float64)[:, None]
        init_mask = init.mask
    rounds = dual_rounds if dual_rounds is not None else (1 if init is None else 0)
    retry = None if init is None else int(RETRY_EXCESS_PER_M * M)
    res = exact_flow(blocks, n, col, init_mask, FlowOptions(rounds, retry, WARM_CENTRING_SWEEPS))
    dtype = blocks.dtype if blocks.dtype in (torch.float32, torch.float64) else torch.float32
    return BlockSolution(
        mask=res.mask,
        upper_bound=res.upper_bound,
        state=DualState(row=res.row.to(dtype), col=res.col.to(dtype), scale=res.scale.to(dtype), mask=res.mask),
        iterations=int(res.paths.max()) if res.paths.numel() else 0,
    )
