"""Baseline transposable N:M mask methods the paper compares against (Appendix B.1).

- `two_approx` (Hubara et al. 2021): greedy over the entries of |W| in descending order, keeping one
  when its row and column have room; a 2-approximation. Greedy can leave rows/columns with fewer
  than N, so `complete_feasibility` finishes those blocks.
- `bi_nm` (Zhang et al. 2023): row-wise N:M on W gives S1, column-wise N:M on W⊙S1 gives S2, mask
  S1⊙S2. That mask keeps at most N per row and column but in general fewer, i.e. it is NOT a
  feasible transposable mask; `complete_feasibility` adds entries/swaps until it is.
- `max_random`: the best of K random feasible transposable masks per block.
"""

from __future__ import annotations

import torch

from tsenor_cli.solver.registry import register
from tsenor_cli.solver.rounding import complete_feasibility, greedy_select
from tsenor_cli.solver.types import BlockSolution, DualState

# Cap on (blocks · samples · M²) elements materialized at once by `max_random`.
RANDOM_CHUNK_ELEMENTS = 1 << 24


def _topn_mask(scores: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """scores: (B, M, M) → mask (B, M, M) bool keeping the n largest along `dim`."""
    idx = scores.topk(n, dim=dim).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(dim, idx, True)


@register("two_approx", "Hubara et al. 2021 greedy 2-approximation on the raw scores, completed to feasibility")
def two_approx(blocks: torch.Tensor, n: int, *, init: DualState | None = None) -> BlockSolution:
    """blocks: (B, M, M) → mask (B, M, M) bool: greedy on the scores, then `complete_feasibility`."""
    return BlockSolution(mask=complete_feasibility(greedy_select(blocks, n), blocks, n).mask)


@register("bi_nm", "Zhang et al. 2023 Bi-NM: row-wise then column-wise N:M, completed to feasibility")
def bi_nm(blocks: torch.Tensor, n: int, *, init: DualState | None = None) -> BlockSolution:
    """blocks: (B, M, M) → mask (B, M, M) bool: S1 = row-wise top-n of W, S2 = column-wise top-n of
    W⊙S1, then `complete_feasibility` on S1⊙S2."""
    s1 = _topn_mask(blocks, n, dim=2)  # (B, M, M): n per row
    s2 = _topn_mask(blocks * s1, n, dim=1)  # (B, M, M): n per column
    return BlockSolution(mask=complete_feasibility(s1 & s2, blocks, n).mask)


def _random_perms(shape: tuple[int, ...], m: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """→ (*shape, m) int64: independent uniform random permutations of 0..m-1."""
    return torch.rand(*shape, m, generator=gen, device=device).argsort(dim=-1)


@register("max_random", "best of K random feasible transposable masks per tile (K=samples, seeded)")
def max_random(
    blocks: torch.Tensor,
    n: int,
    *,
    init: DualState | None = None,
    samples: int = 1000,
    seed: int = 0,
) -> BlockSolution:
    """blocks: (B, M, M) → mask (B, M, M) bool, the best of `samples` random feasible masks per block.

    A random mask is S[p(i), q(j)] = 1 iff (i + j) mod M ∈ D for random row and column permutations
    p, q and a random set D of n residues: the cyclic Latin square keeps exactly n per row and column
    and the permutations preserve that. Only the n·M kept positions are gathered per sample.
    Seeded with a torch.Generator on the blocks' device.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}; e.g. samples=1000")
    B, M, _ = blocks.shape
    device = blocks.device
    gen = torch.Generator(device=device).manual_seed(seed)
    ar = torch.arange(M, device=device)
    w_flat = blocks.reshape(B, 1, M * M)  # (B, 1, M²)
    best_score = blocks.new_full((B,), float("-inf"))
    best_pos = torch.zeros(B, M * n, dtype=torch.long, device=device)
    bidx = torch.arange(B, device=device)
    k = max(1, min(samples, RANDOM_CHUNK_ELEMENTS // max(1, B * M * n)))
    for start in range(0, samples, k):
        s = min(k, samples - start)
        p = _random_perms((B, s), M, gen, device)  # (B, s, M)
        q = _random_perms((B, s), M, gen, device)  # (B, s, M)
        d = _random_perms((B, s), M, gen, device)[..., :n]  # (B, s, n): the kept residues
        # Row i keeps the columns j = (d_k − i) mod M of the cyclic pattern: (B, s, M, n).
        col = (d[:, :, None, :] - ar[None, None, :, None]) % M
        qcol = torch.gather(q, 2, col.reshape(B, s, M * n)).view(B, s, M, n)  # q(j)
        pos = (p[..., None] * M + qcol).reshape(B, s, M * n)  # flat index p(i)·M + q(j)
        score = torch.gather(w_flat.expand(B, s, M * M), 2, pos).sum(dim=2)  # (B, s)
        chunk_best, arg = score.max(dim=1)  # (B,)
        better = chunk_best > best_score
        best_score = torch.where(better, chunk_best, best_score)
        best_pos = torch.where(better[:, None], pos[bidx, arg], best_pos)
    mask = torch.zeros(B, M * M, dtype=torch.bool, device=device).scatter_(1, best_pos, True)
    return BlockSolution(mask=mask.view(B, M, M))
