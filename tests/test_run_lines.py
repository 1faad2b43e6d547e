"""What a prune run says: one line per block (each matrix's line at DEBUG, `tsenor -v`), and one line of
phases that add up to the run's total."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers_tiny import sparsegpt_config

from tsenor_cli.phases import PHASES, Timings
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.settings import RunContext

BLOCKS = 3


def _phases(line: str) -> tuple[float, dict[str, float]]:
    """ "time T s: a 1.0 s, b 2.0 s" → (T, {a: 1.0, b: 2.0})."""
    head, _, rest = line.partition(": ")
    total = float(re.fullmatch(r"time ([0-9.]+) s", head).group(1))  # type: ignore[union-attr]
    parts = dict((name, float(value)) for name, value in re.findall(r"([a-z ]+?) ([0-9.]+) s(?:, |$)", rest))
    return total, parts


def test_the_time_line_adds_up() -> None:
    timings = Timings(seconds={"load": 1.25, "method": 2.0, "solver": 0.5})
    total, parts = _phases(timings.line(4.0))
    assert total == 4.0 and parts == {"load": 1.2, "method": 2.0, "solver": 0.5, "other": 0.2}
    assert _phases(Timings(seconds={"load": 3.0}).line(2.0))[1] == {"load": 3.0, "other": 0.0}


def test_a_prune_says_one_line_per_block_and_its_phases(
    tiny_llama: Callable[..., Path],
    calib: Path,
    data_ctx: RunContext,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = tiny_llama(num_layers=BLOCKS)
    said: list[str] = []
    with caplog.at_level("DEBUG", logger="tsenor"):
        report = prune_model(sparsegpt_config(model, calib, tmp_path / "out"), data_ctx, progress=said.append)
    blocks = [line for line in said if line.startswith("block ")]
    assert [line.split(":")[0] for line in blocks] == [f"block {i}/{BLOCKS}" for i in range(1, BLOCKS + 1)]
    assert not any("rel. error" in line and not line.startswith("block ") for line in said)
    pruned = [r for r in report.layers if r.status == "pruned"]
    detail = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG" and "rel. error" in r.getMessage()]
    assert len(detail) == len(pruned) > 0
    total, parts = _phases(said[-1])
    assert set(parts) - {"other"} <= set(PHASES)
    assert {"plan", "load", "calibration", "capture", "watch", "statistics", "write"} <= set(parts)
    # Each part is rounded to 0.1 s: the sum is the total within the rounding of its parts.
    assert abs(sum(parts.values()) - total) <= 0.05 * (len(parts) + 1)
    assert report.seconds <= total + 0.05  # the report is made during the write, the line after it
