"""`tsenor bench memory`: each evaluation and prune in its own process, streamed and whole agreeing, the page
written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_cli import invoke


@pytest.mark.slow
@pytest.mark.realmodel
def test_bench_memory_measures_both_modes_at_each_depth(tmp_path: Path) -> None:
    out, page = tmp_path / "memory.json", tmp_path / "memory.md"
    args = ["bench", "memory", "--blocks", "1,2", "--width", "64", "--seqlen", "16", "--windows", "1"]
    result = invoke([*args, "--output", str(out), "--markdown", str(page), "--machine", "test box"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = {(row["command"], row["blocks"], row["mode"]): row for row in data["rows"]}
    assert sorted(rows) == [
        (command, blocks, mode) for command in ("eval", "prune") for blocks in (1, 2) for mode in ("streamed", "whole")
    ]
    assert rows[("eval", 2, "streamed")]["ppl"] == pytest.approx(rows[("eval", 2, "whole")]["ppl"], rel=1e-5)
    assert rows[("prune", 2, "streamed")]["sha256"] == rows[("prune", 2, "whole")]["sha256"]
    assert all(row["peak_rss"] > 100 * 2**20 for row in rows.values())  # a Python process with torch
    assert rows[("eval", 2, "whole")]["weights"] > rows[("eval", 1, "whole")]["weights"]
    text = page.read_text()
    assert "test box" in text and "## `tsenor eval`" in text and "## `tsenor prune`" in text
    again = invoke([*args, "--output", str(out)])
    assert again.exit_code == 4 and "--force" in str(again.exception)
