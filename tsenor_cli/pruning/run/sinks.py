"""The run's sinks as one: `Sinks` hands every call to each sink on rank 0 (`pruning/run/seams.py`), counts
the weights the report needs as the blocks pass, and builds what `add_block` and `finish` receive.

The counts (`writer.WeightCounts`) are taken where the tensors already are: a whole load's at the end
from the model in memory; a streamed run's block by block from each `SinkBlock` (a fresh block from
memory, a restored one from its file, read for it) and the rest at the end. Rank 0 counts, and every
rank gets its counts, so every rank's report is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tsenor_cli.models.structure import ModelStructure
from tsenor_cli.phases import phase
from tsenor_cli.pruning.block.distributed import Team
from tsenor_cli.pruning.methods.types import LayerRecord
from tsenor_cli.pruning.run.seams import RunEnd, RunStart, Sink, SinkBlock
from tsenor_cli.pruning.run.writer import WeightCounts
from tsenor_cli.runfiles import PruneReport, SparsityRecord


class FileTensors(Mapping[str, torch.Tensor]):
    """A block file's tensors under full names (`prefix` + the file's local names), each read from the
    file when it is looked up: a restored block of a streamed run costs no memory until a sink reads it."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path = path
        self.prefix = prefix
        with safe_open(str(path), framework="pt") as handle:
            self.local = list(handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        local = name.removeprefix(self.prefix)
        if not name.startswith(self.prefix) or local not in self.local:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_tensor(local)

    def __iter__(self) -> Iterator[str]:
        return (self.prefix + local for local in self.local)

    def __len__(self) -> int:
        return len(self.local)


def block_tensors(block: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """Block `block`'s state dict under full names; the dict holds the tensors when the block is released."""
    return {prefix + name: tensor for name, tensor in block.state_dict().items()}


def block_records(records: Sequence[LayerRecord], index: int) -> tuple[LayerRecord, ...]:
    """The records of block `index` among a run's."""
    return tuple(r for r in records if r.block == index)


class Sinks:
    """The run's sinks (the transformers checkpoint first, then the caller's), called on rank 0 under the
    team's agreement (a failure on rank 0 stops every rank); `streamed`: count each block as it passes."""

    def __init__(self, sinks: Sequence[Sink], team: Team, structure: ModelStructure, *, streamed: bool) -> None:
        self.sinks = list(sinks)
        self.team = team
        self.structure = structure
        self.streamed = streamed
        self.counts = WeightCounts()

    def _each(self, call: Callable[[Sink], None]) -> None:
        with self.team.agreed():
            if self.team.is_root:
                for sink in self.sinks:
                    call(sink)

    def begin(self, run: RunStart, restored: Sequence[SinkBlock]) -> None:
        """`begin` on every sink, then the blocks the resume state restored (`add_block`, in order)."""
        self._each(lambda sink: sink.begin(run))
        for block in restored:
            self.add_block(block)

    def add_block(self, block: SinkBlock) -> None:
        """Count the block (streamed) and hand it to every sink; its time is "save"."""
        with phase("save"):
            if self.streamed and self.team.is_root:
                params = self.structure.blocks[block.index].named_parameters()
                for name, _ in params:
                    self.counts.add(block.tensors[block.prefix + name], in_block=True)
            self._each(lambda sink: sink.add_block(block))

    def outside(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict outside the decoder blocks."""
        inside = f"{self.structure.blocks_name}."
        return {name: t for name, t in model.state_dict().items() if not name.startswith(inside)}

    def final_counts(self, model: nn.Module) -> WeightCounts:
        """The written model's counts, rank 0's on every rank."""
        counts: WeightCounts | None = None
        if self.team.is_root:
            if not self.streamed:
                counts = WeightCounts.of(model, self.structure)
            else:
                counts = self.counts
                inside = f"{self.structure.blocks_name}."
                for name, param in model.named_parameters():  # each parameter once, tied ones too
                    if not name.startswith(inside):
                        counts.add(param.detach(), in_block=False)
        return WeightCounts(**vars(self.team.broadcast_object(counts)))

    def finish(
        self, model: nn.Module, sparsity: SparsityRecord, report: Callable[[WeightCounts], PruneReport]
    ) -> PruneReport:
        """The report made from the final counts, then `finish` on every sink (its time is "write")."""
        made = report(self.final_counts(model))
        with phase("write"):
            end = RunEnd(self.outside(model) if self.team.is_root else {}, sparsity, made)
            self._each(lambda sink: sink.finish(end))
        return made

    def close(self) -> None:
        """`close` on every sink, each whatever the others raise."""
        if not self.team.is_root:
            return
        errors: list[BaseException] = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - every sink closes; the first failure is raised after
                errors.append(exc)
        if errors:
            raise errors[0]
