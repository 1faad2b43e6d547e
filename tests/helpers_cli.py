"""Running the `tsenor` app in-process in tests, with the exit code the console script would give."""

from __future__ import annotations

import sys
from unittest import mock

from typer.testing import CliRunner, Result

from tsenor_cli.cli import app
from tsenor_cli.errors import TsenorError


def invoke(args: list[str]) -> Result:
    """`tsenor ARGS` through typer's CliRunner → its Result, whose exit_code is what `main` (the console
    script) exits with: a known error's own code, where CliRunner reports 1 for any exception. The process's
    command line is the console script's (`tsenor ARGS`) while it runs, so that what a run records of it
    (`cli.app.command_line`) and compares on a rerun is these arguments, not pytest's."""
    argv = ["tsenor", *args]
    with mock.patch.object(sys, "argv", argv), mock.patch.object(sys, "orig_argv", [sys.executable, *argv]):
        result = CliRunner().invoke(app, args)
    if isinstance(result.exception, TsenorError):
        result.exit_code = result.exception.exit_code
    return result
