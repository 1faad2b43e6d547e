"""The `tsenor` command line: parses, cross-checks flags and hands off to the library.

Each command group lives in its own module and registers itself on `app`. Commands that read data or
models build one `RunContext` (`run_context`) from their ``--data-dir``/``--offline`` flags, with the
environment as defaults (tsenor_cli/settings.py), and pass it down. Known errors (`TsenorError`)
become one line on stderr and their exit code; tracebacks only with ``--debug`` or TSENOR_DEBUG=1.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

from tsenor_cli import settings
from tsenor_cli.cli.app import CliState, Command, app, command_line, launch_arguments, run_context
from tsenor_cli.errors import DEBUG_HINT, EXIT_SIGINT, Interrupted, PeerError, TsenorError, one_line

__all__ = ["CliState", "Command", "app", "command_line", "launch_arguments", "main", "run_context"]


def _register_commands() -> None:
    # Imported for their side effect of adding commands to `app`.
    from tsenor_cli.cli import bench, model  # noqa: F401

    for optional in ("prune", "evaluate", "verify", "report", "finetune", "sweep", "pack"):
        try:
            __import__(f"tsenor_cli.cli.{optional}")
        except ModuleNotFoundError as exc:
            if exc.name != f"tsenor_cli.cli.{optional}":
                raise


_register_commands()


def _usage_line(exc: typer.TyperException) -> str:
    """A click usage error (bad value, missing option, unknown flag) as `error:` text naming the fix."""
    ctx = getattr(exc, "ctx", None)  # click's UsageError carries the context of the command it hit
    where = f"{ctx.command_path} --help" if ctx is not None else "tsenor --help"
    return f"{one_line(exc.format_message()).rstrip('.')}; see {where}"


def _is_root_process() -> bool:
    """Whether this process is rank 0 of a torchrun run, or no such run's."""
    try:
        return settings.distributed_default().is_root
    except TsenorError:
        return True


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script (and ``python -m tsenor_cli``) entry: run the app on `argv` (default sys.argv[1:]),
    every failure one ``error: ...`` line on stderr and an exit code (errors.py; README "Errors").

    The app runs outside click's standalone mode so that click's own usage errors (range checks,
    missing or unknown options) come here too and print like ours instead of click's usage box.
    """
    args = list(argv) if argv is not None else sys.argv[1:]
    state = CliState(debug=settings.debug_default(), argv=args)
    try:
        code = app(args=args, obj=state, standalone_mode=False)
    except TsenorError as exc:
        if state.debug:
            raise
        if isinstance(exc, PeerError | Interrupted) and not _is_root_process():
            sys.exit(exc.exit_code)  # rank 0 prints the failing rank's line or the stop's; one for the run
        # An interruption is not an error in the input: its line says what was saved, unprefixed.
        typer.echo(str(exc) if isinstance(exc, Interrupted) else f"error: {one_line(str(exc))}", err=True)
        sys.exit(exc.exit_code)
    except typer.TyperException as exc:  # click's usage errors (exit 2)
        if state.debug:
            raise
        message = exc.format_message()
        if not message.strip() or "\n" in message:
            # no_args_is_help: a bare command group's "error" is its help, which rich has printed already
            # (the message is then empty) or which is the message itself.
            typer.echo(message, err=True, nl=not message.endswith("\n"))
        else:
            typer.echo(f"error: {_usage_line(exc)}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort as exc:  # click turns Ctrl-C (and EOF at a prompt) into Abort
        if isinstance(exc.__context__, KeyboardInterrupt):
            typer.echo("interrupted", err=True)
            sys.exit(130)
        typer.echo("error: aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(EXIT_SIGINT)
    except Exception as exc:
        # Anything else is a bug or an input no check knew about: still one line, the traceback on demand.
        if state.debug:
            raise
        typer.echo(f"error: unexpected {type(exc).__name__}: {one_line(str(exc))}; {DEBUG_HINT}", err=True)
        sys.exit(1)
    if isinstance(code, int) and code:  # typer.Exit(code) returns its code outside standalone mode
        sys.exit(code)
