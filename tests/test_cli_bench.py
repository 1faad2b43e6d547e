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


def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every bench's run fail the test: the refusals below must come before any work."""

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark ran before its options were checked")

    import tsenor_cli.bench.memory as memory
    import tsenor_cli.bench.moe as moe
    import tsenor_cli.bench.prune as prune

    monkeypatch.setattr(moe, "run_moe_bench", never)
    monkeypatch.setattr(memory, "run_memory_bench", never)
    monkeypatch.setattr(prune, "run_e2e", never)
    monkeypatch.setattr(prune, "build_random_model", never)


# The issue-41 audit: each ended after (or instead of) the work with "unexpected OSError/RuntimeError/…".
UNWRITABLE = [
    ["bench", "moe", "--output", "/proc/tsenor-bench.json"],
    ["bench", "moe", "--markdown", "/proc/tsenor-bench.md"],
    ["bench", "memory", "--output", "/proc/tsenor-bench.json"],
    ["bench", "prune", "--output", "/proc/tsenor-bench.json"],
    ["bench", "prune", "--work-dir", "/proc/tsenor-bench-work"],
    ["bench", "speedup", "--markdown", "/proc/tsenor-bench.md"],
    ["bench", "solver", "--output", "/proc/tsenor-bench.json"],
]


@pytest.mark.parametrize("args", UNWRITABLE, ids=lambda a: f"{a[1]}{a[2]}")
def test_an_unwritable_output_is_refused_before_the_work(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers_cli import invoke

    _no_work(monkeypatch)
    result = invoke(args)
    assert result.exit_code == 4, result.output
    message = str(result.exception)
    assert "not writable" in message and "/proc" in message and "\n" not in message


def test_an_output_that_is_a_folder_is_refused_before_the_work_even_with_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers_cli import invoke

    _no_work(monkeypatch)
    result = invoke(["bench", "moe", "--output", str(tmp_path), "--force"])
    assert result.exit_code == 4
    assert "is a folder; pass a file path" in str(result.exception)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["bench", "moe", "--top-k", "8", "--experts", "4"], "--top-k 8 must be between 1 and --experts 4"),
        (["bench", "moe", "--hidden", "33"], "--hidden 33 must be a multiple of 32"),
        (["bench", "moe", "--expert-width", "48"], "--expert-width 48 must be a multiple of 32"),
        (["bench", "memory", "--blocks", ""], "--blocks must list depths of at least 1"),
        (["bench", "memory", "--blocks", "0"], "--blocks must list depths of at least 1"),
        (["bench", "memory", "--width", "65"], "--width must be a multiple of 64"),
        (["bench", "memory", "--commands", "prune-evl"], "--commands must be a comma list of eval, prune, prune-eval"),
        (["bench", "memory", "--commands", ","], "--commands must be a comma list of eval, prune, prune-eval"),
        (["bench", "prune", "--nm", "3:5", "--blocks", "1", "--scale-down", "32"], "M=5 does not divide"),
    ],
)
def test_bad_bench_options_are_one_line_and_exit_2(args: list[str], says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers_cli import invoke

    import tsenor_cli.bench.prune as prune

    monkeypatch.setattr(prune, "build_random_model", lambda *a, **k: pytest.fail("built a model"))
    result = invoke(args)
    assert result.exit_code == 2, result.output
    message = str(result.exception)
    assert says in message and "\n" not in message
    assert "--skip-incompatible" not in message  # a flag bench prune does not have


@pytest.mark.parametrize(("model", "factor"), [("smollm2-135m", 4), ("llama-3.2-3b", 16)])
def test_scale_down_suggests_only_factors_that_work(model: str, factor: int) -> None:
    import re

    from tsenor_cli.bench.prune import config_path, scale_shape

    raw = json.loads(config_path(model).read_text())
    with pytest.raises(UsageError, match="use one of") as refused:
        scale_shape(raw, factor)
    suggested = [int(x) for x in re.search(r"use one of ([\d, ]+)", str(refused.value)).group(1).split(", ")]
    assert suggested
    for good in suggested:
        scaled = scale_shape(raw, good)
        assert scaled["hidden_size"] * good == raw["hidden_size"]
