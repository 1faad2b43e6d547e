"""Replaying one decoder block on hidden states: `block_output` for one call, `run_block` for a batch of
samples one at a time, and `forwards_replaced` to swap every block's forward for a stand-in while the
model's own forward runs (the capture's recorders, the streamed evaluation's replayed outputs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from tsenor_cli.replay.calls import BlockCall


def block_output(block: nn.Module, call: BlockCall, hidden: torch.Tensor) -> torch.Tensor:
    """hidden: (B, T, H) → the block's output hidden states (B, T, H); `hidden` itself for an idle block."""
    if call.idle:
        return hidden
    args, kwargs = call.bind(hidden)
    result = block(*args, **kwargs)
    return result[0] if isinstance(result, tuple) else result


@torch.no_grad()
def run_block(
    block: nn.Module,
    inputs: torch.Tensor,
    call: BlockCall,
    out: torch.Tensor | None,
    device: torch.device | None = None,
) -> None:
    """inputs: (S, T, H) → the block's outputs written into `out` (S, T, H), or discarded when None.

    One sample per call: the recorded arguments (masks, rotary) are for batch 1, and peak memory stays small.
    device: where the block computes; `inputs` and `out` may live elsewhere (the CPU with
    --offload-activations), each sample then travels to `device` and back (None: where `inputs` are).
    """
    for j in range(inputs.shape[0]):
        sample = inputs[j : j + 1] if device is None else inputs[j : j + 1].to(device)
        hidden = block_output(block, call, sample)
        if out is not None:
            out[j : j + 1] = hidden


def input_key(x: torch.Tensor) -> tuple[Any, ...]:
    """The identity of a tensor's view of memory: the same storage, offset, shape, strides and dtype."""
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device)


@contextlib.contextmanager
def forwards_replaced(
    modules: Iterable[nn.Module], stand_in: Callable[[int, Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Within the `with`, block i's forward is stand_in(i, its real forward).

    The stand-ins go into the instance's __dict__, where they shadow the class's forward (hooks and
    nn.Module.__call__ are unchanged); whatever was there before is put back."""
    blocks = list(modules)
    previous = [vars(block).get("forward") for block in blocks]
    try:
        for index, block in enumerate(blocks):
            vars(block)["forward"] = stand_in(index, block.forward)
        yield
    finally:
        for block, before in zip(blocks, previous, strict=True):
            if before is None:
                vars(block).pop("forward", None)
            else:
                vars(block)["forward"] = before
