"""The sparsity pattern, parsed once from strings like ``"16:32"``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tsenor_cli.errors import UsageError

_NM_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class NMPattern:
    """Keep `n` of every `m`; transposable means every M×M tile has exactly n per row and column."""

    n: int
    m: int
    transposable: bool = True

    def __post_init__(self) -> None:
        if self.m < 2:
            raise UsageError(f"N:M pattern {self.n}:{self.m} has M < 2; use M >= 2, e.g. 2:4 or 16:32")
        if not 1 <= self.n < self.m:
            raise UsageError(f"N:M pattern {self.n}:{self.m} needs 1 <= N < M; use e.g. {self.m // 2}:{self.m}")

    @property
    def sparsity(self) -> float:
        """Fraction of weights set to zero."""
        return 1.0 - self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


def parse_nm(text: str, *, transposable: bool = True) -> NMPattern:
    """Parse ``"N:M"`` into an `NMPattern`; a malformed string raises `UsageError` naming the fix."""
    match = _NM_RE.match(text)
    if match is None:
        raise UsageError(f"cannot parse N:M pattern {text!r}; write it as N:M with integers, e.g. 16:32")
    return NMPattern(int(match.group(1)), int(match.group(2)), transposable)
