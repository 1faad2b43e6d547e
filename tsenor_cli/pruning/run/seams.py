"""The seams of a prune run: what a block hook and a sink are, and what each of their calls receives.

A run (`pruning/run/run.py`) is composed of a block source (`replay.BlockSource`), the block pruner
(`engine.BlockPruner`), block hooks and sinks. The run's own hooks are the refinement
(`run.RefineHook`, `--refine block`) and the resume state (`hooks.ResumeHook`); its default sink is the
transformers checkpoint (`writer.CheckpointSink`). `api.prune(..., hooks=[...], sinks=[...])`
adds more, run after the run's own (docs/design/engine.md, "Hooks and sinks").

A **block hook** sees each block this attempt prunes, on every rank of a distributed run, through one
`BlockContext` per block: `before` (the dense block is on the device), `after` (pruned; a hook may
change its weights and, if it writes the block's outputs itself, set `outputs_ready`), `done` (the block
and its outputs are final, the block parked on the CPU, about to be released). A block the resume state
restored was pruned by an earlier attempt and reaches no hook in this one.

A **sink** receives the result, on rank 0 only (the other ranks wait for it, and learn of its failure):
`begin` once, before the first block; `add_block` once per block in order, the blocks restored from the
resume state first (`SinkBlock.restored`); `finish` once, with what lies outside the blocks, the sparsity
record and the report; `close` however the run ends (after `finish`, or on an error or an interruption:
release what `begin` took). A sink holds at most what it keeps of each block, so a streamed run stays
within one block of host memory whatever the model's depth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from tsenor_cli.pruning.methods.types import LayerRecord
from tsenor_cli.replay import BlockCall
from tsenor_cli.runfiles import PruneReport, SparsityRecord

if TYPE_CHECKING:
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.pruning.settings.config import PruneConfig


@dataclass
class BlockContext:
    """One block of the block loop, as every hook sees it.

    index: the block's 0-based index; prefix: its full name and a dot ("model.layers.3."); module: the
    block (on the device until `done`, then on the CPU); call: what the model passes it (`BlockCall`, on
    the device); inputs: (S_r, T, H) this rank's shard of its calibration inputs; outputs: the buffer of
    the same shape that receives its outputs on `inputs` (the next block's inputs), written by the run
    after `after` unless a hook set `outputs_ready`; earlier: the records of the blocks before it (this
    attempt's and the resume state's); records: its own records, one per weight matrix (empty in
    `before`)."""

    index: int
    prefix: str
    module: nn.Module
    call: BlockCall
    inputs: torch.Tensor
    outputs: torch.Tensor
    earlier: Sequence[LayerRecord]
    records: list[LayerRecord] = field(default_factory=list)
    outputs_ready: bool = False


class BlockHook(Protocol):
    """Work done on each pruned block (module docstring); subclass it to inherit no-op calls."""

    def before(self, block: BlockContext) -> None:
        """The dense block is on the device, not yet pruned."""
        return None

    def after(self, block: BlockContext) -> None:
        """The block is pruned (`block.records`), its outputs not yet computed."""
        return None

    def done(self, block: BlockContext) -> None:
        """The block is final and parked on the CPU, `block.outputs` computed; it is released next."""
        return None


@dataclass(frozen=True)
class RunStart:
    """What `Sink.begin` receives: the run's settings (`cfg`: the pattern, method, `--dtype` …), its output
    folder, the loaded model (`loaded.model`, `loaded.structure`; a streamed run's blocks are on the meta
    device), whether the blocks are streamed, the number of blocks and the first block this attempt
    prunes (the blocks before it come from the resume state)."""

    cfg: PruneConfig
    output: Path
    loaded: LoadedModel
    streamed: bool
    blocks: int
    first: int


@dataclass(frozen=True)
class SinkBlock:
    """What `Sink.add_block` receives for each block, in order.

    index: the block; prefix: its full name and a dot; tensors: its state dict (pruned weights and
    everything else the block holds) under the model's full names (prefix + local name; the transformers
    checkpoint maps them to the source's key layout, `LoadedModel.layout`), on the CPU; records: its
    weight matrices' records (each matrix's name, status, pattern kept or why it was left dense; the
    pattern itself is `RunStart.cfg.pattern`); restored: the block comes from the resume state, not from
    this attempt; file: where the block's tensors lie on disk under their local names
    (``block_<i>.safetensors``), when a file holds them, else None. A restored block of a streamed run is
    read from its file only as `tensors` are looked up, one at a time."""

    index: int
    prefix: str
    tensors: Mapping[str, torch.Tensor]
    records: tuple[LayerRecord, ...]
    restored: bool = False
    file: Path | None = None


@dataclass(frozen=True)
class RunEnd:
    """What `Sink.finish` receives: the tensors outside the decoder blocks (embeddings, final norm, head,
    a multimodal model's other towers; pruned ones included) under the model's full names, the sparsity
    record (config.json's `tsenor_sparsity`, tsenor_sparsity.json) and the run's report."""

    outside: Mapping[str, torch.Tensor]
    sparsity: SparsityRecord
    report: PruneReport


class Sink(Protocol):
    """Where the run's result goes (module docstring); subclass it to inherit no-op calls."""

    def begin(self, run: RunStart) -> None:
        """Once, before the first block reaches `add_block`."""
        return None

    def add_block(self, block: SinkBlock) -> None:
        """Once per block, in order; a sink keeps what it needs of it (it is released after the call)."""
        return None

    def finish(self, end: RunEnd) -> None:
        """Once, after every block: write what the sink writes."""
        return None

    def close(self) -> None:
        """However the run ends, after `finish` or instead of it: remove what `begin` made and `finish` did not keep."""
        return None
