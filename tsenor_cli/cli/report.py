"""`tsenor report RUN_DIR... --output DIR`: merge runs into the paper's Table 2 layout with plots."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

import typer

from tsenor_cli.cli import app
from tsenor_cli.cli.options import ForceOpt, OutputDirOpt
from tsenor_cli.errors import UsageError
from tsenor_cli.report import load_run, write_report


class ReportFormat(StrEnum):
    markdown = "markdown"
    json = "json"


@app.command("report")
def report_cmd(
    run_dirs: list[Path] = typer.Argument(
        ..., help="Run directories, each with eval.json (and tsenor_report.json when pruned)."
    ),
    output: OutputDirOpt = None,
    fmt: ReportFormat = typer.Option(ReportFormat.markdown, "--format", help="What to print on stdout."),
    force: ForceOpt = False,
) -> None:
    """Merge runs into one table (perplexity + zero-shot, as the paper's Table 2) and plot them.

    --output receives table.md/.csv/.json and the PNG plots.
    """
    if output is None:
        raise UsageError("--output is required; pass the folder for table.md/.csv/.json and the plots")
    runs = [load_run(path) for path in run_dirs]
    result = write_report(runs, output, force=force)
    for note in result.skipped:
        typer.echo(f"skipped {note}", err=True)
    typer.echo(f"wrote {', '.join(result.files)} to {result.directory}", err=True)
    if fmt is ReportFormat.markdown:
        typer.echo(result.table.to_markdown(), nl=False)
    elif fmt is ReportFormat.json:
        typer.echo(json.dumps(result.table.to_json(), indent=2))
    else:
        raise AssertionError(f"unhandled format {fmt}")
