"""The fused Triton Sinkhorn kernel against the torch loop it replaces on CUDA.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1), so CI checks the same kernel
source that a GPU compiles; on a CUDA device the compiled kernel is checked as well.
"""

from __future__ import annotations

import pytest
import torch

from tsenor_cli.solver import solve, to_blocks
from tsenor_cli.solver import triton_kernels as st
from tsenor_cli.solver.tsenor import _tau_schedule, capped_sinkhorn
from tsenor_cli.solver.types import SinkhornSchedule

pytestmark = pytest.mark.skipif(not st.available(), reason="triton is not installed (make install adds it)")


@pytest.fixture
def triton_device(device: torch.device) -> torch.device:
    """The CPU case runs the kernels in Triton's interpreter (conftest turns it on when there is no GPU)."""
    if device.type == "cpu" and not st._interpreting():
        pytest.skip("Triton's CPU interpreter is off (TRITON_INTERPRET=1); the CUDA case tests the kernels")
    return device


def _scores(B: int, M: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(B, M, M, generator=gen) ** 3  # skewed like |W|, many near-ties
    return (w / w.amax(dim=(1, 2), keepdim=True)).to(device)


@pytest.mark.parametrize(("n", "M", "iterations"), [(2, 4, 25), (4, 8, 25), (8, 16, 7), (16, 32, 13)])
def test_fused_matches_torch_loop_per_block(triton_device: torch.device, n: int, M: int, iterations: int) -> None:
    """One tile per chunk in the torch loop is the kernel's semantics: same potentials, same stop."""
    w = _scores(5, M, seed=M, device=triton_device)
    B = w.shape[0]
    u0 = w.topk(n, dim=2).values[:, :, n - 1] - 0.5 / 200.0
    v0 = w.new_zeros(B, M)
    schedule = SinkhornSchedule(tuple(_tau_schedule(200.0, 4)), iterations, 1e-3)
    want_u, want_v, want_its = capped_sinkhorn(w, n, schedule, u0, v0, chunk_elements=M * M)
    got_u, got_v, got_its = st.capped_sinkhorn_fused(w, n, schedule, u0, v0)
    assert got_its == want_its
    assert torch.allclose(got_u, want_u, atol=2e-4, rtol=0)
    assert torch.allclose(got_v, want_v, atol=2e-4, rtol=0)


def test_fused_leaves_inputs_untouched(triton_device: torch.device) -> None:
    w = _scores(3, 8, seed=1, device=triton_device)
    u0 = w.new_full((3, 8), 0.5)
    v0 = w.new_zeros(3, 8)
    st.capped_sinkhorn_fused(w, 4, SinkhornSchedule((50.0,), 10, 1e-3), u0, v0)
    assert torch.equal(u0, w.new_full((3, 8), 0.5))
    assert torch.equal(v0, w.new_zeros(3, 8))


def test_solve_with_fused_sinkhorn_is_feasible_and_as_good(triton_device: torch.device) -> None:
    """The whole solve with sinkhorn="triton" gives exact N per row and column and the same quality."""
    gen = torch.Generator().manual_seed(3)
    scores = (torch.randn(64, 64, generator=gen).abs()).to(triton_device)
    fused = solve(scores, 8, 16, "tsenor", sinkhorn="triton")
    loop = solve(scores, 8, 16, "tsenor", sinkhorn="torch")
    blocks = to_blocks(fused.mask, 16)
    assert bool((blocks.sum(1) == 8).all()) and bool((blocks.sum(2) == 8).all())
    assert fused.objective == pytest.approx(loop.objective, rel=1e-4)
    assert fused.objective <= fused.upper_bound * (1 + 1e-9)


def test_fused_rejects_what_it_cannot_take() -> None:
    w = torch.rand(2, 12, 12)  # M not a power of two
    with pytest.raises(ValueError, match="power of two"):
        st.capped_sinkhorn_fused(w, 6, SinkhornSchedule((50.0,), 5, 1e-3), w.new_zeros(2, 12), w.new_zeros(2, 12))


def test_unknown_backend_is_an_error() -> None:
    with pytest.raises(ValueError, match="sinkhorn backend"):
        solve(torch.rand(16, 16), 2, 4 * 2, "tsenor", sinkhorn="cupy")


def test_fused_maxplus_matches_torch(triton_device: torch.device) -> None:
    """out[i, k] = max_t a[i, t] + b[t, k], with the −inf entries the row graph uses."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(4, 16, 16, generator=gen)
    b = torch.randn(4, 16, 16, generator=gen)
    a[torch.rand(a.shape, generator=gen) < 0.3] = float("-inf")
    b[torch.rand(b.shape, generator=gen) < 0.3] = float("-inf")
    want = (a[:, :, :, None] + b[:, None, :, :]).amax(dim=2)  # (B, i, k) over t
    got = st.maxplus_fused(a.to(triton_device), b.to(triton_device)).cpu()
    assert torch.equal(got, want)


def test_max_elements_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_elements"):
        solve(torch.rand(32, 32), 4, 8, "tsenor", max_elements=0)


@pytest.mark.parametrize("method", ["flow", "tsenor"])
def test_max_elements_slices_give_the_same_mask(method: str) -> None:
    """Tiles are independent on CPU: slicing the batch changes memory, not the answer."""
    scores = torch.rand(64, 64, generator=torch.Generator().manual_seed(7))
    whole = solve(scores, 4, 8, method)
    sliced = solve(scores, 4, 8, method, max_elements=8 * 8 * 5)
    assert torch.equal(whole.mask, sliced.mask)


@pytest.mark.parametrize(("n", "M"), [(2, 8), (8, 16), (16, 32)])
def test_fused_cycle_search_reaches_the_loop_quality(triton_device: torch.device, n: int, M: int) -> None:
    """From the same rounding, the per-tile kernel keeps N per row and column, never loses objective,
    ends with no positive 2-cycle, and is as good as the sweep loop (it may end at another local optimum)."""
    from tsenor_cli.solver.tsenor import _round, _RowGraph, cycle_search

    w = _scores(6, M, seed=11 * M, device=torch.device("cpu"))
    start = _round(w, w, n, "rowcol")
    loop, _ = cycle_search(start, w, 30)
    fused, moves = st.cycle_search_fused(start.to(triton_device), w.to(triton_device), 30 * M // 2, 1e-6)
    fused = fused.cpu()
    assert bool((fused.sum(1) == n).all()) and bool((fused.sum(2) == n).all())
    objective = (w * fused).sum((1, 2))
    assert bool((objective >= (w * start).sum((1, 2)) - 1e-6).all())
    assert float(objective.sum()) >= float((w * loop).sum()) * (1 - 1e-4)
    d = _RowGraph.build(fused, w).d
    assert float((d + d.transpose(1, 2)).max()) <= 1e-6
    assert 0 < moves < 30 * M // 2


@pytest.mark.parametrize(("n", "M"), [(2, 8), (8, 16), (16, 32)])
def test_fused_bound_equals_coordinate_bound(triton_device: torch.device, n: int, M: int) -> None:
    from tsenor_cli.solver.bounds import coordinate_upper_bound

    w = _scores(5, M, seed=3 * M, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(M)
    u, v = 0.5 * torch.rand(5, M, generator=gen), 0.3 * torch.rand(5, M, generator=gen)
    want = coordinate_upper_bound(w, n, row=u, col=v, rounds=1)
    got = st.coordinate_bound_fused(w.to(triton_device), n, v.to(triton_device)).cpu()
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-9)
