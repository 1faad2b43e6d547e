"""What every run file and sweep file shares: the reading helpers that check each field against its
annotation (`SchemaError` naming the file and the field), the current `SCHEMA_VERSION`, the data-source
and context records, and JSON reading with one-line errors."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin, get_type_hints

from tsenor_cli.errors import SchemaError as SchemaError

if TYPE_CHECKING:
    from tsenor_cli.settings import RunContext

SCHEMA_VERSION = 3
# "none": no data was read (a method that needs none: `data.calibration.stand_in_batches`).
DataKind = Literal["offline", "file", "hub", "none"]
TaskSource = Literal["hub", "offline"]


# ---------------------------------------------------------------- reading helpers


def _type_name(hint: Any) -> str:
    if get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(hint))
    if get_origin(hint) is Literal:
        return " or ".join(repr(a) for a in get_args(hint))
    if hint is type(None):
        return "null"
    origin = get_origin(hint) or hint
    return getattr(origin, "__name__", str(hint))


def _typed(value: Any, hint: Any, key: str, where: str) -> Any:
    """`value` checked against the annotation `hint` (JSON scalars, unions, Literal, dict); ints are
    accepted where floats are expected, booleans never as numbers."""
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(hint):
            return None
        for option in get_args(hint):
            if option is type(None):
                continue
            try:
                return _typed(value, option, key, where)
            except SchemaError:
                continue
        raise SchemaError(f"{where}: field {key!r} must be {_type_name(hint)}, got {value!r}")
    if origin is Literal:
        if isinstance(value, str) and value in get_args(hint):
            return value
        raise SchemaError(f"{where}: field {key!r} is {value!r}, expected {_type_name(hint)}")
    if hint is Any:
        return value
    kind = origin or hint
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if value is None:
        raise SchemaError(f"{where}: field {key!r} is null, expected {_type_name(hint)}")
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise SchemaError(f"{where}: field {key!r} must be {_type_name(hint)}, got {type(value).__name__}")
    return value


def _read(cls: type, obj: Mapping[str, Any], where: str, **given: Any) -> dict[str, Any]:
    """Keyword arguments for dataclass `cls` from the JSON object `obj`: `given` as is, every other
    field read under its own name and checked against its annotation; a field with a default may be
    absent (v2-only fields)."""
    hints = get_type_hints(cls)
    values = dict(given)
    for f in fields(cls):
        if f.name in given:
            continue
        if f.name not in obj:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise SchemaError(f"{where}: missing field {f.name!r}")
        values[f.name] = _typed(obj[f.name], hints[f.name], f.name, where)
    return values


def _field(obj: Mapping[str, Any], key: str, hint: Any, where: str) -> Any:
    """obj[key] checked against `hint`; a missing key is an error."""
    if key not in obj:
        raise SchemaError(f"{where}: missing field {key!r}")
    return _typed(obj[key], hint, key, where)


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _version(obj: Mapping[str, Any], where: str) -> int:
    version = obj.get("schema_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise SchemaError(
            f"{where}: schema_version {version!r} is not one this tsenor reads (1 to {SCHEMA_VERSION}); "
            "upgrade tsenor or re-create the run"
        )
    return version


def _flat_json(record: Any) -> dict[str, Any]:
    return {f.name: getattr(record, f.name) for f in fields(record)}


# ---------------------------------------------------------------- shared records


@dataclass(frozen=True)
class DataFile:
    """One file a dataset was read from, with the sha256 of its bytes."""

    path: str
    sha256: str


@dataclass(frozen=True)
class DataSource:
    """Where one dataset came from.

    kind: "offline" (the data folder), "file" (a user file), "hub" (the HF hub) or "none" (no data was read:
    a method that needs none).
    files: the files read, for offline and file sources (empty when a v1 file did not record them).
    hub: the hub dataset, e.g. "allenai/c4 split=train file=en/c4-train.00000-of-01024.json.gz".
    """

    kind: DataKind
    files: tuple[DataFile, ...] = ()
    hub: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "files": [_flat_json(f) for f in self.files], "hub": self.hub}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> DataSource:
        obj = _object(obj, where)
        raw_files = _field(obj, "files", list, where)
        files = tuple(
            DataFile(**_read(DataFile, _object(f, where), f"{where}: files[{i}]")) for i, f in enumerate(raw_files)
        )
        return cls(**_read(cls, obj, where, files=files))


@dataclass(frozen=True)
class ContextRecord:
    """The run's inputs that are not results settings: the data folder and the hub policy (settings.RunContext)."""

    data_dir: str | None
    offline: bool

    @classmethod
    def of(cls, ctx: RunContext) -> ContextRecord:
        return cls(data_dir=str(ctx.data_dir) if ctx.data_dir is not None else None, offline=ctx.offline)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> ContextRecord:
        return cls(**_read(cls, _object(obj, where), where))


def _optional(obj: Mapping[str, Any], key: str, reader: Any, where: str) -> Any:
    value = obj.get(key)
    return None if value is None else reader(value, f"{where}: {key}")


def read_json(path: Path) -> Mapping[str, Any]:
    """A run file's JSON object; not JSON or not an object → SchemaError naming the file."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); re-create the run") from exc
    if not isinstance(obj, dict):
        raise SchemaError(f"{path} holds a JSON {type(obj).__name__}, expected an object; re-create the run")
    return obj


def read_json_file(path: Path) -> Mapping[str, Any] | None:
    """A small state file's JSON object, None when the file does not exist."""
    return read_json(path) if path.is_file() else None
