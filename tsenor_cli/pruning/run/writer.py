"""The transformers checkpoint: `CheckpointSink`, the run's default sink (`pruning/run/seams.py`).

A whole load (``--no-stream``, a pickle checkpoint, a model built in memory) writes the model held in
memory. A streamed run never holds the whole model: its pruned blocks must be on disk for the write.
With a resume state they are its ``block_<i>.safetensors`` (`ResumeStore.save_block` writes each one);
with ``--no-resume-state`` `CheckpointSink.add_block` writes the same file into a temporary folder beside
the output (named as `atomic.recover` cleans up after a kill, removed by `close`). Both are written by
the run's background writer (`background.py`) while the next block is pruned; `finish` drains it
before it reads a block file. `tensors` then yields the checkpoint's tensors in save_pretrained's order,
each block's from its file and the rest from what lies outside the blocks (`RunEnd.outside`), into
`models.saving.save_streamed`, so the whole model is never in memory. The files are the ones a whole
load writes, bit for bit (tests/test_streamed_prune.py). `WeightCounts` are the report's entries and
nonzeros (counted by `sinks.Sinks` as the blocks pass).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from tsenor_cli.background import BackgroundWriter
from tsenor_cli.models.loading import output_dtype
from tsenor_cli.models.saving import SavedModel, saved_tensors
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.pruning.run.output import write_checkpoint
from tsenor_cli.pruning.run.seams import RunEnd, RunStart, SinkBlock
from tsenor_cli.runfiles import block_file
from tsenor_cli.runfiles.write import kept_blocks_folder, remove_kept_blocks, save_block_file

if TYPE_CHECKING:
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.pruning.settings.config import PruneConfig


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
    """The transformers checkpoint folder (module docstring): safetensors in ``--max-shard-size`` shards,
    in ``--dtype`` or else the source checkpoint's dtype, under the source's key names, with the
    tokenizer, config.json's `tsenor_sparsity`, the reports and the model card, written atomically.

    loaded: the run's model (streamed: its blocks on the meta device); cfg: the run's settings (the shard
    size, the dtype); streamed: the blocks are read back from their files; folder: the resume state's
    folder, which holds ``block_<i>.safetensors`` of every pruned block (None: no resume state, and a
    streamed run keeps its blocks itself); writer: the run's background writer, which writes the kept
    blocks' files (None: written in the caller's thread)."""

    def __init__(
        self,
        loaded: LoadedModel,
        output: Path,
        cfg: PruneConfig,
        *,
        streamed: bool,
        folder: Path | None,
        writer: BackgroundWriter | None = None,
    ) -> None:
        self.loaded = loaded
        self.output = output
        self.max_shard_size = cfg.max_shard_size
        self.dtype = cfg.dtype  # --dtype as given (None: the source checkpoint's own, `output_dtype`)
        # dense, or packed: the same tensors handed to the packed writer (tsenor_cli/packed/files.PackedWriter).
        self.save_format = cfg.save_format
        self.streamed = streamed
        self.folder = folder
        self.writer = writer if writer is not None else BackgroundWriter(0)
        # A streamed run without a resume state keeps its pruned blocks itself, in `spill` (made by `begin`).
        self.keeps = streamed and folder is None
        self.spill: Path | None = None

    def begin(self, run: RunStart) -> None:
        """The folder of kept blocks, when this sink keeps them."""
        if self.keeps:
            self.spill = kept_blocks_folder(self.output)
            self.folder = self.spill

    def add_block(self, block: SinkBlock) -> None:
        """A block pruned by this attempt, kept on disk when no resume state holds it (streamed runs only):
        its file, under its local names, written by the background writer."""
        if self.spill is None or block.restored:
            return
        local = {name.removeprefix(block.prefix): tensor for name, tensor in block.tensors.items()}
        self.writer.submit(lambda: local, partial(save_block_file, self.spill, block.index))

    def finish(self, end: RunEnd) -> None:
        """Write the checkpoint, the sparsity record in config.json, and the report (`output.write_checkpoint`)."""
        loaded = self.loaded
        self.writer.drain()  # the block files it reads back are complete
        saved = SavedModel(
            loaded.model,
            loaded.tokenizer,
            self.max_shard_size,
            tensors=self.tensors(end.outside) if self.streamed else None,
            dtype=output_dtype(self.dtype, loaded.source_dtype, loaded.model.dtype),
            layout=loaded.layout,
            packed=self.save_format == "packed",
        )
        write_checkpoint(saved, self.output, end.report, end.sparsity, loaded.processor_files)

    def close(self) -> None:
        """Remove the temporary folder of pruned blocks."""
        if self.spill is not None:
            remove_kept_blocks(self.spill)
            self.spill = None

    def _block_of(self, key: str) -> tuple[int, str] | None:
        """(block index, key inside the block) of a checkpoint key inside a decoder block, else None."""
        prefix = f"{self.loaded.structure.blocks_name}."
        if not key.startswith(prefix):
            return None
        number, _, local = key[len(prefix) :].partition(".")
        return (int(number), local) if number.isdigit() else None

    def tensors(self, outside: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) of every tensor save_pretrained writes for the model (`saved_tensors`), in its
        order: a block's from its ``block_<i>.safetensors``, the rest from `outside`."""
        assert self.folder is not None, "only a streamed run assembles its checkpoint from block files"
        with contextlib.ExitStack() as stack:
            opened: tuple[int, Any] | None = None
            for spec in saved_tensors(self.loaded.model):
                where = self._block_of(spec.key)
                if where is None:
                    yield spec.key, outside[spec.key]
                    continue
                index, local = where
                if opened is None or opened[0] != index:
                    stack.close()
                    handle = stack.enter_context(safe_open(str(self.folder / block_file(index)), framework="pt"))
                    opened = (index, handle)
                yield spec.key, opened[1].get_tensor(local)
