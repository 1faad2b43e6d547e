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
def _select_rows(
    w: np.ndarray,
    n: int,
    u: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray,
    excess: np.ndarray,
    vals: np.ndarray,
    buf: np.ndarray,
) -> int:
    """Every row keeps its n best entries by w_ij − v_j and u_i is set between the n-th and (n+1)-th,
    so (mask, u, v) satisfy complementary slackness; columns may hold more or fewer than n.
    Fills excess[j] = (kept in column j) − n and returns the total positive excess."""
    m = w.shape[0]
    for j in range(m):
        excess[j] = -n
    for i in range(m):
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
    rounds: int,
    retry_excess: int,
    scale: np.ndarray,
    bound: np.ndarray,
    paths: np.ndarray,
) -> None:
    """blocks: (B, M, M) float32 or float64 non-negative scores; v: (B, M) float64 starting column
    potentials in the units of the scores (zeros for a cold start); a tile whose row selection leaves
    more than `retry_excess` kept entries to move runs one more round and selects again.
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
        total = _select_rows(w, n, u[b], v[b], mask[b], excess, vals, buf)
        if total > retry_excess:
            # The starting potentials were far off (a warm start on much-changed scores): one round of
            # coordinate descent costs less than the paths it saves.
            _dual_rounds(w, n, u[b], v[b], 1, buf)
            total = _select_rows(w, n, u[b], v[b], mask[b], excess, vals, buf)
        paths[b] = _augment(w, mask[b], u[b], v[b], excess, total, key_r, key_c, pred_r, pred_c)
        scale[b] = s
        bound[b] = _dual_bound(w, n, u[b], v[b]) * s
