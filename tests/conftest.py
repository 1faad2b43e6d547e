"""Shared fixtures: compute devices, the offline data folder and the embedded real model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_tiny import make_tiny_llama

from tsenor_cli.settings import RunContext, cache_dir_default

REPO_ROOT = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():
    # Without a GPU the fused Triton kernels run in Triton's CPU interpreter. Triton reads this when it
    # is first imported (its own @jit library functions are built then), so it is set before any test
    # module can import it; with a GPU the kernels are compiled and tested on CUDA instead.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every device test runs on CPU, and on CUDA when one is present."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(request.param)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The offline data folder: $TSENOR_DATA_DIR (make points it at ../shared/data)."""
    value = os.environ.get("TSENOR_DATA_DIR")
    path = Path(value) if value else REPO_ROOT.parent / "shared" / "data"
    if not (path / "README.md").is_file():
        pytest.skip(f"offline data folder not found at {path}; set TSENOR_DATA_DIR")
    return path


@pytest.fixture(scope="session")
def data_ctx(data_dir: Path) -> RunContext:
    """A run context that reads every dataset from the offline data folder and never reaches the hub."""
    return RunContext(data_dir=data_dir.resolve(), offline=True, cache_dir=cache_dir_default())


@pytest.fixture(scope="session")
def calib(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 30 kB of WikiText-2's validation text: real calibration text for a tiny prune."""
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_bytes((data_dir / "wikitext-2-raw" / "wiki.valid.raw").read_bytes()[:30_000])
    return path


@pytest.fixture(scope="session")
def calibration_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 seeded words, no data folder needed: tokenizing it is instant, unlike a WikiText-2 split."""
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    words = [
        "the",
        "model",
        "reads",
        "every",
        "token",
        "and",
        "each",
        "block",
        "adds",
        "what",
        "its",
        "attention",
        "and",
        "its",
        "MLP",
        "found",
    ]
    gen = torch.Generator().manual_seed(0)
    path.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (400,), generator=gen)))
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M checkpoint, materialized into the cache on first use."""
    from tsenor_cli.models.embedded import materialize

    return materialize("smollm2-135m", cache_dir_default())


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> Iterator[None]:
    """The suite runs many small tensor ops; on 2 shared cores a second intra-op thread mostly adds
    barrier waits (measured up to 200x slower for small logsumexp loops under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make_tiny_llama` once per set of options for the whole session: tiny_llama(num_layers=4) → the
    folder of that tiny random LLaMA (tests read it, never write into it)."""
    made: dict[tuple[tuple[str, Any], ...], Path] = {}

    def get(**options: Any) -> Path:
        key = tuple(sorted(options.items()))
        if key not in made:
            made[key] = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", **options)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    """The default tiny LLaMA (2 blocks, hidden 64, SmolLM2's tokenizer); a module needing other sizes
    overrides `tiny` with its own `tiny_llama(...)`."""
    return tiny_llama()
