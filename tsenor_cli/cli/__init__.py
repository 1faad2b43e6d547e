"""The `tsenor` command line: parses, cross-checks flags and hands off to the library.

Each command group lives in its own module and registers itself on `app`. Known errors
(`TsenorError`) become one line on stderr and their exit code; tracebacks only with TSENOR_DEBUG=1.
"""

from __future__ import annotations

import sys

import typer

from tsenor_cli import __version__, settings
from tsenor_cli.errors import TsenorError

app = typer.Typer(
    name="tsenor",
    help="Prune LLaMA-family models to transposable N:M sparsity with the TSENOR mask solver.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tsenor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Prune LLaMA-family models to transposable N:M sparsity with the TSENOR mask solver."""


def _register_commands() -> None:
    # Imported for their side effect of adding commands to `app`.
    from tsenor_cli.cli import bench, model  # noqa: F401

    for optional in ("prune", "evaluate", "verify", "report", "sweep"):
        try:
            __import__(f"tsenor_cli.cli.{optional}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tsenor_cli.cli.{optional}":
                raise


_register_commands()


def main() -> None:
    """Console-script entry: run the app, turning known errors into one line and an exit code.

    Click handles its own usage errors (exit 2) in standalone mode; our errors propagate to here.
    """
    try:
        app()
    except TsenorError as exc:
        if settings.debug():
            raise
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
