"""`tsenor report`: merge run directories into the paper's Table 2 layout, with CSV, JSON and PNG plots.

`write_report` builds every file in a temporary sibling of the output directory and renames it into
place, so a failed report leaves no partial output and an existing one untouched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tsenor_cli.errors import OutputExistsError, UsageError
from tsenor_cli.outputs import check_output_folder, replacing
from tsenor_cli.progress import logger
from tsenor_cli.report.table import Table, build_table, distinct_labels
from tsenor_cli.runfiles import Run, load_run

__all__ = ["ReportOutput", "Run", "Table", "build_table", "check_report_output", "load_run", "write_report"]


@dataclass(frozen=True)
class ReportOutput:
    """What was written: the table, the output directory and the file names in it."""

    table: Table
    directory: Path
    files: tuple[str, ...]
    skipped: tuple[str, ...]


# What `tsenor report` writes at most: three tables and two PNG plots (tens of kilobytes each).
REPORT_BYTES = 16 << 20


def check_report_output(output: Path, force: bool) -> None:
    """`tsenor report --output`, refused before any run is read (exit 4): an existing folder without
    --force, or a place the one output check of every command refuses (`tsenor_cli.outputs`: a file, a
    folder that cannot be created or written, no room for the tables and plots)."""
    if output.exists() and not force:
        raise OutputExistsError(f"{output} already exists; pass --force to replace it or choose another --output")
    check_output_folder(output, REPORT_BYTES, what="the table and plots")


def _check_output(output: Path, runs: Sequence[Run], force: bool) -> None:
    target = output.resolve()
    for run in runs:
        run_path = run.path.resolve()
        if target == run_path or target in run_path.parents:
            raise UsageError(f"--output {output} would replace run directory {run.path}; choose another directory")
    check_report_output(output, force)


def write_report(
    runs: Sequence[Run], output: Path, *, force: bool = False, allow_mixed: bool = False, baseline: str | None = None
) -> ReportOutput:
    """Write table.md, table.csv, table.json and the PNG plots into `output` (atomically); runs evaluated
    under different protocols are refused unless `allow_mixed`; zero-shot differences are paired against
    `baseline` (`report.table.build_table`)."""
    # Imported here: matplotlib is for the plots only, and `tsenor prune` imports report.markdown.
    from tsenor_cli.report.plots import (
        PERPLEXITY_PNG,
        RECONSTRUCTION_PNG,
        plot_perplexity_vs_m,
        plot_reconstruction_error,
    )

    _check_output(output, runs, force)
    runs = distinct_labels(runs)
    table = build_table(runs, allow_mixed=allow_mixed, baseline=baseline)
    files = ["table.md", "table.csv", "table.json"]
    skipped = []
    with replacing(output, logger.warning, lambda: _check_output(output, runs, force)) as tmp:
        (tmp / "table.md").write_text(table.to_markdown(), encoding="utf-8")
        (tmp / "table.csv").write_text(table.to_csv(), encoding="utf-8")
        (tmp / "table.json").write_text(json.dumps(table.to_json(), indent=2) + "\n", encoding="utf-8")
        if plot_perplexity_vs_m(table, tmp / PERPLEXITY_PNG):
            files.append(PERPLEXITY_PNG)
        else:
            skipped.append(f"{PERPLEXITY_PNG} (no N:M run with perplexity)")
        if plot_reconstruction_error(runs, tmp / RECONSTRUCTION_PNG):
            files.append(RECONSTRUCTION_PNG)
        else:
            skipped.append(f"{RECONSTRUCTION_PNG} (no run with per-layer records in tsenor_report.json)")
    return ReportOutput(table=table, directory=output, files=tuple(files), skipped=tuple(skipped))
