"""Files written whole or not at all: a temp sibling renamed over the target.

Kept free of heavy imports: the sweep's job process (which only watches its prune and eval
subprocesses) writes its status files with these.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp sibling, then rename it over `path` (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        tmp.chmod(0o644)
        tmp.replace(path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON (indented, newline-terminated) to `path` atomically."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")
