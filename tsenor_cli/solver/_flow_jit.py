"""Compiled (numba) kernels of `solver/flow.py`: one M×M tile per loop iteration, tiles in parallel.

Kept apart from the torch code as `_triton_jit.py` is: these functions take and return NumPy arrays and
compile on first use (a few seconds, cached on disk by numba afterwards). Every array is float64 or
bool/int64; a tile's arithmetic never mixes tiles, so the parallel loop gives the same result as a
serial one.

Notation (paper eq. (4), a maximization): reduced cost r_ij = w_ij − u_i − v_j. A mask S and
potentials (u, v) are optimal together iff S_ij = 1 ⇒ r_ij ≥ 0 and S_ij = 0 ⇒ r_ij ≤ 0 (complementary
slackness for 0 ≤ S ≤ 1) and every row and column keeps n.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_INF = 1e300
# Round-off allowance of the warm-start consistency test on scores normalized to [0, 1]: re-derived
# potentials of an optimal mask leave its tight arcs a few ulps off zero, which must not count as a
# violation (the certified bound is computed from the final potentials, so exactness is checked).
_SLACK = 1e-12


@njit(cache=True, inline="always")
def _nth_and_next(buf: np.ndarray, m: int, n: int) -> tuple[float, float]:
    """The n-th and (n+1)-th largest of buf[:m] (buf is reordered): quickselect, then a max."""
    lo, hi, k = 0, m - 1, n - 1
    while lo < hi:
        pivot = buf[(lo + hi) >> 1]
        i, j = lo, hi
        while i <= j:
            while buf[i] > pivot:
                i += 1
            while buf[j] < pivot:
                j -= 1
            if i <= j:
                buf[i], buf[j] = buf[j], buf[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            break
    nth = buf[k]
    following = -_INF
    for t in range(n, m):
        following = max(following, buf[t])
    return nth, following


@njit(cache=True)
def _dual_rounds(w: np.ndarray, n: int, u: np.ndarray, v: np.ndarray, rounds: int, buf: np.ndarray) -> None:
    """Exact dual coordinate descent on (u, v) (bounds.coordinate_upper_bound, one tile): u_i, then v_j,
    at the midpoint between the n-th and (n+1)-th largest reduced score, so that each row (column)
    alone would keep exactly its n best entries."""
    m = w.shape[0]
    for _ in range(rounds):
        for i in range(m):
            for j in range(m):
                buf[j] = w[i, j] - v[j]
            a, b = _nth_and_next(buf, m, n)
            u[i] = 0.5 * (a + b)
        for j in range(m):
            for i in range(m):
                buf[i] = w[i, j] - u[i]
            a, b = _nth_and_next(buf, m, n)
            v[j] = 0.5 * (a + b)


@njit(cache=True)
def _select_row(
    w: np.ndarray, n: int, i: int, u: np.ndarray, v: np.ndarray, mask: np.ndarray, vals: np.ndarray, buf: np.ndarray
) -> None:
    """Row i keeps its n best entries by w_ij − v_j and u_i is set between the n-th and (n+1)-th, so row
    i satisfies complementary slackness with (u, v)."""
    m = w.shape[0]
    for j in range(m):
        vals[j] = w[i, j] - v[j]
        buf[j] = vals[j]
    a, b = _nth_and_next(buf, m, n)
    u[i] = 0.5 * (a + b)
    kept = 0
    for j in range(m):
        take = vals[j] > a
        mask[i, j] = take
        kept += take
    for j in range(m):  # ties at the n-th value: the first ones by column index
        if kept < n and vals[j] == a and not mask[i, j]:
            mask[i, j] = True
            kept += 1


@njit(cache=True, inline="always")
def _row_interval(w: np.ndarray, mask: np.ndarray, i: int, v: np.ndarray) -> tuple[float, float]:
    """(max over dropped, min over kept) of w_ij − v_j in row i: the u_i that satisfy complementary
    slackness with row i's current entries (empty when the first exceeds the second)."""
    m = w.shape[0]
    lo, hi = -_INF, _INF
    for j in range(m):
        r = w[i, j] - v[j]
        if mask[i, j]:
            hi = min(hi, r)
        else:
            lo = max(lo, r)
    return lo, hi


@njit(cache=True)
def _center(w: np.ndarray, mask: np.ndarray, u: np.ndarray, v: np.ndarray, sweeps: int) -> None:
    """Coordinate sweeps on the potentials with the mask fixed: u_i, then v_j, moves to the middle of
    the interval that satisfies complementary slackness with its row (column) of the mask (to the
    middle of the violation when that interval is empty).

    Why: a previous solve's potentials are tight (reduced cost 0) on the arcs of its last paths, so
    any noise on the scores breaks slackness there; centred potentials leave every row and column a
    margin, and a mask that is still optimal for the new scores is then kept as it is."""
    m = w.shape[0]
    for _ in range(sweeps):
        for i in range(m):
            lo, hi = _row_interval(w, mask, i, v)
            if lo > -_INF and hi < _INF:  # a row keeping none or all (an outside state) stays put
                u[i] = 0.5 * (lo + hi)
        for j in range(m):
            lo, hi = _row_interval(w.T, mask.T, j, u)  # column j: row j of the transposes
            if lo > -_INF and hi < _INF:
                v[j] = 0.5 * (lo + hi)


@njit(cache=True)
def _select_rows(
    w: np.ndarray,
    n: int,
    u: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray,
    keep: bool,
    excess: np.ndarray,
    vals: np.ndarray,
    buf: np.ndarray,
) -> int:
    """Every row satisfies complementary slackness with (u, v) afterwards: with `keep`, a row of the
    incoming mask that already does (some u_i fits between its dropped and kept entries) stays as it
    is with u_i in the middle of that interval (rows holding other than n are not kept); every other
    row keeps its n best entries by w_ij − v_j. Columns may then hold more or fewer than n: fills
    excess[j] = (kept in column j) − n and returns the total positive excess."""
    m = w.shape[0]
    for j in range(m):
        excess[j] = -n
    for i in range(m):
        lo, hi = _INF, -_INF
        if keep:
            kept = 0
            for j in range(m):
                kept += mask[i, j]
            if kept == n:  # a row of another shape (an outside state) is never kept
                lo, hi = _row_interval(w, mask, i, v)
        if lo <= hi + _SLACK:
            u[i] = 0.5 * (lo + hi)
        else:
            _select_row(w, n, i, u, v, mask, vals, buf)
        for j in range(m):
            excess[j] += mask[i, j]
    total = 0
    for j in range(m):
        total += max(excess[j], 0)
    return total


@njit(cache=True)
def _augment(
    w: np.ndarray,
    mask: np.ndarray,
    u: np.ndarray,
    v: np.ndarray,
    excess: np.ndarray,
    total: int,
    key_r: np.ndarray,
    key_c: np.ndarray,
    pred_r: np.ndarray,
    pred_c: np.ndarray,
) -> int:
    """Successive shortest paths: move one kept entry at a time from a column with excess to a column
    with deficit along a cheapest alternating path, keeping complementary slackness. Returns the number
    of paths (= the initial total excess).

    Residual arcs, lengths ≥ 0 by complementary slackness: column j → row i where S_ij = 1 (drop
    (i, j), length r_ij) and row i → column j where S_ij = 0 (keep (i, j), length −r_ij). Dijkstra from
    every excess column (distance 0) stops at the first deficit column, at distance D; then
    u_i += d_i − D and v_j −= d_j − D for the settled nodes make every arc of the path tight
    (length 0) and leave all lengths ≥ 0, so flipping the path keeps slackness. A settled node's key
    is set to −1, so a relaxation (never below 0) cannot reach it and the search skips it.
    """
    m = w.shape[0]
    paths = 0
    while total > 0:
        for k in range(m):
            key_r[k] = _INF
            key_c[k] = 0.0 if excess[k] > 0 else _INF
            pred_c[k] = -1
        while True:
            best = _INF
            node = -1
            for k in range(m):
                if 0.0 <= key_c[k] < best:
                    best = key_c[k]
                    node = k
            for k in range(m):
                if 0.0 <= key_r[k] < best:
                    best = key_r[k]
                    node = m + k
            if node < m and excess[node] < 0:
                break
            if node < m:  # column: drop one of its kept entries
                j = node
                key_c[j] = -1.0 - best  # settled; distance recoverable as −1 − key
                for i in range(m):
                    if mask[i, j]:
                        d = best + max(w[i, j] - u[i] - v[j], 0.0)
                        if d < key_r[i]:
                            key_r[i] = d
                            pred_r[i] = j
            else:  # row: keep one more entry
                i = node - m
                key_r[i] = -1.0 - best
                for j in range(m):
                    if not mask[i, j]:
                        d = best + max(u[i] + v[j] - w[i, j], 0.0)
                        if d < key_c[j]:
                            key_c[j] = d
                            pred_c[j] = i
        target = node
        for k in range(m):
            if key_r[k] < 0.0:
                u[k] += (-1.0 - key_r[k]) - best
            if key_c[k] < 0.0:
                v[k] -= (-1.0 - key_c[k]) - best
        col = target
        while True:  # walk back: row → col arcs keep, col → row arcs drop
            i = pred_c[col]
            mask[i, col] = True
            col = pred_r[i]
            mask[i, col] = False
            if pred_c[col] < 0:
                break
        excess[col] -= 1
        excess[target] += 1
        total -= 1
        paths += 1
    return paths


@njit(cache=True)
def _normalize(tile: np.ndarray, w: np.ndarray) -> float:
    """w = tile / max(tile) in float64 (1 for an all-zero tile) → that scale."""
    m = tile.shape[0]
    scale = 0.0
    for i in range(m):
        for j in range(m):
            scale = max(scale, float(tile[i, j]))
    if scale <= 0.0:
        scale = 1.0
    for i in range(m):
        for j in range(m):
            w[i, j] = tile[i, j] / scale
    return scale


@njit(cache=True)
def _dual_bound(w: np.ndarray, n: int, u: np.ndarray, v: np.ndarray) -> float:
    """n·Σu + n·Σv + Σ max(0, w − u − v): the certified bound of bounds.dual_upper_bound, one tile."""
    m = w.shape[0]
    total = 0.0
    for i in range(m):
        total += n * u[i]
        for j in range(m):
            total += max(w[i, j] - u[i] - v[j], 0.0)
    for j in range(m):
        total += n * v[j]
    return total


@njit(parallel=True, cache=True)
def solve_tiles(
    blocks: np.ndarray,
    n: int,
    u: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray,
    warm_mask: bool,
    rounds: int,
    sweeps: int,
    retry_excess: int,
    scale: np.ndarray,
    bound: np.ndarray,
    paths: np.ndarray,
) -> None:
    """blocks: (B, M, M) float32 or float64 non-negative scores; v: (B, M) float64 starting column
    potentials in the units of the scores (zeros for a cold start); with `warm_mask`, mask (B, M, M)
    holds a previous mask (n per row and column) that is kept wherever it is still optimal, after
    `sweeps` of mask-fixed centring of the potentials; a tile whose row selection leaves more than
    `retry_excess` kept entries to move runs one round of dual coordinate descent and selects afresh.
    In place: mask (B, M, M) bool, an optimal mask of every tile; u, v (B, M), its optimal potentials
    divided by the tile's max, which goes to scale (B,); bound (B,), the certified bound in the units
    of the scores; paths (B,), the augmenting paths each tile needed. Each tile is normalized in a
    private float64 copy."""
    B, M, _ = blocks.shape
    for b in prange(B):
        w = np.empty((M, M))
        vals = np.empty(M)
        buf = np.empty(M)
        excess = np.empty(M, np.int64)
        key_r = np.empty(M)
        key_c = np.empty(M)
        pred_r = np.empty(M, np.int64)
        pred_c = np.empty(M, np.int64)
        s = _normalize(blocks[b], w)
        for j in range(M):
            v[b, j] /= s
        _dual_rounds(w, n, u[b], v[b], rounds, buf)
        start = v[b].copy()
        if warm_mask:
            _center(w, mask[b], u[b], v[b], sweeps)
        total = _select_rows(w, n, u[b], v[b], mask[b], warm_mask, excess, vals, buf)
        if total > retry_excess:
            # The starting point was far off (a warm start on much-changed scores): one round of
            # coordinate descent costs less than the paths it saves. It starts from the potentials
            # handed in, not the centred ones, which the previous mask has pulled towards itself.
            v[b, :] = start
            _dual_rounds(w, n, u[b], v[b], 1, buf)
            total = _select_rows(w, n, u[b], v[b], mask[b], False, excess, vals, buf)
        paths[b] = _augment(w, mask[b], u[b], v[b], excess, total, key_r, key_c, pred_r, pred_c)
        scale[b] = s
        bound[b] = _dual_bound(w, n, u[b], v[b]) * s
