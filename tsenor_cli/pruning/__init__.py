"""Layer-wise pruning: methods (statistics + a pure `prune`), the block-by-block engine, and the API.

Each method module declares one `PrunerSpec` (`method.py`) with a pure `prune_batch`; `PRUNERS` maps the
built-in `--method` names to them (`registry.get_pruner` also finds installed and `module:NAME` ones).
`tsenor_cli.pruning.run.api.prune_model` runs a whole model.

The names below are imported when first used (PEP 562), so that importing a torch-free module of this
package (`recipe`, `registry`, `method` and the method modules: what `tsenor --help` reads) does not
load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tsenor_cli.pattern import SparsityPattern as SparsityPattern
    from tsenor_cli.pruning.methods.registry import PRUNERS as PRUNERS
    from tsenor_cli.pruning.methods.registry import PrunerSpec as PrunerSpec
    from tsenor_cli.pruning.methods.registry import get_pruner as get_pruner
    from tsenor_cli.pruning.methods.stats import InputStats as InputStats
    from tsenor_cli.pruning.methods.stats import reconstruction_error as reconstruction_error
    from tsenor_cli.pruning.methods.types import MaskSolveInfo as MaskSolveInfo
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig as MatrixPruneConfig
    from tsenor_cli.pruning.methods.types import PruneOutcome as PruneOutcome

_EXPORTS = {
    "PRUNERS": "tsenor_cli.pruning.methods.registry",
    "PrunerSpec": "tsenor_cli.pruning.methods.registry",
    "get_pruner": "tsenor_cli.pruning.methods.registry",
    "InputStats": "tsenor_cli.pruning.methods.stats",
    "reconstruction_error": "tsenor_cli.pruning.methods.stats",
    "MatrixPruneConfig": "tsenor_cli.pruning.methods.types",
    "MaskSolveInfo": "tsenor_cli.pruning.methods.types",
    "PruneOutcome": "tsenor_cli.pruning.methods.types",
    "SparsityPattern": "tsenor_cli.pattern",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
