"""The `tsenor` app and what every command module takes from it: the command class, the root options, the
run context and the command line. The command modules import this module; `cli/__init__.py` imports them
(to register their commands) and this one, so no command module imports the package that imports it."""

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

from tsenor_cli import settings
from tsenor_cli.progress import configure_logging, quiet_libraries
from tsenor_cli.settings import RunContext
from tsenor_cli.version import __version__

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


def launch_arguments(ctx: typer.Context) -> list[str]:
    """The arguments this invocation was given after the program name (to start it again elsewhere)."""
    state = ctx.find_root().obj
    if isinstance(state, CliState) and state.argv is not None:
        return list(state.argv)
    return sys.argv[1:]
