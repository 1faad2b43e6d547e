"""Bad input to the solver API: one ValueError naming the problem and the fix, input untouched."""

from __future__ import annotations

import pytest
import torch

from tsenor_cli.solver import METHODS, DualState, solve, transposable_nm_mask
from tsenor_cli.solver.api import _init_state


def _ok(rows: int = 8, cols: int = 8) -> torch.Tensor:
    return torch.rand(rows, cols, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("scores", "n", "m", "match"),
    [
        (_ok(6, 8), 2, 4, r"divisible by M=4 \(pad the matrix"),
        (_ok(8, 10), 2, 4, r"divisible by M=4"),
        (_ok(), 0, 4, r"N must be an integer in 1\.\.M-1 = 1\.\.3, got 0; e\.g\. n=2"),
        (_ok(), 4, 4, r"N must be an integer in 1\.\.M-1"),
        (_ok(), -1, 4, r"N must be an integer in 1\.\.M-1"),
        (_ok(), 2, 1, r"M must be an integer >= 2"),
        (_ok().index_fill(0, torch.tensor([1]), float("nan")), 2, 4, r"NaN or Inf; clean the input"),
        (_ok().index_fill(1, torch.tensor([3]), float("inf")), 2, 4, r"NaN or Inf"),
        (_ok() - 0.5, 2, 4, r"non-negative .* pass scores\.abs\(\)"),
        (_ok().reshape(2, 4, 8), 2, 4, r"2-D matrix .* one weight matrix at a time"),
        (_ok().reshape(64), 2, 4, r"2-D matrix"),
        (
            torch.ones(8, 8, dtype=torch.int64),
            2,
            4,
            r"float tensor, got dtype torch\.int64; convert with \.float\(\)",
        ),
        (torch.ones(8, 8, dtype=torch.bool), 2, 4, r"float tensor"),
        (torch.zeros(0, 8), 2, 4, r"empty; pass a non-empty matrix"),
    ],
)
@pytest.mark.parametrize("method", ["exact", "tsenor-reference", "two_approx"])
def test_bad_scores(scores: torch.Tensor, n: int, m: int, match: str, method: str) -> None:
    before = scores.clone()
    with pytest.raises(ValueError, match=match):
        solve(scores, n, m, method)
    assert torch.equal(scores, before) or bool(torch.isnan(scores).any())


def test_not_a_tensor() -> None:
    with pytest.raises(ValueError, match=r"torch\.Tensor, got list; pass torch\.as_tensor"):
        solve([[1.0, 2.0], [3.0, 4.0]], 1, 2, "exact")  # type: ignore[arg-type]


def test_unknown_method() -> None:
    with pytest.raises(ValueError, match=r"unknown mask method 'hungarian'; choose one of: .*exact"):
        solve(_ok(), 2, 4, "hungarian")


def test_exhaustive_rejects_large_m() -> None:
    with pytest.raises(ValueError, match=r"'exhaustive' handles M <= 4, got M=8; use method='auto' or 'exact'"):
        transposable_nm_mask(_ok(), 4, 8, "exhaustive")


def test_bad_method_options() -> None:
    with pytest.raises(ValueError, match=r"samples must be >= 1.*samples=1000"):
        solve(_ok(), 2, 4, "max_random", samples=0)
    with pytest.raises(ValueError, match=r"tau_scale must be > 0.*0\.005"):
        solve(_ok(), 2, 4, "tsenor-reference", tau_scale=0.0)
    with pytest.raises(ValueError, match=r"iterations and local_steps must be >= 0"):
        solve(_ok(), 2, 4, "tsenor-reference", iterations=-1)
    with pytest.raises(ValueError, match=r"chunk_variables must be >= 1"):
        solve(_ok(), 2, 4, "exact", chunk_variables=0)


def test_warm_start_shape_mismatch_in_api() -> None:
    """`solve` checks a warm start's shape before calling a method that uses it."""
    blocks = torch.rand(4, 4, 4)
    other = DualState(row=torch.zeros(9, 4), col=torch.zeros(9, 4), scale=torch.ones(9))
    with pytest.raises(ValueError, match=r"warm-start only from a result on a matrix of the same shape and N:M"):
        _init_state(other, blocks)


@pytest.mark.parametrize("method", sorted(name for name, info in METHODS.items() if info.supports_init))
def test_warm_start_from_other_shape(method: str) -> None:
    first = solve(_ok(8, 16), 4, 8, method)
    with pytest.raises(ValueError, match=r"warm-start only from a result on a matrix of the same shape"):
        solve(_ok(16, 16), 4, 8, method, init=first)
