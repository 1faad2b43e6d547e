"""`tsenor model ...`: the embedded default model."""

from __future__ import annotations

import typer

from tsenor_cli.cli.app import Command, app, run_context
from tsenor_cli.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, materialize

model_app = typer.Typer(help="Manage the embedded default model.", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(model_app, name="model")


@model_app.command("materialize", cls=Command)
def materialize_cmd(
    ctx: typer.Context,
    name: str = typer.Argument(DEFAULT_MODEL, help=f"One of: {', '.join(EMBEDDED_MODELS)}."),
) -> None:
    """Convert an embedded model to a safetensors checkpoint in the cache (once) and print its path."""
    cache_dir = run_context(ctx, None, offline=False).cache_dir
    path = materialize(name, cache_dir)
    typer.echo(str(path))


@model_app.command("list", cls=Command)
def list_cmd() -> None:
    """List the embedded models."""
    for spec in EMBEDDED_MODELS.values():
        typer.echo(f"{spec.name}\t{spec.description}")
