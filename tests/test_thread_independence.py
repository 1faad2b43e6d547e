"""A run gives the same bytes whatever torch's CPU thread count (docs/reliability.md).

MKL's eigh and Cholesky round differently on 1 and 2 threads, and ALPS's ADMM turns that into another
support; `pruning/methods/linalg.py` runs them on one thread. Measured before the fix: SmolLM2 ALPS T16:32 on
block 0 (c4, 8 × 256) gave another `k_proj` on 2 threads than on 1.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.linalg import inverse_cholesky_upper, symmetric_eigh, thread_independent
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.run import api
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.runfiles import PRUNE_FILE
from tsenor_cli.settings import RunContext


@pytest.fixture
def restore_threads() -> Iterator[int]:
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def _at(threads: int, fn: Callable[[], object]) -> object:
    torch.set_num_threads(threads)
    return fn()


def _gram(n: int, tokens: int) -> torch.Tensor:
    """A damped Gram matrix (n, n) float64 of correlated inputs, like a layer's."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(tokens, n, generator=g) @ torch.randn(n, n, generator=g) / n**0.5
    h = (x.T @ x).double()
    return h + 0.01 * h.diagonal().mean() * torch.eye(n, dtype=h.dtype)


@pytest.mark.parametrize("n", [576, 1536])  # SmolLM2's in_features
def test_factorizations_give_the_same_bits_on_one_and_two_threads(n: int, restore_threads: int) -> None:
    h = _gram(n, 2048)
    one, two = (_at(t, lambda: symmetric_eigh(h)) for t in (1, 2))
    assert isinstance(one, tuple) and isinstance(two, tuple)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    evals, evecs = one
    assert torch.allclose((evecs * evals) @ evecs.T, h, rtol=0, atol=1e-9 * float(h.abs().max()))
    u1, u2 = (_at(t, lambda: inverse_cholesky_upper(h)) for t in (1, 2))
    assert isinstance(u1, torch.Tensor) and isinstance(u2, torch.Tensor) and torch.equal(u1, u2)
    assert torch.allclose(u1.T @ u1 @ h, torch.eye(n, dtype=h.dtype), atol=1e-6)
    assert torch.get_num_threads() == 2  # left as the caller set it


def test_the_thread_count_comes_back_after_an_error(restore_threads: int) -> None:
    torch.set_num_threads(2)
    with pytest.raises(ValueError), thread_independent(torch.device("cpu")):
        assert torch.get_num_threads() == 1
        raise ValueError
    assert torch.get_num_threads() == 2


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.realdata
@pytest.mark.parametrize("method", ["alps", "sparsegpt"])
def test_real_smollm2_prunes_to_the_same_bytes_on_one_and_two_threads(
    method: str, smollm2_path: Path, data_ctx: RunContext, tmp_path: Path, restore_threads: int
) -> None:
    def run(threads: int) -> tuple[str, dict[str, object]]:
        out = tmp_path / f"{threads}"
        cfg = PruneConfig(
            model=str(smollm2_path),
            matrix=MatrixPruneConfig(SparsityPattern.from_nm(16, 32, transposable=True)),
            method=method,
            calib_data="c4",
            nsamples=8,
            seqlen=256,
            targets=("re:model\\.layers\\.0\\.",),
            output=out,
            resume=False,
        )
        torch.set_num_threads(threads)
        api.prune_model(cfg, data_ctx)
        settings = json.loads((out / PRUNE_FILE).read_text())["settings"]
        return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(), settings

    (one, settings_one), (two, settings_two) = run(1), run(2)
    assert one == two
    assert (settings_one["threads"], settings_two["threads"]) == (1, 2)  # recorded, though it no longer matters
