"""What the dry run knows of a model's weight matrices before any weight is read.

`--dry-run` builds the model on the meta device (shapes, no storage). The nn.Linear layers are known
from the module tree, but the other matrices (fused expert stacks, bare 2D parameters, Conv1D), their
orientation, and the roles of all of them (router, gate, not a matmul weight) are only seen by watching
a forward (`pruning/block/observe.py`), and a forward needs values. So the probe gives real storage, filled
with seeded random values (not the checkpoint's: nothing is read), to

- the language model's modules outside the blocks other than its token embedding (rotary embeddings,
  norms: small), so its forward can run on random input embeddings (``inputs_embeds``) and record what
  it passes each block (`replay.capture_block_calls`), including which blocks never run on text;
- one block of each kind at a time (same class, same parameter names and shapes: LLaMA has one kind,
  DeepSeek-V3 a dense and a MoE kind, Jamba up to four), watched in one forward of `PROBE_TOKENS`
  random hidden states; its observation stands for every block of its kind. Every block of a kind has
  the same parameters used by the same code, so orientation, experts and roles are the same.

Cost: the largest probed block plus the small modules, at the model's dtype, and one forward of a few
tokens per kind; everything goes back to the meta device afterwards. A block whose parameters exceed
`probe_limit` (the smaller of `PROBE_BYTES` and a quarter of the available host memory), and every
block when the language model's forward cannot run without its token embedding or on random values,
is not probed: its matrices other than nn.Linear layers are "decided at prune time", said per block.
Values do not matter to what is observed (which parameter is multiplied how, whether an output reaches
a top-k); random ones route tokens to some experts, which is all the geometry of a stack needs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.pruning.block.memory import available_host_bytes
from tsenor_cli.pruning.block.observe import BlockObservation, observe_block
from tsenor_cli.replay import block_output, capture_block_calls, input_key

PROBE_TOKENS = 8
PROBE_BYTES = 4 << 30
# What a forward on random values in place of the checkpoint's may raise: the model's own checks and
# torch's (a module that needs the token ids, an op without a kernel for the dtype on the CPU).
_FORWARD_ERRORS = (
    RuntimeError,
    TypeError,
    ValueError,
    AttributeError,
    NotImplementedError,
    IndexError,
    IncompatibleModelError,
)


@dataclass(frozen=True)
class Probe:
    """What the probe saw, per block index.

    observed: {block: its kind's observation}; idle: the blocks the language model's text-only forward
    does not run; pending: {block: why its matrices other than nn.Linear layers are decided at prune
    time}; peak_bytes: the most bytes given real storage at once.
    """

    observed: dict[int, BlockObservation] = field(default_factory=dict)
    idle: frozenset[int] = frozenset()
    pending: dict[int, str] = field(default_factory=dict)
    peak_bytes: int = 0


def probe_limit() -> int:
    """The most bytes one probed block may take: `PROBE_BYTES`, or a quarter of the available host memory."""
    return min(PROBE_BYTES, available_host_bytes() // 4)


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=False)
    yield from (b for b in module.buffers(recurse=False) if b is not None)


def _bytes(modules: list[nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in _own_tensors(m))


@torch.no_grad()
def _materialize(modules: list[nn.Module], gen: torch.Generator) -> None:
    """Give `modules` (their own tensors, not their children's) CPU storage with seeded values: weights
    of two or more dimensions N(0, 0.02²), other parameters 1 (norm scales, biases: finite activations),
    buffers 0 (rotary frequencies then give cos 1, sin 0; the values only need to be finite)."""
    for module in modules:
        module.to_empty(device="cpu", recurse=False)
        for param in module.parameters(recurse=False):
            if param.dim() >= 2 and param.is_floating_point():
                param.normal_(0.0, 0.02, generator=gen)  # in place: no temporary the size of the block
            else:
                param.fill_(1)
        for buffer in module.buffers(recurse=False):
            if buffer is not None:
                buffer.zero_()


def _release(modules: list[nn.Module]) -> None:
    for module in modules:
        module.to_empty(device="meta", recurse=False)


def _kind(block: nn.Module) -> tuple[Any, ...]:
    """Blocks of one kind: the same class with the same parameter names, shapes and dtypes."""
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
    return (type(block), params)


def _outside_blocks(structure: ModelStructure) -> list[nn.Module]:
    """The language model's modules outside its blocks and its input embedding (whose forward the probe
    replaces by random hidden states): what the probe gives storage besides the blocks."""
    base, blocks = structure.base, structure.blocks
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    getter = getattr(base, "get_input_embeddings", None)
    embedding = getter() if getter is not None else None
    in_embedding = {id(m) for m in embedding.modules()} if isinstance(embedding, nn.Module) else set()
    return [m for m in base.modules() if id(m) not in in_blocks and id(m) not in in_embedding]


def probe_blocks(structure: ModelStructure, hidden_size: int, *, limit: int | None = None) -> Probe:
    """Watch one block of each kind of `structure` (a model on the meta device) on random values; see the
    module docstring. limit: the most bytes one probed block may take (default `probe_limit()`)."""
    limit = probe_limit() if limit is None else limit
    blocks = structure.blocks
    small = _outside_blocks(structure)
    small_bytes = _bytes(small)
    every = range(len(blocks))
    if small_bytes > limit:
        why = f"the language model's modules outside its blocks take {small_bytes / 2**30:.1f} GiB, too many to probe"
        return Probe(pending=dict.fromkeys(every, why))
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for index, block in enumerate(blocks):
        kinds.setdefault(_kind(block), []).append(index)
    dtype = next((p.dtype for p in blocks[0].parameters() if p.is_floating_point()), torch.float32)
    gen = torch.Generator().manual_seed(0)
    first = list(blocks[0].modules())
    peak = small_bytes + _bytes(first)
    _materialize(small + first, gen)
    try:
        embeds = torch.randn((1, PROBE_TOKENS, hidden_size), generator=gen).to(dtype)
        try:
            calls = capture_block_calls(structure, PROBE_TOKENS, embeds=embeds)
        except _FORWARD_ERRORS as exc:
            why = f"the language model's forward does not run without its weights ({type(exc).__name__}: {exc})"
            return Probe(pending=dict.fromkeys(every, why.splitlines()[0]), peak_bytes=peak)
        idle = frozenset(index for index, call in enumerate(calls) if call.idle)
        observed: dict[int, BlockObservation] = {}
        pending: dict[int, str] = {}
        for indices in kinds.values():
            running = [index for index in indices if index not in idle]
            if not running:
                continue
            index = running[0]
            modules = first if index == 0 else list(blocks[index].modules())
            size = _bytes(modules)
            if size > limit:
                why = f"its block ({size / 2**30:.1f} GiB) is too large to probe in a dry run"
                pending.update(dict.fromkeys(running, why))
                continue
            if index != 0:
                peak = max(peak, small_bytes + _bytes(first) + size)
                _materialize(modules, gen)
            try:
                block, call = blocks[index], calls[index]
                hidden = torch.randn((1, PROBE_TOKENS, hidden_size), generator=gen).to(dtype)
                run = functools.partial(block_output, block, call, hidden)
                seen = observe_block(block, run, input_key=input_key)
            except _FORWARD_ERRORS as exc:
                why = f"its block does not run on random values ({type(exc).__name__}: {exc})".splitlines()[0]
                pending.update(dict.fromkeys(running, why))
                continue
            finally:
                if index != 0:
                    _release(modules)
            observed.update(dict.fromkeys(running, seen))
        return Probe(observed, idle, pending, peak)
    finally:
        _release(small + first)
