"""`tsenor`: the paper's TSENOR solver (Section 3: entropic OT, then rounding) with our improvements.

The same pipeline on every device: torch operations on the CPU, fused Triton kernels for its hot loops
on CUDA (solver/triton_kernels.py). Not exact: each solve reports a certified gap. `flow`
(solver/flow.py) is the exact solver that is faster on CPUs; `auto` picks between them by device.

Pipeline per batch of blocks, all vectorized over blocks:

1. Normalize each block by its max so one temperature fits every layer (Appendix B.1 scales τ by
   max|W|).
2. Entropic optimal transport with capacities (Algorithm 1) in the *scaling* domain. Writing the
   log-domain Dykstra listing of Appendix A.2 with X = log S + log Q, the capacity dual folds away:
   X only changes by additive row and column shifts, X = τ(w − u_i − v_j), and S = min(exp X, 1).
   So each iteration is one clipped matrix scaling on K = exp(X): a row sum, one batched
   matrix-vector product for the column sums, and two vector updates — no logsumexp. The scalings
   are absorbed into the potentials (u, v) every few iterations so nothing overflows, τ grows
   geometrically (ε-scaling) so few iterations are needed at each temperature, and blocks whose
   row marginals are within tolerance stop early.
3. Greedy selection (Algorithm 2, lines 1-6) ordered by the reduced cost w − u − v rather than by
   S: at the cap S = 1 ties, the reduced cost still ranks entries.
4. `complete_feasibility` makes every block exactly n per row and column.
5. Cycle cancelling, our addition beyond the paper's L = 10 swaps: an alternating cycle
   add (i₁, j₁), remove (i₂, j₁), add (i₂, j₂), remove (i₃, j₂), … back to i₁ keeps every row and
   column count, and its gain is a sum of edge weights of a "row graph"
       D[i, i'] = max_j { w[i, j] − w[i', j] : S[i, j] = 0, S[i', j] = 1 }.
   The mask is optimal iff no cycle of that graph has positive weight, so we repeatedly apply the
   best positive 2-cycle (the 2×2 exchange) or 3-cycle in every block that still has one.
6. Certified bound: the potentials give a dual-feasible point of the block LP (solver/bounds.py),
   tightened by a round of exact dual coordinate descent.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tsenor_cli.solver import triton_kernels
from tsenor_cli.solver.bounds import coordinate_upper_bound, dual_upper_bound
from tsenor_cli.solver.registry import register
from tsenor_cli.solver.rounding import complete_feasibility, greedy_select
from tsenor_cli.solver.slices import blocks_per_slice, in_slices
from tsenor_cli.solver.types import BlockSolution, DualState, SinkhornSchedule

# Exponents are clipped to this range: above it exp overflows fp32, below it entries are
# negligible (e^-60 ≈ 1e-26 of a kept entry) and would otherwise become slow denormals.
_EXP_MAX = 50.0
_EXP_MIN = -60.0


@dataclass(frozen=True)
class _Chunks:
    """Elements per batched temporary. On CPU small, so a chunk's iterations run in cache; on CUDA
    large, because there the cost is one kernel launch per operation and chunk, not memory traffic."""

    slice: int  # scores per independent sub-solve (bounds every temporary of `tsenor`)
    sinkhorn: int  # scores per chunk that runs all its Sinkhorn iterations at once
    maxplus: int  # elements of the (chunk, M, M, M) temporary of a max-plus product


def _chunks(device: torch.device) -> _Chunks:
    if device.type == "cuda":
        return _Chunks(slice=1 << 26, sinkhorn=1 << 26, maxplus=1 << 27)
    return _Chunks(slice=1 << 22, sinkhorn=1 << 18, maxplus=1 << 19)


def _block_scale(blocks: torch.Tensor) -> torch.Tensor:
    """blocks: (B, M, M) → (B,) per-block max, 1 where a block is all zero."""
    scale = blocks.amax(dim=(1, 2))  # (B,)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _scale(k: torch.Tensor, s: torch.Tensor, p: torch.Tensor, q: torch.Tensor, n: int, steps: int) -> float:
    """`steps` clipped matrix scalings of k (b, M, M) = exp(τ·reduced cost): p, q (b, M), the row and column
    scalings, updated in place; s (b, M, M), scratch → the largest row-marginal violation of the last step."""
    one = s.new_ones(())
    violation = float("inf")
    for step in range(steps):
        # S = min(K ⊙ p qᵀ, 1): the capacity projection (C3) of the previous iterate.
        torch.mul(k, p[:, :, None], out=s)
        s.mul_(q[:, None, :]).clamp_(max=one)
        row_sum = s.sum(dim=2)  # (b, M)
        if step == steps - 1:
            # Only the period's last violation decides the early stop; reading it is a
            # device sync on CUDA, so it is not read on the other steps.
            violation = float((row_sum - n).abs().amax())
        row_fac = n / row_sum  # row projection (C1)
        # Σ_i S_ij·row_fac_i as a scaled reduction: batched (1×M)@(M×M) matmuls are slow.
        col_sum = s.mul_(row_fac[:, :, None]).sum(dim=1)  # (b, M)
        p.mul_(row_fac)
        q.mul_(n / col_sum)  # column projection (C2)
    return violation


def capped_sinkhorn(
    w: torch.Tensor,
    n: int,
    schedule: SinkhornSchedule,
    u: torch.Tensor,
    v: torch.Tensor,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Algorithm 1 (Dykstra for entropic OT with capacities) in potential form, ε-scaled.

    w: (B, M, M) normalized scores in [0, 1]; u, v: (B, M) initial potentials →
    (u, v) (B, M) final potentials and the largest number of iterations any chunk ran.
    `schedule.iterations` is the budget per temperature in `schedule.taus`; a chunk of blocks leaves a
    temperature early once max_i |Σ_j S_ij − n| ≤ tol·n in all its blocks. Chunks of about `chunk_elements`
    scores run all their iterations while their data is in cache; much smaller chunks would be
    dominated by per-call overhead, much larger ones by memory traffic (default: by device).
    """
    B, M, _ = w.shape
    chunk = max(1, (chunk_elements or _chunks(w.device).sinkhorn) // (M * M))
    iterations = schedule.iterations
    u = u.clone()
    v = v.clone()
    most = 0
    for start in range(0, B, chunk):
        wc = w[start : start + chunk]  # (b, M, M)
        uc, vc = u[start : start + chunk], v[start : start + chunk]  # (b, M) views, updated in place
        s = torch.empty_like(wc)
        ran = 0
        for tau in schedule.taus:
            done = 0
            while done < iterations:
                k = torch.sub(wc, uc[:, :, None]).sub_(vc[:, None, :]).mul_(tau)  # (b, M, M) τ·reduced cost
                k.clamp_(_EXP_MIN, _EXP_MAX).exp_()
                p = uc.new_ones(uc.shape)  # row scalings, absorbed into u below
                q = vc.new_ones(vc.shape)  # column scalings, absorbed into v below
                steps = min(schedule.absorb_every, iterations - done)
                violation = _scale(k, s, p, q, n, steps)
                done += steps
                uc.sub_(torch.log(p) / tau)
                vc.sub_(torch.log(q) / tau)
                if violation <= schedule.tol * n:
                    break
            ran += done
        most = max(most, ran)
    return u, v, most


def _maxplus(a: torch.Tensor, b: torch.Tensor, chunk_elements: int | None = None) -> torch.Tensor:
    """a: (B, M, K), b: (B, K, N) → (B, M, N), out[i, k] = max_t a[i, t] + b[t, k] (max-plus product).

    Chunks keep the (chunk, M, N, K) temporary near cache size; only values are computed here, the
    few maximizers needed are recovered afterwards for the chosen cycles.
    """
    B, M, K = a.shape
    if a.is_cuda and K == M == b.shape[2] and triton_kernels.supports(a):
        # On CUDA the (chunk, M, N, K) temporary is the cost; the fused kernel has none.
        return triton_kernels.maxplus_fused(a, b)
    bt = b.transpose(1, 2)  # (B, N, K)
    chunk = max(1, (chunk_elements or _chunks(a.device).maxplus) // (M * bt.shape[1] * K))
    out = a.new_empty(B, M, bt.shape[1])
    for start in range(0, B, chunk):
        sl = slice(start, start + chunk)
        out[sl] = (a[sl, :, None, :] + bt[sl, None, :, :]).amax(dim=3)
    return out


@dataclass(frozen=True)
class _RowGraph:
    """The row graph of a batch of masks (see module docstring, step 5).

    add[i, j] = w[i, j] where S[i, j] = 0 else −inf; remove[i, j] = −w[i, j] where S[i, j] = 1 else −inf;
    d[i, i'] = max_j add[i, j] + remove[i', j]: the gain of adding (i, j) and removing (i', j). All (b, M, M).
    """

    add: torch.Tensor
    remove: torch.Tensor
    d: torch.Tensor

    @classmethod
    def build(cls, mask: torch.Tensor, w: torch.Tensor) -> _RowGraph:
        add = w.masked_fill(mask, float("-inf"))
        remove = (-w).masked_fill_(~mask, float("-inf"))
        return cls(add, remove, _maxplus(add, remove.transpose(1, 2)))

    def column(self, sel: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """(k,) blocks, source rows, target rows → (k,) the column j realizing d[src, dst]."""
        return (self.add[sel, src, :] + self.remove[sel, dst, :]).argmax(dim=1)


def _apply_path(
    mask: torch.Tensor, idx: torch.Tensor, graph: _RowGraph, sel: torch.Tensor, rows: list[torch.Tensor]
) -> None:
    """Apply the closed row-graph walk rows[0] → rows[1] → … → rows[0] in blocks idx[sel].

    Each edge a → b adds (a, j) and removes (b, j) for its best column j; in place on mask (B, M, M).
    All columns are looked up before any change, as the cycle's gain was computed on the old mask.
    """
    edges = list(itertools.pairwise([*rows, rows[0]]))
    cols = [graph.column(sel, a, b) for a, b in edges]
    blk = idx[sel]
    for (a, b), j in zip(edges, cols, strict=True):
        mask[blk, a, j] = True
        mask[blk, b, j] = False


def _apply_two_cycles(mask: torch.Tensor, idx: torch.Tensor, graph: _RowGraph, tiny: float) -> torch.Tensor:
    """Apply, in every block of idx, a greedy set of row-disjoint positive 2-cycles (2×2 exchanges).

    mask: (B, M, M), changed in place → (b,) bool, whether a block had a positive 2-cycle. Cycles on
    disjoint rows touch disjoint entries, so their gains add up and they can be applied together.
    """
    d = graph.d
    b, M, _ = d.shape
    upper = torch.ones(M, M, dtype=torch.bool, device=d.device).triu(diagonal=1)
    g2 = (d + d.transpose(1, 2)).masked_fill_(~upper, float("-inf"))  # (b, M, M): i → k → i, i < k
    gains, flat = g2.reshape(b, M * M).topk(M // 2, dim=1)  # (b, M/2) best pairs first
    first, second = flat // M, flat % M  # (b, M/2) the two rows of each candidate
    used = torch.zeros(b, M, dtype=torch.bool, device=d.device)
    ar = torch.arange(b, device=d.device)
    chosen = torch.zeros(b, M // 2, dtype=torch.bool, device=d.device)
    # Greedy choice over the candidates in gain order (cheap (b,) steps); applied all at once below.
    for c in range(M // 2):
        i, k = first[:, c], second[:, c]  # (b,)
        ok = (gains[:, c] > tiny) & ~used[ar, i] & ~used[ar, k]  # (b,)
        chosen[:, c] = ok
        used[ar, i] |= ok
        used[ar, k] |= ok
    sel, cand = chosen.nonzero().unbind(1)  # (k,) block and candidate of every chosen 2-cycle
    _apply_path(mask, idx, graph, sel, [first[sel, cand], second[sel, cand]])
    return gains[:, 0] > tiny


def _apply_long_cycle(mask: torch.Tensor, idx: torch.Tensor, graph: _RowGraph, tiny: float) -> torch.Tensor:
    """Apply the best positive 3- or 4-cycle of the row graph in every block of idx.

    Same arguments as `_apply_two_cycles` → (b,) bool, whether a block had one. Both come from one
    max-plus square P[i, k] = max_a D[i, a] + D[a, k]: a 3-cycle is P[i, k] + D[k, i], a 4-cycle
    P[i, k] + P[k, i]. Called only where no positive 2-cycle is left, so a positive closed walk of
    length ≤ 4 is a simple cycle (a repeated row would split it into non-positive shorter cycles);
    the distinctness checks only guard against ties.
    """
    d = graph.d
    b, M, _ = d.shape
    two_step = _maxplus(d, d)  # (b, M i, M k)
    g3 = two_step + d.transpose(1, 2)  # i → a → k → i
    g4 = two_step + two_step.transpose(1, 2)  # i → a → k → c → i
    g3.diagonal(dim1=1, dim2=2).fill_(float("-inf"))
    g4.diagonal(dim1=1, dim2=2).fill_(float("-inf"))
    best3, flat3 = g3.reshape(b, M * M).max(dim=1)  # (b,)
    best4, flat4 = g4.reshape(b, M * M).max(dim=1)  # (b,)
    ar = torch.arange(b, device=d.device)

    def mid(i: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (d[ar, i, :] + d[ar, :, k]).argmax(dim=1)  # the a realizing P[i, k]

    i3, k3 = flat3 // M, flat3 % M
    a3 = mid(i3, k3)
    ok3 = (best3 > tiny) & (a3 != i3) & (a3 != k3)
    i4, k4 = flat4 // M, flat4 % M
    a4, c4 = mid(i4, k4), mid(k4, i4)
    distinct4 = (a4 != i4) & (a4 != k4) & (c4 != i4) & (c4 != k4) & (a4 != c4)
    ok4 = (best4 > tiny) & distinct4 & (~ok3 | (best4 > best3))
    ok3 = ok3 & ~ok4
    sel = ok3.nonzero().squeeze(1)
    _apply_path(mask, idx, graph, sel, [i3[sel], a3[sel], k3[sel]])
    sel = ok4.nonzero().squeeze(1)
    _apply_path(mask, idx, graph, sel, [i4[sel], a4[sel], k4[sel], c4[sel]])
    return ok3 | ok4


def cycle_search(
    mask: torch.Tensor, w: torch.Tensor, max_sweeps: int, *, fused: bool = True
) -> tuple[torch.Tensor, int]:
    """Cancel positive 2-, 3- and 4-cycles of the row graph until none is left or `max_sweeps` ran.

    mask: (B, M, M) feasible, w: (B, M, M) → (mask (B, M, M) feasible with objective ≥ the input's,
    sweeps run). A sweep applies a set of row-disjoint positive 2-cycles in every active block, or,
    where there is none, its best positive 3- or 4-cycle; blocks with neither leave the active set.
    On CUDA (float32, M a power of two) the fused kernel applies one cycle per step, at most
    max_sweeps·M/2 per tile (what the sweeps allow), and the count returned is the most cycles any
    tile applied; `fused=False` keeps the sweep loop (for comparisons).
    """
    B, M, _ = mask.shape
    tiny = 1e-6 * float(w.amax()) if w.numel() else 0.0
    if fused and w.is_cuda and triton_kernels.supports(w):
        # On CUDA every sweep here is dozens of launches and syncs; the fused kernel runs each tile's
        # search to the end in one launch, one cycle per step, with the same budget of cycles.
        return triton_kernels.cycle_search_fused(mask, w, max_sweeps * M // 2, tiny)
    mask = mask.clone()
    active = torch.arange(B, device=mask.device)
    sweeps = 0
    while sweeps < max_sweeps and active.numel() > 0:
        sweeps += 1
        graph = _RowGraph.build(mask[active], w[active])
        moved = _apply_two_cycles(mask, active, graph, tiny)  # (b,)
        rest = (~moved).nonzero().squeeze(1)
        if rest.numel() > 0:
            sub = _RowGraph(graph.add[rest], graph.remove[rest], graph.d[rest])
            moved[rest] = _apply_long_cycle(mask, active[rest], sub, tiny)
        active = active[moved]
    return mask, sweeps


def _tau_schedule(tau: float, stages: int) -> list[float]:
    """Geometric ε-scaling ending at `tau`: tau/2^(stages-1), …, tau/2, tau."""
    return [tau / 2 ** (stages - 1 - s) for s in range(stages)]


def _topn(scores: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """scores: (B, M, M) → mask (B, M, M) bool with the n largest along `dim`."""
    idx = scores.topk(n, dim=dim).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(dim, idx, True)


Rounding = Literal["auto", "greedy", "rowcol"]
# "auto" rounds by greedy from this many blocks up: its M² sequential steps cost the same for 1 block
# or 4096, so below this size the two `topk` of "rowcol" (plus a longer repair) are faster
# (SparseGPT's (rows, M) slabs: 48 blocks of 32×32 solve in 85 ms instead of 125 ms; docs/design/solver.md).
_GREEDY_FROM_BLOCKS = 1024
Bound = Literal["coordinate", "potentials"]
Sinkhorn = Literal["auto", "torch", "triton"]


def _sinkhorn(
    backend: Sinkhorn, w: torch.Tensor, n: int, schedule: SinkhornSchedule, u: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Dispatch `capped_sinkhorn`: "auto" takes the fused Triton kernel for float32 tiles on CUDA
    when Triton is installed (it ships with CUDA builds of torch) and the torch loop otherwise."""
    if backend == "auto":
        backend = "triton" if w.is_cuda and triton_kernels.supports(w) else "torch"
    if backend == "torch":
        return capped_sinkhorn(w, n, schedule, u, v)
    if backend == "triton":
        return triton_kernels.capped_sinkhorn_fused(w, n, schedule, u, v)
    raise ValueError(f"unknown sinkhorn backend {backend!r}; choose 'auto', 'torch' or 'triton'")


def _round(reduced: torch.Tensor, w: torch.Tensor, n: int, rounding: Rounding) -> torch.Tensor:
    """reduced, w: (B, M, M) → feasible mask (B, M, M) from the reduced costs.

    "greedy" is Algorithm 2's greedy selection (M² sequential steps); "rowcol" keeps the top n of
    each row by reduced cost, then the top n of each column among those (two `topk`, no sequential
    loop), leaving somewhat larger deficits for `complete_feasibility` and the cycle search.
    """
    if rounding == "auto":
        # On CUDA each of the greedy's M² steps is a few kernel launches: rowcol is faster at any size
        # (8192², docs/measurements/benchmarks-cuda.md).
        big = reduced.shape[0] >= _GREEDY_FROM_BLOCKS and not reduced.is_cuda
        rounding = "greedy" if big else "rowcol"
    if rounding == "greedy":
        start = greedy_select(reduced, n)
    elif rounding == "rowcol":
        rows = _topn(reduced, n, dim=2)
        start = _topn(reduced.masked_fill(~rows, float("-inf")), n, dim=1) & rows
    else:
        raise ValueError(f"unknown rounding {rounding!r}; choose 'auto', 'greedy' or 'rowcol'")
    return complete_feasibility(start, w, n).mask


def _bound(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, n: int, bound: Bound) -> torch.Tensor:
    """(B,) float64 certified upper bound of each normalized block from the potentials (see `tsenor`)."""
    if bound == "coordinate":
        # A round of exact dual coordinate descent from the Sinkhorn potentials tightens the bound.
        if w.is_cuda and triton_kernels.supports(w):
            return triton_kernels.coordinate_bound_fused(w, n, v)
        return coordinate_upper_bound(w, n, row=u, col=v, rounds=1)
    if bound == "potentials":
        return dual_upper_bound(w, u, v, n)
    raise ValueError(f"unknown bound {bound!r}; choose 'coordinate' or 'potentials'")


def _check_choices(rounding: str | None, bound: str | None, sinkhorn: str | None) -> None:
    """Raise ValueError naming the choices for an unknown `rounding`, `bound` or `sinkhorn` of `tsenor`."""
    if rounding is not None and rounding not in ("auto", "greedy", "rowcol"):
        raise ValueError(f"unknown rounding {rounding!r}; choose 'auto', 'greedy' or 'rowcol'")
    if bound is not None and bound not in ("coordinate", "potentials"):
        raise ValueError(f"unknown bound {bound!r}; choose 'coordinate' or 'potentials'")
    if sinkhorn is not None and sinkhorn not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown sinkhorn backend {sinkhorn!r}; choose 'auto', 'torch' or 'triton'")


@dataclass(frozen=True)
class TsenorOptions:
    """The options of `tsenor` (defaults chosen by measurement on SmolLM2 tiles, see docs/design/solver.md).

    tau: the final inverse temperature on max-normalized scores; stages: ε-scaling stages ending at `tau`;
    iterations: the Sinkhorn budget per stage; tol: the row-marginal tolerance for early stop; rounding: see
    `_round` ("auto": greedy from 1024 blocks up on CPU, else rowcol); sweeps: the cycle-cancelling budget
    (0 disables it); bound: "coordinate" tightens the certified bound by a round of dual coordinate descent,
    "potentials" evaluates it at the Sinkhorn potentials only (looser, but one pass: for inner loops such as
    ALPS's, whose intermediate masks need no tight certificate); sinkhorn: "triton" for the fused kernel of
    solver/triton_kernels.py, "torch" for the loop here, "auto" for the kernel on CUDA when Triton is
    installed; max_elements: scores per independent sub-solve (bounds every temporary; None: by device).
    """

    tau: float = 200.0
    stages: int = 4
    iterations: int = 25
    tol: float = 1e-3
    rounding: Rounding = "auto"
    sweeps: int = 30
    bound: Bound = "coordinate"
    sinkhorn: Sinkhorn = "auto"
    max_elements: int | None = None

    def __post_init__(self) -> None:
        _check_choices(self.rounding, self.bound, self.sinkhorn)


def _start(
    w: torch.Tensor, scale: torch.Tensor, n: int, options: TsenorOptions, init: DualState | None
) -> tuple[torch.Tensor, torch.Tensor, SinkhornSchedule]:
    """w: (B, M, M) normalized blocks, scale: (B,) their maxima → (u0, v0) (B, M) initial potentials and
    the schedule to run: the final temperature only from `init` (its potentials rescaled to these units),
    else the ε-scaling schedule from the row-wise top-n threshold, a dual point close to the answer."""
    tau = options.tau
    if init is not None:
        ratio = (init.scale.to(w) / scale)[:, None]  # (B, 1): old units → new units
        u0, v0, taus = init.row.to(w) * ratio, init.col.to(w) * ratio, [tau]
    else:
        u0 = w.topk(n, dim=2).values[:, :, n - 1] - 0.5 / tau
        v0, taus = w.new_zeros(w.shape[:2]), _tau_schedule(tau, options.stages)
    return u0, v0, SinkhornSchedule(tuple(taus), options.iterations, options.tol)


@register(
    "tsenor",
    "the paper's TSENOR: ε-scaled entropic OT with capacities (Alg. 1) + greedy rounding + feasibility completion "
    "+ cycle cancelling + certified bound; Triton kernels on CUDA",
    supports_init=True,
    options=TsenorOptions,
)
def tsenor(blocks: torch.Tensor, n: int, *, init: DualState | None = None, **options: Any) -> BlockSolution:
    """blocks: (B, M, M) non-negative → mask (B, M, M) bool, exactly n per row and column.

    `options`: the fields of `TsenorOptions` by name (None: the field's default).
    With `init` (the state of an earlier solve on similar scores) only the final stage runs, and
    the cycle search starts from the earlier mask instead of a fresh rounding.
    """
    return solve_blocks(blocks, n, TsenorOptions(**{k: v for k, v in options.items() if v is not None}), init)


def solve_blocks(blocks: torch.Tensor, n: int, options: TsenorOptions, init: DualState | None) -> BlockSolution:
    """`tsenor` with its options as one record: blocks (B, M, M) → `BlockSolution`."""
    B, M, _ = blocks.shape
    per_slice = blocks_per_slice(options.max_elements, _chunks(blocks.device).slice, M)
    if per_slice < B:
        # Blocks are independent: solving them in slices bounds the temporaries (index tensors of the
        # greedy pass, reduced costs, row graphs) to a fixed size instead of a multiple of the matrix.
        return in_slices(lambda part, state: solve_blocks(part, n, options, state), blocks, init, per_slice)
    work = blocks if blocks.dtype in (torch.float32, torch.float64) else blocks.float()
    scale = _block_scale(work)  # (B,)
    w = work / scale[:, None, None]  # (B, M, M) in [0, 1]
    u0, v0, schedule = _start(w, scale, n, options, init)
    u, v, its = _sinkhorn(options.sinkhorn, w, n, schedule, u0, v0)

    if init is not None and init.mask is not None:
        mask = init.mask.to(blocks.device)
    else:
        mask = _round(w - u[:, :, None] - v[:, None, :], w, n, options.rounding)
    if options.sweeps > 0:
        mask, _ = cycle_search(mask, w, options.sweeps)
    upper = _bound(w, u, v, n, options.bound) * scale.double()  # (B,)
    return BlockSolution(
        mask=mask,
        upper_bound=upper if bool(torch.isfinite(upper).all()) else None,
        state=DualState(row=u, col=v, scale=scale, mask=mask),
        iterations=its,
    )
