"""The exact `flow` solver (solver/flow.py): exact masks and optimal potentials, checked against HiGHS."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tsenor_cli.bench.solver import sample_real_tiles
from tsenor_cli.solver import from_blocks, solve, to_blocks
from tsenor_cli.solver.bounds import dual_upper_bound
from tsenor_cli.solver.flow import FlowOptions, exact_flow


def _feasible(blocks_mask: torch.Tensor, n: int) -> bool:
    return bool((blocks_mask.sum(1) == n).all()) and bool((blocks_mask.sum(2) == n).all())


def test_hand_worked_exchange() -> None:
    """1:2 on [[0, 1], [1, 0]]: the anti-diagonal, objective 2, potentials certify it."""
    w = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])
    res = exact_flow(w, 1)
    assert torch.equal(res.mask[0], torch.tensor([[False, True], [True, False]]))
    assert float(dual_upper_bound(w, res.row, res.col, 1)[0]) == pytest.approx(2.0)  # max 1: units agree
    assert float(res.upper_bound[0]) == pytest.approx(2.0)


def test_hand_worked_three_cycle() -> None:
    """1:3 where the best mask is the shifted permutation (3.0), which no 2×2 exchange of the identity
    (1.5) reaches."""
    w = torch.tensor([[[0.5, 1.0, 0.0], [0.0, 0.5, 1.0], [1.0, 0.0, 0.5]]])
    res = exact_flow(w, 1)
    assert float((w * res.mask).sum()) == pytest.approx(3.0)


@pytest.mark.parametrize(("n", "m"), [(1, 4), (2, 4), (1, 8), (4, 8), (7, 8), (3, 6), (8, 16), (16, 32), (8, 32)])
def test_equals_highs_on_random_tiles(n: int, m: int) -> None:
    """Objective per tile equal to the LP optimum from HiGHS, exactly n per row and column, and the
    returned potentials certify it (dual bound = objective)."""
    gen = torch.Generator().manual_seed(n * 1000 + m)
    scores = torch.rand(6 * m, 4 * m, generator=gen)
    exact = solve(scores, n, m, "exact")
    ours = solve(scores, n, m, "flow")
    assert ours.method == "flow"
    assert _feasible(to_blocks(ours.mask, m), n)
    torch.testing.assert_close(ours.block_objective, exact.block_objective, rtol=1e-12, atol=1e-12)
    assert ours.gap <= 1e-12


def _adversarial_tiles(m: int, seed: int) -> torch.Tensor:
    """(8, m, m) tiles that are hard for iterative solvers: integer ties, a constant and an all-zero
    tile, near-ties 1e-9 apart, rows spanning twelve orders of magnitude (W² of tiny weights), one
    dominant entry per row, and a permutation structure that no 2×2 exchange improves."""
    gen = torch.Generator().manual_seed(seed)
    ties = torch.randint(0, 3, (m, m), generator=gen).double()
    const = torch.ones(m, m, dtype=torch.float64)
    zero = torch.zeros(m, m, dtype=torch.float64)
    near = 1 + 1e-9 * torch.randint(0, 4, (m, m), generator=gen).double()
    ranges = torch.rand(m, m, generator=gen, dtype=torch.float64) * 10.0 ** -torch.arange(m).remainder(12)[:, None]
    dominant = torch.rand(m, m, generator=gen, dtype=torch.float64) * 1e-3
    dominant[torch.arange(m), torch.randperm(m, generator=gen)] = 1.0
    shift = torch.eye(m, dtype=torch.float64).roll(1, dims=1) + 0.5 * torch.eye(m, dtype=torch.float64)
    rand = torch.rand(m, m, generator=gen, dtype=torch.float64)
    return torch.stack([ties, const, zero, near, ranges, dominant, shift, rand])


@pytest.mark.parametrize(("n", "m"), [(1, 4), (2, 4), (3, 4), (1, 8), (4, 8), (8, 16), (5, 16), (16, 32)])
def test_equals_highs_on_adversarial_tiles(n: int, m: int) -> None:
    """On every adversarial tile `flow` is feasible, certifies its own optimality (gap at round-off) and
    is at least as good as HiGHS, whose 1e-7 tolerances may stop short on the 1e-9 near-ties."""
    tiles = _adversarial_tiles(m, seed=n * 10 + m)
    scores = from_blocks(tiles, tiles.shape[0] * m, m)
    ours = solve(scores, n, m, "flow")
    exact = solve(scores, n, m, "exact")
    assert _feasible(to_blocks(ours.mask, m), n)
    assert bool((ours.block_objective >= exact.block_objective * (1 - 1e-12)).all())
    torch.testing.assert_close(ours.block_upper_bound, ours.block_objective, rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(ours.block_objective, exact.block_objective, rtol=1e-6, atol=0.0)


@pytest.mark.realmodel
@pytest.mark.parametrize(("n", "m"), [(8, 16), (16, 32), (8, 32), (32, 64)])
@pytest.mark.parametrize("kind", ["abs", "sq"])
def test_equals_highs_on_real_tiles(smollm2_path: Path, n: int, m: int, kind: str) -> None:
    tiles = sample_real_tiles(smollm2_path, m, 48, seed=13)
    tiles = tiles.abs() if kind == "abs" else tiles.square()
    scores = from_blocks(tiles, tiles.shape[0] * m, m)
    exact = solve(scores, n, m, "exact")
    ours = solve(scores, n, m, "flow")
    torch.testing.assert_close(ours.block_objective, exact.block_objective, rtol=1e-12, atol=0.0)
    assert ours.upper_bound >= exact.objective * (1 - 1e-12)


@pytest.mark.parametrize("rounds", [0, 1, 2, 5])
def test_dual_rounds_change_speed_not_the_answer(rounds: int) -> None:
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(64, 64, generator=gen)
    base = solve(scores, 8, 16, "flow", dual_rounds=0)
    other = solve(scores, 8, 16, "flow", dual_rounds=rounds)
    torch.testing.assert_close(other.block_objective, base.block_objective, rtol=1e-12, atol=0.0)


def test_more_rounds_need_fewer_paths() -> None:
    """Better starting potentials leave less column excess to route (why cold solves run 2 rounds)."""
    gen = torch.Generator().manual_seed(8)
    w = torch.rand(200, 32, 32, generator=gen)
    paths = [int(exact_flow(w, 16, options=FlowOptions(rounds=r)).paths.sum()) for r in (0, 1, 2)]
    assert paths[0] > paths[1] > paths[2]


def test_warm_start_is_exact_and_needs_fewer_paths() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.rand(300, 16, 16, generator=gen, dtype=torch.float64)
    first = exact_flow(w, 8, options=FlowOptions(rounds=2))
    perturbed = w * (1 + 0.01 * torch.randn(w.shape, generator=gen, dtype=torch.float64))
    cold = exact_flow(perturbed, 8, options=FlowOptions(rounds=0))
    warm = exact_flow(perturbed, 8, col=first.col * first.scale[:, None], options=FlowOptions(rounds=0))  # score units
    torch.testing.assert_close((perturbed * warm.mask).sum((1, 2)), (perturbed * cold.mask).sum((1, 2)))
    assert int(warm.paths.sum()) < int(cold.paths.sum()) / 2


def test_warm_mask_on_unchanged_scores_needs_no_path() -> None:
    """Re-solving the same scores from the previous mask and potentials keeps the mask as it is: the
    centred potentials certify it, so not one tile routes a path."""
    gen = torch.Generator().manual_seed(21)
    w = torch.rand(200, 16, 16, generator=gen, dtype=torch.float64)
    first = exact_flow(w, 8)
    again = exact_flow(w, 8, col=first.col * first.scale[:, None], init_mask=first.mask, options=FlowOptions(rounds=0))
    assert int(again.paths.sum()) == 0
    assert torch.equal(again.mask, first.mask)
    torch.testing.assert_close(again.upper_bound, (w * first.mask).sum((1, 2)), rtol=1e-12, atol=0.0)


@pytest.mark.parametrize(("n", "m"), [(2, 8), (8, 16), (16, 32)])
def test_warm_mask_equals_highs_and_beats_potentials_alone(n: int, m: int) -> None:
    """1% noise: the warm start from the previous mask is exact (HiGHS per tile), and centring plus the
    kept rows route fewer paths than the previous potentials alone, which route fewer than none."""
    gen = torch.Generator().manual_seed(n * 100 + m)
    w = torch.rand(120, m, m, generator=gen, dtype=torch.float64)
    first = exact_flow(w, n)
    noisy = (w * (1 + 0.01 * torch.randn(w.shape, generator=gen, dtype=torch.float64))).abs()
    col = first.col * first.scale[:, None]
    potentials_only = exact_flow(noisy, n, col=col, options=FlowOptions(rounds=0))
    warm = exact_flow(noisy, n, col=col, init_mask=first.mask, options=FlowOptions(rounds=0))
    assert _feasible(warm.mask, n)
    exact = solve(from_blocks(noisy, noisy.shape[0] * m, m), n, m, "exact")
    torch.testing.assert_close((noisy * warm.mask).sum((1, 2)), exact.block_objective, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(warm.upper_bound, exact.block_objective, rtol=1e-9, atol=1e-12)
    assert int(warm.paths.sum()) < int(potentials_only.paths.sum())
    assert torch.equal(first.mask, exact_flow(w, n).mask)  # the caller's previous mask is not modified


def test_warm_mask_of_another_shape_is_repaired() -> None:
    """An outside state whose mask rows do not hold n (or keep nothing) is not trusted: those rows are
    selected afresh and the answer is still exact."""
    gen = torch.Generator().manual_seed(4)
    w = torch.rand(50, 8, 8, generator=gen, dtype=torch.float64)
    bad = torch.zeros(50, 8, 8, dtype=torch.bool)
    bad[:, :, :3] = True  # three per row, eight or none per column
    bad[:, 0] = False  # and a row that keeps nothing
    res = exact_flow(w, 3, col=torch.zeros(50, 8, dtype=torch.float64), init_mask=bad, options=FlowOptions(rounds=0))
    assert _feasible(res.mask, 3)
    exact = solve(from_blocks(w, 50 * 8, 8), 3, 8, "exact")
    torch.testing.assert_close((w * res.mask).sum((1, 2)), exact.block_objective, rtol=1e-12, atol=1e-12)


def test_warm_mask_shape_and_sweeps_are_checked() -> None:
    w = torch.rand(4, 8, 8)
    with pytest.raises(ValueError, match="init_mask has shape"):
        exact_flow(w, 4, init_mask=torch.zeros(4, 8, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="sweeps must be >= 0"):
        exact_flow(w, 4, options=FlowOptions(sweeps=-1))


def test_ties_and_zero_tiles_are_feasible() -> None:
    """Constant and all-zero tiles (every mask optimal) and heavy ties still give exactly n per line."""
    const = torch.ones(1, 8, 8)
    zero = torch.zeros(1, 8, 8)
    ties = torch.randint(0, 3, (5, 8, 8), generator=torch.Generator().manual_seed(0)).float()
    w = torch.cat([const, zero, ties])
    res = exact_flow(w, 3)
    assert _feasible(res.mask, 3)
    exact = solve(from_blocks(w, 7 * 8, 8), 3, 8, "exact")
    torch.testing.assert_close((w.double() * res.mask).sum((1, 2)), exact.block_objective)


def test_deterministic_across_thread_counts() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.rand(64, 16, 16, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = exact_flow(w, 8)
        torch.set_num_threads(2)
        two = exact_flow(w, 8)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.mask, two.mask)
    assert torch.equal(one.col, two.col)


def test_state_roundtrip_through_solve() -> None:
    """solve(..., init=result) with `flow`: a warm start on a rescaled matrix gives the same (exact)
    objective as a cold solve."""
    gen = torch.Generator().manual_seed(6)
    scores = torch.rand(96, 96, generator=gen)
    first = solve(scores, 16, 32, "flow")
    changed = (scores * (1 + 0.05 * torch.randn(96, 96, generator=gen))).abs() * 3.0
    warm = solve(changed, 16, 32, "flow", init=first)
    cold = solve(changed, 16, 32, "flow")
    assert warm.objective == pytest.approx(cold.objective, rel=1e-12)
    assert warm.gap <= 1e-12


def test_flow_on_the_input_device(device: torch.device) -> None:
    """`flow` takes tensors on any device (it computes on the CPU) and answers on theirs, exactly."""
    scores = torch.rand(32, 32, generator=torch.Generator().manual_seed(1)).to(device)
    res = solve(scores, 4, 8, "flow")
    assert res.mask.device == scores.device
    assert _feasible(to_blocks(res.mask, 8).cpu(), 4)
    exact = solve(scores.cpu(), 4, 8, "exact")
    torch.testing.assert_close(res.block_objective.cpu(), exact.block_objective, rtol=1e-12, atol=1e-12)


def test_options_of_other_methods_are_refused() -> None:
    """`flow` takes dual_rounds and max_elements; `tsenor`'s options are an error naming what it takes."""
    scores = torch.rand(16, 16)
    with pytest.raises(ValueError, match=r"option\(s\) sweeps do not apply to method 'flow'; its options: dual_rounds"):
        solve(scores, 8, 16, "flow", sweeps=3)
    with pytest.raises(ValueError, match=r"dual_rounds do not apply to method 'tsenor'"):
        solve(scores, 8, 16, "tsenor", dual_rounds=1)
    with pytest.raises(ValueError, match="dual_rounds must be >= 0"):
        solve(scores, 8, 16, "flow", dual_rounds=-1)
    with pytest.raises(ValueError, match="max_elements"):
        solve(scores, 8, 16, "flow", max_elements=0)


def test_retry_round_for_far_off_potentials() -> None:
    """Potentials from unrelated scores (as ALPS's early iterations hand over): the retry round keeps
    the answer exact and routes fewer paths than the stale potentials alone."""
    gen = torch.Generator().manual_seed(9)
    w = torch.rand(200, 32, 32, generator=gen, dtype=torch.float64)
    stale = exact_flow(torch.rand(200, 32, 32, generator=gen, dtype=torch.float64), 16)
    col = stale.col * stale.scale[:, None]
    plain = exact_flow(w, 16, col=col, options=FlowOptions(rounds=0))
    retried = exact_flow(w, 16, col=col, options=FlowOptions(rounds=0, retry_excess=16))
    torch.testing.assert_close((w * retried.mask).sum((1, 2)), (w * plain.mask).sum((1, 2)))
    assert int(retried.paths.sum()) < int(plain.paths.sum())


def test_a_solve_leaves_torch_thread_count_as_it_was() -> None:
    """numba's OpenMP pool, started by the first parallel kernel of a process, sets the OpenMP thread
    count for the whole process; torch's must stay what it was, or float results would depend on
    whether a solve ran earlier (a resumed prune would differ from an uninterrupted one). A fresh
    process, since this one's pool may already run."""
    import subprocess
    import sys

    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from tsenor_cli.solver.flow import exact_flow\n"
        "exact_flow(torch.rand(4, 8, 8), 4)\n"
        "print(torch.get_num_threads())"
    )
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
