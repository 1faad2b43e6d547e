"""`tsenor-reference`: the paper's algorithm exactly as printed, the baseline for speed and quality.

1. Log-domain Dykstra (Algorithm 1, listing in Appendix A.2): row log-sum-exp normalization to N,
   column normalization to N, capacity projection with the dual variable log_Q; T = 300 iterations,
   no early stop.
2. Greedy selection on the result, then L = 10 local-search swaps (Algorithm 2).
3. `complete_feasibility` on every block still infeasible. The paper's L = 10 steps can leave blocks
   with deficit rows and columns (each step repairs at most one row/column pair, and only when the
   swap improves the objective), while our API promises exactly N per row and column. How many blocks
   needed it is reported by `run_reference` (`infeasible_after_local_search`, `forced_blocks`).

Reading of the regularization: Appendix B.1 sets "τ = 0.005·max|W|", but Algorithm 1 starts from
S⁰ = exp(τ|W|), where a τ proportional to |W| would make the regularization vanish for small weights
and blow up for large ones. As a temperature it is scale-free: we use
    log S⁰ = |W| / (0.005 · max_block |W|),   i.e. τ' = 1 / (0.005 · max_block |W|),
per block, so log S⁰ ∈ [0, 200] and exp never overflows across layers of different scale.

Dual potentials: inside the loop X = log_S + log_Q changes only by the row and column shifts of the
two normalizations (the capacity step just splits X into log_S and log_Q). With a_i, b_j the
accumulated shifts, X = τ'|W| − a_i − b_j, so u = a/τ', v = b/τ' are dual potentials of the block LP
(S ≈ min(1, exp(τ'(w − u_i − v_j)))) and `dual_upper_bound` turns them into a certified bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tsenor_cli.solver.bounds import dual_upper_bound
from tsenor_cli.solver.registry import register
from tsenor_cli.solver.rounding import complete_feasibility, greedy_select, local_search
from tsenor_cli.solver.types import BlockSolution, DualState


@dataclass(frozen=True)
class DykstraResult:
    """Output of `dykstra_log` for B blocks of size M.

    log_s: (B, M, M) log of the entropic solution S^(T); log_q: (B, M, M) log of the capacity dual Q.
    row_shift: (B, M) float64 sum of row normalization shifts a; col_shift: (B, M) float64 sum b.
    scale: (B,) float64 per-block max of the scores; temperature τ' = 1 / (tau_scale · scale).
    """

    log_s: torch.Tensor
    log_q: torch.Tensor
    row_shift: torch.Tensor
    col_shift: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class ReferenceRun:
    """`run_reference`'s result: the block solution plus rounding counters.

    infeasible_after_local_search: blocks with a row/column holding fewer than n after the paper's
      greedy selection and L local-search steps.
    forced_blocks: blocks whose completion needed a non-improving swap.
    """

    solution: BlockSolution
    infeasible_after_local_search: int
    forced_blocks: int


def _block_scale(blocks: torch.Tensor) -> torch.Tensor:
    """blocks: (B, M, M) → (B,) float64 per-block max; 1 for an all-zero block (any positive scale
    serves there, and a tiny one would turn 0/0 into NaN)."""
    peak = blocks.double().amax(dim=(1, 2))
    return torch.where(peak > 0, peak, torch.ones_like(peak))


def dykstra_log(blocks: torch.Tensor, n: int, *, tau_scale: float, iterations: int) -> DykstraResult:
    """blocks: (B, M, M) non-negative → `DykstraResult` after `iterations` steps of Algorithm 1 in
    log space (Appendix A.2 listing), computed in the blocks' dtype."""
    scale = _block_scale(blocks)  # (B,)
    log_n = math.log(n)
    # Divide in float64: tau_scale · scale can underflow float32 for tiny scores. (B, M, M) = τ'|W|
    log_s = (blocks.double() / (tau_scale * scale)[:, None, None]).to(blocks.dtype)
    log_q = torch.zeros_like(log_s)
    B, M, _ = blocks.shape
    row_shift = blocks.new_zeros(B, M, dtype=torch.float64)
    col_shift = blocks.new_zeros(B, M, dtype=torch.float64)
    for _ in range(iterations):
        r = torch.logsumexp(log_s, dim=2) - log_n  # (B, M): projection onto C1, rows sum to N
        log_s = log_s - r[:, :, None]
        c = torch.logsumexp(log_s, dim=1) - log_n  # (B, M): projection onto C2, columns sum to N
        log_s = log_s - c[:, None, :]
        tmp = log_s + log_q  # projection onto C3 (S <= 1) with Dykstra's correction Q
        log_s = tmp.clamp_max(0.0)
        log_q = tmp - log_s
        row_shift += r.double()
        col_shift += c.double()
    return DykstraResult(log_s=log_s, log_q=log_q, row_shift=row_shift, col_shift=col_shift, scale=scale)


def run_reference(
    blocks: torch.Tensor,
    n: int,
    *,
    tau_scale: float = 0.005,
    iterations: int = 300,
    local_steps: int = 10,
) -> ReferenceRun:
    """blocks: (B, M, M) non-negative → `ReferenceRun` (mask (B, M, M) bool, exactly n per row and
    column; certified bound (B,); dual state in per-block max units)."""
    if not tau_scale > 0:
        raise ValueError(f"tau_scale must be > 0, got {tau_scale}; the paper uses 0.005")
    if iterations < 0 or local_steps < 0:
        raise ValueError(
            f"iterations and local_steps must be >= 0, got {iterations} and {local_steps}; the paper uses 300 and 10"
        )
    dyk = dykstra_log(blocks, n, tau_scale=tau_scale, iterations=iterations)
    mask = greedy_select(dyk.log_s, n)  # exp is monotone: same order as S^(T)
    mask = local_search(mask, blocks, n, local_steps)
    infeasible = (mask.sum(dim=2) < n).any(dim=1)  # (B,)
    done = complete_feasibility(mask, blocks, n)
    # u = a/τ' = a·tau_scale·scale; kept in units of the per-block max like `DualState` asks.
    row = dyk.row_shift * tau_scale  # (B, M)
    col = dyk.col_shift * tau_scale
    upper = dual_upper_bound(blocks, row * dyk.scale[:, None], col * dyk.scale[:, None], n)  # (B,)
    solution = BlockSolution(
        mask=done.mask,
        upper_bound=upper,
        state=DualState(row=row, col=col, scale=dyk.scale),
        iterations=iterations,
    )
    return ReferenceRun(
        solution=solution,
        infeasible_after_local_search=int(infeasible.sum()),
        forced_blocks=done.forced_blocks,
    )


@register(
    "tsenor-reference",
    "the paper's algorithm as printed: log-domain Dykstra (T=300), greedy + 10 local-search steps",
)
def tsenor_reference(
    blocks: torch.Tensor,
    n: int,
    *,
    init: DualState | None = None,
    tau_scale: float = 0.005,
    iterations: int = 300,
    local_steps: int = 10,
) -> BlockSolution:
    """blocks: (B, M, M) → mask (B, M, M) bool via `run_reference` (see the module docstring)."""
    return run_reference(blocks, n, tau_scale=tau_scale, iterations=iterations, local_steps=local_steps).solution
