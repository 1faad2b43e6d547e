"""Reading the YAML files a user hands us (prune recipes, sweep files): one place for the two errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tsenor_cli.errors import InputNotFoundError, UsageError


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
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"{what} is not valid YAML ({exc}); fix the file") from exc
