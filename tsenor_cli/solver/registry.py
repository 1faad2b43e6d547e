"""The registry of transposable mask methods; the CLI's `--solver` choices come from here."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import torch

from tsenor_cli.solver.types import BlockSolution

# Block solvers: fn(blocks (B, M, M), n, *, init=None, **options) -> BlockSolution (see types.BlockSolver);
# a TypeVar keeps each solver's own typed keyword options visible to the type checker.
F = TypeVar("F", bound=Callable[..., BlockSolution])
# A method that picks another registered method for the scores' device, M and number of scores (None
# when the caller plans without a matrix: a whole weight matrix's solve is assumed) (`auto`).
Chooser = Callable[[torch.device, int, "int | None"], str]


@dataclass(frozen=True)
class MethodInfo:
    name: str
    fn: Callable[..., BlockSolution]
    description: str
    exact: bool  # provably optimal on every block
    supports_init: bool  # uses a warm start (`init=`)
    max_m: int | None = None  # largest M the method accepts, None for any
    options: tuple[str, ...] = ()  # the keyword options `fn` takes besides `init`
    choose: Chooser | None = None  # set for a method that runs another one (see `resolve_method`)
    # Loads what the method's first solve on scores of a dtype loads (compiled kernels), so that a plan
    # measures the process with them (`plan.plan_prune`); None: nothing beyond its module.
    prepare: Callable[[torch.dtype], None] | None = None


METHODS: dict[str, MethodInfo] = {}


def _keyword_options(fn: Callable[..., BlockSolution], record: type | None) -> tuple[str, ...]:
    """The option names of a method: the fields of its options record (`record`, a dataclass whose fields
    `fn` takes as keywords), else `fn`'s keyword-only parameters."""
    if record is not None:
        return tuple(field.name for field in fields(record))
    params = inspect.signature(fn).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "init")


def register(
    name: str,
    description: str,
    *,
    exact: bool = False,
    supports_init: bool = False,
    max_m: int | None = None,
    choose: Chooser | None = None,
    options: type | None = None,
    prepare: Callable[[torch.dtype], None] | None = None,
) -> Callable[[F], F]:
    """Register the block solver `fn` under `name`; `options`: the dataclass of its keyword options, for a
    method that takes them as `**options` (`tsenor.TsenorOptions`); `prepare`: `MethodInfo.prepare`."""

    def wrap(fn: F) -> F:
        if name in METHODS:
            raise RuntimeError(f"mask method {name!r} registered twice")
        METHODS[name] = MethodInfo(
            name,
            fn,
            description,
            exact,
            supports_init,
            max_m,
            options=_keyword_options(fn, options),
            choose=choose,
            prepare=prepare,
        )
        return fn

    return wrap


def get_method(name: str) -> MethodInfo:
    try:
        return METHODS[name]
    except KeyError:
        known = ", ".join(sorted(METHODS))
        raise ValueError(f"unknown mask method {name!r}; choose one of: {known}") from None


def resolve_method(name: str, device: torch.device, m: int, scores: int | None = None) -> MethodInfo:
    """The method that runs when `name` is asked for on `scores` scores (None: a whole weight matrix's,
    as a plan assumes) on `device` with tiles of side `m`: the method itself, or for a choosing method
    (`auto`) the one it picks there."""
    info = get_method(name)
    if info.choose is None:
        return info
    return get_method(info.choose(device, m, scores))
