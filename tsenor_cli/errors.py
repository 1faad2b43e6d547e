"""Known errors: each carries a one-line message that names the problem and the fix.

The CLI maps every `TsenorError` to that line and a non-zero exit code; tracebacks are shown only
with `TSENOR_DEBUG=1`.
"""

from __future__ import annotations

DEBUG_HINT = "run with TSENOR_DEBUG=1 for the traceback"


def one_line(text: str) -> str:
    """`text` with its lines joined by spaces: an error is always one line on stderr."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


class TsenorError(Exception):
    """Base class of the errors a user can fix; `exit_code` is what the CLI exits with."""

    exit_code: int = 2


class UsageError(TsenorError, ValueError):
    """A bad option value or combination (exit 2)."""

    exit_code = 2


class SchemaError(UsageError):
    """A run file that is not valid JSON or lacks a required field (exit 2)."""


class InputNotFoundError(TsenorError, FileNotFoundError):
    """A model, data file or run directory that does not exist or cannot be fetched (exit 3)."""

    exit_code = 3


class OutputExistsError(TsenorError, FileExistsError):
    """An output that already exists and would be overwritten without --force (exit 4)."""

    exit_code = 4


class IncompatibleModelError(TsenorError, ValueError):
    """A model whose architecture or layer shapes cannot take the requested pattern (exit 5)."""

    exit_code = 5


class DoesNotFitError(UsageError):
    """The run's memory estimate exceeds the machine's (`pruning/block/memory.check_fits`): the message names the
    flags that would make it fit. Exit 5, as a model that does not fit the pattern: the options are
    valid, the run cannot happen as asked."""

    exit_code = 5


class VerificationError(TsenorError):
    """A checkpoint whose weights violate the recorded sparsity pattern (exit 6)."""

    exit_code = 6


class BadInputError(TsenorError, ValueError):
    """An input whose contents are unusable: non-finite weights, a truncated or corrupt weight file (exit 7)."""

    exit_code = 7


class CheckpointMismatchError(BadInputError):
    """A checkpoint whose weights disagree with its config.json: tensors missing or of another shape,
    extra blocks (`models/conformance.py`; exit 7, as a corrupt weight file)."""


class PackedFormatError(UsageError):
    """A packed checkpoint (docs/reference/packed-format.md) that is not one tsenor can read: an unknown format
    version, a truncated or corrupt file, a mask that breaks its recorded pattern; or weights that cannot be
    packed under their recorded pattern (exit 2)."""


class OutputBusyError(TsenorError):
    """An --output folder locked by another running tsenor process (exit 4)."""

    exit_code = 4


class OutputUnwritableError(TsenorError):
    """An --output location that cannot be created or written, or lacks the space for the run (exit 4)."""

    exit_code = 4


class ResumeStateError(TsenorError):
    """A resume state that is damaged or belongs to other settings; --force starts over (exit 4)."""

    exit_code = 4


EXIT_RESUMABLE = 75  # sysexits EX_TEMPFAIL: stopped by SIGTERM/SIGUSR1/SIGUSR2; the same command continues
EXIT_SIGINT = 130  # the shell's code for a run stopped by Ctrl-C (128 + SIGINT)


class Interrupted(TsenorError):
    """A run stopped by a signal; the message says what was saved and how to continue.

    exit_code: EXIT_RESUMABLE after SIGTERM/SIGUSR1/SIGUSR2 (a scheduler's stop), EXIT_SIGINT after Ctrl-C.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class PeerError(TsenorError):
    """Raised on the ranks of a distributed run when one rank failed: carries that rank's line and exit
    code, so every rank stops with the same code and rank 0 alone prints the line (the others are quiet)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
