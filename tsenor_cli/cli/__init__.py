"""The `tsenor` command line: parses, cross-checks flags and hands off to the library.

Each command group lives in its own module and registers itself on `app`. Commands that read data or
models build one `RunContext` (`run_context`) from their ``--data-dir``/``--offline`` flags, with the
environment as defaults (tsenor_cli/settings.py), and pass it down. Known errors (`TsenorError`)
become one line on stderr and their exit code; tracebacks only with ``--debug`` or TSENOR_DEBUG=1.
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from tsenor_cli import __version__, settings
from tsenor_cli.errors import DEBUG_HINT, EXIT_SIGINT, Interrupted, PeerError, TsenorError, one_line
from tsenor_cli.progress import configure_logging, quiet_libraries
from tsenor_cli.settings import RunContext

# The root options that may also follow the command name (`RootGroup`).
ROOT_FLAGS = ("-q", "--quiet", "-v", "--verbose", "--debug")


class Command(TyperCommand):
    """Every tsenor command: its arguments spelled as click spells them, SWEEP_FILE and RUN_DIRS..., in the
    usage line and the argument list (typer writes `{sweep_file}` and `run_dirs... <list[Path]>`)."""

    @staticmethod
    def _argument_name(param: Any) -> str:
        name = str(param.name).upper() + ("..." if param.nargs != 1 else "")
        return name if param.required else f"[{name}]"

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                pieces.append(self._argument_name(param))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """Arguments, then the options in their panels (`rich_help_panel`, in order of first use), then the
        rest under "Options"; plain text, as click writes it (Typer draws panels only with rich markup)."""
        from tsenor_cli.cli.options import LAZY_CHOICES

        sections: dict[str, list[tuple[str, str]]] = {"Arguments": []}
        for param in self.get_params(ctx):
            if param.metavar in LAZY_CHOICES:  # listing these needs the library: only when help is shown
                param.metavar = "<" + "|".join(LAZY_CHOICES[param.metavar].choice_list() or ()) + ">"
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                sections["Arguments"].append((self._argument_name(param), record[1]))
            else:
                sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        sections["Options"] = sections.pop("Options", [])  # the general options after the panels
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


class RootGroup(TyperGroup):
    """The `tsenor` group: its -q/-v/--debug may also follow the command name (`tsenor prune -q ...`),
    where they are moved in front of it before parsing (up to a `--`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        flags = [a for a in args[:end] if a in ROOT_FLAGS]
        args = [*flags, *(a for a in args[:end] if a not in ROOT_FLAGS), *args[end:]]
        return super().parse_args(ctx, args)


app = typer.Typer(
    name="tsenor",
    cls=RootGroup,
    help="Prune decoder language models to transposable N:M sparsity with the TSENOR mask solver.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: flags without a `<bool>` metavar, required options marked, no box drawing.
    rich_markup_mode=None,
)


@dataclass
class CliState:
    """What the root options decide for one invocation; `main` owns it to format errors."""

    debug: bool
    argv: list[str] | None = None  # the arguments after the program name, when `main` was given them


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tsenor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks (default: $TSENOR_DEBUG)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also log inner detail (ADMM iterations)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log warnings only (no progress lines)."),
) -> None:
    """Prune decoder language models to transposable N:M sparsity with the TSENOR mask solver."""
    if ctx.obj is None:  # invoked without `main` (tests, or app() embedded elsewhere)
        ctx.obj = CliState(debug=settings.debug_default())
    ctx.obj.debug = ctx.obj.debug or debug
    if verbose and quiet:
        raise typer.BadParameter("pass at most one of --verbose and --quiet")
    configure_logging(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
    if quiet:
        quiet_libraries()


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


def launch_arguments(ctx: typer.Context) -> list[str]:
    """The arguments this invocation was given after the program name (to start it again elsewhere)."""
    state = ctx.find_root().obj
    if isinstance(state, CliState) and state.argv is not None:
        return list(state.argv)
    return sys.argv[1:]


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
