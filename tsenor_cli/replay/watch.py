"""Running blocks under observation: every sample through a block with hooks on some of its modules,
stopped as soon as they have all been seen (`each_module_input`), and one sample through the blocks
in turn, each looked at by a caller's function (`watch_blocks`: the pruning engine's forward watch,
`pruning/block/observe.py`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from tsenor_cli.replay.calls import BlockCall
from tsenor_cli.replay.run import block_output, run_block
from tsenor_cli.replay.source import BlockSource

T = TypeVar("T")


class Seen(Exception):
    """Raised by a hook once everything it waits for in the current sample's forward has been seen: the
    rest of the block's forward cannot change what was seen, so it is abandoned."""


@torch.no_grad()
def each_module_input(
    block: nn.Module,
    modules: Mapping[str, nn.Module],
    inputs: torch.Tensor,
    call: BlockCall,
    device: torch.device,
    stop_early: bool,
    sink: Callable[[str, torch.Tensor], None],
) -> None:
    """inputs: (S, T, H). Call sink(name, input) for each module of `modules` as it runs (its first
    positional argument), sample after sample, each sample moved to `device`. stop_early: abandon a
    sample's forward once every module has run (`Seen`); a module that never runs is an error (it would
    be pruned from empty statistics)."""
    pending: set[str] = set()  # the modules not yet called for the current sample

    def make_hook(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
            sink(name, args[0])
            pending.discard(name)
            if stop_early and not pending:
                raise Seen

        return hook

    handles = [module.register_forward_hook(make_hook(name)) for name, module in modules.items()]
    try:
        for j in range(inputs.shape[0]):  # one sample per call, as in run_block (the arguments are for batch 1)
            pending.update(modules)
            try:
                block_output(block, call, inputs[j : j + 1].to(device))
            except Seen:
                pass
            else:
                if pending:
                    raise RuntimeError(f"{sorted(pending)} never ran in the block's forward")
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def watch_blocks(
    source: BlockSource,
    sample: torch.Tensor,
    calls: Sequence[BlockCall],
    first: int,
    look: Callable[[nn.Module, Callable[[], torch.Tensor]], T],
) -> dict[int, T]:
    """sample: (1, T, H) the input of block `first` → {block: look(block, its forward on its input)} for
    the blocks `first`.. that run, each on the dense output of the one before; each block is read from
    `source` for it and released after (`BlockSource.resident`). An idle block passes its input on."""
    found: dict[int, T] = {}
    hidden = sample.to(source.device)
    for index in range(first, len(source.structure)):
        if calls[index].idle:
            continue
        with source.resident(index) as block:
            call = calls[index].to(source.device)
            found[index] = look(block, functools.partial(block_output, block, call, hidden))
            out = torch.empty_like(hidden)
            run_block(block, hidden, call, out)
            hidden = out
    return found
