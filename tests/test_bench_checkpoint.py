"""`tsenor bench checkpoint` on a tiny model: every measurement runs and the ratios are the format's (no
timing is asserted: the seconds of a shared machine are not a test)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tsenor_cli.bench.checkpoint import CheckpointBenchConfig, judged, run_checkpoint_bench, shape_row, to_markdown


@pytest.fixture(scope="module")
def result(tiny_llama: Callable[..., Path], data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = tiny_llama(num_layers=2)
    cfg = CheckpointBenchConfig(model, "tiny", size=64, shapes=("smollm2-135m",), loads=1, max_windows=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TSENOR_DATA_DIR", str(data_dir))
        # A --work-dir not made yet, as the CLI accepts it.
        return run_checkpoint_bench(cfg, tmp_path_factory.mktemp("work") / "new", say=lambda _: None)


def test_matrix_ratios_are_the_formats(result: dict) -> None:
    """bf16 2:4 stores (2·16 + 4) / 64 of its bits, 16:32 (16·16 + 32) / 512 (docs/reference/packed-format.md)."""
    ratios = {row["pattern"]: row["packed"] / row["dense"] for row in result["matrices"]}
    assert set(ratios) == {"2:4", "2:4 transposable", "16:32", "16:32 transposable"}
    assert ratios["2:4"] == ratios["2:4 transposable"] == (2 * 16 + 4) / 64
    assert ratios["16:32"] == ratios["16:32 transposable"] == (16 * 16 + 32) / 512
    assert judged(result)["matrices"]


def test_whole_checkpoints_save_less_than_their_matrices(result: dict) -> None:
    for row in result["shapes"]:
        matrices = row["matrices_packed"] / row["matrices_dense"]
        assert matrices < row["packed"] / row["dense"] < 1.0
    assert result["real"]["packed"] < result["real"]["dense"]


def test_a_shape_row_counts_only_the_block_linears_packed() -> None:
    row = shape_row("smollm2-135m", 2, 4)
    # SmolLM2-135M: 30 blocks of q, k, v, o (576 wide, 3 KV heads of 64) and an MLP of 1536.
    per_block = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert row["dtype"] == "float32"  # configs/models/smollm2-135m.json
    assert row["matrices_dense"] == 30 * per_block * 4
    assert row["matrices_packed"] * 128 == row["matrices_dense"] * (2 * 32 + 4)


def test_load_and_eval_are_measured_and_the_printed_ppl_agrees(result: dict) -> None:
    assert set(result["loads"]) == {"dense", "packed"}
    assert all(found["median_peak_rss"] > 0 and found["median_seconds"] > 0 for found in result["loads"].values())
    # The peak after a forward pass is the same process's high-water mark later on: never below the load's.
    assert all(found["median_peak_rss_forward"] >= found["median_peak_rss"] for found in result["loads"].values())
    assert result["eval"]["packed"]["printed"] == result["eval"]["dense"]["printed"]
    assert judged(result)["ppl"]
    page = to_markdown(result, "tsenor bench checkpoint")
    for heading in ("One pruned matrix", "Whole checkpoints", "Loading", "tsenor eval --ppl wikitext2"):
        assert heading in page


def test_an_existing_output_is_refused_before_any_work(tmp_path: Path) -> None:
    existing = tmp_path / "out.json"
    existing.write_text("{}")
    done = subprocess.run(
        [sys.executable, "-m", "tsenor_cli", "bench", "checkpoint", "--output", str(existing)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 4 and "--force" in done.stderr
    assert existing.read_text() == "{}"
