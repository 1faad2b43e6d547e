"""`tsenor report`: schema, merged table (hand-checked numbers), CSV/JSON, PNG plots and errors."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tsenor_cli.cli import app
from tsenor_cli.errors import InputNotFoundError, OutputExistsError, UsageError
from tsenor_cli.report import build_table, load_run, write_report
from tsenor_cli.report.schema import EvalRecord, PruneReport, SchemaError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _eval(ppl: dict[str, float], accs: dict[str, float] | None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "model": "tiny-llama",
        "perplexity": {k: {"ppl": v, "tokens": 1000} for k, v in ppl.items()},
    }
    if accs is not None:
        obj["zeroshot"] = {
            "tasks": {k: {"acc": v, "acc_norm": None, "n_samples": 200} for k, v in accs.items()},
            "average": sum(accs.values()) / len(accs),
            "average_metric": "acc",
        }
    return obj


def _prune(n: int, m: int, transposable: bool, errors: list[float]) -> dict[str, Any]:
    return {
        "method": "alps",
        "pattern": {"n": n, "m": m, "transposable": transposable},
        "sparsity": 1 - n / m,
        "layers": [
            # `gap` and `seconds` are optional: the last record leaves them out.
            {"name": f"model.layers.{i // 2}.mlp.proj{i % 2}", "block": i // 2, "reconstruction_error": e}
            | ({"gap": 0.0, "seconds": 0.5} if i < len(errors) - 1 else {})
            for i, e in enumerate(errors)
        ],
        "extra_field_from_the_pruner": [1, 2, 3],
    }


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
    assert lines[4] == "| N:M | Algorithm | Transposable | C4 | WT2 | PTB | PIQA | HS | BoolQ | Avg | Run |"
    # Avg: (60 + 40 + 62) / 3 = 54.00; (55 + 35 + 60) / 3 = 50.00; (52 + 30 + 61) / 3 = 47.67.
    assert lines[6:] == [
        "| dense | dense | - | 30.00 | 20.00 | 40.00 | 60.00 | 40.00 | 62.00 | 54.00 | dense |",
        "| 2:4 | alps | no | 50.00 | 35.50 | 70.00 | 55.00 | 35.00 | 60.00 | 50.00 | nm24 |",
        "| 2:4 | alps | yes | 60.50 | 45.25 | 80.00 | 52.00 | 30.00 | 61.00 | 47.67 | t24 |",
        "| 8:16 | alps | yes | 40.00 | 28.00 | - | - | - | - | - | t816 |",
    ]


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
    assert float(rows[2]["average_acc"]) == pytest.approx((0.52 + 0.30 + 0.61) / 3)
    assert rows[3]["ppl_ptb"] == "" and rows[3]["average_acc"] == ""
    payload = json.loads((out / "table.json").read_text())
    assert payload["columns"][:3] == ["run", "model", "nm"] and len(payload["rows"]) == 4
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
    with pytest.raises(SchemaError, match="missing field 'model'"):
        EvalRecord.from_json({"perplexity": {}})
    with pytest.raises(SchemaError, match="fraction"):
        EvalRecord.from_json({"model": "x", "zeroshot": {"tasks": {"piqa": {"acc": 52.0}}}})
    with pytest.raises(SchemaError, match="average_metric"):
        EvalRecord.from_json({"model": "x", "zeroshot": {"tasks": {}, "average_metric": "acc_norm"}})
    with pytest.raises(SchemaError, match="transposable"):
        PruneReport.from_json({"method": "alps", "pattern": {"n": 2, "m": 4}, "sparsity": 0.5})


def test_schema_tolerates_missing_optional_fields() -> None:
    record = EvalRecord.from_json({"model": "m"})
    assert record.perplexity == {} and record.zeroshot is None
    prune = PruneReport.from_json({"method": "magnitude", "pattern": None, "sparsity": 0.5})
    assert prune.pattern is None and prune.layers == ()
    layer = PruneReport.from_json(
        {
            "method": "a",
            "pattern": None,
            "sparsity": 0.5,
            "layers": [{"name": "q", "block": 0, "reconstruction_error": 1}],
        }
    ).layers[0]
    assert layer.gap is None and layer.seconds is None and layer.reconstruction_error == 1.0
    skipped = PruneReport.from_json(
        {"method": "a", "pattern": None, "sparsity": 0.5, "layers": [{"name": "q", "block": 0}]}
    ).layers[0]
    assert skipped.reconstruction_error is None  # a skipped layer: no error, a gap in the plot


def test_block_means_average_recorded_linears_and_leave_skipped_blocks_as_gaps() -> None:
    import math

    from tsenor_cli.report.plots import _block_means
    from tsenor_cli.report.schema import LayerRecord, PatternInfo

    layers = (
        LayerRecord("model.layers.0.self_attn.q_proj", 0, 0.02),
        LayerRecord("model.layers.0.mlp.down_proj", 0, 0.04),
        LayerRecord("model.layers.1.self_attn.q_proj", 1, None),  # skipped: no error
        LayerRecord("model.layers.2.self_attn.q_proj", 2, 0.01),
        LayerRecord("model.layers.2.mlp.down_proj", 2, None),
    )
    prune = PruneReport("alps", PatternInfo(n=2, m=4, transposable=True), 0.5, layers)
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
