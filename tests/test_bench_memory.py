"""`tsenor bench memory`: each evaluation and prune in its own process, streamed and whole agreeing, the page
written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def test_prune_eval_runs_the_command_with_default_flags_and_no_stream_for_whole(tmp_path: Path) -> None:
    from tsenor_cli.bench.memory import MemoryConfig, prune_eval_command

    cfg = MemoryConfig(blocks=(1,), windows=3)
    streamed, whole = (
        prune_eval_command(tmp_path / "m", tmp_path / "out", mode, cfg) for mode in ("streamed", "whole")
    )
    assert streamed[1:4] == ["-m", "tsenor_cli", "prune"] and "--eval" in streamed and "-q" not in streamed
    assert whole == [*streamed, "--no-stream"]  # the only difference: the whole row loads the model whole
    flags = {flag: streamed[streamed.index(flag) + 1] for flag in ("--max-windows", "--ppl", "--nm", "--method")}
    assert flags == {"--max-windows": "3", "--ppl": "wikitext2", "--nm": "2:4", "--method": "magnitude"}
    assert not {"--stream", "--no-resume-state", "--dtype", "--device"} & set(streamed)  # the defaults


def test_prune_eval_without_a_data_source_is_refused_before_any_model_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tsenor_cli.bench.memory as memory

    monkeypatch.setattr(memory, "build_model", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.delenv("TSENOR_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke(["bench", "memory", "--blocks", "1", "--width", "64", "--commands", "prune,prune-eval"])
    assert result.exit_code == 3, result.output
    message = str(result.exception)
    assert message.startswith("no data for wikitext2") and "TSENOR_DATA_DIR" in message and "\n" not in message


@pytest.mark.slow
@pytest.mark.realmodel
def test_bench_memory_prune_eval_agrees_streamed_and_whole(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TSENOR_DATA_DIR", str(data_dir))
    out, page = tmp_path / "memory.json", tmp_path / "memory.md"
    args = ["bench", "memory", "--blocks", "1,2", "--width", "64", "--windows", "1", "--commands", "prune-eval"]
    result = invoke([*args, "--output", str(out), "--markdown", str(page)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = {(row["blocks"], row["mode"]): row for row in data["rows"]}
    assert sorted(rows) == [(1, "streamed"), (1, "whole"), (2, "streamed"), (2, "whole")]
    assert {row["command"] for row in rows.values()} == {"prune-eval"}
    for blocks in (1, 2):
        streamed, whole = rows[(blocks, "streamed")], rows[(blocks, "whole")]
        assert streamed["sha256"] == whole["sha256"] and streamed["ppl"] == pytest.approx(whole["ppl"], rel=1e-5)
    assert rows[(2, "whole")]["sha256"] != rows[(1, "whole")]["sha256"]  # another model, other weights
    # The child's own peak: a Python process with torch that held a 2048×49152 float32 logits window.
    assert all(row["peak_rss"] > 49152 * 2048 * 4 for row in rows.values())
    assert set(data["peak_ratio_deepest_over_shallowest"]) == {"prune-eval whole", "prune-eval streamed"}
    assert "## `tsenor prune --eval`" in page.read_text()


def _result(
    commands: tuple[str, ...], windows: int, peaks: dict[int, int], load: float, date: str = "2026-11-25"
) -> dict[str, Any]:
    """A hand-made `run_memory_bench` result: each command's rows at 8 and 32 blocks, whole = streamed."""
    from dataclasses import asdict

    from tsenor_cli.bench.memory import MemoryConfig

    cfg = asdict(MemoryConfig(blocks=(8, 32), windows=windows, commands=commands))
    rows = [
        {"command": c, "blocks": b, "mode": m, "weights": b * 2**20, "peak_rss": peaks[b], "seconds": 1.0}
        for c in commands
        for b in (8, 32)
        for m in ("whole", "streamed")
    ]
    ratios = {f"{c} {m}": peaks[32] / peaks[8] for c in commands for m in ("whole", "streamed")}
    machine = {"tsenor": "0", "torch": "t", "transformers": "x", "python": "3", "load_average": load}
    result = {"config": cfg, "rows": rows, "peak_ratio_deepest_over_shallowest": ratios, "machine": machine}
    return {**result, "date": date, "command": f"bench {date}"}


def test_a_merged_result_keeps_each_sections_rows_settings_and_provenance() -> None:
    from tsenor_cli.bench.memory import merge_results, to_markdown

    base = _result(("eval", "prune"), 2, {8: 2**30, 32: 2 * 2**30}, load=1.5)
    new = _result(("prune", "prune-eval"), 1, {8: 2**30, 32: 5 * 2**29}, load=6.0, date="2026-11-27")
    merged = merge_results(base, new, "base.json")
    assert merged["config"]["commands"] == ["eval", "prune", "prune-eval"]
    # prune was measured again: only the new rows and ratio are kept.
    assert [(r["command"], r["peak_rss"]) for r in merged["rows"] if r["blocks"] == 32][::2] == [
        ("eval", 2 * 2**30), ("prune", 5 * 2**29), ("prune-eval", 5 * 2**29),
    ]  # fmt: skip
    assert merged["peak_ratio_deepest_over_shallowest"] == {
        "eval whole": 2.0, "eval streamed": 2.0, "prune whole": 2.5, "prune streamed": 2.5,
        "prune-eval whole": 2.5, "prune-eval streamed": 2.5,
    }  # fmt: skip
    assert {c: (v["date"], v["config"]["windows"]) for c, v in merged["sections"].items()} == {
        "eval": ("2026-11-25", 2), "prune": ("2026-11-27", 1), "prune-eval": ("2026-11-27", 1),
    }  # fmt: skip
    page = to_markdown(merged, "unused", "unused", "test box")
    assert page.startswith("# Host memory of `tsenor eval`, `tsenor prune` and `tsenor prune --eval`")
    assert "unused" not in page and page.count("Measured 2026-11-27 with `bench 2026-11-27`.") == 2
    assert (
        "Measured 2026-11-25 with `bench 2026-11-25`.\ntsenor 0, torch t, transformers x, Python 3; load average 1.5"
        in page
    )
    assert "`--ppl` on 2 window(s)" in page and "WikiText-2, 1 window(s) of 2048 tokens" in page
    assert "Peak RSS at 32 blocks over 8 blocks: whole 2.50x, streamed 2.50x" in page
    # Merging the merged page again keeps the provenance it has.
    again = merge_results(merged, _result(("eval",), 3, {8: 2**30, 32: 2**30}, load=0.5, date="2026-12-01"), "m")
    assert {c: v["date"] for c, v in again["sections"].items()} == {
        "prune": "2026-11-27", "prune-eval": "2026-11-27", "eval": "2026-12-01",
    }  # fmt: skip
    assert again["config"]["commands"] == ["prune", "prune-eval", "eval"]


def test_merge_replaces_the_measured_commands_of_the_output_and_refuses_what_it_cannot_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime

    import tsenor_cli.bench.memory as memory

    measured = _result(("prune-eval",), 1, {8: 2**30, 32: 2**30}, load=3.0)
    fresh = {k: v for k, v in measured.items() if k[0] != "d"}
    monkeypatch.setattr(memory, "run_memory_bench", lambda cfg, ctx, say: fresh)
    out, page = tmp_path / "memory.json", tmp_path / "memory.md"
    out.write_text(json.dumps(_result(("eval", "prune"), 2, {8: 2**30, 32: 2 * 2**30}, load=1.5)))
    args = ["bench", "memory", "--blocks", "8,32", "--commands", "prune-eval", "--output", str(out), "--merge"]
    result = invoke([*args, "--markdown", str(page)])
    assert result.exit_code == 0, result.output
    merged = json.loads(out.read_text())
    assert merged["config"]["commands"] == ["eval", "prune", "prune-eval"] and len(merged["rows"]) == 12
    dates = {command: section["date"] for command, section in merged["sections"].items()}
    assert dates == {"eval": "2026-11-25", "prune": "2026-11-25", "prune-eval": datetime.date.today().isoformat()}
    assert "## `tsenor prune --eval`" in page.read_text() and "## `tsenor eval`" in page.read_text()

    for content, says, code in [
        (None, "--merge keeps the other commands of an earlier --output JSON", 2),
        ("{", "--merge cannot read", 7),
        (json.dumps({k: v for k, v in _result(("eval",), 2, {8: 1, 32: 1}, 1.0).items() if k != "date"}), "no date", 7),
    ]:
        target = tmp_path / "other.json"
        target.unlink(missing_ok=True)
        if content is not None:
            target.write_text(content)
        refused = invoke([*args[:-2], str(target), "--merge"])
        assert refused.exit_code == code, refused.output
        assert says in str(refused.exception) and "\n" not in str(refused.exception)
