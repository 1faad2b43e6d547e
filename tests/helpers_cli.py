"""Running the `tsenor` app in-process in tests, with the exit code the console script would give."""

from __future__ import annotations

from typer.testing import CliRunner, Result

from tsenor_cli.cli import app
from tsenor_cli.errors import TsenorError


def invoke(args: list[str]) -> Result:
    """`tsenor ARGS` through typer's CliRunner → its Result, whose exit_code is what `main` (the console
    script) exits with: a known error's own code, where CliRunner reports 1 for any exception."""
    result = CliRunner().invoke(app, args)
    if isinstance(result.exception, TsenorError):
        result.exit_code = result.exception.exit_code
    return result
