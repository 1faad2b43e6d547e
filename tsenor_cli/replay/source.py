"""Where each decoder block's weights are when a block-by-block pass needs them: `BlockSource`.

One object for pruning (the capture, the watch, the block loop), the streamed evaluation and
refinement, under one of three policies:

- ``resident``: the blocks are already where they compute (a whole model on the device); `load` gives
  the block as it is, `park` and `release` do nothing;
- ``offloaded``: the whole model is held on the CPU and each block visits the device (`load` moves it
  there, `park` back to the CPU; on a CPU run both are no-ops);
- ``streamed``: the blocks stay on the meta device (`models.loading.load_model(stream=True)`) and `load`
  reads one from the checkpoint onto the device (`models.streaming.load_block`); `park` brings it to
  the CPU (where the resume state and the output's block files are written from) and `release` puts its
  parameters back on the meta device. Host memory then holds what lies outside the blocks and one block,
  whatever the model's depth (docs/guide/large-models.md).

`checked(block, index)`, when given, runs on every block read from the checkpoint before it is used
(pruning refuses NaN/Inf weights there, `pruning/block/finite.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.models.streaming import load_block, release_block
from tsenor_cli.models.structure import ModelStructure

CPU = torch.device("cpu")


class BlockSource:
    """The blocks of `structure`, one at a time on `device` (module docstring): streamed from `checkpoint`
    when one is given, else held whole (`offloaded`: True when they are held on the CPU and visit the device)."""

    def __init__(
        self,
        structure: ModelStructure,
        device: torch.device,
        *,
        checkpoint: Checkpoint | None = None,
        offloaded: bool = True,
        checked: Callable[[nn.Module, int], None] | None = None,
    ) -> None:
        self.structure = structure
        self.device = device
        self.checkpoint = checkpoint
        self.checked = checked
        self.policy = "streamed" if checkpoint is not None else "offloaded" if offloaded else "resident"

    @property
    def streamed(self) -> bool:
        return self.checkpoint is not None

    def load(self, index: int, to: torch.device | None = None) -> nn.Module:
        """Block `index` with its weights on `to` (default: the source's device; the capture runs block 0
        where the rest of the model is): read from the checkpoint when streamed."""
        target = self.device if to is None else to
        if self.checkpoint is not None:
            block = load_block(self.structure, index, self.checkpoint, CPU)
            if self.checked is not None:
                self.checked(block, index)
            return block.to(target)
        block = self.structure.blocks[index]
        return block.to(target) if self.policy == "offloaded" else block

    def park(self, index: int) -> nn.Module:
        """Block `index` back on the CPU (nothing for a resident source); its weights stay until `release`."""
        block = self.structure.blocks[index]
        return block if self.policy == "resident" else block.to(CPU)

    def release(self, index: int) -> None:
        """Free block `index`'s weights when streamed (nothing otherwise)."""
        if self.checkpoint is not None:
            release_block(self.structure, index)

    @contextlib.contextmanager
    def resident(self, index: int, to: torch.device | None = None) -> Iterator[nn.Module]:
        """Block `index` with its dense weights on `to` (`load`) for the body of the `with`, parked and
        released after."""
        block = self.load(index, to)
        try:
            yield block
        finally:
            self.park(index)
            self.release(index)
