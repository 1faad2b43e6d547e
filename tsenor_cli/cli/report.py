"""`tsenor report RUN_DIR... [--output DIR]`: merge runs into the paper's Table 2 layout, printed, and with
--output written as tables and plots."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

import typer

from tsenor_cli.cli.app import Command, app
from tsenor_cli.cli.options import ForceOpt, JsonOpt, OutputDirOpt
from tsenor_cli.errors import UsageError
from tsenor_cli.report import build_table, check_report_output, load_run, write_report


class ReportFormat(StrEnum):
    markdown = "markdown"
    json = "json"


def _expand_sweeps(paths: list[Path]) -> list[Path]:
    """Each sweep folder (not itself a run) → its finished run directories, in the sweep's order."""
    from tsenor_cli.runfiles import EVAL_FILE
    from tsenor_cli.sweep.status import collect, is_sweep_dir

    expanded: list[Path] = []
    for path in paths:
        if (path / EVAL_FILE).is_file() or not is_sweep_dir(path):
            expanded.append(path)
            continue
        done = [view.run_dir for view in collect(path) if view.state == "done"]
        if not done:
            raise UsageError(f"sweep folder {path} has no finished run yet; see tsenor sweep status {path}")
        expanded += done
    return expanded


@app.command("report", cls=Command)
def report_cmd(
    run_dirs: list[Path] = typer.Argument(
        ...,
        help="Run directories, each with eval.json (and tsenor_report.json when pruned), or sweep folders "
        "(the --output of tsenor sweep: their finished runs).",
    ),
    output: OutputDirOpt = None,
    as_json: JsonOpt = False,
    # `--format json`: the old spelling of --json; hidden, accepted for one release.
    fmt: ReportFormat | None = typer.Option(
        None, "--format", hidden=True, help="Old spelling of --json (--format json), accepted for one release."
    ),
    force: ForceOpt = False,
    allow_mixed: bool = typer.Option(
        False,
        "--allow-mixed",
        help="Put runs evaluated under different protocols (window length and count, zero-shot limit and "
        "shots, data source) in one table, each row's protocol in a column; refused without it.",
    ),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="The run (its row's name: its folder's name, or where names repeat its path below the folder "
        "they share, e.g. sweep-a/runs/dense) the others' zero-shot scores are compared with, document by "
        "document; default the first row with zero-shot scores (the dense model when given).",
    ),
) -> None:
    """Merge runs into one table (perplexity + zero-shot, as the paper's Table 2) and plot them.

    The table is printed; --output also receives table.md/.csv/.json and the PNG plots.
    """
    if output is not None:
        check_report_output(output, force)  # before any run is read: a report that cannot be written is refused
    elif force:
        raise UsageError("--force replaces an --output folder, and none was given; pass --output DIR or drop --force")
    runs = [load_run(path) for path in _expand_sweeps(run_dirs)]
    if output is None:
        table = build_table(runs, allow_mixed=allow_mixed, baseline=baseline)
    else:
        result = write_report(runs, output, force=force, allow_mixed=allow_mixed, baseline=baseline)
        for note in result.skipped:
            typer.echo(f"skipped {note}", err=True)
        typer.echo(f"wrote {', '.join(result.files)} to {result.directory}", err=True)
        table = result.table
    if as_json or fmt is ReportFormat.json:
        typer.echo(json.dumps(table.to_json(), indent=2))
    else:
        typer.echo(table.to_markdown(), nl=False)
