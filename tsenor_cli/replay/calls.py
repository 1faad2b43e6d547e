"""The calls of a model's decoder blocks, captured once from the model's own forward.

What a block is given is never built here: one forward of the model's own ``forward`` records the
arguments it passes each block (`capture_block_calls`), and a block is then replayed
(`replay.run.block_output`) with the hidden states swapped. Invariant (checked at capture): for a
batch-1 input of length T, every argument of every block other than the hidden states (attention
masks, sliding-window masks, rotary position embeddings, position ids, cache flags) depends only on T,
not on the token values; so one record per calibration shape serves every sample, and only the hidden
states differ between samples.

A block the forward does not run on text (Mllama's cross-attention layers, skipped without image
features) is recorded as such (`BlockCall.idle`): its replay passes the hidden states on
unchanged, as the model's forward does. Its record lends it the arguments the model passes the
running block nearest before it (after it, when none runs before): transformers 5's Mllama text model
calls every decoder layer with the same keywords, so that is what the block would get on text, and
pruning runs the idle block's own forward with them (`BlockCall.running`) to see which of its
matrices the text reaches (`pruning/block/idle.py`).

Used by pruning (`pruning/block/engine.py`), the streamed evaluation (`evaluation/streamed.py`), refinement
and the dry run's probe alike; this package imports nothing from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.replay.run import forwards_replaced

HIDDEN_KEYWORD = "hidden_states"


@dataclass(frozen=True, eq=False)
class BlockCall:
    """What the model's forward passes one decoder block, less the hidden states.

    args: the positional arguments after the hidden states; kwargs: the keyword arguments;
    hidden_keyword: None when the hidden states are the first positional argument, else their keyword.
    idle: True for a block the model's forward skips on this input, an idle block (`BlockCall.empty_idle`,
    `BlockCall.as_idle`): replaying it returns the hidden states unchanged, whatever arguments it carries.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    hidden_keyword: str | None = None
    idle: bool = False

    @staticmethod
    def empty_idle() -> BlockCall:
        """The record of an idle block (one the model's forward did not run), with no arguments."""
        return BlockCall((), {}, None, idle=True)

    def as_idle(self) -> BlockCall:
        """The record of an idle block carrying this running call's arguments (lent to it for its own forward)."""
        return BlockCall(self.args, self.kwargs, self.hidden_keyword, idle=True)

    def as_running(self) -> BlockCall:
        """This call with the block's own forward run on replay, even when the model skips the block."""
        return BlockCall(self.args, self.kwargs, self.hidden_keyword, idle=False)

    @staticmethod
    def split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, BlockCall]:
        """(hidden states, the rest) of one call ``block(*args, **kwargs)``."""
        if args and isinstance(args[0], torch.Tensor):
            return args[0], BlockCall(tuple(args[1:]), dict(kwargs))
        hidden = kwargs.get(HIDDEN_KEYWORD)
        if isinstance(hidden, torch.Tensor):
            rest = {key: value for key, value in kwargs.items() if key != HIDDEN_KEYWORD}
            return hidden, BlockCall(tuple(args), rest, HIDDEN_KEYWORD)
        raise IncompatibleModelError(
            "the model calls its decoder blocks without hidden states (neither a first positional tensor nor "
            f"{HIDDEN_KEYWORD}=); tsenor cannot replay this architecture's blocks"
        )

    def bind(self, hidden: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """hidden: (B, T, H) → the (args, kwargs) of ``block(*args, **kwargs)`` on these hidden states."""
        if self.hidden_keyword is None:
            return (hidden, *self.args), self.kwargs
        return self.args, {**self.kwargs, self.hidden_keyword: hidden}

    def to(self, device: torch.device) -> BlockCall:
        """The same call with its tensors on `device`."""
        return BlockCall(_to_device(self.args, device), _to_device(self.kwargs, device), self.hidden_keyword, self.idle)


@dataclass(frozen=True, eq=False)
class BlockInputs:
    """hidden: (S, T, H) the calibration hidden states entering block 0; calls: per block, on the CPU."""

    hidden: torch.Tensor
    calls: tuple[BlockCall, ...]


class _Captured(Exception):
    """Raised by the pre-hook on block 0 to stop the forward once its input is known."""

    def __init__(self, hidden: torch.Tensor, call: BlockCall) -> None:
        super().__init__("captured")
        self.hidden = hidden
        self.call = call


class _AllRecorded(Exception):
    """Raised by the last block's recorder: the rest of the model's forward is not needed."""


def _to_device(value: Any, device: torch.device) -> Any:
    """Move tensors (also inside tuples/lists/dicts) to `device`; everything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    """Whether two recorded arguments are equal: tensors by shape, dtype and every value; containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return type(a) is type(b) and bool(a == b)


def call_difference(a: BlockCall, b: BlockCall) -> str | None:
    """The first argument in which two calls of a block differ ("attention_mask", "positional argument 1"), or None."""
    if a.idle != b.idle:
        return "decision to run the block at all"
    if a.hidden_keyword != b.hidden_keyword:
        return "hidden-state argument"
    if len(a.args) != len(b.args):
        return "positional arguments"
    for position, (x, y) in enumerate(zip(a.args, b.args, strict=True)):
        if not _same(x, y):
            return f"positional argument {position + 1}"
    for key in sorted(a.kwargs.keys() | b.kwargs.keys()):
        if key not in a.kwargs or key not in b.kwargs or not _same(a.kwargs[key], b.kwargs[key]):
            return key
    return None


def output_like(template: Any, hidden: torch.Tensor) -> Any:
    """A block output shaped like `template` (a tensor, or a tuple led by the hidden states) carrying `hidden`."""
    if isinstance(template, torch.Tensor):
        return hidden
    if isinstance(template, tuple) and template and isinstance(template[0], torch.Tensor):
        return (hidden, *template[1:])
    raise IncompatibleModelError(
        f"decoder blocks return {type(template).__name__}; tsenor needs a tensor or a tuple led by the hidden states"
    )


@torch.no_grad()
def capture_block_calls(
    structure: ModelStructure, seq_len: int, *, tokens: torch.Tensor | None = None, embeds: torch.Tensor | None = None
) -> tuple[BlockCall, ...]:
    """What the model's own forward passes each decoder block for a batch-1 input of `seq_len` tokens.

    tokens: (1, seq_len) long, the probe input; zeros when None (the recorded arguments depend on the
    length only: see the module docstring). embeds: (1, seq_len, H) input embeddings to pass instead of
    tokens (`pruning/plan/probe.py`: the dry run's model has no token embedding to read). Each block's
    forward is swapped, for this one call, for a recorder that returns its input unchanged, so no block
    computes and the record costs the embedding and mask/rotary set-up; block 0's real output, computed
    once, shows the return type the model's loop expects. Returns one BlockCall per block, on the
    model's device; a block the forward never ran gets the arguments of the running block nearest before
    it (after it when none runs before), not to run (`BlockCall.as_idle`; IncompatibleModelError when no
    block ran).
    """
    blocks = structure.blocks
    inputs: dict[str, torch.Tensor]
    if embeds is not None:
        inputs = {"inputs_embeds": embeds}
    else:
        if tokens is None:
            device = next(structure.base.parameters()).device
            tokens = torch.zeros((1, seq_len), dtype=torch.long, device=device)
        if tuple(tokens.shape) != (1, seq_len):
            raise ValueError(f"tokens must be (1, {seq_len}), got shape {tuple(tokens.shape)}")
        inputs = {"input_ids": tokens}
    calls: dict[int, BlockCall] = {}
    template: list[Any] = []

    def recorder(index: int, real_forward: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            hidden, call = BlockCall.split(args, kwargs)
            if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (1, seq_len):
                raise IncompatibleModelError(
                    f"block {index} of {structure.blocks_name} got hidden states of shape "
                    f"{tuple(hidden.shape)}, not (1, {seq_len}, hidden); tsenor needs (batch, tokens, hidden) inputs"
                )
            if index in calls:
                raise IncompatibleModelError(
                    f"block {index} of {structure.blocks_name} runs twice in one forward; tsenor needs each "
                    "decoder block to run once"
                )
            calls[index] = call
            if not template:
                template.append(real_forward(*args, **kwargs))
            if len(calls) == len(blocks):
                raise _AllRecorded
            return output_like(template[0], hidden)

        return forward

    with forwards_replaced(blocks, recorder), contextlib.suppress(_AllRecorded):
        structure.base(**inputs, use_cache=False)
    if not calls:
        raise IncompatibleModelError(
            f"the forward of {type(structure.base).__name__} never ran a block of {structure.blocks_name} on "
            "text-only input; tsenor needs the decoder blocks to run on text"
        )
    return tuple(calls[index] if index in calls else _lender(calls, index).as_idle() for index in range(len(blocks)))


def _lender(calls: dict[int, BlockCall], index: int) -> BlockCall:
    """The call of the running block nearest before block `index`, else the first one after it."""
    before = [i for i in calls if i < index]
    return calls[max(before)] if before else calls[min(calls)]


@torch.no_grad()
def capture_block_inputs(structure: ModelStructure, input_ids: torch.Tensor, device: torch.device) -> BlockInputs:
    """input_ids: (S, T) long → hidden states (S, T, H) entering decoder block 0 (on `device`) and every
    block's other arguments (on the model's device).

    The model's own forward runs up to block 0 (the first block that runs: blocks before it pass the
    hidden states on unchanged), whose pre-hook records its input and stops the forward,
    so whatever the architecture does before the blocks (embedding scale etc.) is kept. The block
    arguments are recorded for a zeros probe and compared with those of the first sample: they must not
    depend on the token values (the module docstring's invariant), else IncompatibleModelError.
    """
    seq_len = int(input_ids.shape[1])
    calls = capture_block_calls(structure, seq_len)
    first = capture_block_calls(structure, seq_len, tokens=input_ids[:1])
    for index, (probe, sample) in enumerate(zip(calls, first, strict=True)):
        differs = call_difference(probe, sample)
        if differs is not None:
            raise IncompatibleModelError(
                f"the {differs} that the model passes block {index} depends on the token values, not only on "
                "the sequence length; tsenor replays one record per calibration shape and cannot prune this model"
            )

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise _Captured(*BlockCall.split(args, kwargs))

    first_running = next(index for index, call in enumerate(calls) if not call.idle)
    handle = structure.blocks[first_running].register_forward_pre_hook(hook, with_kwargs=True)
    captured: list[torch.Tensor] = []
    try:
        for row in input_ids:  # one sample at a time keeps the CPU memory at one sequence
            try:
                structure.base(input_ids=row[None, :], use_cache=False)
            except _Captured as caught:
                captured.append(caught.hidden.to(device))
            else:
                raise RuntimeError(
                    f"decoder block {first_running} was never called; the structure does not match this model"
                )
    finally:
        handle.remove()
    return BlockInputs(torch.cat(captured, 0), calls)  # hidden (S, T, H)
