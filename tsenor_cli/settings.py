"""Project settings read from the environment, in one place (no hidden globals elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "TSENOR_DATA_DIR"
CACHE_DIR_ENV = "TSENOR_CACHE_DIR"
DEBUG_ENV = "TSENOR_DEBUG"


def data_dir() -> Path | None:
    """The offline data folder (layout of ``../shared/data``) or None when unset."""
    value = os.environ.get(DATA_DIR_ENV)
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    """Where materialized models live: $TSENOR_CACHE_DIR, else $XDG_CACHE_HOME/tsenor, else ~/.cache/tsenor."""
    value = os.environ.get(CACHE_DIR_ENV)
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tsenor"


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "False")


def hub_offline() -> bool:
    """True when the user told the HF libraries not to reach the hub."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(v, "") not in ("", "0") for v in names)
