"""A pruning method declared outside tsenor_cli, as a plug-in would be (tests/test_method_plugins.py): one
module ending in one `PrunerSpec`, with typed options (a number, a bool, a choice)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tsenor_cli.pruning.methods.method import MethodOptions, PrunerSpec, option, top_scores_workspace

if TYPE_CHECKING:
    import torch

    from tsenor_cli.pruning.methods.stats import Statistics
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig, PruneOutcome


@dataclass(frozen=True)
class ToyOptions(MethodOptions):
    power: float = option(1.0, "Score |W| to this power.", minimum=0)
    smallest: bool = option(False, "Keep the smallest scores instead of the largest.")
    scope: str = option("matrix", "Unstructured comparison group.", choices=("row", "matrix"))


def prune_batch(
    weights: torch.Tensor, stats: Statistics | None, cfg: MatrixPruneConfig, *, parts: Sequence[int] | None = None
) -> list[PruneOutcome]:
    """Keep the largest |W|^power (the smallest with `smallest`): magnitude pruning by default."""
    import torch

    from tsenor_cli.pruning.methods.masks import keep_top_scores

    opts = cfg.method_options(ToyOptions)
    w = weights.to(torch.float32)
    scores = w.abs() ** opts.power
    if opts.smallest:
        scores = 1.0 / (scores + 1e-12)
    scope = "row" if opts.scope == "row" else "matrix"
    return keep_top_scores(w, scores, cfg, unstructured_scope=scope, parts=parts)


TOY = PrunerSpec(
    "toy",
    "keep the largest |W|^power (a test's method)",
    prune_batch,
    needs_data=False,
    options=ToyOptions,
    workspace=top_scores_workspace,
    fuses_rows=True,
)
NOT_A_METHOD = 42
