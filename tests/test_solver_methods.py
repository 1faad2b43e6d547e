"""Every registered mask method on random and real SmolLM2 tiles, against `exact`; rounding units."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tsenor_cli.solver import METHODS, SolveResult, solve, to_blocks
from tsenor_cli.solver.baselines import _topn_mask
from tsenor_cli.solver.bounds import dual_upper_bound
from tsenor_cli.solver.exact import exact
from tsenor_cli.solver.reference import dykstra_log, run_reference
from tsenor_cli.solver.rounding import complete_feasibility, greedy_select, local_search

FIG_W = torch.tensor(
    [[0.88, 0.01, 0.84, 0.27], [0.01, 0.71, 0.75, 0.53], [0.82, 0.78, 0.15, 0.25], [0.29, 0.50, 0.26, 0.95]],
    dtype=torch.float64,
)


def _feasible(mask: torch.Tensor, n: int, m: int) -> bool:
    blocks = to_blocks(mask, m)  # (B, M, M)
    return bool((blocks.sum(1) == n).all()) and bool((blocks.sum(2) == n).all())


def _methods_for(m: int) -> list[str]:
    return [name for name, info in METHODS.items() if info.max_m is None or m <= info.max_m]


def _check_against_exact(result: SolveResult, ex: SolveResult) -> None:
    """Objective <= optimum, certified bound >= optimum, reported gap >= true relative error."""
    opt = ex.block_objective.cpu()
    obj = result.block_objective.cpu()
    ub = result.block_upper_bound.cpu()
    assert bool((obj <= opt * (1 + 1e-6) + 1e-12).all())
    assert bool((ub >= opt * (1 - 1e-6) - 1e-12).all())
    true_gap = (ex.objective - result.objective) / ex.objective
    assert result.gap >= true_gap - 1e-6


# ---------------------------------------------------------------- every method, random scores


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize(("n", "m"), [(2, 4), (4, 8), (8, 16)])
def test_every_method_feasible_and_bounded(method: str, n: int, m: int, device: torch.device) -> None:
    if method not in _methods_for(m):
        pytest.skip(f"{method} handles M <= {METHODS[method].max_m}")
    gen = torch.Generator().manual_seed(n * m)
    scores = torch.rand(2 * m, 3 * m, generator=gen).to(device)
    before = scores.clone()
    result = solve(scores, n, m, method)
    assert torch.equal(scores, before)  # input left untouched
    assert result.mask.shape == scores.shape and result.mask.dtype == torch.bool
    assert result.mask.device.type == device.type
    assert _feasible(result.mask.cpu(), n, m)
    _check_against_exact(result, solve(scores.cpu(), n, m, "exact"))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_deterministic(method: str) -> None:
    m = 4 if METHODS[method].max_m is not None else 8
    gen = torch.Generator().manual_seed(11)
    scores = torch.randint(0, 5, (4 * m, 2 * m), generator=gen).float()  # ties on purpose
    first = solve(scores, m // 2, m, method)
    second = solve(scores.clone(), m // 2, m, method)
    assert torch.equal(first.mask, second.mask)
    assert first.objective == second.objective


# ---------------------------------------------------------------- real SmolLM2 tiles


@pytest.fixture(scope="module")
def real_weights(smollm2_path: Path) -> dict[str, torch.Tensor]:
    """Three SmolLM2 projections (layers 0 and 12), sliced to 64×128 to keep the test fast."""
    from safetensors import safe_open

    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.12.mlp.down_proj.weight",
        "model.layers.12.self_attn.v_proj.weight",
    ]
    with safe_open(str(smollm2_path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name)[:64, :128].float() for name in names}


@pytest.mark.realmodel
@pytest.mark.parametrize("score", ["abs", "square"])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (8, 16), (16, 32), (8, 32)])
def test_every_method_on_real_tiles(real_weights: dict[str, torch.Tensor], score: str, n: int, m: int) -> None:
    for w in real_weights.values():
        scores = w.abs() if score == "abs" else w.square()
        ex = solve(scores, n, m, "exact")
        assert _feasible(ex.mask, n, m)
        assert ex.gap == pytest.approx(0.0, abs=1e-6)
        for method in _methods_for(m):
            result = solve(scores, n, m, method)
            assert _feasible(result.mask, n, m), method
            _check_against_exact(result, ex)


@pytest.mark.realmodel
def test_reference_close_to_optimal_on_real_tiles(real_weights: dict[str, torch.Tensor]) -> None:
    """The paper's algorithm beats the greedy 2-approximation on real weights (Table 1's ordering)."""
    w = torch.cat([v.abs() for v in real_weights.values()], dim=0)  # (192, 128)
    ex = solve(w, 8, 16, "exact")
    ref = solve(w, 8, 16, "tsenor-reference")
    greedy = solve(w, 8, 16, "two_approx")
    err_ref = (ex.objective - ref.objective) / ex.objective
    err_greedy = (ex.objective - greedy.objective) / ex.objective
    assert err_ref < err_greedy
    assert ref.upper_bound >= ex.objective * (1 - 1e-9)
    # The reference's own dual bound (before `solve` takes the min with the generic one), per tile.
    own = run_reference(to_blocks(w, 16), 8).solution.upper_bound
    assert own is not None
    assert bool((own >= ex.block_objective * (1 - 1e-9)).all())


# ---------------------------------------------------------------- tsenor-reference internals


def test_dykstra_shift_algebra() -> None:
    """log_S + log_Q = τ'|W| − a_i − b_j after any number of iterations (module docstring)."""
    gen = torch.Generator().manual_seed(5)
    blocks = torch.rand(20, 8, 8, generator=gen, dtype=torch.float64) * 3.0
    for iterations in (1, 7, 50):
        d = dykstra_log(blocks, 3, tau_scale=0.005, iterations=iterations)
        x = d.log_s + d.log_q
        expected = blocks / (0.005 * d.scale[:, None, None]) - d.row_shift[:, :, None] - d.col_shift[:, None, :]
        torch.testing.assert_close(x, expected, rtol=1e-9, atol=1e-8)


def test_dykstra_marginals_converge() -> None:
    gen = torch.Generator().manual_seed(6)
    blocks = torch.rand(10, 8, 8, generator=gen, dtype=torch.float64)
    s = dykstra_log(blocks, 4, tau_scale=0.05, iterations=300).log_s.exp()
    assert bool((s <= 1 + 1e-12).all())
    torch.testing.assert_close(s.sum(2), torch.full((10, 8), 4.0, dtype=torch.float64), atol=1e-3, rtol=0)
    torch.testing.assert_close(s.sum(1), torch.full((10, 8), 4.0, dtype=torch.float64), atol=1e-3, rtol=0)


def test_reference_bound_certified_and_tight() -> None:
    gen = torch.Generator().manual_seed(8)
    blocks = torch.rand(64, 16, 16, generator=gen, dtype=torch.float64)
    run = run_reference(blocks, 8)
    sol = run.solution
    opt = (blocks * exact(blocks, 8).mask).sum((1, 2))
    assert sol.upper_bound is not None and sol.state is not None
    assert bool((sol.upper_bound >= opt * (1 - 1e-9)).all())
    # Potentials from 300 entropic iterations are close to LP-optimal: the bound is within 2%.
    assert float(((sol.upper_bound - opt) / opt).max()) < 0.02
    scale = sol.state.scale[:, None]
    torch.testing.assert_close(
        dual_upper_bound(blocks, sol.state.row * scale, sol.state.col * scale, 8), sol.upper_bound
    )
    assert 0 <= run.forced_blocks <= run.infeasible_after_local_search <= 64


def test_reference_counts_blocks_the_paper_leaves_infeasible() -> None:
    """With L = 0 local steps greedy alone leaves infeasible blocks; completion repairs all of them."""
    gen = torch.Generator().manual_seed(9)
    blocks = torch.rand(200, 8, 8, generator=gen)
    run = run_reference(blocks, 4, local_steps=0, iterations=5)
    assert run.infeasible_after_local_search > 0
    mask = run.solution.mask
    assert bool((mask.sum(1) == 4).all()) and bool((mask.sum(2) == 4).all())


# ---------------------------------------------------------------- rounding units


def test_greedy_and_local_search_paper_figure() -> None:
    """Fig. 3: greedy gives 5.73 with row 4 / column 4 short; one swap (i', j') = (2, 2) gives 6.05."""
    greedy = greedy_select(FIG_W[None], 2)  # (1, 4, 4)
    assert float((FIG_W * greedy).sum()) == pytest.approx(5.73)
    assert greedy[0].sum(1).tolist() == [2, 2, 2, 1]
    assert greedy[0].sum(0).tolist() == [2, 2, 2, 1]
    improved = local_search(greedy, FIG_W[None], 2, steps=10)
    assert float((FIG_W * improved).sum()) == pytest.approx(6.05)
    assert not bool(improved[0, 1, 1]) and bool(improved[0, 1, 3]) and bool(improved[0, 3, 1])
    assert torch.equal(greedy, greedy_select(FIG_W[None], 2))  # inputs not modified


def test_greedy_keeps_at_most_n_and_top_entry() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(100, 8, 8, generator=gen)
    mask = greedy_select(scores, 3)
    assert bool((mask.sum(1) <= 3).all()) and bool((mask.sum(2) <= 3).all())
    top = scores.reshape(100, -1).argmax(1)
    assert bool(mask.reshape(100, -1)[torch.arange(100), top].all())


def test_local_search_never_decreases() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.rand(300, 8, 8, generator=gen, dtype=torch.float64)
    start = greedy_select(w, 4)
    after = local_search(start, w, 4, steps=10)
    assert bool(((w * after).sum((1, 2)) >= (w * start).sum((1, 2)) - 1e-12).all())


def test_complete_feasibility_from_empty_and_bi_nm_masks() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.rand(100, 8, 8, generator=gen)
    done = complete_feasibility(torch.zeros(100, 8, 8, dtype=torch.bool), w, 3)
    assert bool((done.mask.sum(1) == 3).all()) and bool((done.mask.sum(2) == 3).all())
    assert done.steps <= 3 * 8
    s1 = _topn_mask(w, 3, dim=2)
    s2 = _topn_mask(w * s1, 3, dim=1)
    partial = s1 & s2
    # Bi-NM's S1⊙S2 is not transposable N:M in general: it must need repair here.
    assert bool((partial.sum(2) < 3).any())
    fixed = complete_feasibility(partial, w, 3).mask
    assert bool((fixed.sum(1) == 3).all()) and bool((fixed.sum(2) == 3).all())


def test_complete_feasibility_forced_swap() -> None:
    """2:3 with rows/columns 0-1 saturated among themselves: the only deficit pair (2, 2) is already
    kept, so the only way to feasibility is a swap that removes a 4 or 5 and adds two zeros."""
    w = torch.tensor([[[5.0, 4.0, 0.0], [4.0, 5.0, 0.0], [0.0, 0.0, 1.0]]])
    stuck = torch.tensor([[[1, 1, 0], [1, 1, 0], [0, 0, 1]]], dtype=torch.bool)
    done = complete_feasibility(stuck, w, 2)
    assert bool((done.mask.sum(1) == 2).all()) and bool((done.mask.sum(2) == 2).all())
    assert done.forced_blocks == 1
    assert float((w * done.mask).sum()) < float((w * stuck).sum())


@pytest.mark.parametrize(("n", "m"), [(2, 4), (8, 16), (16, 32)])
def test_complete_feasibility_batch_equals_each_block_alone(n: int, m: int) -> None:
    """Blocks never interact: a batch mixing full, nearly full and empty starts (so the batch shrinks
    while it runs) gives every block the mask, forced swap and step count it gets alone."""
    gen = torch.Generator().manual_seed(m)
    w = torch.rand(24, m, m, generator=gen)
    rows = _topn_mask(w, n, dim=2)
    start = _topn_mask(w.masked_fill(~rows, float("-inf")), n, dim=1) & rows  # rowcol rounding: deficits
    start[:8] = False  # empty: the longest repairs
    start[8:12] = complete_feasibility(start[8:12], w[8:12], n).mask  # already feasible: no step
    done = complete_feasibility(start, w, n)
    alone = [complete_feasibility(start[b : b + 1], w[b : b + 1], n) for b in range(24)]
    assert torch.equal(done.mask, torch.cat([a.mask for a in alone]))
    assert done.steps == max(a.steps for a in alone) > 0
    assert done.forced_blocks == sum(a.forced_blocks for a in alone)
    assert all(a.steps == 0 for a in alone[8:12])


def test_complete_feasibility_rejects_overfull() -> None:
    with pytest.raises(ValueError, match="at most n=1"):
        complete_feasibility(torch.ones(1, 3, 3, dtype=torch.bool), torch.rand(1, 3, 3), 1)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_zero_and_tiny_tiles(method: str) -> None:
    """An all-zero tile and a tile of 1e-30 scores (float32) must give finite, certified results."""
    m = 4
    scores = torch.zeros(m, 3 * m)
    scores[:, m : 2 * m] = torch.rand(m, m, generator=torch.Generator().manual_seed(0)) * 1e-30
    scores[:, 2 * m :] = torch.rand(m, m, generator=torch.Generator().manual_seed(1))
    result = solve(scores, 2, m, method)
    assert _feasible(result.mask, 2, m)
    assert bool(torch.isfinite(result.block_upper_bound).all())
    _check_against_exact(result, solve(scores, 2, m, "exact"))
