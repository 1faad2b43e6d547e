"""The loss curvature at each linear's outputs, for `--loss-aware` (`pruning/methods/loss_aware.py`):
g_i = Σ_t δ_ti², δ the gradient of the dense model's language-model loss at output i of the linear, over
the calibration tokens; the diagonal of K-FAC's output factor E[δδᵀ].

One dense forward and backward pass over the calibration samples before any block is pruned, block by
block so that it keeps a streamed run's memory bound (one block's weights at a time):

1. forward: from the hidden states entering block 0, each block is read (`BlockSource.resident`) and run on
   every sample; the input of every k-th block is kept on the CPU (k = ⌈√L⌉, `memory.segment_length`), a
   checkpoint its segment of k blocks is replayed from in step 3;
2. the loss: the model's own forward on each sample's tokens, with every block's forward a stand-in (the
   first running block returns the last block's output, the others pass their input on, as the streamed
   evaluation does), so whatever follows the blocks (final norm, head, logit scaling) is the model's; the
   gradient of the sample's mean next-token cross-entropy with respect to the last block's output;
3. backward: segment by segment from the last, the segment's block inputs made again from its checkpoint,
   then each of its blocks, last first, read again and run on its input with gradients on, the output
   gradient pushed through it (`torch.autograd.grad`: no parameter gradient is kept); a hook on each
   nn.Linear's output adds Σ_t δ_ti² of the sample.

So the pass holds ⌈L/k⌉ + max(k, 2) copies of the calibration hidden states (the checkpoints, a segment's
inputs, the gradient), about 2√L instead of the L + 2 of keeping every block's input, for one more
forward of the blocks (each block is read three times); the plan's estimate counts them
(`memory.curvature_bytes`).

Each sample's sums are kept apart and added in sample order at the end, so that a `--nproc` run (each
rank its shard of the samples, the sums gathered) gives the single process's curvature bit for bit. The
model's forward runs where the capture runs it (the CPU); the blocks on the run's device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.pruning.block.distributed import Team
from tsenor_cli.pruning.block.memory import segment_length
from tsenor_cli.pruning.block.slots import LinearSlot
from tsenor_cli.replay import BlockCall, BlockSource, block_output, forwards_replaced, run_block
from tsenor_cli.replay.calls import output_like
from tsenor_cli.replay.source import CPU

# {sample index: {linear's full name: (out,) float32 Σ_t δ_ti² over that sample}}
PerSample = dict[int, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class CalibrationBatch:
    """This rank's calibration as the curvature pass reads it: the blocks' calls, the hidden states entering
    block 0 (S_r, T, H) and their tokens (S_r, T) long."""

    calls: Sequence[BlockCall]
    hidden: torch.Tensor
    input_ids: torch.Tensor


@dataclass(frozen=True)
class _Backward:
    """What every block's backward shares: the blocks' source and calls, the nn.Linear slots of each block
    (by block index) and the per-sample sums, keyed by the sample's index in the whole calibration (this
    rank's first sample is `first`)."""

    source: BlockSource
    calls: Sequence[BlockCall]
    linears: Mapping[int, list[LinearSlot]]
    per_sample: PerSample
    first: int


def loss_curvature(
    model: nn.Module, source: BlockSource, batch: CalibrationBatch, slots: Sequence[LinearSlot], team: Team
) -> dict[str, torch.Tensor]:
    """batch: this rank's calibration; slots: the run's weight matrices (the nn.Linear ones get a
    curvature) → {full name: (out,) float32 g on the CPU}, the whole calibration's (every rank's samples,
    in sample order)."""
    calls, hidden, input_ids = batch.calls, batch.hidden, batch.input_ids
    first = _first_sample(team, int(hidden.shape[0]))
    blocks = len(calls)
    k = segment_length(blocks)
    checkpoints, last = _forward(source, calls, hidden, k)
    grad = _head_gradient(model, source, calls, last, input_ids)
    del last
    per_sample: PerSample = {first + j: {} for j in range(int(hidden.shape[0]))}
    linears = {
        index: [s for s in slots if s.block == index and not s.param and not s.experts] for index in range(blocks)
    }
    backward = _Backward(source, calls, linears, per_sample, first)
    for start in reversed(range(0, blocks, k)):
        stop = min(start + k, blocks)
        segment = _replay(source, calls, checkpoints.pop(start), start, stop)
        for index in reversed(range(start, stop)):
            if not calls[index].idle:
                _backward_block(backward, index, segment[index - start], grad)
            segment[index - start] = torch.empty(0)  # its activations are not needed again
    merged = team.gather_objects({str(j): sums for j, sums in per_sample.items()})
    total: dict[str, torch.Tensor] = {}
    for j in sorted(int(key) for key in merged):  # sample order, whatever the ranks
        for name, sums in merged[str(j)].items():
            total[name] = total[name] + sums if name in total else sums.clone()
    return total


def _first_sample(team: Team, mine: int) -> int:
    """The index of this rank's first calibration sample in the whole run's order."""
    counts = team.gather_objects({str(team.rank): mine})
    return sum(count for rank, count in counts.items() if int(rank) < team.rank)


def _forward(
    source: BlockSource, calls: Sequence[BlockCall], hidden: torch.Tensor, k: int
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The dense blocks run in turn on `hidden` → ({c: block c's input, for c = 0, k, 2k, …}, the last
    block's output), each (S_r, T, H) on the CPU: the checkpoints the backward replays its segments from."""
    checkpoints: dict[int, torch.Tensor] = {}
    current = hidden.to(CPU)  # read, never written: the first checkpoint is the caller's tensor, not a copy
    for index, call in enumerate(calls):
        if index % k == 0:
            checkpoints[index] = current
        out = torch.empty_like(current)
        with source.resident(index) as block:
            run_block(block, current, call.to(source.device), out, source.device)
        current = out
    return checkpoints, current


def _replay(
    source: BlockSource, calls: Sequence[BlockCall], checkpoint: torch.Tensor, start: int, stop: int
) -> list[torch.Tensor]:
    """checkpoint: (S_r, T, H) block `start`'s input → the inputs of blocks start … stop − 1, the dense
    blocks run again from it (on the CPU)."""
    inputs = [checkpoint]
    for index in range(start, stop - 1):
        out = torch.empty_like(checkpoint)
        with source.resident(index) as block:
            run_block(block, inputs[-1], calls[index].to(source.device), out, source.device)
        inputs.append(out)
    return inputs


def _head_gradient(
    model: nn.Module, source: BlockSource, calls: Sequence[BlockCall], last: torch.Tensor, input_ids: torch.Tensor
) -> torch.Tensor:
    """last: (S_r, T, H) the last block's outputs → d(loss)/d(last) (S_r, T, H) on the CPU, each sample's
    loss its mean next-token cross-entropy under the model's own forward past the blocks (module docstring)."""
    first = next(index for index, call in enumerate(calls) if not call.idle)
    with source.resident(first, to=CPU) as block:  # one real call shows the blocks' output type
        template = block_output_raw(block, calls[first], last[:1])
    grad = torch.empty_like(last)
    current: list[torch.Tensor] = []
    with _blocks_returning(source, template, first, current), torch.enable_grad():
        for j in range(last.shape[0]):
            leaf = last[j : j + 1].detach().requires_grad_(True)
            current[:] = [leaf]
            tokens = input_ids[j : j + 1].to(CPU)
            logits = model(input_ids=tokens, use_cache=False).logits  # (1, T, V)
            loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
            (grad[j : j + 1],) = torch.autograd.grad(loss, leaf)
    return grad


def block_output_raw(block: nn.Module, call: BlockCall, hidden: torch.Tensor) -> Any:
    """The block's own return value on `hidden` (a tensor, or a tuple led by the hidden states)."""
    args, kwargs = call.to(hidden.device).bind(hidden)
    with torch.no_grad():
        return block(*args, **kwargs)


@contextlib.contextmanager
def _blocks_returning(source: BlockSource, template: Any, first: int, current: list[torch.Tensor]) -> Iterator[None]:
    """Every block's forward a stand-in that computes nothing: block `first` returns current[0], the
    others their input."""

    def stand_in(index: int, _real: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            given, _ = BlockCall.split(args, kwargs)
            return output_like(template, current[0] if index == first else given)

        return forward

    with forwards_replaced(source.structure.blocks, stand_in):
        yield


def _backward_block(backward: _Backward, index: int, inputs: torch.Tensor, grad: torch.Tensor) -> None:
    """Push `grad` (S_r, T, H: d loss / d block output, on the CPU) through block `index` on its dense
    `inputs`, in place (it becomes d loss / d block input), adding each linear's Σ_t δ² per sample."""
    source, call, linears = backward.source, backward.calls[index], backward.linears[index]
    per_sample, first = backward.per_sample, backward.first
    device = source.device
    sample: list[int] = [0]

    def hook_of(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                raise IncompatibleModelError(f"{name} returns no tensor to take a gradient at; pass --loss-aware 0")

            def add(delta: torch.Tensor) -> None:
                sums = delta.reshape(-1, delta.shape[-1]).float().square().sum(0).to(CPU)  # (out,)
                seen = per_sample[first + sample[0]]
                seen[name] = seen[name] + sums if name in seen else sums

            output.register_hook(add)

        return hook

    with source.resident(index) as block, _hooked(block, linears, hook_of), torch.enable_grad():
        placed = call.to(device)
        for j in range(inputs.shape[0]):
            sample[0] = j
            x = inputs[j : j + 1].to(device).requires_grad_(True)
            y = block_output(block, placed, x)
            (dx,) = torch.autograd.grad(y, x, grad[j : j + 1].to(device, y.dtype))
            grad[j : j + 1] = dx.to(CPU, grad.dtype)


@contextlib.contextmanager
def _hooked(
    block: nn.Module, linears: Sequence[LinearSlot], hook_of: Callable[[str], Callable[[nn.Module, Any, Any], None]]
) -> Iterator[None]:
    handles = [block.get_submodule(s.local_name).register_forward_hook(hook_of(s.full_name)) for s in linears]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def curvature_rows(curvature: Mapping[str, torch.Tensor], weight: float) -> dict[str, torch.Tensor]:
    """{full name: g} → {full name: (out,) row weights 1 + λ·g/mean g} (`loss_aware.row_weights`)."""
    from tsenor_cli.pruning.methods.loss_aware import row_weights

    return {name: row_weights(g, weight) for name, g in curvature.items()}
