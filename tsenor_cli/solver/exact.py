"""`exact`: the provably optimal transposable N:M mask of every block, by linear programming.

The LP relaxation of the block problem (paper eq. (4)),
    max <S, w>  s.t.  S1 = n1,  Sᵀ1 = n1,  0 <= S <= 1,
has a totally unimodular constraint matrix (bipartite b-matching polytope, Section 3.1), so every
vertex is integral. HiGHS' dual simplex (`scipy.optimize.linprog(method="highs-ds")`) returns a
vertex, hence an optimal 0/1 mask. All blocks of a chunk go into ONE sparse block-diagonal LP.
The returned solution is checked to be integral (never silently rounded), and the row/column
duals HiGHS reports give a certified upper bound through weak duality (`bounds.dual_upper_bound`),
which must match the objective: an independent optimality certificate.

Each block is divided by its maximum before solving: this does not change the optimal mask and
keeps HiGHS' absolute tolerances (1e-7) meaningful for scores of any scale (e.g. W² ~ 1e-6).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from scipy.optimize import linprog

from tsenor_cli.solver.bounds import dual_upper_bound
from tsenor_cli.solver.registry import register
from tsenor_cli.solver.types import BlockSolution, DualState

INTEGRALITY_TOL = 1e-6
# Relative mismatch allowed between the primal objective and the dual certificate of a block.
CERTIFICATE_RTOL = 1e-6
# Dual simplex time grows faster than linearly in the LP size: measured on 512 SmolLM2 tiles at 16:32,
# 16-block chunks took 3.0 s against 9.3 s for 512-block chunks (2-core CPU, see docs/design/solver-baselines.md).
DEFAULT_CHUNK_VARIABLES = 1 << 14


def _constraint_matrix(blocks: int, m: int) -> sp.csc_array:
    """(2·blocks·m, blocks·m²) 0/1 matrix: row sums then column sums of every block.

    Variable b·m² + i·m + j is S[b, i, j]; constraint b·2m + i is row i of block b and
    b·2m + m + j is column j of block b.
    """
    var = np.arange(blocks * m * m, dtype=np.int64)
    b, rem = np.divmod(var, m * m)
    i, j = np.divmod(rem, m)
    row_con = b * 2 * m + i
    col_con = b * 2 * m + m + j
    rows = np.concatenate([row_con, col_con])
    cols = np.concatenate([var, var])
    data = np.ones(rows.shape[0], dtype=np.float64)
    return sp.csc_array((data, (rows, cols)), shape=(2 * blocks * m, blocks * m * m))


def _solve_chunk(w: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w: (b, M, M) float64 in [0, 1] → (x (b, M, M) float64 vertex, u (b, M), v (b, M) duals)."""
    b, m, _ = w.shape
    a_eq = _constraint_matrix(b, m)
    b_eq = np.full(2 * b * m, float(n))
    res = linprog(-w.reshape(-1), A_eq=a_eq, b_eq=b_eq, bounds=(0.0, 1.0), method="highs-ds")
    if res.status != 0:
        raise RuntimeError(f"HiGHS failed on the transposable N:M LP: {res.message}")
    # linprog minimizes −<w, x>; its equality marginals y are ∂(min)/∂b, so the duals of the
    # maximization are −y (row part, then column part of each block).
    y = -np.asarray(res.eqlin.marginals, dtype=np.float64).reshape(b, 2 * m)
    return np.asarray(res.x, dtype=np.float64).reshape(b, m, m), y[:, :m], y[:, m:]


@register(
    "exact",
    "provably optimal per tile: sparse LP (integral polytope) solved by HiGHS dual simplex (CPU)",
    exact=True,
)
def exact(
    blocks: torch.Tensor,
    n: int,
    *,
    init: DualState | None = None,
    chunk_variables: int = DEFAULT_CHUNK_VARIABLES,
) -> BlockSolution:
    """blocks: (B, M, M) non-negative → mask (B, M, M) bool (optimal, on blocks' device), upper
    bound (B,) float64 from the LP duals, and the duals as `DualState` (per-block max units).

    `chunk_variables`: at most this many LP variables (blocks·M²) per HiGHS call.
    """
    if chunk_variables < 1:
        raise ValueError(f"chunk_variables must be >= 1, got {chunk_variables}; e.g. {DEFAULT_CHUNK_VARIABLES}")
    B, M, _ = blocks.shape
    w = blocks.detach().to("cpu", torch.float64)  # (B, M, M)
    scale = w.amax(dim=(1, 2)).clamp_min(torch.finfo(torch.float64).tiny)  # (B,)
    wn = (w / scale[:, None, None]).numpy()  # (B, M, M) in [0, 1]
    per = max(1, chunk_variables // (M * M))
    x = np.empty((B, M, M), dtype=np.float64)
    u = np.empty((B, M), dtype=np.float64)
    v = np.empty((B, M), dtype=np.float64)
    for start in range(0, B, per):
        part = slice(start, start + per)
        x[part], u[part], v[part] = _solve_chunk(wn[part], n)
    frac = np.abs(x - np.round(x))
    if frac.max(initial=0.0) >= INTEGRALITY_TOL:
        bad = int((frac.reshape(B, -1).max(axis=1) >= INTEGRALITY_TOL).sum())
        raise RuntimeError(
            f"HiGHS returned a fractional LP solution in {bad} blocks (max deviation {frac.max():.2e}); "
            "the b-matching LP must have an integral vertex optimum"
        )
    mask = torch.from_numpy(np.round(x) > 0.5)  # (B, M, M)
    counts_ok = bool((mask.sum(2) == n).all()) and bool((mask.sum(1) == n).all())
    if not counts_ok:
        raise RuntimeError("HiGHS returned a mask that does not keep exactly n per row and column")
    row = torch.from_numpy(u)  # (B, M) in units of the per-block max
    col = torch.from_numpy(v)
    upper = dual_upper_bound(w, row * scale[:, None], col * scale[:, None], n)  # (B,)
    primal = (w * mask).sum((1, 2))
    if bool((upper > primal * (1 + CERTIFICATE_RTOL) + 1e-300).any()):
        raise RuntimeError("the LP dual bound does not certify the mask optimal; HiGHS stopped early")
    device = blocks.device
    return BlockSolution(
        mask=mask.to(device),
        upper_bound=upper.to(device),
        state=DualState(row=row.to(device), col=col.to(device), scale=scale.to(device)),
        iterations=0,
    )
