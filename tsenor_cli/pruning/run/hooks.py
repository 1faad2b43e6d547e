"""The resume state as a block hook (`pruning/run/seams.py`): `ResumeHook` queues each finished block's state
for the run's background writer (`background.py`), which commits it (`ResumeStore.save_block`:
the block file, the next block's inputs, their sha256s, the state JSON last) while the next block is
pruned. The run's point counts a block done once its state is committed, so the line an interruption
prints names only blocks a rerun will find.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tsenor_cli.background import BackgroundWriter
from tsenor_cli.phases import phase
from tsenor_cli.pruning.block.distributed import Team
from tsenor_cli.pruning.methods.types import LayerRecord
from tsenor_cli.pruning.run.seams import BlockContext, BlockHook
from tsenor_cli.replay.source import CPU
from tsenor_cli.runfiles import BlockRefinement, DataSource, ResumeState
from tsenor_cli.runfiles.resume import BlockSave, ResumeStore, StateKey


class HostCopies:
    """The CPU copies a queued write reads of the loop's hidden-state buffers, which a later block writes
    again, made into buffers allocated once and reused block after block.

    A fresh copy each block paid the page faults of its memory again: on this project's 2-core VM, a
    (128, 2048, 2048) bf16 copy took 1.5-3.2 s into fresh memory against 0.28-0.34 s into a reused buffer.
    A copy from a CUDA device goes into page-locked memory, which the device writes without a staging
    copy. slots: the payloads the writer holds at once (its depth, at least 1); snapshot k uses buffer
    k mod slots, whose last payload is written once the writer has a free slot again."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.taken = 0

    def copy(self, stream: str, tensor: torch.Tensor | None, buffer: torch.Tensor | None) -> torch.Tensor | None:
        """`tensor` as the background writer may hold it: copied to the CPU when it is the loop's `buffer`
        (the `stream` "outputs" or "dense"), else as it is (a gathered copy, or None)."""
        if tensor is None or tensor is not buffer:
            return tensor
        key = (stream, self.taken % self.slots)
        held = self.buffers.get(key)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            held = torch.empty(tensor.shape, dtype=tensor.dtype, device=CPU, pin_memory=tensor.is_cuda)
            self.buffers[key] = held
        return held.copy_(tensor)

    def next_snapshot(self) -> None:
        self.taken += 1

    def release(self) -> None:
        """Drop the buffers (a queued write keeps its own until written)."""
        self.buffers.clear()


@dataclass
class ResumeRecord:
    """What every committed state repeats: the interrupted run's state to continue (None: fresh; each
    commit replaces it), the run's `result_hash`, its sample count and block count, and the calibration
    text's description and source."""

    state: ResumeState | None
    result_hash: str
    nsamples: int
    blocks: int
    calibration: str
    calibration_source: DataSource


class DenseStream(Protocol):
    """What the resume state saves of `--refine block` (`run.RefineHook`): the dense stream's buffer
    (S_r, T, H) after each block, and the records of the blocks refined so far."""

    dense: torch.Tensor
    refined: list[BlockRefinement]


class ResumeHook(BlockHook):
    """Rank 0 queues the resume state after each block for the background writer; every rank takes part
    in the gather of the next block's inputs (module docstring). The time here (the gather, the snapshot,
    a wait for the writer) is "save". committed(i): called on the writer's thread once block i's state is
    committed. refine: the refinement's hook, whose dense stream and records the state holds."""

    def __init__(
        self,
        store: ResumeStore,
        writer: BackgroundWriter,
        team: Team,
        record: ResumeRecord,
        *,
        refine: DenseStream | None,
        committed: Callable[[int], None],
    ) -> None:
        self.store = store
        self.writer = writer
        self.team = team
        self.record = record
        self.refine = refine
        self.committed = committed
        self.refinement = record.state.refinement if record.state is not None else ()
        self.copies = HostCopies(writer.depth)

    def done(self, block: BlockContext) -> None:
        team, refine, nsamples = self.team, self.refine, self.record.nsamples
        last = block.index == self.record.blocks - 1
        records: Sequence[LayerRecord] = [*block.earlier, *block.records]
        with phase("save"):
            whole = None if last else team.gather_samples(block.outputs, nsamples)
            whole_dense = None if last or refine is None else team.gather_samples(refine.dense, nsamples)
            refinement = tuple(refine.refined) if refine is not None else self.refinement

            def snapshot() -> BlockSave:
                # The loop writes into its hidden-state buffers again (the rerun two blocks on writes
                # `outputs`' buffer, the next dense forward the dense stream in place): what a queued write
                # reads must be its own copy. A distributed gather is a new tensor already, and the
                # block's parameters are not changed once it is done (streamed, `release` swaps them for
                # meta tensors and the state dict keeps the pruned ones alive until written).
                dense = refine.dense if refine is not None else None
                copies = self.copies
                save = BlockSave(
                    block.index, dict(block.module.state_dict()), copies.copy("outputs", whole, block.outputs),
                    list(records), copies.copy("dense", whole_dense, dense), refinement,
                )  # fmt: skip
                copies.next_snapshot()
                return save

            with team.agreed():
                if team.is_root:
                    self.writer.submit(snapshot, self._commit)
            if last:
                self.copies.release()

    def _commit(self, save: BlockSave) -> None:
        """On the writer's thread: `ResumeStore.save_block` of the block's snapshot, then `committed`."""
        record = self.record
        key = StateKey(record.result_hash, record.calibration, record.calibration_source, record.blocks)
        record.state = self.store.save_block(save, key, record.state)
        self.committed(save.index)
