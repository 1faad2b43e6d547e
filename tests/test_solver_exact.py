"""`exact` against independent references: brute force, `exhaustive`, hand-worked cases, LP duality."""

from __future__ import annotations

import itertools

import pytest
import torch

from tsenor_cli.solver import METHODS, solve, to_blocks
from tsenor_cli.solver.bounds import dual_upper_bound
from tsenor_cli.solver.exact import exact


def _brute_force(block: torch.Tensor, n: int) -> float:
    """Best objective over every M×M 0/1 matrix with n per row and column, by enumeration."""
    m = block.shape[0]
    rows = [r for r in itertools.product((0, 1), repeat=m) if sum(r) == n]
    best = float("-inf")
    for combo in itertools.product(rows, repeat=m):
        if all(sum(c) == n for c in zip(*combo, strict=True)):
            mask = torch.tensor(combo, dtype=torch.float64)
            best = max(best, float((mask * block).sum()))
    return best


def _feasible(mask: torch.Tensor, n: int, m: int) -> bool:
    blocks = to_blocks(mask, m)  # (B, M, M)
    return bool((blocks.sum(1) == n).all()) and bool((blocks.sum(2) == n).all())


@pytest.mark.parametrize(("m", "n"), [(3, 1), (3, 2), (4, 1), (4, 2), (4, 3), (5, 2)])
def test_exact_matches_brute_force(m: int, n: int) -> None:
    gen = torch.Generator().manual_seed(100 * m + n)
    scores = torch.rand(2 * m, m, generator=gen, dtype=torch.float64)  # 2 tiles
    result = solve(scores, n, m, "exact")
    assert _feasible(result.mask, n, m)
    for b, block in enumerate(to_blocks(scores, m)):
        assert float(result.block_objective[b]) == pytest.approx(_brute_force(block, n), rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_exact_matches_exhaustive_m4(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    # Integer scores create many ties: the optimum value must still agree.
    scores = torch.cat([torch.rand(40, 40, generator=gen), torch.randint(0, 4, (40, 40), generator=gen).float()], dim=0)
    ex = solve(scores, n, 4, "exact")
    ref = solve(scores, n, 4, "exhaustive")
    assert _feasible(ex.mask, n, 4)
    torch.testing.assert_close(ex.block_objective, ref.block_objective, rtol=1e-9, atol=1e-9)


def test_paper_figure_example() -> None:
    """Fig. 3 of the paper (2:4): greedy reaches 5.73 and is stuck; the optimum is 6.05."""
    w = torch.tensor(
        [
            [0.88, 0.01, 0.84, 0.27],
            [0.01, 0.71, 0.75, 0.53],
            [0.82, 0.78, 0.15, 0.25],
            [0.29, 0.50, 0.26, 0.95],
        ],
        dtype=torch.float64,
    )
    result = solve(w, 2, 4, "exact")
    expected = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(result.mask, expected)
    assert result.objective == pytest.approx(6.05)
    assert result.gap == pytest.approx(0.0, abs=1e-9)


def test_hand_worked_permutation_case() -> None:
    """1:3 masks are permutation matrices. Greedy takes 10, is then forced onto 0 and 1 (total 11);
    the six permutations by hand: the best is (0,1), (1,0), (2,2) = 9 + 9 + 1 = 19."""
    w = torch.tensor([[10.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    greedy = solve(w, 1, 3, "two_approx")
    assert greedy.objective == pytest.approx(11.0)
    result = solve(w, 1, 3, "exact")
    assert result.objective == pytest.approx(19.0)
    assert torch.equal(result.mask, torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.bool))


def test_exact_dual_certificate_and_integrality() -> None:
    gen = torch.Generator().manual_seed(7)
    blocks = torch.rand(50, 8, 8, generator=gen, dtype=torch.float64) ** 3
    sol = exact(blocks, 3)
    assert sol.mask.dtype == torch.bool
    assert sol.upper_bound is not None and sol.state is not None
    primal = (blocks * sol.mask).sum((1, 2))
    # The bound is recomputed here from the returned potentials: weak duality, valid for any (u, v).
    scale = sol.state.scale[:, None]
    recomputed = dual_upper_bound(blocks, sol.state.row * scale, sol.state.col * scale, 3)
    torch.testing.assert_close(recomputed, sol.upper_bound)
    torch.testing.assert_close(recomputed, primal, rtol=1e-7, atol=0.0)


def test_exact_scale_invariant_and_chunking() -> None:
    """Tiny scores (W² of small weights) and different chunk sizes give the same optimal objective."""
    gen = torch.Generator().manual_seed(3)
    blocks = torch.rand(30, 8, 8, generator=gen, dtype=torch.float64)
    a = exact(blocks, 4)
    b = exact(blocks * 1e-9, 4, chunk_variables=64)
    c = exact(blocks, 4, chunk_variables=10**9)
    obj = [(blocks * s.mask).sum((1, 2)) for s in (a, b, c)]
    torch.testing.assert_close(obj[0], obj[1], rtol=1e-9, atol=0.0)
    torch.testing.assert_close(obj[0], obj[2], rtol=1e-9, atol=0.0)


def test_exact_registered_as_exact() -> None:
    assert METHODS["exact"].exact
    assert METHODS["exact"].max_m is None


def test_exact_keeps_device(device: torch.device) -> None:
    scores = torch.rand(16, 16, device=device)
    result = solve(scores, 2, 8, "exact")
    assert result.mask.device.type == device.type
    assert result.block_upper_bound.device.type == device.type
    assert _feasible(result.mask.cpu(), 2, 8)
