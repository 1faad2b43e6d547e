"""The @triton.jit kernels behind `triton_kernels` (imported only when a kernel is first used:
importing Triton is slow, and Triton reads TRITON_INTERPRET when it builds these functions)."""

import triton
import triton.language as tl


@triton.jit
def sinkhorn_kernel(
    w_ptr,
    u_ptr,
    v_ptr,
    taus_ptr,
    ran_ptr,
    n,
    tol_n,
    M: tl.constexpr,
    TAUS: tl.constexpr,  # temperatures (ε-scaling stages)
    PERIODS: tl.constexpr,  # absorb periods per temperature: ceil(iterations / absorb_every)
    ABSORB: tl.constexpr,  # iterations per period
    LAST: tl.constexpr,  # iterations of the last period
):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, M)
    cols = tl.arange(0, M)
    w = tl.load(w_ptr + pid * M * M + rows[:, None] * M + cols[None, :])  # (M, M)
    u = tl.load(u_ptr + pid * M + rows)  # (M,)
    v = tl.load(v_ptr + pid * M + cols)  # (M,)
    ran = 0
    for t in tl.static_range(TAUS):
        tau = tl.load(taus_ptr + t)
        stop = 0
        for period in tl.static_range(PERIODS):
            if stop == 0:
                x = tau * (w - u[:, None] - v[None, :])
                k = tl.exp(tl.minimum(tl.maximum(x, -60.0), 50.0))  # (M, M), clipped as EXP_MIN/MAX
                p = tl.full((M,), 1.0, tl.float32)  # row scalings, absorbed into u below
                q = tl.full((M,), 1.0, tl.float32)  # column scalings, absorbed into v below
                violation = 0.0
                for _ in tl.static_range(LAST if period == PERIODS - 1 else ABSORB):
                    s = tl.minimum(k * p[:, None] * q[None, :], 1.0)  # capacity projection (C3)
                    row_sum = tl.sum(s, axis=1)  # (M,)
                    violation = tl.max(tl.abs(row_sum - n), axis=0)
                    row_fac = n / row_sum  # row projection (C1)
                    col_sum = tl.sum(s * row_fac[:, None], axis=0)  # (M,)
                    p = p * row_fac
                    q = q * (n / col_sum)  # column projection (C2)
                ran += LAST if period == PERIODS - 1 else ABSORB
                u = u - tl.log(p) / tau
                v = v - tl.log(q) / tau
                if violation <= tol_n:
                    stop = 1
    tl.store(u_ptr + pid * M + rows, u)
    tl.store(v_ptr + pid * M + cols, v)
    tl.store(ran_ptr + pid, ran)


@triton.jit
def maxplus_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, M)
    cols = tl.arange(0, M)
    base = pid * M * M
    acc = tl.full((M, M), float("-inf"), tl.float32)
    for t in range(M):
        a_col = tl.load(a_ptr + base + rows * M + t)  # (M,) a[:, t]
        b_row = tl.load(b_ptr + base + t * M + cols)  # (M,) b[t, :]
        acc = tl.maximum(acc, a_col[:, None] + b_row[None, :])
    tl.store(out_ptr + base + rows[:, None] * M + cols[None, :], acc)


@triton.jit
def _edge_column(add_p, rem_p, a, b, M: tl.constexpr):
    """The column j realizing D[a, b]: argmax_j add[a, j] + remove[b, j]."""
    cols = tl.arange(0, M)
    return tl.argmax(tl.load(add_p + a * M + cols) + tl.load(rem_p + b * M + cols), axis=0)


@triton.jit
def _apply_edge(s, a, b, j, do, M: tl.constexpr):
    """Keep (a, j) and drop (b, j) where `do` holds; s: (M, M) int1."""
    rows = tl.arange(0, M)[:, None]
    cols = tl.arange(0, M)[None, :]
    hit = (do != 0) & (cols == j)
    s = tl.where(hit & (rows == a), 1, s)
    return tl.where(hit & (rows == b), 0, s)


@triton.jit
def _middle(d_p, i, k, M: tl.constexpr):
    """The row a realizing max_a D[i, a] + D[a, k]."""
    idx = tl.arange(0, M)
    return tl.argmax(tl.load(d_p + i * M + idx) + tl.load(d_p + idx * M + k), axis=0)


@triton.jit
def cycle_kernel(w_ptr, mask_ptr, scratch_ptr, moves_ptr, max_moves, tiny, M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, M)
    cols = tl.arange(0, M)
    grid = rows[:, None] * M + cols[None, :]
    w = tl.load(w_ptr + pid * M * M + grid)  # (M, M)
    s = tl.load(mask_ptr + pid * M * M + grid).to(tl.int32)  # (M, M) 0/1
    add_p = scratch_ptr + pid * 3 * M * M
    rem_p = add_p + M * M
    d_p = rem_p + M * M
    upper = rows[:, None] < cols[None, :]
    diag = rows[:, None] == cols[None, :]
    moves = 0
    go = 1
    while (moves < max_moves) & (go == 1):
        tl.debug_barrier()  # the previous step's reads of the scratch are done
        tl.store(add_p + grid, tl.where(s == 1, float("-inf"), w))
        tl.store(rem_p + grid, tl.where(s == 1, -w, float("-inf")))
        tl.debug_barrier()
        d = tl.full((M, M), float("-inf"), tl.float32)
        for j in range(M):
            d = tl.maximum(d, tl.load(add_p + rows * M + j)[:, None] + tl.load(rem_p + rows * M + j)[None, :])
        g2 = tl.where(upper, d + tl.trans(d), float("-inf"))
        flat2 = tl.reshape(g2, (M * M,))
        best2 = tl.max(flat2, axis=0)
        at2 = tl.argmax(flat2, axis=0)
        if best2 > tiny:
            i = at2 // M
            k = at2 % M
            j1 = _edge_column(add_p, rem_p, i, k, M)
            j2 = _edge_column(add_p, rem_p, k, i, M)
            s = _apply_edge(s, i, k, j1, 1, M)
            s = _apply_edge(s, k, i, j2, 1, M)
            moves += 1
        else:
            tl.store(d_p + grid, d)
            tl.debug_barrier()
            p = tl.full((M, M), float("-inf"), tl.float32)
            for a in range(M):
                p = tl.maximum(p, tl.load(d_p + rows * M + a)[:, None] + tl.load(d_p + a * M + cols)[None, :])
            g3 = tl.where(diag, float("-inf"), p + tl.trans(d))
            g4 = tl.where(diag, float("-inf"), p + tl.trans(p))
            flat3 = tl.reshape(g3, (M * M,))
            flat4 = tl.reshape(g4, (M * M,))
            best3 = tl.max(flat3, axis=0)
            best4 = tl.max(flat4, axis=0)
            at3 = tl.argmax(flat3, axis=0)
            at4 = tl.argmax(flat4, axis=0)
            i3 = at3 // M
            k3 = at3 % M
            a3 = _middle(d_p, i3, k3, M)
            i4 = at4 // M
            k4 = at4 % M
            a4 = _middle(d_p, i4, k4, M)
            c4 = _middle(d_p, k4, i4, M)
            ok3 = ((best3 > tiny) & (a3 != i3) & (a3 != k3)).to(tl.int32)
            distinct4 = (a4 != i4) & (a4 != k4) & (c4 != i4) & (c4 != k4) & (a4 != c4)
            ok4 = ((best4 > tiny) & distinct4 & ((ok3 == 0) | (best4 > best3))).to(tl.int32)
            ok3 = ok3 * (1 - ok4)
            # All columns from the scratch of the old mask, as in tsenor._apply_path.
            e1 = _edge_column(add_p, rem_p, i3, a3, M)
            e2 = _edge_column(add_p, rem_p, a3, k3, M)
            e3 = _edge_column(add_p, rem_p, k3, i3, M)
            f1 = _edge_column(add_p, rem_p, i4, a4, M)
            f2 = _edge_column(add_p, rem_p, a4, k4, M)
            f3 = _edge_column(add_p, rem_p, k4, c4, M)
            f4 = _edge_column(add_p, rem_p, c4, i4, M)
            s = _apply_edge(s, i3, a3, e1, ok3, M)
            s = _apply_edge(s, a3, k3, e2, ok3, M)
            s = _apply_edge(s, k3, i3, e3, ok3, M)
            s = _apply_edge(s, i4, a4, f1, ok4, M)
            s = _apply_edge(s, a4, k4, f2, ok4, M)
            s = _apply_edge(s, k4, c4, f3, ok4, M)
            s = _apply_edge(s, c4, i4, f4, ok4, M)
            if (ok3 + ok4) > 0:
                moves += 1
            else:
                go = 0
    tl.store(mask_ptr + pid * M * M + grid, s.to(tl.int8))
    tl.store(moves_ptr + pid, moves)


@triton.jit
def bound_kernel(w_ptr, v_ptr, out_ptr, n, M: tl.constexpr):
    """One round of exact dual coordinate descent from the column potentials v, then the dual bound in float64 (see
    bounds.coordinate_upper_bound): u_i = n-th largest of w_ij − v_j, v_j = n-th largest of w_ij − u_i."""
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, M)
    cols = tl.arange(0, M)
    w = tl.load(w_ptr + pid * M * M + rows[:, None] * M + cols[None, :])  # (M, M)
    v = tl.load(v_ptr + pid * M + cols)  # (M,)
    nth = cols[None, :] == (n - 1)  # the n-th position of a descending sort along the last axis
    u = tl.sum(tl.where(nth, tl.sort(w - v[None, :], descending=True), 0.0), axis=1)  # (M,) per row
    v = tl.sum(tl.where(nth, tl.sort(tl.trans(w - u[:, None]), descending=True), 0.0), axis=1)  # per column
    w64 = w.to(tl.float64)
    u64 = u.to(tl.float64)
    v64 = v.to(tl.float64)
    slack = tl.maximum(w64 - u64[:, None] - v64[None, :], 0.0)
    total = n * (tl.sum(u64, axis=0) + tl.sum(v64, axis=0)) + tl.sum(tl.sum(slack, axis=1), axis=0)
    tl.store(out_ptr + pid, total)
