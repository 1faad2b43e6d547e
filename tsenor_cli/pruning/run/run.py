"""One prune run, composed (docs/architecture.md, "The flow of `tsenor prune`"; docs/design/engine.md,
"Hooks and sinks").

`api.prune_model` checks the output, makes the plan (`pruning/plan/plan.py`), takes the lock and opens the
resume state, then hands `execute` a `RunSetup`. `execute` composes the run from parts, each complete
when built: the steps before the loop (`pruning/run/steps.py`: load with the finite checks and the
calibration text, the first block's inputs captured or restored, the watch), a `replay.BlockSource`
(where the blocks' weights are: resident, offloaded, streamed), the `engine.BlockPruner` (how a block is
pruned), the block hooks (`RefineHook` for `--refine block`, `hooks.ResumeHook` for the resume state,
then the caller's), the `BlockLoop` (blocks in order, stop requests, progress), and the sinks
(`sinks.Sinks`: the transformers checkpoint, `writer.CheckpointSink`, then the caller's). Every step's
wall time is a phase of the run's recording (`phases.py`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tsenor_cli.background import WRITER_DEPTH, BackgroundWriter
from tsenor_cli.errors import Interrupted
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.phases import Timings, phase
from tsenor_cli.progress import Progress, bar, logger
from tsenor_cli.pruning.block.distributed import Team
from tsenor_cli.pruning.block.engine import BlockPruner
from tsenor_cli.pruning.block.gather import MoeOptions
from tsenor_cli.pruning.block.memory import return_free_memory
from tsenor_cli.pruning.block.outside import prune_outside
from tsenor_cli.pruning.block.refine import RefineJob, dense_pass, refine_pruned_block
from tsenor_cli.pruning.block.regions import Regions
from tsenor_cli.pruning.block.slots import linear_slots
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.methods.types import LayerRecord
from tsenor_cli.pruning.plan.plan import PrunePlan
from tsenor_cli.pruning.run.hooks import ResumeHook, ResumeRecord
from tsenor_cli.pruning.run.loss_aware import loss_rows
from tsenor_cli.pruning.run.output import sparsity_record
from tsenor_cli.pruning.run.seams import BlockContext, BlockHook, RunStart, Sink, SinkBlock
from tsenor_cli.pruning.run.sinks import FileTensors, Sinks, block_records, block_tensors
from tsenor_cli.pruning.run.steps import (
    RunFacts,
    Start,
    WatchedWeights,
    build_report,
    capture_start,
    check_linears,
    finite_block_check,
    load_for_pruning,
    outside_linears,
    read_calibration,
    restore_start,
    say_matrices,
    watch_blocks,
)
from tsenor_cli.pruning.run.writer import CheckpointSink
from tsenor_cli.pruning.settings.config import PruneConfig, RefineConfig
from tsenor_cli.replay import BlockSource, run_block
from tsenor_cli.replay.source import CPU
from tsenor_cli.report.markdown import block_range
from tsenor_cli.runfiles import BlockRefinement, PruneReport, ResumeState, block_file
from tsenor_cli.runfiles.output import interruption
from tsenor_cli.runfiles.resume import ResumeStore
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.data.calibration import CalibrationData
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.models.structure import ModelStructure


@dataclass
class RunPoint:
    """Where a run is, for the line an interruption prints: the model's block count (0 until the output
    is checked and locked), blocks done (`done`; with a resume state, committed to it), the 0-based block
    being pruned (`current`), or the final write (`writing`)."""

    blocks: int = 0
    done: int = 0
    current: int | None = None
    writing: bool = False

    def interrupted(self, output: Path, *, saving: bool, signal_name: str | None) -> Interrupted:
        """The `Interrupted` error for a stop here: by `signal_name` (exit 75) or by Ctrl-C (None, exit 130)."""
        total = self.blocks
        if not total:
            return interruption(signal_name, "before pruning began", "nothing was written")
        if self.writing:
            where = f"while writing {output}"
        elif self.current is not None:
            where = f"at block {self.current + 1}/{total}"
        else:
            where = f"after block {self.done}/{total}" if self.done else "before block 1"
        if not saving:
            saved = "nothing was saved (--no-resume-state): rerunning starts over"
        elif self.done == total:
            saved = "every block is saved in the resume state: rerun the same command to write the checkpoint"
        elif self.done:
            saved = f"the resume state holds {block_range(self.done)}: rerun the same command to continue"
        else:
            saved = "no block was finished: rerunning the same command starts over"
        return interruption(signal_name, where, saved)


@dataclass
class RunSetup:
    """What `api.prune_model` hands the run: the frozen settings and context, the plan (made once), the
    output folder, the team of processes, where it computes and in which dtype, the progress sink, where
    the run is (`point`), the resume store (None with --no-resume-state) and the interrupted run's state
    to continue (None: fresh), the stop request polled before each block, `after_block(i)` run once
    block i is done and handed to the sinks (tests simulate a kill with it), a model already in memory
    to prune instead of loading `cfg.model` (`built`), the run's start (`time.perf_counter()`) and
    recording, and the caller's hooks and sinks (run after the run's own)."""

    cfg: PruneConfig
    ctx: RunContext
    plan: PrunePlan
    output: Path
    team: Team
    device: torch.device
    dtype: torch.dtype
    say: Progress
    point: RunPoint
    timings: Timings
    started: float
    store: ResumeStore | None = None
    state: ResumeState | None = None
    stop: StopRequest | None = None
    after_block: Callable[[int], None] | None = None
    built: LoadedModel | None = None
    hooks: Sequence[BlockHook] = ()
    sinks: Sequence[Sink] = ()


class RefineHook(BlockHook):
    """`--refine block` as a block hook: the dense stream (S_r, T, H) runs through each dense block before
    it is pruned (in place: its outputs are the refinement's targets and the next block's dense inputs),
    and once pruned the block trains towards them (`refine.refine_pruned_block`); a kept refinement's last
    error pass writes the block's outputs (`BlockContext.outputs_ready`). dense: the stream, from the
    start; refined: the records of the blocks refined before it; `full_name(index, local)`: the
    structure's names."""

    def __init__(
        self, cfg: RefineConfig, dense: torch.Tensor, refined: Sequence[BlockRefinement], run: RefineRun
    ) -> None:
        self.cfg = cfg
        self.dense = dense
        self.refined = list(refined)
        self.run = run
        # With --refine-regions sub-blocks: the block's regions and the dense values at their boundaries.
        self.regions: Regions | None = None
        self.region_targets: tuple[torch.Tensor, ...] = ()

    def before(self, block: BlockContext) -> None:
        with phase("dense stream"), self.run.team.agreed():
            self.regions, self.region_targets, why = dense_pass(
                block.module, self.dense, block.call, self.run.device, self.cfg
            )
        if why is not None:
            self.run.say(f"  block {block.index}: {why}; refined as a whole block")

    def after(self, block: BlockContext) -> None:
        run = self.run
        job = RefineJob(
            block.module, block.index, block.inputs, block.call, self.dense, self.cfg, run.seed, run.device,
            team=run.team, nsamples=run.nsamples, progress=run.say, outputs=block.outputs,
            regions=self.regions, region_targets=self.region_targets,
        )  # fmt: skip
        with phase("refine"), run.team.agreed():
            fresh, written = refine_pruned_block(job, block.prefix, block.records)
        self.region_targets = ()  # the boundaries' values are this block's only
        self.refined += fresh
        block.outputs_ready = block.outputs_ready or written

    def done(self, block: BlockContext) -> None:
        """Nothing: the stream is the next block's already."""


@dataclass(frozen=True)
class RefineRun:
    """What the refinement takes from the run: its seed and sample count, where it computes, the team,
    and the progress sink."""

    seed: int
    nsamples: int
    device: torch.device
    team: Team
    say: Progress


@dataclass(frozen=True)
class LoopParts:
    """What the block loop is made of: where the blocks come from, how each is pruned, the watch's
    matrices, the hooks (in order), the sinks, the team and device, the background writer (drained
    before an interruption's line), where the run is, the stop request, `after_block`, the progress sink,
    the output folder (for the interruption's line), whether a resume state is saved and whether its
    commits count the blocks done (rank 0 with one)."""

    source: BlockSource
    pruner: BlockPruner
    blocks: WatchedWeights
    hooks: Sequence[BlockHook]
    sinks: Sinks
    team: Team
    device: torch.device
    writer: BackgroundWriter
    point: RunPoint
    stop: StopRequest | None
    after_block: Callable[[int], None] | None
    say: Progress
    output: Path
    saving: bool
    commits_count: bool


class BlockLoop:
    """The blocks from the start's on, in order: each read onto the device, hooked, pruned, run once more
    for the next block's inputs (unless a hook wrote them), handed to the sinks, released; one progress
    line each. A stop request is honoured before a block, on every rank at the same block."""

    def __init__(self, parts: LoopParts) -> None:
        self.parts = parts
        self.structure = parts.source.structure

    def run(self, begin: Start) -> list[LayerRecord]:
        """Every block from `begin.first` → the records of every block (the start's first)."""
        parts = self.parts
        records = list(begin.records)
        hidden = begin.hidden  # (S_r, T, H) this rank's shard of the input of the next block
        buffer = torch.empty_like(hidden) if hidden is not None else None
        blocks = len(self.structure.blocks)
        for index in bar(range(begin.first, blocks), total=blocks - begin.first, desc="blocks", unit="block"):
            self.check_stop()
            assert hidden is not None and buffer is not None  # set whenever a block is left to prune
            parts.point.current = index
            block = BlockContext(
                index, self.structure.full_name(index, ""), parts.source.load(index),
                begin.calls[index].to(parts.device), hidden, buffer, tuple(records),
            )  # fmt: skip
            self.prune(block)
            records += block.records
            hidden, buffer = buffer, hidden
            if parts.after_block is not None:
                parts.after_block(index)
        return records

    def check_stop(self) -> None:
        """Raise the interruption when a stop was requested (on any rank: the ranks stop together)."""
        parts = self.parts
        signal_name = parts.team.first_set(parts.stop.name) if parts.stop is not None else None
        if signal_name is not None:
            drain(parts.writer, parts.team)  # the line names every finished block as committed: they land first
            raise parts.point.interrupted(parts.output, saving=parts.saving, signal_name=signal_name)

    def prune(self, block: BlockContext) -> None:
        """One block (class docstring); its records into `block.records`."""
        parts, index = self.parts, block.index
        start = time.perf_counter()
        # Each phase's freed memory goes back to the system before the next phase allocates its own
        # (`memory.return_free_memory`: glibc kept 0.4-0.5 GB of the method's freed work resident through
        # the refinement); the method's own goes back in the engine, after each group of matrices.
        return_free_memory()
        for hook in parts.hooks:
            hook.before(block)
        with phase("statistics"):
            block.records = parts.pruner.prune(
                block.module, index, block.inputs, block.call, parts.blocks.observed.get(index)
            )
        block.records += parts.blocks.unused.get(index, [])
        for hook in parts.hooks:
            hook.after(block)
        return_free_memory()
        if not block.outputs_ready:
            with phase("rerun"), parts.team.agreed():  # the next block sees the pruned outputs
                run_block(block.module, block.inputs, block.call, block.outputs, parts.device)
        block.module = parts.source.park(index)
        for hook in parts.hooks:
            hook.done(block)
        # With a resume state, rank 0's block is done once committed (on the writer's thread); the other
        # ranks write nothing and count it done now.
        if not parts.commits_count:
            parts.point.done = index + 1
        parts.point.current = None
        tensors = block_tensors(block.module, block.prefix)  # holds the pruned tensors past `release`
        parts.sinks.add_block(SinkBlock(index, block.prefix, tensors, tuple(block.records)))
        parts.source.release(index)
        parts.say(_block_line(index, block.records, len(self.structure.blocks), time.perf_counter() - start))


def _block_line(index: int, records: list[LayerRecord], blocks: int, seconds: float) -> str:
    """The one progress line of a finished block (each matrix's own line is at DEBUG: `tsenor -v`)."""
    pruned = [r for r in records if r.status == "pruned"]
    dense = len(records) - len(pruned)
    worst = max((r.recon_error for r in pruned if r.recon_error is not None), default=None)  # none: no data
    errors = f", worst rel. error {worst:.4f}" if worst is not None else ""
    left = f", {dense} left dense" if dense else ""
    return f"block {index + 1}/{blocks}: {len(pruned)} pruned{left}{errors}, {seconds:.1f}s"


def drain(writer: BackgroundWriter, team: Team) -> None:
    """Wait for the background writer (its time is "save"); every rank learns of a failed write."""
    with phase("save"), team.agreed():
        writer.drain()


def load(run: RunSetup) -> tuple[LoadedModel, CalibrationData | None]:
    """The model (`steps.load_for_pruning`), with a fresh run's calibration text read before its weights,
    and its nn.Linear layers checked against the pattern."""
    cfg, texts = run.cfg, []

    def calibrate(_config: object, tokenizer: object) -> None:
        texts.append(read_calibration(cfg, run.ctx, run.plan, tokenizer))

    fresh = run.state is None or bool(cfg.loss_aware)  # --loss-aware's pass reads the text on resume too
    with phase("load"), run.team.agreed():
        loaded = load_for_pruning(
            cfg, run.ctx, run.dtype, run.say, before_weights=calibrate if fresh else None, built=run.built
        )
        check_linears(cfg, linear_slots(loaded.structure), run.plan.ignored)
    if run.plan.calibrate and run.plan.seqlen < cfg.seqlen:
        logger.warning(
            "--seqlen %d is longer than the model's %d positions; calibrating with %d",
            cfg.seqlen, run.plan.seqlen, run.plan.seqlen,
        )  # fmt: skip
    return loaded, texts[0] if texts else None


def start(run: RunSetup, source: BlockSource, calib: CalibrationData | None) -> Start:
    """The input of the first block to prune: restored from the resume state, or captured from this
    rank's shard of the calibration tokens. The activations live between blocks on the device, or on the
    CPU with --offload-activations (each sample then streamed to the device when the block needs it)."""
    cfg, team = run.cfg, run.team
    storage = CPU if cfg.offload_activations else run.device
    shard = team.shard(run.plan.calibration_samples)  # --nsamples, or one stand-in sample per process
    with phase("capture"), team.agreed():
        if run.state is not None and run.store is not None:
            # A stand-in run's one sample per process: row 0, whatever the process count that saved it.
            rows = (shard if team.distributed else None) if run.plan.calibrate else slice(0, 1)
            return restore_start(run.store, run.state, source, rows, storage, refine=cfg.refine.on)
        assert calib is not None  # a fresh run read its calibration text while loading
        run.say(f"calibration: {calib.source_description}, {tuple(calib.input_ids.shape)} tokens")
        if team.distributed:
            run.say(f"{team.world_size} processes, {shard.stop - shard.start} samples on rank 0")
        return capture_start(source, calib, shard, storage, refine=cfg.refine.on)


def restored_blocks(run: RunSetup, source: BlockSource, begin: Start) -> list[SinkBlock]:
    """The blocks the resume state holds, as the sinks receive them: from the model in memory (restored
    into it), or read from their files one tensor at a time when streamed. Every rank hands them on (each
    call is agreed by the team); only rank 0's sinks read them, so the other ranks' hold no tensor."""
    if run.store is None:
        return []
    structure, made = source.structure, []
    for index in range(begin.first):
        prefix, path = structure.full_name(index, ""), run.store.root / block_file(index)
        tensors: Mapping[str, torch.Tensor] = {}
        if run.team.is_root:
            tensors = FileTensors(path, prefix) if source.streamed else block_tensors(structure.blocks[index], prefix)
        made.append(SinkBlock(index, prefix, tensors, block_records(begin.records, index), restored=True, file=path))
    return made


def block_hooks(run: RunSetup, writer: BackgroundWriter, begin: Start) -> list[BlockHook]:
    """The run's hooks, in order: the refinement, the resume state, then the caller's."""
    hooks: list[BlockHook] = []
    refine = None
    if begin.dense is not None:
        place = RefineRun(run.cfg.seed, run.cfg.nsamples, run.device, run.team, run.say)
        refine = RefineHook(run.cfg.refine, begin.dense, begin.refinement, place)
        hooks.append(refine)
    if run.store is not None:
        point = run.point
        record = ResumeRecord(
            run.state, run.cfg.result_hash(), run.plan.calibration_samples, run.plan.blocks, begin.calibration,
            begin.calibration_source,
        )  # fmt: skip

        def committed(index: int) -> None:
            point.done = index + 1

        hooks.append(ResumeHook(run.store, writer, run.team, record, refine=refine, committed=committed))
    return [*hooks, *run.hooks]


def block_pruner(run: RunSetup, structure: ModelStructure, blocks: WatchedWeights) -> BlockPruner:
    """How each block is pruned: the watched matrices, the method, its settings and policies."""
    cfg = run.cfg
    return BlockPruner(
        structure, blocks.slots, get_pruner(cfg.method), cfg.matrix, run.device, logger.debug,
        skipped=blocks.skipped, ignored=blocks.ignored, sequential=cfg.sequential,
        moe=MoeOptions(cfg.moe_calibration, cfg.moe_min_tokens), team=run.team,
    )  # fmt: skip


def execute(run: RunSetup) -> PruneReport:
    """Load, calibrate, watch, prune every block, prune the selected linears outside the language model,
    and hand the result to the sinks (module docstring) → the report (every rank's)."""
    cfg, team = run.cfg, run.team
    loaded, calib = load(run)
    structure = loaded.structure
    linears = outside_linears(loaded, run.plan, run.say, root=team.is_root)
    check = finite_block_check(cfg, structure.blocks_name)
    source = BlockSource(structure, run.device, checkpoint=loaded.checkpoint, checked=check)
    writer = BackgroundWriter(WRITER_DEPTH)
    folder = run.store.root if run.store is not None else None
    checkpoint = CheckpointSink(loaded, run.output, cfg, streamed=source.streamed, folder=folder, writer=writer)
    sinks = Sinks([checkpoint, *run.sinks], team, structure, streamed=source.streamed)
    # The writer drains (and its thread ends) before the sinks remove their folders of kept blocks.
    with contextlib.closing(sinks), writer:
        rows = loss_rows(run, loaded, source, calib)
        begin = start(run, source, calib)
        with phase("watch"):
            blocks = watch_blocks(cfg, run.plan, source, linear_slots(structure), begin, team)
        say_matrices(structure, blocks, run.say)
        first = RunStart(cfg, run.output, loaded, source.streamed, len(structure.blocks), begin.first)
        sinks.begin(first, restored_blocks(run, source, begin))
        hooks = block_hooks(run, writer, begin)
        parts = LoopParts(
            source, replace(block_pruner(run, structure, blocks), row_weights=rows), blocks, hooks, sinks, team,
            run.device, writer,
            run.point, run.stop, run.after_block, run.say, run.output, saving=run.store is not None,
            commits_count=run.store is not None and team.is_root,
        )  # fmt: skip
        records = BlockLoop(parts).run(begin)
        drain(writer, team)  # every block's files complete before the sinks read or follow them
        records += prune_outside(linears, run.plan.outside_targets, cfg.matrix, run.say)
        run.say(f"writing {run.output}")
        run.point.writing = True
        refine = next((h for h in hooks if isinstance(h, RefineHook)), None)
        refined = refine.refined if refine is not None else begin.refinement
        facts = RunFacts(cfg, run.ctx, run.plan, run.device, team, run.started, run.timings.seconds)
        metadata = sparsity_record(cfg, records, cfg.solver_that_runs(run.device))
        report = sinks.finish(
            loaded.model, metadata, lambda counts: build_report(facts, counts, records, begin, refined)
        )
    # The report (file and summary alike) holds the phases up to its making, its "other" the rest; this
    # line has every phase, the write included, and the writer thread's time beside them.
    run.timings.background["save"] = writer.busy
    run.say(run.timings.line(time.perf_counter() - run.started))
    return report
