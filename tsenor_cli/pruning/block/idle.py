"""The weight matrices of a block the model's text-only forward skips (Mllama's cross-attention layers).

Mllama's text model skips its cross-attention layers when no image is given: 8 of the 40 layers of the
11B model, with their full-size MLPs, about 20% of its decoder weights, which the
calibration text never reaches through the model's own forward (`BlockCall.idle`). Their replay
stays the identity the model's forward makes it, so the blocks after one see what they see in the
model. To prune the block itself, its own forward runs on the text hidden states that reach it (its
calibration inputs, as any block's: the pruned outputs of the blocks before it) with the arguments the
model passes its running blocks (`BlockCall.as_idle`: Mllama's text model calls every decoder layer with
the same keywords). The matrices that forward reaches are pruned by the run's method on their
statistics, as in any block (paper Section 4's layer-wise reconstruction); the forward of Mllama's
cross-attention stops once ``q_proj`` has run (without image features it reads the keys and values
from a cache there is none of: AttributeError), so k/v/o and the MLP have no inputs and are pruned
from their magnitudes (`pruning/methods/magnitude.py`, data-free, as the vision tower's linears are:
`pruning/block/outside.py`) under the run's pattern. Each record's reason says which.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.progress import Progress
from tsenor_cli.pruning.block.observe import BlockObservation, observe_block
from tsenor_cli.pruning.block.slots import LinearSlot, dense_records
from tsenor_cli.pruning.methods import magnitude
from tsenor_cli.pruning.methods.types import LayerRecord, MaskSolveInfo, MatrixPruneConfig
from tsenor_cli.replay import BlockCall, block_output

# What a forward raises when an input the text does not give is used (a None where a tensor or a cache
# was expected: Mllama's cross-attention reads ``cache.layers`` on cache None, AttributeError); any other
# error of the forward is the model's or ours, and stops the run.
MISSING_INPUT = (AttributeError, TypeError)

TEXT_REASON = "calibrated on the text hidden states that reach this block; the model's text-only forward skips it"
MAGNITUDE_REASON = "by magnitude: the text-only forward skips this block and no text reaches it"
UNKNOWN_ORIENTATION = (
    "left dense: the text-only forward skips this block and no text reaches this matrix, which is no "
    "nn.Linear, so which dimension is its input is unknown"
)


@dataclass(frozen=True)
class IdleWatch:
    """What the idle block's own forward on text showed: which matrices ran (`observation`), and why the
    forward stopped before its end (`stopped`: the error's type and first line; None when it finished)."""

    observation: BlockObservation
    stopped: str | None

    @property
    def magnitude_reason(self) -> str:
        """The reason of a matrix the text did not reach."""
        return MAGNITUDE_REASON + (f" (its forward on text stops: {self.stopped})" if self.stopped else "")


@torch.no_grad()
def watch_idle(
    block: nn.Module, call: BlockCall, sample: torch.Tensor, *, input_key: Callable[[torch.Tensor], Any]
) -> IdleWatch:
    """sample: (1, T, H) the text hidden states reaching the block → its forward under the watch
    (`observe.observe_block`) with `call` (a running call); an error of `MISSING_INPUT` ends it there."""
    stopped: list[str] = []

    def run() -> None:
        try:
            block_output(block, call, sample)
        except MISSING_INPUT as exc:
            stopped.append(f"{type(exc).__name__}: {exc}".splitlines()[0])

    observation = observe_block(block, run, input_key=input_key)
    return IdleWatch(observation, stopped[0] if stopped else None)


def idle_line(structure: ModelStructure, index: int, seen: IdleWatch) -> str:
    """The progress line of an idle block: how many of its matrices the text reached."""
    kind = type(structure.blocks[index]).__name__
    reached = len(seen.observation.units)
    return (
        f"  {structure.blocks_name}.{index} ({kind}) never runs on text: {reached} matrix(es) calibrated on the "
        "text reaching it, the rest pruned by magnitude"
    )


def text_record(record: LayerRecord) -> LayerRecord:
    """A pruned record of an idle block's matrix the text reached, its reason saying so (with any note)."""
    if record.status != "pruned":
        return record
    reason = TEXT_REASON if record.reason is None else f"{TEXT_REASON}; {record.reason}"
    return replace(record, reason=reason)


@torch.no_grad()
def prune_idle_by_magnitude(
    block: nn.Module, slot: LinearSlot, cfg: MatrixPruneConfig, seen: IdleWatch, say: Progress
) -> list[LayerRecord]:
    """Prune `slot` of an idle block, which the text did not reach, by magnitude under `cfg`'s pattern, in
    place → its record. A matrix that is no nn.Linear (`slot.param` set) stays dense: only its use in
    the forward tells its orientation."""
    if slot.param:
        return dense_records(slot, "idle", UNKNOWN_ORIENTATION)
    weight = block.get_parameter(slot.param_name)  # (out, in)
    start = time.perf_counter()
    outcome = magnitude.METHOD.prune(weight, None, cfg)
    weight.copy_(outcome.weight.to(weight.dtype))
    record = LayerRecord(
        block=slot.block,
        name=slot.full_name,
        out_features=slot.out_features,
        in_features=slot.in_features,
        status="pruned",
        reason=seen.magnitude_reason,
        density=float(outcome.mask.float().mean()),
        **MaskSolveInfo.record_fields(outcome.solve),
        seconds=time.perf_counter() - start,
        param=slot.full_param,
        transposed=slot.transposed,
    )
    say(f"  {record.name}: by magnitude, density {record.density:.4f}")
    return [record]
