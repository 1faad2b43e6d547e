"""The registry of transposable mask methods; the CLI's `--solver` choices come from here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tsenor_cli.solver.types import BlockSolution

# Block solvers: fn(blocks (B, M, M), n, *, init=None, **options) -> BlockSolution (see types.BlockSolver);
# a TypeVar keeps each solver's own typed keyword options visible to the type checker.
F = TypeVar("F", bound=Callable[..., BlockSolution])


@dataclass(frozen=True)
class MethodInfo:
    name: str
    fn: Callable[..., BlockSolution]
    description: str
    exact: bool  # provably optimal on every block
    supports_init: bool  # uses a warm start (`init=`)
    max_m: int | None = None  # largest M the method accepts, None for any


METHODS: dict[str, MethodInfo] = {}


def register(
    name: str,
    description: str,
    *,
    exact: bool = False,
    supports_init: bool = False,
    max_m: int | None = None,
) -> Callable[[F], F]:
    def wrap(fn: F) -> F:
        if name in METHODS:
            raise RuntimeError(f"mask method {name!r} registered twice")
        METHODS[name] = MethodInfo(name, fn, description, exact, supports_init, max_m)
        return fn

    return wrap


def get_method(name: str) -> MethodInfo:
    try:
        return METHODS[name]
    except KeyError:
        known = ", ".join(sorted(METHODS))
        raise ValueError(f"unknown mask method {name!r}; choose one of: {known}") from None
