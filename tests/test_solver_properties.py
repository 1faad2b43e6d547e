"""Property tests (hypothesis): every method on random shapes, N:M patterns, dtypes and devices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tsenor_cli.solver import METHODS, solve, to_blocks

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def problems(draw: st.DrawFn) -> tuple[torch.Tensor, int, int]:
    """(scores (R, C) float, n, m) with M in 2..8, R and C multiples of M, varied value patterns."""
    m = draw(st.integers(2, 8))
    n = draw(st.integers(1, m - 1))
    rows = m * draw(st.integers(1, 3))
    cols = m * draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["uniform", "ties", "sparse", "wide"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "uniform":
        x = torch.rand(rows, cols, generator=gen)
    elif kind == "ties":
        x = torch.randint(0, 3, (rows, cols), generator=gen).float()
    elif kind == "sparse":
        x = torch.rand(rows, cols, generator=gen) * (torch.rand(rows, cols, generator=gen) < 0.3)
    elif kind == "wide":
        x = torch.exp(torch.randn(rows, cols, generator=gen) * 3).clamp_max(1e4)
    else:
        raise AssertionError(kind)
    return x.to(dtype), n, m


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_all_methods_feasible_and_bounded(problem: tuple[torch.Tensor, int, int], device: torch.device) -> None:
    scores, n, m = problem
    scores = scores.to(device)
    before = scores.clone()
    ex = solve(scores, n, m, "exact")
    opt = ex.block_objective.cpu()
    for name, info in METHODS.items():
        if info.max_m is not None and m > info.max_m:
            continue
        result = solve(scores, n, m, name)
        blocks = to_blocks(result.mask.cpu(), m)  # (B, M, M)
        assert result.mask.shape == scores.shape, name
        assert bool((blocks.sum(1) == n).all()) and bool((blocks.sum(2) == n).all()), name
        obj = result.block_objective.cpu()
        assert bool((obj <= opt * (1 + 1e-6) + 1e-9).all()), name
        assert bool((result.block_upper_bound.cpu() >= opt * (1 - 1e-6) - 1e-9).all()), name
        true_gap = (ex.objective - result.objective) / ex.objective if ex.objective > 0 else 0.0
        assert result.gap >= true_gap - 1e-6, name
        assert 0.0 <= result.gap <= 1.0, name
    assert torch.equal(scores, before)


@settings(max_examples=15, deadline=None)
@given(problem=problems())
def test_exact_certified_optimal(problem: tuple[torch.Tensor, int, int]) -> None:
    scores, n, m = problem
    result = solve(scores, n, m, "exact")
    assert result.gap == pytest.approx(0.0, abs=1e-6)
    # Every feasible mask from another method can only be worse.
    for name in ("two_approx", "bi_nm"):
        assert solve(scores, n, m, name).objective <= result.objective * (1 + 1e-9) + 1e-9


@settings(max_examples=15, deadline=None)
@given(problem=problems())
def test_masks_invariant_to_positive_scaling(problem: tuple[torch.Tensor, int, int]) -> None:
    """Rescaling the scores by a power of two (exact in every dtype, no comparison changes) must not
    change any method's mask: methods may not depend on the absolute scale of the scores."""
    scores, n, m = problem
    scaled = scores * 4
    for name, info in METHODS.items():
        if info.max_m is not None and m > info.max_m:
            continue
        a = solve(scores, n, m, name)
        b = solve(scaled, n, m, name)
        assert torch.equal(a.mask, b.mask), name
        assert b.objective == pytest.approx(4 * a.objective, rel=1e-9, abs=1e-12), name


def test_block_objective_in_slices_matches_whole_matrix() -> None:
    from tsenor_cli.solver.api import _block_objective

    gen = torch.Generator().manual_seed(3)
    blocks = torch.rand(37, 8, 8, generator=gen)
    mask = torch.rand(37, 8, 8, generator=gen) < 0.5
    whole = (blocks.double() * mask).sum((1, 2))
    # 3 blocks per slice: 13 slices, the last one partial.
    assert torch.equal(_block_objective(blocks, mask, chunk_elements=3 * 64), whole)
    assert torch.equal(_block_objective(blocks, mask), whole)
