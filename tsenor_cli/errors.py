"""Known errors: each carries a one-line message that names the problem and the fix.

The CLI maps every `TsenorError` to that line and a non-zero exit code; tracebacks are shown only
with `TSENOR_DEBUG=1`.
"""

from __future__ import annotations


class TsenorError(Exception):
    """Base class of the errors a user can fix; `exit_code` is what the CLI exits with."""

    exit_code: int = 2


class UsageError(TsenorError, ValueError):
    """A bad option value or combination (exit 2)."""

    exit_code = 2


class InputNotFoundError(TsenorError, FileNotFoundError):
    """A model, data file or run directory that does not exist or cannot be fetched (exit 3)."""

    exit_code = 3


class OutputExistsError(TsenorError, FileExistsError):
    """An output that already exists and would be overwritten without --force (exit 4)."""

    exit_code = 4


class IncompatibleModelError(TsenorError, ValueError):
    """A model whose architecture or layer shapes cannot take the requested pattern (exit 5)."""

    exit_code = 5


class VerificationError(TsenorError):
    """A checkpoint whose weights violate the recorded sparsity pattern (exit 6)."""

    exit_code = 6


class BadInputError(TsenorError, ValueError):
    """An input whose contents are unusable: non-finite weights, a truncated or corrupt weight file (exit 7)."""

    exit_code = 7
