"""One declaration per setting: the `Field` type that a setting's table row is written in.

A command's settings are one tuple of `Field`s (`pruning/settings/table.PRUNE_FIELDS`,
`finetune/config.FINETUNE_FIELDS`). Everything else is derived from it: the recipe keys and their
types, the defaults (the config dataclass's field defaults come from `default_of`), the value checks
run once when the config is built (`check`), and the CLI flags (`cli/options.field_parameters`: flag
name, hidden old aliases, help, panel, shown choices). tests/test_fields.py checks no other copy exists.

This module imports neither torch nor typer: `tsenor --help` reads it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tsenor_cli.errors import UsageError

Choices = tuple[str, ...] | Callable[[], Sequence[str]]


@dataclass(frozen=True)
class Field:
    """One setting.

    name: the recipe key and the config attribute; kind: the type of its value in a recipe (str, int,
    float, bool, list of strings); default: its value when unset (None: unset); help; panel: the group
    it is listed under in `--help`. flag: the CLI flag (default `--name` with `-`); short: its one-letter
    form; negation: a bool's off flag; aliases: old flag names, hidden, accepted for one release;
    positional: the CLI takes it as an argument; choices: the accepted strings (a callable where listing
    them needs the library, read at check and help time only); minimum / positive: numeric range;
    metavar: what help shows for the value (default: the choices); result: whether it decides the
    output's weights (part of the resume key); check: a further check of the value (raises UsageError).
    """

    name: str
    kind: type
    default: Any
    help: str
    panel: str
    flag: str | None = None
    short: str | None = None
    negation: str | None = None
    aliases: tuple[str, ...] = ()
    positional: bool = False
    choices: Choices | None = None
    minimum: float | None = None
    positive: bool = False
    metavar: str | None = None
    result: bool = True
    check: Callable[[Any], None] | None = None

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def choice_list(self) -> tuple[str, ...] | None:
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def coerce(self, value: Any, where: str) -> Any:
        """A recipe value → the value of this setting's kind, or one UsageError line. Ints are accepted
        where a float is wanted, and so is text that reads as a number (YAML reads `1e-3` as a string);
        bools are never numbers."""
        if value is None and self.default is None:
            return None
        if self.kind is list:
            if isinstance(value, str):
                return [value]
            if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
                return list(value)
            raise UsageError(
                f"{where}: {self.name} must be a pattern string or a list of them (e.g. ['*.mlp.down_proj']), "
                f"got {value!r}"
            )
        if self.kind is float and not isinstance(value, bool):
            if isinstance(value, int):
                return float(value)
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        ok = isinstance(value, self.kind) and not (self.kind in (int, float) and isinstance(value, bool))
        if not ok:
            raise UsageError(f"{where}: {self.name} must be a {self.kind.__name__}, got {value!r}")
        return value

    def validate(self, value: Any) -> None:
        """The value's own checks (choices, range, `check`): one UsageError line naming the flag."""
        if value is None:
            return
        flag = self.cli_flag
        choices = self.choice_list()
        if choices is not None and value not in choices:
            raise UsageError(f"unknown {flag} {value!r}; choose one of: {', '.join(choices)}")
        if self.kind in (int, float) and not isinstance(value, bool):
            default = "" if self.default is None else f" (default {self.default})"
            if self.minimum is not None and value < self.minimum:
                raise UsageError(f"{flag} {value} must be >= {self.minimum:g}; pass {self.minimum:g} or more{default}")
            if self.positive and not (math.isfinite(value) and value > 0):
                raise UsageError(f"{flag} {value} must be a positive number; pass one above 0{default}")
        if self.check is not None:
            self.check(value)


def by_name(table: Iterable[Field]) -> dict[str, Field]:
    return {f.name: f for f in table}


def default_of(table: Iterable[Field], name: str) -> Any:
    """A config dataclass field whose default is the table's (`dataclasses.field`, the setting in its
    metadata): the dataclass names the attribute and its type, the table everything else."""
    setting = by_name(table)[name]
    return dataclasses.field(default=setting.default, metadata={"setting": setting})


def validate_settings(config: Any) -> None:
    """Run each table-declared field's checks on a config dataclass (its `__post_init__` calls this)."""
    for item in dataclasses.fields(config):
        setting = item.metadata.get("setting")
        if setting is not None:
            setting.validate(getattr(config, item.name))


def read_mapping(data: Mapping[Any, Any], table: Iterable[Field], where: str) -> dict[str, Any]:
    """A recipe mapping {key: value} (keys may be spelled with `-`) → {name: value} of the table's kinds.

    `where` starts every error message ("--config recipe.yaml", "sweep.yaml base"): unknown keys and
    wrongly typed values are one UsageError line each."""
    known = by_name(table)
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in known:
            raise unknown_key(where, raw_key, known)
        values[key] = known[key].coerce(value, where)
    return values


def unknown_key(where: str, key: Any, known: Iterable[str]) -> UsageError:
    """The one line for a key of a recipe or sweep file that is not one of `known`: the closest known key
    when one is near enough (a typo: 'methd' → 'method'), then every known key."""
    names = list(known)
    near = difflib.get_close_matches(str(key).replace("-", "_"), names, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return UsageError(f"{where}: unknown key {key!r}{hint}; known keys: {', '.join(names)}")
