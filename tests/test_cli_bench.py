"""`tsenor bench solver` through the CLI (the quick variant CI can afford)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tsenor_cli.cli import app
from tsenor_cli.errors import UsageError


@pytest.mark.realmodel
def test_bench_solver_quick(tmp_path: Path, smollm2_path: Path) -> None:
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "solver",
            "--quick",
            "--methods",
            "flow,tsenor,tsenor-reference,exact,exhaustive,two_approx",
            "--time-methods",
            "flow,tsenor,tsenor-reference,exact",
            "--output",
            str(out),
            "--markdown",
            str(md),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    quality = {(r["pattern"], r["score"], r["method"]): r for r in data["quality"]}
    # exhaustive only runs for M=4; exact is its own reference.
    assert ("8:16", "|W|", "exhaustive") not in quality
    assert quality[("2:4", "|W|", "exact")]["mean_rel_error"] == 0.0
    for pattern in ("2:4", "8:16"):
        assert quality[(pattern, "|W|", "flow")]["max_rel_error"] <= 1e-12  # exact up to round-off
        assert quality[(pattern, "|W|", "tsenor")]["mean_rel_error"] <= 1e-4  # entropic: the 0.01%
    for row in data["quality"]:
        assert row["bound_holds"], row
        assert 0.0 <= row["mean_rel_error"] <= row["max_rel_error"] + 1e-15
    assert {r["method"] for r in data["timing"]} == {"flow", "tsenor", "tsenor-reference", "exact"}
    assert data["config"]["repeats"] == 1  # --quick times each method once
    assert {(r["pattern"], r["method"]) for r in data["warm"]} == {("8:16", "flow"), ("8:16", "tsenor")}
    text = md.read_text()
    assert "### Quality against `exact`" in text and "| 8:16 | W² | tsenor |" in text


def test_bench_rejects_unknown_method() -> None:
    # CliRunner sees the exception; `main()` turns it into "error: …" and exit code 2.
    result = CliRunner().invoke(app, ["bench", "solver", "--quick", "--methods", "nope"])
    assert isinstance(result.exception, UsageError)
    assert "unknown solver method" in str(result.exception)


def test_bench_rejects_bad_pattern() -> None:
    result = CliRunner().invoke(app, ["bench", "solver", "--patterns", "8-16"])
    assert isinstance(result.exception, UsageError)
    assert "N:M" in str(result.exception)


def test_bench_rejects_timed_method_outside_methods() -> None:
    result = CliRunner().invoke(
        app, ["bench", "solver", "--quick", "--methods", "tsenor,exact", "--time-methods", "two_approx"]
    )
    assert isinstance(result.exception, UsageError)
    assert "--time-methods" in str(result.exception)


@pytest.mark.realmodel
def test_large_cpu_solve_reports_the_spread_of_its_memory_peak(smollm2_path: Path) -> None:
    """The large-matrix row on CPU runs LARGE_REPEATS fresh processes and shows min ≤ median ≤ max."""
    from tsenor_cli.bench.machine import environment
    from tsenor_cli.bench.solver import LARGE_REPEATS, BenchConfig, BenchResult, run_large, to_markdown
    from tsenor_cli.pattern import SparsityPattern

    pattern = SparsityPattern.parse("8:16")
    cfg = BenchConfig(smollm2_path, "smollm2-135m", (pattern,), ("flow",), time_patterns=(pattern,), large_size=256)
    (row,) = run_large(cfg, lambda _: None)
    assert row.method == "flow" and row.size == 256 and row.matrix_mib == 256 * 256 * 4 / 2**20
    assert row.peak_extra_min_mib is not None and row.peak_extra_max_mib is not None
    assert 0.0 <= row.peak_extra_min_mib <= row.peak_extra_mib <= row.peak_extra_max_mib
    config = {"model": "smollm2-135m", "tiles": 0, "seed": 0}
    text = to_markdown(BenchResult(environment("cpu"), config, large=[row]))
    assert f"({LARGE_REPEATS} processes, median shown) |" in text


def test_bench_moe_small(tmp_path: Path) -> None:
    """`tsenor bench moe` on a small block: the JSON's ratios are its own seconds divided, the routed
    tokens per expert are top_k/experts of the calibration tokens, and every method was timed both ways.
    A second run into the same files needs --force (exit 4, the files untouched)."""
    from helpers_cli import invoke

    out, md = tmp_path / "moe.json", tmp_path / "moe.md"
    args = ["bench", "moe", "--experts", "8", "--top-k", "2", "--hidden", "64", "--expert-width", "32"]
    args += ["--samples", "2", "--seqlen", "16", "--repeats", "1", "--output", str(out), "--markdown", str(md)]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["stats_ratio"] == pytest.approx(data["stats_seconds"] / data["dense_seconds"])
    assert data["stacks"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    for tokens in data["tokens_per_expert"].values():
        assert tokens == pytest.approx(2 * 16 * 2 / 8)  # every token reaches top_k of the experts
    assert set(data["prune"]) == {"wanda", "sparsegpt"}
    assert "| sparsegpt |" in md.read_text()
    before = out.read_text()
    again = invoke(args)
    assert again.exit_code == 4 and "--force" in str(again.exception) and out.read_text() == before
