"""Layer-wise pruning: methods (statistics + a pure `prune`), the block-by-block engine, and the API.

Each method module holds a pure `prune(weight, stats, cfg) -> PruneOutcome`; `PRUNERS` maps the
`--method` names to them. `tsenor_cli.pruning.api.prune_model` runs a whole model.
"""

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.registry import PRUNERS, PrunerSpec, get_pruner
from tsenor_cli.pruning.stats import InputStats, reconstruction_error
from tsenor_cli.pruning.types import LayerPruneConfig, MaskSolveInfo, PruneOutcome

__all__ = [
    "PRUNERS",
    "InputStats",
    "LayerPruneConfig",
    "MaskSolveInfo",
    "PruneOutcome",
    "PrunerSpec",
    "SparsityPattern",
    "get_pruner",
    "reconstruction_error",
]
