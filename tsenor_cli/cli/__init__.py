"""The `tsenor` command line: parses, cross-checks flags and hands off to the library.

Each command group lives in its own module and registers itself on `app`. Commands that read data or
models build one `RunContext` (`run_context`) from their ``--data-dir``/``--offline`` flags, with the
environment as defaults (tsenor_cli/settings.py), and pass it down. Known errors (`TsenorError`)
become one line on stderr and their exit code; tracebacks only with ``--debug`` or TSENOR_DEBUG=1.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import typer

from tsenor_cli import __version__, settings
from tsenor_cli.errors import EXIT_SIGINT, Interrupted, TsenorError
from tsenor_cli.settings import RunContext

app = typer.Typer(
    name="tsenor",
    help="Prune LLaMA-family models to transposable N:M sparsity with the TSENOR mask solver.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DATA_DIR_HELP = "Offline data folder (layout of shared/data); every dataset is read from it. Default: $TSENOR_DATA_DIR."
OFFLINE_HELP = "Never contact the HF hub (hub model ids from the local HF cache only). Default: HF_HUB_OFFLINE."


@dataclass
class CliState:
    """What the root options decide for one invocation; `main` owns it to format errors."""

    debug: bool


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tsenor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks (default: $TSENOR_DEBUG)."),
) -> None:
    """Prune LLaMA-family models to transposable N:M sparsity with the TSENOR mask solver."""
    if ctx.obj is None:  # invoked without `main` (tests, or app() embedded elsewhere)
        ctx.obj = CliState(debug=settings.debug_default())
    ctx.obj.debug = ctx.obj.debug or debug


def run_context(ctx: typer.Context, data_dir: Path | None, offline: bool) -> RunContext:
    """The command's RunContext: its --data-dir / --offline, the root --debug, the environment for the rest."""
    state = ctx.find_root().obj
    return RunContext.from_environment(
        data_dir=data_dir,
        offline=True if offline else None,
        debug=state.debug if isinstance(state, CliState) else None,
    )


def command_line(argv: Sequence[str] | None = None, orig_argv: Sequence[str] | None = None) -> str:
    """The command line that started this process, quoted for a POSIX shell.

    For ``python -m tsenor_cli ...`` sys.argv[0] is the path of __main__.py, so the interpreter's own
    command line (sys.orig_argv: interpreter, its options, ``-m tsenor_cli``, the arguments) is
    recorded; for the ``tsenor`` console script, sys.argv (script path and arguments).
    """
    args = list(sys.argv if argv is None else argv)
    orig = list(sys.orig_argv if orig_argv is None else orig_argv)
    if "-m" in orig[: len(orig) - len(args) + 1]:
        return shlex.join(orig)
    return shlex.join(args)


def _register_commands() -> None:
    # Imported for their side effect of adding commands to `app`.
    from tsenor_cli.cli import bench, model  # noqa: F401

    for optional in ("prune", "evaluate", "verify", "report", "finetune"):
        try:
            __import__(f"tsenor_cli.cli.{optional}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tsenor_cli.cli.{optional}":
                raise


_register_commands()


def main() -> None:
    """Console-script (and ``python -m tsenor_cli``) entry: run the app, turning known errors into one
    line and an exit code.

    Click handles its own usage errors (exit 2) in standalone mode; our errors propagate to here.
    """
    state = CliState(debug=settings.debug_default())
    try:
        app(obj=state)
    except TsenorError as exc:
        if state.debug:
            raise
        # An interruption is not an error in the input: its line says what was saved, unprefixed.
        typer.echo(str(exc) if isinstance(exc, Interrupted) else f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(EXIT_SIGINT)
