"""`tsenor report`: run files (one schema, v1 compatibility), merged table (hand-checked numbers),
CSV/JSON, PNG plots and errors."""

from __future__ import annotations

import copy
import csv
import io
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tsenor_cli.cli import app
from tsenor_cli.errors import InputNotFoundError, OutputExistsError, UsageError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.report import build_table, load_run, write_report
from tsenor_cli.runfiles import (
    EVAL_FILE,
    FINETUNE_FILE,
    PRUNE_FILE,
    SCHEMA_VERSION,
    ContextRecord,
    DataFile,
    DataSource,
    EvalReport,
    FinetuneReport,
    LayerRecord,
    PerplexityRecord,
    PruneReport,
    SchemaError,
    TaskScore,
    ZeroShotResult,
    read_json,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = Path(__file__).resolve().parents[1]
OFFLINE = DataSource(kind="offline", files=(DataFile("/data/wiki.test.raw", "ab" * 32),))


def _eval_report(ppl: dict[str, float], accs: dict[str, float] | None) -> EvalReport:
    tokens = 1000
    zeroshot = None
    if accs is not None:
        zeroshot = ZeroShotResult(
            tasks=tuple(TaskScore(k, v, 0.03, None, None, 200, OFFLINE, "1.0") for k, v in accs.items()),
            average=sum(accs.values()) / len(accs),
            average_metric="acc",
            num_fewshot=0,
            limit=200,
            source="offline",
            lm_eval_version="0.4.13",
        )
    return EvalReport(
        model="tiny-llama",
        source="/ckpt/tiny-llama",
        model_type="llama",
        dtype="float32",
        device="cpu",
        seqlen=64,
        max_windows=None,
        perplexity={
            k: PerplexityRecord(v, math.log(v) * tokens, tokens, 16, 64, "test text", OFFLINE, 1.5)
            for k, v in ppl.items()
        },
        zeroshot=zeroshot,
        versions={"tsenor": "0.1.0"},
        seconds=3.0,
        command="tsenor eval --model tiny-llama",
        context=ContextRecord(data_dir="/data", offline=True),
    )


def _eval(ppl: dict[str, float], accs: dict[str, float] | None) -> dict[str, Any]:
    return _eval_report(ppl, accs).to_json()


def _layers(errors: list[float | None]) -> tuple[LayerRecord, ...]:
    return tuple(
        LayerRecord(
            block=i // 2,
            name=f"model.layers.{i // 2}.mlp.proj{i % 2}",
            out_features=8,
            in_features=16,
            status="pruned" if e is not None else "skipped",
            reason=None if e is not None else "shape (8, 16) is not divisible by M=32 in both dims",
            recon_error=e,
            density=0.5 if e is not None else None,
            gap=0.0 if e is not None else None,
            seconds=0.5,
        )
        for i, e in enumerate(errors)
    )


def _prune_report(n: int, m: int, transposable: bool, errors: list[float | None]) -> PruneReport:
    return PruneReport(
        method="alps",
        pattern=SparsityPattern.from_nm(n, m, transposable=transposable),
        sparsity=1 - n / m,
        settings={"model": "tiny-llama", "method": "alps", "seed": 0},
        layers=_layers(errors),
        calibration="test calibration text",
        seconds=12.5,
        output="/runs/x",
        command="tsenor prune --model tiny-llama",
        versions={"tsenor": "0.1.0"},
        calibration_source=OFFLINE,
        context=ContextRecord(data_dir="/data", offline=False),
    )


def _prune(n: int, m: int, transposable: bool, errors: list[float | None]) -> dict[str, Any]:
    return {**_prune_report(n, m, transposable, errors).to_json(), "extra_field_from_the_pruner": [1, 2, 3]}


def _write_run(root: Path, name: str, eval_obj: dict[str, Any], prune_obj: dict[str, Any] | None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "eval.json").write_text(json.dumps(eval_obj))
    if prune_obj is not None:
        (run / "tsenor_report.json").write_text(json.dumps(prune_obj))
    return run


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    ppl = {"c4": 30.0, "wikitext2": 20.0, "ptb": 40.0}
    return [
        _write_run(
            tmp_path,
            "t24",
            _eval(
                {"c4": 60.5, "wikitext2": 45.25, "ptb": 80.0},
                {"piqa": 0.52, "hellaswag": 0.30, "boolq": 0.61},
            ),
            _prune(2, 4, True, [0.06, 0.08, 0.10, 0.12]),
        ),
        _write_run(tmp_path, "dense", _eval(ppl, {"piqa": 0.60, "hellaswag": 0.40, "boolq": 0.62}), None),
        _write_run(
            tmp_path,
            "nm24",
            _eval({"c4": 50.0, "wikitext2": 35.5, "ptb": 70.0}, {"piqa": 0.55, "hellaswag": 0.35, "boolq": 0.60}),
            _prune(2, 4, False, [0.04, 0.05, 0.07, 0.09]),
        ),
        _write_run(
            tmp_path,
            "t816",
            _eval({"c4": 40.0, "wikitext2": 28.0}, None),
            _prune(8, 16, True, [0.03, 0.04, 0.05, 0.06]),
        ),
    ]


def test_table_rows_hand_checked(runs: list[Path]) -> None:
    table = build_table([load_run(p) for p in runs])
    assert [r.run for r in table.rows] == ["dense", "nm24", "t24", "t816"]  # dense, then M up, N:M before T
    assert table.ppl_datasets == ("c4", "wikitext2", "ptb")
    assert table.tasks == ("piqa", "hellaswag", "boolq")  # paper order, only tasks some run has
    lines = table.to_markdown().splitlines()
    # The shared protocol: the fixture's 64-token windows (no cap), limit 200, offline data.
    assert lines[1] == (
        "Protocol: perplexity on every window of 64 tokens (offline data); "
        "zero-shot 0-shot on limit 200 documents per task (offline tasks)"
    )
    assert lines[5] == "| N:M | Algorithm | Transposable | C4 | WT2 | PTB | PIQA | HS | BoolQ | Avg | Run |"
    # Avg: (60 + 40 + 62) / 3 = 54.00; (55 + 35 + 60) / 3 = 50.00; (52 + 30 + 61) / 3 = 47.67.
    # Each accuracy with the fixture's standard error 0.03 = 3.00 points.
    assert lines[7:] == [
        "| dense | dense | - | 30.00 | 20.00 | 40.00 | 60.00 ± 3.00 | 40.00 ± 3.00 | 62.00 ± 3.00 | 54.00 | dense |",
        "| 2:4 | alps | no | 50.00 | 35.50 | 70.00 | 55.00 ± 3.00 | 35.00 ± 3.00 | 60.00 ± 3.00 | 50.00 | nm24 |",
        "| 2:4 | alps | yes | 60.50 | 45.25 | 80.00 | 52.00 ± 3.00 | 30.00 ± 3.00 | 61.00 ± 3.00 | 47.67 | t24 |",
        "| 8:16 | alps | yes | 40.00 | 28.00 | - | - | - | - | - | t816 |",
        "",
        # The fixture's scores predate the per-document ones: no paired difference, and the reason.
        "- nm24 against dense: zero-shot not paired, piqa: no per-document scores (evaluated before tsenor kept "
        "them; run tsenor eval again)",
        "- t24 against dense: zero-shot not paired, piqa: no per-document scores (evaluated before tsenor kept "
        "them; run tsenor eval again)",
    ]


def test_a_refined_run_gets_a_refine_column_and_sorts_after_its_plain_twin(runs: list[Path], tmp_path: Path) -> None:
    from tsenor_cli.pruning.settings.config import RefineConfig

    twin = _prune(2, 4, True, [0.05, 0.06, 0.07, 0.08])
    twin["settings"] = {**twin["settings"], "refine": RefineConfig("block", 2, 1e-3).result_fields()}
    refined = _write_run(tmp_path, "t24-refined", _eval({"c4": 50.0, "wikitext2": 40.0, "ptb": 70.0}, None), twin)
    table = build_table([load_run(p) for p in [refined, *runs]])
    assert [r.run for r in table.rows] == ["dense", "nm24", "t24", "t24-refined", "t816"]
    lines = table.to_markdown().splitlines()
    assert lines[5].startswith("| N:M | Algorithm | Transposable | Refine | C4 | WT2 |")
    assert lines[6].startswith("| --- | --- | --- | --- | ---: |")
    assert lines[9].startswith("| 2:4 | alps | yes | none | 60.50 |")
    refined_cells = "| block (2 epochs, lr 0.001) | 50.00 | 40.00 | 70.00 | - | - | - | - | t24-refined |"
    assert lines[10] == "| 2:4 | alps | yes " + refined_cells
    assert [r.method for r in table.rows[2:4]] == ["alps", "alps + refine"]  # one plotted line each
    rows = list(csv.DictReader(io.StringIO(table.to_csv())))
    assert [r["refine"] for r in rows] == ["", "", "", "block (2 epochs, lr 0.001)", ""]
    assert table.to_json()["columns"][8] == "refine"


def test_the_published_refined_runs_are_labelled_by_their_settings() -> None:
    folder = REPO_ROOT / "docs" / "results" / "refine" / "runs"
    table = build_table([load_run(folder / "alps-2x4-o-none"), load_run(folder / "alps-2x4-o-block")])
    assert [(r.run, r.refine) for r in table.rows] == [
        ("alps-2x4-o-none", None),
        ("alps-2x4-o-block", "block (2 epochs, lr 0.001)"),
    ]


def _with_protocol(eval_obj: dict[str, Any], seqlen: int, max_windows: int | None) -> dict[str, Any]:
    """An eval.json evaluated at another window length and cap (its records say the same)."""
    changed = copy.deepcopy(eval_obj)
    changed["seqlen"], changed["max_windows"] = seqlen, max_windows
    for record in changed["perplexity"].values():
        record["seqlen"] = seqlen
        record["windows"] = max_windows or record["windows"]
    return changed


def test_runs_of_different_protocols_are_refused_or_shown_with_allow_mixed(tmp_path: Path) -> None:
    """The issue's case: a dense run at 512 tokens × 1 window beside a pruned one at 128 × 2 (21.98 vs 222.40)."""
    dense = _write_run(tmp_path, "dense", _with_protocol(_eval({"wikitext2": 21.98}, None), 512, 1), None)
    pruned = _write_run(
        tmp_path, "t24", _with_protocol(_eval({"wikitext2": 222.40}, None), 128, 2), _prune(2, 4, True, [0.1] * 4)
    )
    runs = [load_run(dense), load_run(pruned)]
    with pytest.raises(UsageError) as refused:
        build_table(runs)
    assert str(refused.value) == (
        "the runs were evaluated under different protocols (dense: perplexity on at most 1 window of 512 tokens "
        "(offline data); t24: perplexity on at most 2 windows of 128 tokens (offline data)), so their numbers do "
        "not compare; re-evaluate them with the same tsenor eval options, or pass --allow-mixed to show each "
        "run's protocol"
    )
    result = CliRunner().invoke(app, ["report", str(dense), str(pruned), "--output", str(tmp_path / "out")])
    assert isinstance(result.exception, UsageError) and not (tmp_path / "out").exists()
    result = CliRunner().invoke(
        app, ["report", str(dense), str(pruned), "--output", str(tmp_path / "out"), "--allow-mixed"]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1] == "Protocol: mixed, see the Protocol column"
    assert lines[5] == "| N:M | Algorithm | Transposable | WT2 | Avg | Protocol | Run |"
    assert lines[7] == (
        "| dense | dense | - | 21.98 | - | perplexity on at most 1 window of 512 tokens (offline data) | dense |"
    )
    assert lines[8].endswith("| 222.40 | - | perplexity on at most 2 windows of 128 tokens (offline data) | t24 |")
    payload = json.loads((tmp_path / "out" / "table.json").read_text())
    assert payload["protocol"] is None
    assert [(r["eval_seqlen"], r["eval_max_windows"]) for r in payload["rows"]] == [(512, 1), (128, 2)]
    # Another zero-shot limit is another protocol too; a run without zero-shot conflicts with none.
    zs_a = _write_run(tmp_path, "zs-a", _eval({"wikitext2": 20.0}, {"piqa": 0.6}), None)
    other = _eval({"wikitext2": 30.0}, {"piqa": 0.5})
    other["zeroshot"]["limit"] = 100
    zs_b = _write_run(tmp_path, "zs-b", other, _prune(2, 4, True, [0.1] * 4))
    ppl_only = _write_run(tmp_path, "ppl-only", _eval({"wikitext2": 25.0}, None), _prune(2, 4, False, [0.1] * 4))
    assert not build_table([load_run(zs_a), load_run(ppl_only)]).mixed
    with pytest.raises(UsageError, match=r"zs-a: .*limit 200 documents.*zs-b: .*limit 100 documents"):
        build_table([load_run(zs_a), load_run(zs_b)])


def test_report_writes_csv_json_and_valid_pngs(runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = write_report([load_run(p) for p in runs], out)
    assert sorted(result.files) == sorted(
        ["table.md", "table.csv", "table.json", "perplexity_vs_m.png", "reconstruction_error.png"]
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(result.files)  # no temp files left behind
    rows = list(csv.DictReader(io.StringIO((out / "table.csv").read_text())))
    assert [r["run"] for r in rows] == ["dense", "nm24", "t24", "t816"]
    assert rows[2]["nm"] == "2:4" and rows[2]["transposable"] == "True" and rows[2]["sparsity"] == "0.5"
    assert float(rows[2]["ppl_wikitext2"]) == 45.25 and float(rows[2]["acc_piqa"]) == 0.52
    assert float(rows[2]["acc_stderr_piqa"]) == 0.03 and rows[3]["acc_stderr_piqa"] == ""
    assert (rows[0]["eval_seqlen"], rows[0]["eval_max_windows"], rows[0]["eval_limit"]) == ("64", "", "200")
    assert float(rows[2]["average_acc"]) == pytest.approx((0.52 + 0.30 + 0.61) / 3)
    assert rows[3]["ppl_ptb"] == "" and rows[3]["average_acc"] == ""
    payload = json.loads((out / "table.json").read_text())
    assert payload["columns"][:3] == ["run", "model", "nm"] and len(payload["rows"]) == 4
    assert payload["protocol"].startswith("perplexity on every window of 64 tokens")
    for name in ("perplexity_vs_m.png", "reconstruction_error.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        from PIL import Image

        with Image.open(out / name) as image:
            image.verify()
            assert image.size[0] > 300 and image.size[1] > 200


def test_plots_skipped_without_data(tmp_path: Path) -> None:
    dense = _write_run(tmp_path, "dense", _eval({"wikitext2": 20.0}, None), None)
    result = write_report([load_run(dense)], tmp_path / "out")
    assert result.files == ("table.md", "table.csv", "table.json") and len(result.skipped) == 2


def test_cli_report_markdown_json_and_force(runs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "report"
    runner = CliRunner()
    result = runner.invoke(app, ["report", *map(str, runs), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "| 2:4 | alps | yes |" in result.stdout
    # An existing output is refused, and left as it was.
    before = (out / "table.md").read_bytes()
    result = runner.invoke(app, ["report", str(runs[0]), "--output", str(out), "--format", "json"])
    assert isinstance(result.exception, OutputExistsError) and "--force" in str(result.exception)
    assert (out / "table.md").read_bytes() == before
    result = runner.invoke(app, ["report", str(runs[0]), "--output", str(out), "--format", "json", "--force"])
    assert result.exit_code == 0, result.output
    assert [r["run"] for r in json.loads(result.stdout)["rows"]] == ["t24"]
    assert "| t24 |" in (out / "table.md").read_text() and "| dense |" not in (out / "table.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")]


def test_cli_report_without_output_prints_the_table_and_writes_nothing(runs: list[Path], tmp_path: Path) -> None:
    """`tsenor report A B` prints the table that `--output` would hold (it was refused: "--output is
    required"), as Markdown or JSON, and writes no file; --force without --output is a usage error."""
    listing = sorted(p for p in tmp_path.rglob("*"))
    runner = CliRunner()
    shown = runner.invoke(app, ["report", *map(str, runs)])
    assert shown.exit_code == 0, shown.output
    as_json = runner.invoke(app, ["report", *map(str, runs), "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert sorted(p for p in tmp_path.rglob("*")) == listing
    written = runner.invoke(app, ["report", *map(str, runs), "--output", str(tmp_path / "out"), "--json"])
    assert written.exit_code == 0, written.output
    assert shown.stdout == (tmp_path / "out" / "table.md").read_text()
    assert (
        json.loads(as_json.stdout)
        == json.loads(written.stdout)
        == json.loads((tmp_path / "out" / "table.json").read_text())
    )
    forced = runner.invoke(app, ["report", *map(str, runs), "--force"])
    assert isinstance(forced.exception, UsageError) and "pass --output DIR or drop --force" in str(forced.exception)


def test_a_killed_report_s_leftovers_are_cleared_by_the_next(runs: list[Path], tmp_path: Path) -> None:
    """A report killed while writing leaves its temporary, and one killed while replacing leaves the old
    output moved aside; the next report puts the old one back (then refuses it without --force) and removes
    the rest."""
    out = tmp_path / "report"
    assert write_report([load_run(runs[0])], out).files
    aside = tmp_path / ".report.old-999999-aside"
    aside.mkdir()
    out.replace(aside / "report")
    (tmp_path / ".report.tmp-999999-unfinished").mkdir()
    with pytest.raises(OutputExistsError, match="--force"):
        write_report([load_run(runs[0])], out)
    assert (out / "table.md").is_file()
    write_report([load_run(r) for r in runs], out, force=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")]


def test_errors(runs: list[Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputNotFoundError, match=r"no eval\.json"):
        load_run(empty)
    with pytest.raises(InputNotFoundError, match="does not exist"):
        load_run(tmp_path / "absent")
    result = CliRunner().invoke(app, ["report", str(empty), "--output", str(tmp_path / "o")])
    assert isinstance(result.exception, InputNotFoundError) and result.exception.exit_code == 3
    assert not (tmp_path / "o").exists()
    with pytest.raises(UsageError, match="would replace run directory"):
        write_report([load_run(runs[0])], runs[0], force=True)
    (empty / "eval.json").write_text("{not json")
    with pytest.raises(SchemaError, match="not valid JSON"):
        load_run(empty)
    valid = _eval({"c4": 30.0}, {"piqa": 0.5})
    no_model = {k: v for k, v in valid.items() if k != "model"}
    with pytest.raises(SchemaError, match="missing field 'model'"):
        EvalReport.from_json(no_model)
    percent = copy.deepcopy(valid)
    percent["zeroshot"]["tasks"]["piqa"]["acc"] = 52.0
    with pytest.raises(SchemaError, match="fraction"):
        EvalReport.from_json(percent)
    norm = copy.deepcopy(valid)
    norm["zeroshot"]["average_metric"] = "acc_norm"
    with pytest.raises(SchemaError, match="average_metric"):
        EvalReport.from_json(norm)
    wrong_type = copy.deepcopy(valid)
    wrong_type["seqlen"] = "64"
    with pytest.raises(SchemaError, match="field 'seqlen' must be int"):
        EvalReport.from_json(wrong_type)
    pruned = _prune(2, 4, True, [0.1])
    pruned["pattern"] = {"n": 2, "m": 4}
    with pytest.raises(SchemaError, match="missing field 'transposable'"):
        PruneReport.from_json(pruned)
    bad_status = _prune(2, 4, True, [0.1])
    bad_status["layers"][0]["status"] = "half-done"
    with pytest.raises(SchemaError, match="status 'half-done'"):
        PruneReport.from_json(bad_status)
    future = {**_eval({"c4": 30.0}, None), "schema_version": SCHEMA_VERSION + 1}
    with pytest.raises(SchemaError, match="upgrade tsenor"):
        EvalReport.from_json(future)


def test_runs_of_the_same_name_are_labelled_by_their_paths(tmp_path: Path) -> None:
    """Two sweeps each have a `dense` run: the report of both labels those rows by their paths below the
    folder they share (it was refused: "run directory names repeat", which named every run), pairs against
    either, and a run given twice is one line naming it."""
    scores = {"piqa": 0.60, "hellaswag": 0.40, "boolq": 0.62}
    dense_a = _write_run(tmp_path / "sweep-a" / "runs", "dense", _eval({"wikitext2": 20.0}, scores), None)
    dense_b = _write_run(tmp_path / "sweep-b" / "runs", "dense", _eval({"wikitext2": 21.0}, scores), None)
    pruned = _write_run(
        tmp_path / "sweep-b" / "runs", "t24", _eval({"wikitext2": 45.0}, scores), _prune(2, 4, True, [0.1])
    )
    runs = [load_run(path) for path in (dense_a, dense_b, pruned)]
    table = build_table(runs, baseline="sweep-b/runs/dense")
    assert [row.run for row in table.rows] == ["sweep-a/runs/dense", "sweep-b/runs/dense", "t24"]
    assert [p.run for p in table.paired] == ["sweep-a/runs/dense", "t24"]
    written = write_report(runs, tmp_path / "report")
    assert "| sweep-b/runs/dense |" in (tmp_path / "report" / "table.md").read_text()
    assert written.table.rows == table.rows
    with pytest.raises(UsageError) as twice:
        build_table([runs[0], load_run(dense_a)])
    assert str(twice.value) == f"run directory {dense_a.resolve()} is given twice; pass each run once"


@pytest.mark.parametrize("accs", [None, {"piqa": 0.52, "boolq": 0.61}])
def test_eval_file_round_trips(accs: dict[str, float] | None) -> None:
    """write → read → equal, through real JSON text (inf, the perplexity of a diverged model, included)."""
    report = _eval_report({"c4": 30.0, "wikitext2": math.inf}, accs)
    text = json.dumps(report.to_json())
    assert EvalReport.from_json(json.loads(text)) == report


def test_prune_file_round_trips_with_ignored_layers_and_model_totals() -> None:
    """Layer status "ignored" and the optional model_params / model_nonzero totals read back as written."""
    report = _prune_report(8, 16, False, [0.1, None, 0.3])
    ignored = LayerRecord(3, "lm_head", 8, 16, "ignored", "left dense by --ignore")
    report = replace(report, layers=(*report.layers, ignored), model_params=1000, model_nonzero=600)
    written = json.loads(json.dumps(report.to_json()))
    assert written["schema_version"] == SCHEMA_VERSION
    totals = written["totals"]
    assert totals["model_params"] == 1000 and totals["layers_skipped"] == 1 and totals["layers_ignored"] == 1
    assert PruneReport.from_json(written) == report
    without = _prune_report(2, 4, True, [0.2])
    assert PruneReport.from_json(without.to_json()).model_params is None  # optional: absent totals are None


def test_version_1_files_still_load() -> None:
    """A v1 file (no schema_version): the error under either name, source flags as kind-only sources."""
    v1_prune = _prune(2, 4, True, [0.25, None])
    for key in ("schema_version", "calibration_source", "context"):
        del v1_prune[key]
    for layer in v1_prune["layers"]:
        layer["reconstruction_error"] = layer["recon_error"]
    only_long_name = copy.deepcopy(v1_prune)
    for layer in only_long_name["layers"]:
        del layer["recon_error"]
    for obj in (v1_prune, only_long_name):
        read = PruneReport.from_json(obj)
        assert read.schema_version == 1 and [layer.recon_error for layer in read.layers] == [0.25, None]
        assert read.calibration_source is None and read.context is None
        assert "reconstruction_error" not in read.to_json()["layers"][0]  # written back under one name
    v1_eval = _eval({"wikitext2": 20.0}, {"piqa": 0.5})
    for key in ("schema_version", "command", "context"):
        del v1_eval[key]
    v1_eval["perplexity"]["wikitext2"]["offline"] = True
    del v1_eval["perplexity"]["wikitext2"]["data_source"]
    v1_eval["zeroshot"]["tasks"]["piqa"]["source"] = "hub"
    del v1_eval["zeroshot"]["tasks"]["piqa"]["data_source"]
    read_eval = EvalReport.from_json(v1_eval)
    assert read_eval.schema_version == 1 and read_eval.command is None and read_eval.context is None
    assert read_eval.perplexity["wikitext2"].data_source == DataSource(kind="offline")
    assert read_eval.zeroshot is not None and read_eval.zeroshot.tasks[0].data_source == DataSource(kind="hub")


RESULT_FILES = sorted(
    p.relative_to(REPO_ROOT)
    for p in (REPO_ROOT / "docs" / "results").rglob("*.json")
    if p.name in (EVAL_FILE, PRUNE_FILE, FINETUNE_FILE)
)


def test_every_published_run_directory_is_covered() -> None:
    """The parametrized test below really sees every run directory: a pruned or dense run by its eval.json,
    a fine-tuning run (docs/results/finetune) by its finetune.json; the glob is not empty."""
    run_dirs = {d.relative_to(REPO_ROOT) for d in (REPO_ROOT / "docs" / "results").glob("**/runs/*") if d.is_dir()}
    covered = {p.parent for p in RESULT_FILES if p.name in (EVAL_FILE, FINETUNE_FILE)}
    assert run_dirs and any(p.name == FINETUNE_FILE for p in RESULT_FILES) and covered == run_dirs


@pytest.mark.parametrize("relative", RESULT_FILES, ids=str)
def test_published_run_files_load_and_keep_their_numbers(relative: Path) -> None:
    """Every run file under docs/results (v1, and v2 from 2026-11-24 on) loads; the numbers `tsenor report`
    uses are the file's."""
    obj = read_json(REPO_ROOT / relative)
    if relative.name == EVAL_FILE:
        record = EvalReport.from_json(obj, str(relative))
        assert record.schema_version == obj.get("schema_version", 1)
        assert {k: v.ppl for k, v in record.perplexity.items()} == {k: v["ppl"] for k, v in obj["perplexity"].items()}
        if obj["zeroshot"] is not None:
            assert record.zeroshot is not None
            assert {t.name: t.acc for t in record.zeroshot.tasks} == {
                k: v["acc"] for k, v in obj["zeroshot"]["tasks"].items()
            }
        # written back, it is a current-version file with the same content
        assert EvalReport.from_json(record.to_json()) == replace(record, schema_version=SCHEMA_VERSION)
    elif relative.name == FINETUNE_FILE:
        finetune = FinetuneReport.from_json(obj, str(relative))
        assert finetune.schema_version == obj.get("schema_version", 1) and finetune.steps == obj["steps"]
        assert finetune.ppl("before") == obj["ppl_before"] and finetune.ppl("after") == obj["ppl_after"]
        assert finetune.loss_curve == [(step, loss) for step, loss in obj["loss_curve"]]
        assert FinetuneReport.from_json(finetune.to_json()) == replace(finetune, schema_version=SCHEMA_VERSION)
    else:
        prune = PruneReport.from_json(obj, str(relative))
        assert prune.schema_version == obj.get("schema_version", 1) and prune.method == obj["method"]
        assert [layer.recon_error for layer in prune.layers] == [layer["recon_error"] for layer in obj["layers"]]
        assert prune.totals()["mean_recon_error"] == pytest.approx(obj["totals"]["mean_recon_error"], rel=1e-12)
        assert PruneReport.from_json(prune.to_json()) == replace(prune, schema_version=SCHEMA_VERSION)


def test_block_means_average_recorded_linears_and_leave_skipped_blocks_as_gaps() -> None:
    from tsenor_cli.report.plots import _block_means

    errors: list[float | None] = [0.02, 0.04, None, None, 0.01, None]  # block 1: all skipped
    prune = _prune_report(2, 4, True, errors)
    blocks, means = _block_means(prune)
    assert blocks == [0, 1, 2]
    assert means[0] == pytest.approx(0.03) and math.isnan(means[1]) and means[2] == pytest.approx(0.01)


def test_tick_labels_stay_plain_numbers_over_wide_ranges() -> None:
    """A perplexity axis spanning 20 to 5 million (broken 75%-sparse runs) once read "0.000" at every
    tick below a million, because the default formatter moved the scale into a "1e6" offset."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from tsenor_cli.report.plots import _log_y, tick_label

    assert [tick_label(v) for v in (0.5, 1.0, 20.0, 500.0, 2000.0, 5e6, 2.5e9)] == [
        "0.5",
        "1",
        "20",
        "500",
        "2k",
        "5M",
        "2.5G",
    ]
    fig = Figure()
    FigureCanvasAgg(fig)
    wide, narrow = fig.subplots(1, 2)
    wide.plot([4, 32], [20.0, 5.4e6])
    _log_y(wide)
    narrow.plot([4, 32], [36.0, 140.0])
    _log_y(narrow)
    fig.canvas.draw()
    low, high = wide.get_ylim()
    shown = [t.get_text() for t in wide.get_yticklabels() if low <= t.get_position()[1] <= high]
    assert shown == ["100", "1k", "10k", "100k", "1M", "10M"]
    assert wide.yaxis.get_offset_text().get_text() == ""
    low, high = narrow.get_ylim()
    assert [t.get_text() for t in narrow.get_yticklabels() if low <= t.get_position()[1] <= high] == ["50", "100"]


def _scored(name: str, docs: dict[str, tuple[float, ...]], digest: str = "d" * 64) -> ZeroShotResult:
    """A run's zero-shot result with each document's acc (binary-outcome stderr, as lm-eval's)."""
    tasks = []
    for task, values in docs.items():
        n, acc = len(values), sum(values) / len(values)
        stderr = math.sqrt(acc * (1 - acc) / (n - 1))
        tasks.append(TaskScore(task, acc, stderr, None, None, n, OFFLINE, "1.0", values, digest))
    average = sum(t.acc for t in tasks) / len(tasks)
    return ZeroShotResult(tuple(tasks), average, "acc", 0, n, "offline", "0.4.13")


def test_paired_differences_hand_checked() -> None:
    from tsenor_cli.report.paired import paired_difference

    base = _scored("a", {"piqa": (1.0, 0.0, 1.0, 0.0), "boolq": (1.0, 1.0, 0.0, 0.0)})
    other = _scored("b", {"piqa": (1.0, 1.0, 1.0, 0.0), "boolq": (1.0, 1.0, 0.0, 0.0)})
    paired = paired_difference("b", other, "a", base)
    # piqa: d = (0, 1, 0, 0), mean 1/4, sample variance (3·(1/4)² + (3/4)²)/3 = 1/4, se = √(1/16) = 1/4;
    # boolq: d = 0, se 0. Avg: (1/4 + 0)/2 = 1/8, its error √(1/16 + 0)/2 = 1/8.
    assert paired.difference == pytest.approx(0.125) and paired.stderr == pytest.approx(0.125)
    assert paired.tasks == ("piqa", "boolq") and paired.documents == 8 and paired.reason is None
    # Unpaired: piqa 0.5 ± √(1/12) and 0.75 ± √(3/48); boolq 0.5 ± √(1/12) twice.
    unpaired = math.sqrt(1 / 12 + 3 / 48 + 2 / 12) / 2
    assert paired.unpaired_stderr == pytest.approx(unpaired) and paired.stderr < paired.unpaired_stderr
    # One task without lm-eval's error: no unpaired error, the paired one unchanged.
    bare = replace(other, tasks=(replace(other.tasks[0], acc_stderr=None), other.tasks[1]))
    half = paired_difference("b", bare, "a", base)
    assert half.unpaired_stderr is None and half.stderr == pytest.approx(0.125)
    # Other documents, or scores from before the documents were kept: not paired, and said why.
    moved = _scored("c", {"piqa": (1.0, 1.0, 1.0, 0.0), "boolq": (1.0, 1.0, 0.0, 0.0)}, digest="e" * 64)
    assert "other documents" in (paired_difference("c", moved, "a", base).reason or "")
    old = replace(base, tasks=tuple(replace(t, doc_acc=None, docs_sha256=None) for t in base.tasks))
    assert "per-document" in (paired_difference("b", other, "a", old).reason or "")


def test_the_report_pairs_each_run_with_the_baseline(tmp_path: Path) -> None:
    dense = _scored("dense", {"piqa": (1.0, 1.0, 1.0, 0.0)})
    pruned = _scored("pruned", {"piqa": (1.0, 0.0, 1.0, 0.0)})
    folders = []
    for name, result, prune in (("dense", dense, None), ("pruned", pruned, _prune(2, 4, True, [0.1]))):
        report = replace(_eval_report({"c4": 30.0}, None), zeroshot=result)
        folders.append(_write_run(tmp_path, name, report.to_json(), prune))
    table = build_table([load_run(f) for f in folders])
    assert [(p.run, p.baseline) for p in table.paired] == [("pruned", "dense")]
    assert table.paired[0].difference == pytest.approx(-0.25) and table.paired[0].stderr == pytest.approx(0.25)
    assert "| pruned | -25.00 | 25.00 |" in table.to_markdown()
    assert table.to_json()["paired"][0]["difference"] == pytest.approx(-0.25)
    flipped = build_table([load_run(f) for f in folders], baseline="pruned")
    assert [(p.run, p.difference) for p in flipped.paired] == [("dense", pytest.approx(0.25))]
    with pytest.raises(UsageError, match="--baseline nope is not a run with zero-shot scores"):
        build_table([load_run(f) for f in folders], baseline="nope")


def test_per_document_scores_round_trip_and_are_checked() -> None:
    result = _scored("a", {"piqa": (1.0, 0.0, 1.0)})
    report = replace(_eval_report({"c4": 30.0}, None), zeroshot=result)
    obj = json.loads(json.dumps(report.to_json()))
    assert EvalReport.from_json(obj) == report
    obj["zeroshot"]["tasks"]["piqa"]["doc_acc"] = [1.0, 0.0]
    with pytest.raises(SchemaError, match="doc_acc has 2 documents, n_samples 3"):
        EvalReport.from_json(obj)
    obj["zeroshot"]["tasks"]["piqa"]["doc_acc"] = [1.0, "no", 1.0]
    with pytest.raises(SchemaError, match="doc_acc must be a list of fractions"):
        EvalReport.from_json(obj)
