"""Reading the YAML files a user hands us (prune recipes, sweep files): one loader and one place for the
two errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tsenor_cli.errors import InputNotFoundError, UsageError

_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    """`yaml.safe_load`'s YAML 1.1 less its base-60 numbers: `nm: 2:4` is the text "2:4", as YAML 1.2 reads
    it, where YAML 1.1 reads 124 (and `16:32` 992), so an N:M pattern needs no quotes in a recipe."""


# The resolvers of every other tag as they are; int and float again without their `[0-9]+(:[0-5]?[0-9])+` form.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """The YAML document `text` as our files are read (`_Loader`: no base-60 numbers); errors are yaml's."""
    return yaml.load(text, Loader=_Loader)


def read_yaml(path: Path, what: str, example: str) -> Any:
    """The parsed content of the YAML file `path` (None for an empty file).

    what names the file in errors ("--config recipe.yaml", "sweep file s.yaml"); example is a file the
    user could pass instead. A missing file is `InputNotFoundError`, malformed YAML `UsageError`.
    """
    if path.is_dir():
        raise UsageError(f"{what} is a folder; pass a YAML file such as {example}")
    if not path.is_file():
        raise InputNotFoundError(f"{what} does not exist; pass a YAML file such as {example}")
    try:
        return load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"{what} is not valid YAML ({exc}); fix the file") from exc
