"""A block's sub-block regions for `--refine-regions sub-blocks`, found by watching its forward.

Sub-block reconstruction (A Free Lunch, arXiv 2510.14444) refines one region of a block at a time, the
attention and then the MLP, each towards the dense model's residual stream after it. The regions are read
from what the block's forward calls, never from module names:

- the block's direct children run in some order; a child that holds a weight matrix (a floating
  parameter of two or more dimensions: the attention, the MLP, a mixture of experts) closes a region;
- the region's output is what the block hands the next direct child it calls after that one (that
  child's first tensor argument: LLaMA's and GPT-2's second norm read the residual stream there, after
  the attention's output was added, gated or not), or the first such call up to the next weight-holding
  child that has the block's hidden shape, is not the region's own output (a post-norm, Gemma-2's and
  OLMo-2's, reads that before the residual addition) and moves when the region's output moves (one
  sample, the child's output perturbed);
- a parallel block's MLP reads the normed input, not the attention's output, and a matrix feeding a wider
  activation (OPT's fc1) is inside an MLP: no call qualifies, and the region merges with the next. The
  last region's output is the block's output.

A block with fewer than two regions is refined as a whole (`find_regions` says why). Region k trains the
parameters of the children called from its first child to its boundary, and the block's own parameters
(Mllama's gates) in every region.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tsenor_cli.replay import BlockCall, block_output
from tsenor_cli.replay.watch import Seen


@dataclass(frozen=True)
class Regions:
    """boundaries: for every region but the last, the position (0-based, in the order the block's direct
    children are called) of the call whose first tensor argument is the region's output; params: per
    region, the names of the block's parameters it trains."""

    boundaries: tuple[int, ...]
    params: tuple[tuple[str, ...], ...]


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def _call_events(block: nn.Module, call: BlockCall, sample: torch.Tensor) -> list[tuple[str, str, Any]]:
    """One forward of `sample` (1, T, H) → [(start|end, child name, the first tensor of its arguments
    (start) or of its output (end), or None)] of the block's direct children, in order."""
    events: list[tuple[str, str, Any]] = []
    handles = []
    for name, child in block.named_children():

        def start(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name) -> None:
            events.append(("start", name, _first_tensor(args, kwargs)))

        def end(_m: nn.Module, _args: tuple[Any, ...], out: Any, name: str = name) -> None:
            events.append(("end", name, _first_tensor(out if isinstance(out, tuple) else (out,), {})))

        handles += [child.register_forward_pre_hook(start, with_kwargs=True), child.register_forward_hook(end)]
    try:
        with torch.no_grad():
            block_output(block, call, sample)
    finally:
        for handle in handles:
            handle.remove()
    return events


def _holds_matrix(child: nn.Module) -> bool:
    return any(p.is_floating_point() and p.dim() >= 2 for p in child.parameters())


def _perturbed_input(block: nn.Module, call: BlockCall, sample: torch.Tensor, child: str, position: int) -> Any:
    """The first tensor argument of direct-child call `position` when `child`'s output is moved by one."""

    def moved(_m: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out + 1
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (out[0] + 1, *out[1:])
        return out

    handle = block.get_submodule(child).register_forward_hook(moved)
    try:
        with torch.no_grad():
            return region_output(block, call, sample, position)
    finally:
        handle.remove()


def find_regions(block: nn.Module, call: BlockCall, sample: torch.Tensor) -> Regions | str:
    """sample: (1, T, H) one input of the block → its regions (module docstring), or one line saying why
    it has fewer than two."""
    events = _call_events(block, call, sample)
    starts = [(name, arg) for kind, name, arg in events if kind == "start"]
    names = [name for name, _ in starts]
    matrices = [name for name in dict.fromkeys(names) if _holds_matrix(block.get_submodule(name))]
    if any(names.count(name) > 1 for name in matrices):
        return "a child holding weights runs more than once in the block's forward"
    boundaries: list[int] = []
    for child, following in itertools.pairwise(matrices):
        ended = next(i for i, (kind, name, _) in enumerate(events) if (kind, name) == ("end", child))
        first = sum(kind == "start" for kind, _, _ in events[:ended])  # the first call after it ends
        found = _boundary(block, call, sample, child, (starts, first, names.index(following), events[ended][2]))
        if found is not None:
            boundaries.append(found)
    if not boundaries:
        return "no point inside the block reads one part's output before the next part runs"
    return Regions(tuple(boundaries), _region_params(block, names, boundaries))


def _boundary(
    block: nn.Module, call: BlockCall, sample: torch.Tensor, child: str, seen: tuple[Any, int, int, Any]
) -> int | None:
    """The position of the first call from `first` through the next weight-holding child's (`last`) whose
    first tensor argument has the hidden shape, is not `child`'s output itself (a post-norm reads that
    before the residual addition: Gemma-2, OLMo-2) and moves when `child`'s output moves; None if none.
    seen: (starts, first, last, child's output) from the watched forward."""
    starts, first, last, output = seen
    for position in range(first, last + 1):
        arg = starts[position][1]
        if not isinstance(arg, torch.Tensor) or arg.shape != sample.shape:
            continue
        if isinstance(output, torch.Tensor) and output.shape == arg.shape and torch.equal(output, arg):
            continue
        if not torch.equal(_perturbed_input(block, call, sample, child, position), arg):
            return position
    return None


def _region_params(block: nn.Module, names: Sequence[str], boundaries: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """Per region, the floating parameters of the children first called in it, and the block's own."""
    own = tuple(n for n, p in block.named_parameters(recurse=False) if p.is_floating_point())
    edges = [0, *boundaries, len(names)]
    regions = []
    for first, stop in itertools.pairwise(edges):
        children = [c for c in dict.fromkeys(names[first:stop]) if names.index(c) >= first]
        found = [f"{c}.{n}" for c in children for n, p in block.get_submodule(c).named_parameters()]
        regions.append(tuple(found) + own)
    return tuple(regions)


def region_output(block: nn.Module, call: BlockCall, hidden: torch.Tensor, position: int) -> torch.Tensor:
    """hidden: (1, T, H) → the first tensor argument of the block's direct-child call `position` (a
    region's output, `Regions.boundaries`); the rest of the forward is not run."""
    seen: list[torch.Tensor] = []
    count = [0]

    def start(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if count[0] == position:
            found = _first_tensor(args, kwargs)
            assert found is not None  # find_regions checked it
            seen.append(found)
            raise Seen
        count[0] += 1

    handles = [child.register_forward_pre_hook(start, with_kwargs=True) for child in block.children()]
    try:
        block_output(block, call, hidden)
    except Seen:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if not seen:
        raise RuntimeError(f"the block's forward made fewer than {position + 1} calls of its children")
    return seen[0]


@torch.no_grad()
def run_dense_block(
    block: nn.Module, stream: torch.Tensor, call: BlockCall, device: torch.device, regions: Regions
) -> tuple[torch.Tensor, ...]:
    """stream: (S_r, T, H) the dense block's inputs, replaced in place by its outputs (as `replay.run_block`
    does) → the dense values at each boundary of `regions`, (S_r, T, H) each, beside `stream`."""
    values = tuple(torch.empty_like(stream) for _ in regions.boundaries)
    count = [0]
    sample = [0]

    def start(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if count[0] in regions.boundaries:
            found = _first_tensor(args, kwargs)
            assert found is not None
            values[regions.boundaries.index(count[0])][sample[0] : sample[0] + 1] = found
        count[0] += 1

    handles = [child.register_forward_pre_hook(start, with_kwargs=True) for child in block.children()]
    try:
        for j in range(stream.shape[0]):
            count[0], sample[0] = 0, j
            stream[j : j + 1] = block_output(block, call, stream[j : j + 1].to(device))
    finally:
        for handle in handles:
            handle.remove()
    return values


def stage_outputs(
    block: nn.Module, call: BlockCall, regions: Regions | None
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Per training stage, what the block computes from a sample (1, T, H) that the stage matches: each
    region's output, the last the block's output; without regions, one stage: the block's output."""
    boundaries = regions.boundaries if regions is not None else ()
    outputs: list[Callable[[torch.Tensor], torch.Tensor]] = [
        functools.partial(_region_output_at, block, call, position) for position in boundaries
    ]
    return [*outputs, functools.partial(block_output, block, call)]


def _region_output_at(block: nn.Module, call: BlockCall, position: int, hidden: torch.Tensor) -> torch.Tensor:
    return region_output(block, call, hidden, position)
