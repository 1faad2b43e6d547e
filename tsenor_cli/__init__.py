"""tsenor: prune LLaMA-family models to transposable N:M sparsity with the TSENOR mask solver.

`from tsenor_cli import prune, evaluate`: the Python API (`tsenor_cli/api.py`, docs/guide/python-api.md),
imported when first used (PEP 562) so that `import tsenor_cli` and `tsenor --help` load no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tsenor_cli.api import evaluate as evaluate
    from tsenor_cli.api import prune as prune

from tsenor_cli.version import __version__

__all__ = ["__version__", "evaluate", "prune"]


def __getattr__(name: str) -> Any:
    if name in ("prune", "evaluate"):
        from tsenor_cli import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
