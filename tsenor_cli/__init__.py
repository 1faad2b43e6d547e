"""tsenor: prune LLaMA-family models to transposable N:M sparsity with the TSENOR mask solver.

`from tsenor_cli import prune, evaluate, load`: the Python API (`tsenor_cli/api.py`, docs/guide/python-api.md),
imported when first used (PEP 562) so that `import tsenor_cli` and `tsenor --help` load no torch. Importing
the package also makes the packed format known to transformers the moment transformers loads its quantizers:
`models/packed.py` registers it when imported, and a hook here imports it right after them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tsenor_cli.api import evaluate as evaluate
    from tsenor_cli.api import prune as prune

from tsenor_cli.version import __version__

__all__ = ["__version__", "evaluate", "load", "prune"]


def __getattr__(name: str) -> Any:
    if name in ("prune", "evaluate"):
        from tsenor_cli import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# transformers' module whose import makes its quantizers known: the packed format registers with it then.
_QUANTIZERS = "transformers.quantizers.auto"
# The module that registers the packed format when imported.
_PACKED = "tsenor_cli.models.packed"


def load(folder: Any, **kwargs: Any) -> Any:
    """The model of a tsenor checkpoint folder, packed or dense, with the class its config names
    (`models.packed.load`); kwargs go to ``from_pretrained``."""
    from tsenor_cli.models.packed import load as load_folder

    return load_folder(folder, **kwargs)


class _RegisterPacked(importlib.abc.MetaPathFinder):
    """Registers the packed format with transformers when its quantizers module is first imported, so that
    `import tsenor_cli` stays light (no torch, no transformers) and `from_pretrained` still finds the format."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _QUANTIZERS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None:
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            # Importing registers. When that module's own import is what brought the quantizers in (as
            # `load` does in a fresh process), this returns it half made and it registers at its end.
            importlib.import_module(_PACKED)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _QUANTIZERS in sys.modules:
    importlib.import_module(_PACKED)
elif not any(isinstance(finder, _RegisterPacked) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterPacked())
