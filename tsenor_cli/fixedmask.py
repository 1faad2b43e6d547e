"""The fixed sparsity mask of a training run: pruned weights held at exactly 0.

`FixedMask` keeps every pruned weight at 0 in two ways: a gradient hook zeroes the gradient at pruned
positions as it is produced (before it is accumulated, all-reduced, clipped or seen by the optimizer),
and `apply` writes the mask into the weights again after every step, which also covers what a zero
gradient does not (weight decay on a non-zero value, other update rules). Used by `tsenor finetune`
(`finetune/callback.MaskCallback`) and by `tsenor prune --refine block` (`pruning/block/refine.py`); a module
of its own so that neither package imports the other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FixedMask:
    """The pruned weights of a model and their masks (True = pruned).

    masks: {parameter name in `model`: its mask} (a module's weight, or a stack of experts whole; a decoder
    block's parameters for `tsenor prune --refine`, the model's for `tsenor finetune`)."""

    def __init__(self, model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
        self.weights = [model.get_parameter(name) for name in masks]
        self.pruned = [mask.to(weight.device) for mask, weight in zip(masks.values(), self.weights, strict=True)]
        self.names = tuple(masks)
        self._hooks: list[Any] = []

    def apply(self) -> None:
        """Write the mask into the weights (exact zeros; masked_fill, so a NaN cannot survive as NaN·0)."""
        with torch.no_grad():
            for weight, pruned in zip(self.weights, self.pruned, strict=True):
                weight.masked_fill_(pruned, 0.0)

    def attach(self) -> None:
        """Zero the gradient at pruned positions as it is produced (before accumulation into .grad)."""
        self.detach()
        for weight, pruned in zip(self.weights, self.pruned, strict=True):
            self._hooks.append(weight.register_hook(lambda grad, pruned=pruned: grad.masked_fill(pruned, 0.0)))

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def nonzero_pruned(self) -> int:
        """How many pruned positions hold a non-zero weight (0 unless something bypassed the mask)."""
        return sum(
            int(weight.detach()[pruned].count_nonzero())
            for weight, pruned in zip(self.weights, self.pruned, strict=True)
        )
