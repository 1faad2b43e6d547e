"""Public entry points: validate once, tile, dispatch to a registered block solver, certify."""

from __future__ import annotations

import time

import torch

from tsenor_cli.solver.bounds import coordinate_upper_bound
from tsenor_cli.solver.registry import MethodInfo, resolve_method
from tsenor_cli.solver.tiling import from_blocks, to_blocks, validate_scores
from tsenor_cli.solver.types import DualState, SolveResult


def _init_state(init: SolveResult | DualState | None, blocks: torch.Tensor) -> DualState | None:
    if init is None:
        return None
    state = init.state if isinstance(init, SolveResult) else init
    if state is None:
        return None
    B, M, _ = blocks.shape
    if tuple(state.row.shape) != (B, M) or tuple(state.col.shape) != (B, M):
        raise ValueError(
            f"init has potentials for {tuple(state.row.shape)} blocks but the scores give ({B}, {M}); "
            "warm-start only from a result on a matrix of the same shape and N:M"
        )
    return state


def _block_objective(blocks: torch.Tensor, mask: torch.Tensor, chunk_elements: int = 1 << 22) -> torch.Tensor:
    """blocks: (B, M, M), mask: (B, M, M) bool → (B,) float64 sum of the kept scores per block.

    In slices of about `chunk_elements` scores: a float64 copy of the whole matrix would be twice its
    size, the largest allocation of a solve on a big matrix (docs/measurements/benchmarks.md, large matrix).
    """
    B, M, _ = blocks.shape
    step = max(1, chunk_elements // (M * M))
    parts = [(blocks[s : s + step].double() * mask[s : s + step]).sum((1, 2)) for s in range(0, B, step)]
    return torch.cat(parts) if parts else blocks.new_zeros(0, dtype=torch.float64)


def _method(method: str, scores: torch.Tensor, m: int, options: dict[str, object]) -> MethodInfo:
    """The method that runs when `method` is asked for on `scores` with M = m; ValueError when it does not
    handle M or does not take one of `options`."""
    info = resolve_method(method, scores.device, m, scores.numel())
    named = repr(method) if info.name == method else f"{method!r} (which runs {info.name!r} here)"
    if info.max_m is not None and m > info.max_m:
        raise ValueError(f"method {named} handles M <= {info.max_m}, got M={m}; use method='auto' or 'exact'")
    unknown = sorted(set(options) - set(info.options))
    if unknown:
        raise ValueError(
            f"option(s) {', '.join(unknown)} do not apply to method {named}; "
            f"its options: {', '.join(info.options) or 'none'}"
        )
    return info


def solve(
    scores: torch.Tensor,
    n: int,
    m: int,
    method: str = "auto",
    *,
    init: SolveResult | DualState | None = None,
    **options: object,
) -> SolveResult:
    """Transposable N:M mask of `scores` with its objective and a certified upper bound.

    scores: (R, C) non-negative float, R and C divisible by m → `SolveResult` whose mask is (R, C)
    bool with exactly n kept in every row and column of every m×m tile. `method` "auto" runs the
    method it picks for the scores' device, M and size (solver/auto.py); `SolveResult.method` names the one
    that ran. `options` go to that method and must be among its options.
    """
    validate_scores(scores, n, m)
    info = _method(method, scores, m, options)
    rows, cols = scores.shape
    work_dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    blocks = to_blocks(scores.to(work_dtype), m)  # (B, M, M)
    state = _init_state(init, blocks) if info.supports_init else None

    if scores.is_cuda:
        torch.cuda.synchronize(scores.device)
    start = time.perf_counter()
    sol = info.fn(blocks, n, init=state, **options)
    if scores.is_cuda:
        torch.cuda.synchronize(scores.device)
    seconds = time.perf_counter() - start

    mask_blocks = sol.mask  # (B, M, M) bool
    block_obj = _block_objective(blocks, mask_blocks)  # (B,)
    block_ub = coordinate_upper_bound(blocks, n) if sol.upper_bound is None else sol.upper_bound.double()
    # A bound below the objective can only be round-off of an optimal block; never report a negative gap.
    block_ub = torch.maximum(block_ub, block_obj)
    objective, upper = torch.stack([block_obj.sum(), block_ub.sum()]).tolist()  # one device read
    gap = (upper - objective) / upper if upper > 0 else 0.0
    return SolveResult(
        mask=from_blocks(mask_blocks, rows, cols),
        objective=objective,
        upper_bound=upper,
        gap=gap,
        block_objective=block_obj,
        block_upper_bound=block_ub,
        iterations=sol.iterations,
        seconds=seconds,
        method=info.name,
        requested=method,
        n=n,
        m=m,
        state=sol.state,
    )


def transposable_nm_mask(
    scores: torch.Tensor,
    n: int,
    m: int,
    method: str = "auto",
    *,
    init: SolveResult | DualState | None = None,
    **options: object,
) -> torch.Tensor:
    """scores: (R, C) → mask (R, C) bool, exactly n per row and column of every m×m tile."""
    return solve(scores, n, m, method, init=init, **options).mask
