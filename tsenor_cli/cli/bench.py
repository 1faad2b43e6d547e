"""`tsenor bench ...`: benchmarks."""

from __future__ import annotations

import typer

from tsenor_cli.cli import app

bench_app = typer.Typer(help="Benchmarks (speed and quality ratios measured in one run).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
