"""Rounding fractional block solutions to transposable N:M masks (paper Section 3.3, Algorithm 2).

Pure batched functions over (B, M, M) tensors; Python loops run over algorithm steps only, never
over blocks, rows or columns (paper Appendix A.2):

- `greedy_select`: visit the M² entries of each block in descending score order and keep one
  while its row and column have room (Algorithm 2, lines 1-6).
- `local_search`: the paper's swap step (eq. (localscore)), applied only when it improves.
- `complete_feasibility`: finishes any block that still has rows/columns with fewer than n kept,
  so that every returned mask has exactly n per row and column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Completion:
    """Result of `complete_feasibility`.

    mask: (B, M, M) bool with exactly n per row and column.
    forced_blocks: how many blocks needed at least one non-improving swap (gain <= 0).
    steps: how many repair steps ran (each adds one kept entry to a deficit row and column).
    """

    mask: torch.Tensor
    forced_blocks: int
    steps: int


def greedy_select(order_scores: torch.Tensor, n: int) -> torch.Tensor:
    """order_scores: (B, M, M) → mask (B, M, M) bool with at most n per row and column.

    Visits the M² positions of every block in descending order of `order_scores` (ties broken by
    position, stable sort, so the result is deterministic) and keeps a position when its row and
    column both hold fewer than n (Algorithm 2, lines 1-6; listing in Appendix A.2). One pass of
    M² vectorized steps over all blocks.
    """
    B, M, _ = order_scores.shape
    device = order_scores.device
    order = order_scores.reshape(B, M * M).argsort(dim=1, descending=True, stable=True)  # (B, M²)
    # Counters live in flat (B·M,) vectors and each step touches them with index_select/index_add_
    # on contiguous per-step index rows: ~15x faster on CPU than advanced indexing counter[b, r].
    base = torch.arange(B, device=device)[None, :] * M  # (1, B)
    rows_all = (order // M).T.contiguous() + base  # (M², B) flat row-counter index per step
    cols_all = (order % M).T.contiguous() + base  # (M², B)
    row_count = torch.zeros(B * M, dtype=torch.int32, device=device)
    col_count = torch.zeros(B * M, dtype=torch.int32, device=device)
    keep = torch.zeros(M * M, B, dtype=torch.bool, device=device)  # keep[k, b]: k-th visited kept
    for k in range(M * M):
        r = rows_all[k]  # (B,)
        c = cols_all[k]  # (B,)
        take = (row_count.index_select(0, r) < n) & (col_count.index_select(0, c) < n)  # (B,)
        keep[k] = take
        inc = take.to(torch.int32)
        row_count.index_add_(0, r, inc)
        col_count.index_add_(0, c, inc)
    mask = torch.zeros(B, M * M, dtype=torch.bool, device=device).scatter_(1, order, keep.T)
    return mask.view(B, M, M)


def _first_true(x: torch.Tensor) -> torch.Tensor:
    """x: (B, M) bool → (B,) index of the first True (0 where a row has none)."""
    return x.to(torch.uint8).argmax(dim=1)


def _best_swap(
    mask: torch.Tensor, w: torch.Tensor, i: torch.Tensor, j: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best 3-swap of eq. (localscore) for deficit row i and deficit column j of every block.

    mask: (B, M, M) bool, w: (B, M, M) float64, i, j: (B,) → (gain (B,) float64 with -inf where no
    valid swap exists, i' (B,), j' (B,)). The swap inserts (i, j') and (i', j) and removes (i', j').
    """
    B, M, _ = mask.shape
    bidx = torch.arange(B, device=mask.device)
    w_row = w[bidx, i, :]  # (B, M): w[i, j']
    w_col = w[bidx, :, j]  # (B, M): w[i', j]
    s_row = mask[bidx, i, :]  # (B, M): S[i, j']
    s_col = mask[bidx, :, j]  # (B, M): S[i', j]
    gain = w_row[:, None, :] + w_col[:, :, None] - w  # (B, M i', M j')
    valid = mask & ~s_row[:, None, :] & ~s_col[:, :, None]  # (B, M, M)
    gain = gain.masked_fill(~valid, float("-inf"))
    best, flat = gain.reshape(B, M * M).max(dim=1)  # (B,)
    return best, flat // M, flat % M


def _apply_swap(
    mask: torch.Tensor,
    apply: torch.Tensor,
    i: torch.Tensor,
    j: torch.Tensor,
    ip: torch.Tensor,
    jp: torch.Tensor,
) -> None:
    """In place on mask (B, M, M): where apply (B,) holds, set S[i', j'] = 0, S[i, j'] = S[i', j] = 1."""
    b = apply.nonzero().squeeze(1)  # (k,)
    mask[b, ip[b], jp[b]] = False
    mask[b, i[b], jp[b]] = True
    mask[b, ip[b], j[b]] = True


def _deficits(mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mask: (B, M, M) → (row_deficit (B, M) bool, col_deficit (B, M) bool): fewer than n kept."""
    return mask.sum(dim=2) < n, mask.sum(dim=1) < n


def local_search(mask: torch.Tensor, weights: torch.Tensor, n: int, steps: int) -> torch.Tensor:
    """mask: (B, M, M) bool (at most n per row/column), weights: (B, M, M) → improved mask (B, M, M).

    Paper Algorithm 2, lines 7-14: for `steps` rounds, in every block that still has a deficit row
    and column, take the first deficit row i and first deficit column j, find the swap
    (i', j') = argmax w[i, j'] + w[i', j] − w[i', j'] over S[i', j'] = 1, S[i, j'] = 0, S[i', j] = 0
    (eq. (localscore)) and apply it only when its gain is > 0. Blocks may stay infeasible; see
    `complete_feasibility`. Does not modify the input.
    """
    mask = mask.clone()
    w = weights.double()
    for _ in range(steps):
        row_def, col_def = _deficits(mask, n)
        needs = row_def.any(dim=1) & col_def.any(dim=1)  # (B,)
        if not bool(needs.any()):
            break
        i, j = _first_true(row_def), _first_true(col_def)
        gain, ip, jp = _best_swap(mask, w, i, j)
        _apply_swap(mask, needs & (gain > 0), i, j, ip, jp)
    return mask


def _set_where(flat: torch.Tensor, pos: torch.Tensor, where: torch.Tensor, value: bool) -> None:
    """In place on flat (b, K) bool: flat[k, pos[k]] = value in the rows k where `where` (b,) holds.

    A gather and a scatter instead of `nonzero` + indexing: no host sync on CUDA."""
    old = flat.gather(1, pos[:, None])  # (b, 1)
    new = old | where[:, None] if value else old & ~where[:, None]
    flat.scatter_(1, pos[:, None], new)


def _check_at_most(mask: torch.Tensor, n: int) -> None:
    """ValueError when a row or column of mask (B, M, M) holds more than n."""
    too_many = (mask.sum(dim=2) > n).any(dim=1) | (mask.sum(dim=1) > n).any(dim=1)  # (B,)
    if bool(too_many.any()):
        raise ValueError(f"complete_feasibility needs at most n={n} kept per row and column; got more")


def _best_additions(
    square: torch.Tensor, w: torch.Tensor, row_def: torch.Tensor, col_def: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """square, w: (b, M, M), row_def, col_def: (b, M) → ((b,) the flat index of the best unkept entry of a
    deficit row and deficit column, (b,) whether there is one)."""
    b, M, _ = square.shape
    pair_free = row_def[:, :, None] & col_def[:, None, :] & ~square  # (b, M, M)
    add_best, add_flat = w.masked_fill(~pair_free, float("-inf")).reshape(b, M * M).max(dim=1)  # (b,)
    return add_flat, add_best > float("-inf")


def _swap_first_deficits(
    sub: torch.Tensor, w: torch.Tensor, row_def: torch.Tensor, col_def: torch.Tensor, sw: torch.Tensor
) -> torch.Tensor:
    """In place on sub (b, M²) bool: in each block of sw (k,), the best 3-swap of eq. (localscore) for its
    first deficit row and column, whatever its gain → (k,) the gains (−inf where no swap existed)."""
    M = w.shape[1]
    square = sub.view(-1, M, M)
    i, j = _first_true(row_def[sw]), _first_true(col_def[sw])  # (k,)
    gain, ip, jp = _best_swap(square[sw], w[sw], i, j)
    # The swap's three entries are distinct (i' != i, j' != j by eq. (localscore)'s validity).
    sub[sw, ip * M + jp] = False
    sub[sw, i * M + jp] = True
    sub[sw, ip * M + j] = True
    return gain


def _check_swapped(failed: bool) -> None:
    """RuntimeError when a block needed a swap and had none (impossible while the mask holds at most n)."""
    if failed:
        raise RuntimeError("complete_feasibility found no valid swap; the mask invariant is broken")


def _write_back(
    targets: tuple[torch.Tensor, torch.Tensor], active: torch.Tensor, values: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """targets[k][active] = values[k]: the working blocks' masks and forced flags into the whole batch's."""
    for target, value in zip(targets, values, strict=True):
        target[active] = value


def complete_feasibility(mask: torch.Tensor, weights: torch.Tensor, n: int) -> Completion:
    """mask: (B, M, M) bool with at most n per row and column, weights: (B, M, M) non-negative →
    `Completion` whose mask (B, M, M) has exactly n per row and column.

    Each step, in every block with deficits: if some deficit row i and deficit column j have
    S[i, j] = 0, add the best such entry; otherwise apply the best 3-swap of eq. (localscore) for the
    first deficit row and column even when its gain is <= 0. Such a swap always exists then: column j
    has < n < M ones, so some row i' has S[i', j] = 0; i' is not a deficit row (every deficit pair is
    kept), so it holds n ones, which cannot all lie among the < n ones of row i. Every step raises one
    deficit row and one deficit column by one, so the loop ends after at most the total deficit
    (<= n·M) steps. Raises ValueError if a row or column holds more than n.

    On CUDA each step's cost is its launches, host syncs and passes over the batch (as profiled in
    docs/measurements/benchmarks-cuda.md): a step reads the device once (how many blocks still have
    deficits or need a swap, and the invariant check of the step before), applies its additions by a
    masked scatter instead of `nonzero` + indexing, searches swaps only in the blocks that need one, and
    on CUDA finished blocks stay in the batch as no-ops until they are half of it. Blocks never interact,
    so every block's steps, and the mask, are those of one block completed alone.
    """
    B, M, _ = mask.shape
    _check_at_most(mask, n)
    mask = mask.clone()
    forced, steps = torch.zeros(B, dtype=torch.bool, device=mask.device), 0
    # Work only on the blocks that still have deficits (usually a small share after greedy).
    row_def, _ = _deficits(mask, n)
    active = row_def.any(dim=1).nonzero().squeeze(1)  # (b,); row and column deficits have equal totals
    sub = mask[active].reshape(-1, M * M)  # (b, M²)
    w = weights[active].double()  # (b, M, M)
    sub_forced = torch.zeros(active.numel(), dtype=torch.bool, device=mask.device)  # (b,)
    broken = torch.zeros((), dtype=torch.bool, device=mask.device)  # a swap was needed and none existed
    while active.numel() > 0:
        b = active.numel()
        square = sub.view(b, M, M)
        row_def, col_def = _deficits(square, n)
        live = row_def.any(dim=1)  # (b,)
        add_flat, do_add = _best_additions(square, w, row_def, col_def)
        do_swap = live & ~do_add
        # The step's one device read (a second only in steps where some block needs a swap).
        live_count, swap_count, failed = torch.stack([live.sum(), do_swap.sum(), broken.long()]).tolist()
        _check_swapped(failed)
        if live_count == 0:
            _write_back((mask, forced), active, (square, sub_forced))
            break
        steps += 1
        _set_where(sub, add_flat, do_add, True)
        if swap_count:
            # The (k, M, M) swap search runs only on the k blocks that need a swap.
            sw = do_swap.nonzero().squeeze(1)  # (k,)
            gain = _swap_first_deficits(sub, w, row_def, col_def, sw)
            broken = broken | (gain == float("-inf")).any()
            sub_forced[sw] |= gain <= 0
        if live_count < b and (2 * live_count <= b or not sub.is_cuda):
            # Compact: write the finished blocks back and keep the rest. On CUDA a sync, so only once
            # half the batch is done (at most log2(B) times); on the CPU, where ops cost their data,
            # at every step.
            still = (sub.view(b, M, M).sum(dim=2) < n).any(dim=1).nonzero().squeeze(1)  # (b',) one read
            _write_back((mask, forced), active, (sub.view(b, M, M), sub_forced))
            active, sub, w, sub_forced = active[still], sub[still], w[still], sub_forced[still]
    _check_swapped(bool(broken))
    return Completion(mask=mask, forced_blocks=int(forced.sum()), steps=steps)
