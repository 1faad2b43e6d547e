"""`tsenor verify DIR`: check every pruned weight against the recorded (transposable) N:M pattern."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from tsenor_cli.cli.app import Command, app
from tsenor_cli.cli.options import JsonOpt
from tsenor_cli.errors import VerificationError


@app.command("verify", cls=Command)
def verify_cmd(
    directory: Path = typer.Argument(..., help="Checkpoint directory written by tsenor prune."),
    as_json: JsonOpt = False,
) -> None:
    """Check each M×M tile keeps at most N per row and column (exactly N where weights were non-zero)."""
    from tsenor_cli.pruning.run.verify import dense_lines, load_lines, table_lines, verify_checkpoint

    report = verify_checkpoint(directory)
    pattern = report.pattern
    named = f"{pattern.label} ({pattern.kind})"
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo(f"{directory}: {report.sparsity.method} {named}")
        typer.echo("\n".join(table_lines(report)))
        under = sum(c.under for c in report.layers)
        if under:
            typer.echo(f"info: {under} rows/columns keep fewer than N (weights that were already zero)")
        for line in [*dense_lines(report), *load_lines(report)]:
            typer.echo(line)
    bad = [c.name for c in report.layers if not c.ok]
    if bad:
        raise VerificationError(
            f"{len(bad)} weight(s) violate {named}, first: {bad[0]}; "
            "the checkpoint was modified after pruning — re-run tsenor prune"
        )
    unloaded = [load for load in report.loads if not load.ok]
    if unloaded:
        raise VerificationError(
            f"{unloaded[0].name} finds {len(unloaded[0].missing)} weight(s) of the checkpoint missing "
            f"(e.g. {unloaded[0].missing[0]}) and would initialise them at random; re-run tsenor prune"
        )
    if not as_json:
        typer.echo(f"all {len(report.layers)} pruned weights satisfy {named}")
