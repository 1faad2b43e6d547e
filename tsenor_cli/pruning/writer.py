"""The checkpoint's writer: `CheckpointSink`, the one object the run hands its result to.

A whole load (``--no-stream``, a pickle checkpoint, a model built in memory) writes the model held in
memory. A streamed run never holds the whole model: its pruned blocks must be on disk for the write.
With a resume state they are its ``block_<i>.safetensors`` (`ResumeStore.save_block` writes each one);
with ``--no-resume-state`` `CheckpointSink.keep` writes the same file into a temporary folder beside the
output (named as `atomic.recover` cleans up after a kill, removed by `close`). Both are written by the
run's background writer (`pruning/background.py`) while the next block is pruned; `write` drains it
before it reads a block file. `tensors` then yields the
checkpoint's tensors in save_pretrained's order, each block's from its file and the rest from the model
in memory, into `models.saving.save_streamed`, so the whole model is never in memory; `WeightCounts`
counts the report's entries and nonzeros as the tensors pass. The files are the ones a whole load
writes, bit for bit (tests/test_streamed_prune.py).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors import safe_open
from torch import nn

from tsenor_cli import atomic
from tsenor_cli.models.loading import output_dtype
from tsenor_cli.models.saving import saved_tensors
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.pruning.background import BackgroundWriter
from tsenor_cli.pruning.distributed import Team
from tsenor_cli.pruning.output import write_checkpoint
from tsenor_cli.pruning.phases import phase
from tsenor_cli.runfiles import PruneReport, SparsityRecord, block_file

if TYPE_CHECKING:
    from tsenor_cli.models.loading import LoadedModel


@dataclass
class WeightCounts:
    """Entries and nonzero entries of the model's parameters (each once, however often it is tied) and
    of the decoder blocks' matrices (two or more dimensions): the report's densities."""

    model_params: int = 0
    model_nonzero: int = 0
    linear_params: int = 0
    linear_nonzero: int = 0

    @classmethod
    def of(cls, model: nn.Module, structure: ModelStructure) -> WeightCounts:
        """The counts of a model held whole."""
        counts = cls()
        blocks = {id(p) for block in structure.blocks for p in block.parameters()}
        for param in model.parameters():  # each parameter once, tied ones too
            counts.add(param.detach(), in_block=id(param) in blocks)
        return counts

    def add(self, tensor: torch.Tensor, *, in_block: bool) -> None:
        """Count one parameter `tensor` (any shape); in_block: it belongs to a decoder block."""
        nonzero = int(torch.count_nonzero(tensor))
        self.model_params += tensor.numel()
        self.model_nonzero += nonzero
        if in_block and tensor.dim() >= 2:
            self.linear_params += tensor.numel()
            self.linear_nonzero += nonzero


class CheckpointSink:
    """Where the run's result goes: the one object `_prune` hands the pruned model and its report to.

    A whole load's model is written from memory; a streamed run's blocks from their files (`keep`
    writes each pruned block's file when no resume state does, into a temporary folder beside `output`
    named as `atomic.recover` cleans up after a kill, removed by `close`). Only rank 0 writes
    (`Team.is_root`); every rank gets the report. writer: the run's background writer, which writes
    the kept blocks' files (None: written in the caller's thread).

    folder: the resume state's folder, holding ``block_<i>.safetensors`` of every pruned block (None:
    no resume state)."""

    def __init__(
        self,
        loaded: LoadedModel,
        output: Path,
        *,
        streamed: bool,
        folder: Path | None,
        team: Team,
        max_shard_size: str,
        dtype: str | None = None,
        writer: BackgroundWriter | None = None,
        save_format: str = "dense",
    ) -> None:
        self.loaded = loaded
        self.writer = writer if writer is not None else BackgroundWriter(0)
        self.output = output
        self.streamed = streamed
        self.team = team
        self.max_shard_size = max_shard_size
        self.dtype = dtype  # --dtype as given (None: the source checkpoint's own, `output_dtype`)
        self.folder = folder
        # dense, or packed: the same tensors handed to the packed writer (tsenor_cli/packed/files.PackedWriter).
        self.save_format = save_format
        self.structure = loaded.structure
        self.spill: Path | None = None
        # A streamed run without a resume state keeps its pruned blocks itself (rank 0 writes them).
        self.keeps = streamed and folder is None
        if self.keeps and team.is_root:
            self.spill = Path(tempfile.mkdtemp(prefix=atomic.temp_prefix(output), dir=output.parent))
            self.folder = self.spill

    def keep(self, index: int, block: nn.Module) -> None:
        """Block `index` is pruned (on the CPU) and will be released: a streamed run without a resume
        state writes its file now, as the write reads it back."""
        if not self.keeps:
            return
        # Every rank enters: a failed write on rank 0 must stop the others, not leave them waiting.
        with self.team.agreed():
            if self.spill is not None:
                path = self.spill / block_file(index)
                # The state dict holds the pruned tensors: `release` swaps the block's for meta ones.
                self.writer.submit(lambda: dict(block.state_dict()), partial(atomic.save_safetensors, path=path))

    def write(self, report: Callable[[WeightCounts], PruneReport], metadata: SparsityRecord) -> PruneReport:
        """Write the checkpoint, `metadata` in config.json's `tsenor_sparsity`, and the report made by
        report(the weights' counts) (`output.write_checkpoint`) → the report."""
        model, structure = self.loaded.model, self.loaded.structure
        with self.team.agreed():
            self.writer.drain()  # the block files it reads back are complete
        if not self.streamed:
            whole = report(WeightCounts.of(model, structure))
            self._write(whole, metadata, None)
            return whole
        # Streamed: the tensors come from the block files one at a time, counted as they pass; rank 0's
        # report, made once they are written, is every rank's.
        counts = WeightCounts()
        made: list[PruneReport] = []

        def after_weights() -> PruneReport:
            made.append(report(counts))
            return made[0]

        self._write(after_weights, metadata, self.tensors(model, counts) if self.team.is_root else None)
        return cast(PruneReport, self.team.broadcast_object(made[0] if made else None))

    def _write(
        self,
        report: PruneReport | Callable[[], PruneReport],
        metadata: SparsityRecord,
        tensors: Iterable[tuple[str, torch.Tensor]] | None,
    ) -> None:
        """Rank 0 writes; the weights in --dtype, else the checkpoint's own dtype, under the source's key layout."""
        loaded = self.loaded
        with phase("save"), self.team.agreed():
            if self.team.is_root:
                write_checkpoint(
                    loaded.model,
                    loaded.tokenizer,
                    self.output,
                    report,
                    metadata,
                    loaded.processor_files,
                    tensors=tensors,
                    max_shard_size=self.max_shard_size,
                    dtype=output_dtype(self.dtype, loaded.source_dtype, loaded.model.dtype),
                    layout=loaded.layout,
                    save_format=self.save_format,
                )

    def close(self) -> None:
        """Remove the temporary folder of pruned blocks."""
        if self.spill is not None:
            shutil.rmtree(self.spill, ignore_errors=True)
            self.spill = None

    def _block_of(self, key: str) -> tuple[int, str] | None:
        """(block index, key inside the block) of a checkpoint key inside a decoder block, else None."""
        prefix = f"{self.structure.blocks_name}."
        if not key.startswith(prefix):
            return None
        number, _, local = key[len(prefix) :].partition(".")
        return (int(number), local) if number.isdigit() else None

    def tensors(self, model: Any, counts: WeightCounts) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) of every tensor save_pretrained writes for `model` (`saved_tensors`), in its order:
        a block's from its ``block_<i>.safetensors``, the rest from `model`; each parameter is counted
        into `counts` as it passes."""
        assert self.folder is not None, "only a streamed run assembles its checkpoint from block files"
        state = model.state_dict()
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        with contextlib.ExitStack() as stack:
            opened: tuple[int, Any] | None = None
            for spec in saved_tensors(model):
                where = self._block_of(spec.key)
                if where is None:
                    tensor = state[spec.key]
                else:
                    index, local = where
                    if opened is None or opened[0] != index:
                        stack.close()
                        handle = stack.enter_context(safe_open(str(self.folder / block_file(index)), framework="pt"))
                        opened = (index, handle)
                    tensor = opened[1].get_tensor(local)
                if spec.key in params:
                    counts.add(tensor, in_block=where is not None)
                yield spec.key, tensor
