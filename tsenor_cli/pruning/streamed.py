"""Where the block loop finds each block's weights, and the pruned blocks for the final write.

A whole load (`tsenor prune` without ``--stream``) holds every block in memory: `BlockSource.load` gives
the block as it is and `release` does nothing. A streamed run (``--stream``, a safetensors checkpoint:
`models.loading.load_model(stream=True)`) keeps the blocks on the meta device and reads one when its turn
comes, for the watch pass and the capture of block 0 (`resident`, released right after) and for the
block loop (`load`, then `release` once the block is written to disk). Host memory then holds what lies
outside the blocks (embeddings, head) and one block, whatever the model's depth
(docs/guide/large-models.md).

The pruned blocks must be on disk for the write: with a resume state they are its
``block_<i>.safetensors`` (`ResumeStore.save_block` writes each one); with ``--no-resume-state``,
`release` writes the same file into a temporary folder beside the output (named as `atomic.recover`
cleans up after a kill, removed by `close`). `tensors` then yields the checkpoint's tensors in
save_pretrained's order, each block's from its file and the rest from the model in memory, into
`models.saving.save_streamed`, so the whole model is never in memory; `WeightCounts` counts the report's
entries and nonzeros as the tensors pass. The files are the ones a whole load writes, bit for bit
(tests/test_streamed_prune.py).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tsenor_cli import atomic
from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.models.saving import saved_tensors
from tsenor_cli.models.streaming import load_block, release_block
from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.pruning.distributed import Team
from tsenor_cli.pruning.finite import check_finite
from tsenor_cli.runfiles import block_file


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


class BlockSource:
    """The blocks of `structure`, held whole (checkpoint None) or read from `checkpoint` one at a time.

    folder: where the pruned blocks' ``block_<i>.safetensors`` are (the resume state's folder), None for a
    streamed run without a resume state: `release` then keeps them in a temporary folder beside `output`.
    writer: this process writes the output (rank 0 of a distributed run); the other ranks only read.
    """

    def __init__(
        self,
        structure: ModelStructure,
        checkpoint: Checkpoint | None,
        *,
        output: Path,
        folder: Path | None,
        team: Team,
        where: str,
    ) -> None:
        self.structure = structure
        self.checkpoint = checkpoint
        self.team = team
        self.where = where
        self.folder = folder
        self.spill: Path | None = None
        # A streamed run without a resume state keeps its pruned blocks itself (rank 0 writes them).
        self.keeps = checkpoint is not None and folder is None
        if self.keeps and team.is_root:
            # Beside the output with its temporaries' name, so `atomic.recover` removes it after a kill.
            self.spill = Path(tempfile.mkdtemp(prefix=atomic.temp_prefix(output), dir=output.parent))
            self.folder = self.spill

    @property
    def streamed(self) -> bool:
        return self.checkpoint is not None

    def load(self, index: int) -> nn.Module:
        """Block `index` with its weights on the CPU: read from the checkpoint (checked finite) when streamed."""
        if self.checkpoint is None:
            return self.structure.blocks[index]
        block = load_block(self.structure, index, self.checkpoint, torch.device("cpu"))
        check_finite(
            block.named_parameters(prefix=f"{self.structure.blocks_name}.{index}"),
            where=self.where,
            fix="the checkpoint is corrupt; re-download or re-convert it (nothing was written)",
        )
        return block

    def release(self, index: int, *, keep: bool = False) -> None:
        """Free block `index`'s weights when streamed; keep: write the pruned block to the temporary folder
        first (a run without a resume state, which wrote no file of it)."""
        if self.checkpoint is None:
            return
        if keep and self.keeps:
            # Every rank enters: a failed write on rank 0 must stop the others, not leave them waiting.
            with self.team.agreed():
                if self.spill is not None:
                    blocks = self.structure.blocks
                    atomic.save_safetensors(dict(blocks[index].state_dict()), self.spill / block_file(index))
        release_block(self.structure, index)

    @contextlib.contextmanager
    def resident(self, index: int) -> Iterator[nn.Module]:
        """Block `index` with its dense weights for the body of the `with` (released after when streamed)."""
        block = self.load(index)
        try:
            yield block
        finally:
            self.release(index)

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
