"""One prune run: `PruneRun`, the object that holds what every step of a run shares.

`api.prune_model` checks the output, makes the plan (`pruning/plan.py`), takes the lock and opens the
resume state, then builds a `PruneRun` and calls `execute`, which runs the steps docs/architecture.md
names: load the model and read the calibration text (`load`), capture the input of the first block to
prune or restore it from the resume state (`calibrate`), watch the blocks' dense forwards (`watch`),
prune block by block (`prune_blocks`), then hand the result to the checkpoint's writer
(`writer.CheckpointSink`). The run uses the plan it was given and decides no selection itself: the
calibration length, the `--ignore`/`--targets` selection (`PrunePlan.ignored` for the nn.Linear check
before calibration, `PrunePlan.selection` applied to the watched matrices) and the linears `--targets`
selects outside the language model are the plan's. Only the watch is the run's own: it sees the real
blocks' forwards, which the plan (made without reading a weight) cannot.

Where the blocks' weights come from is the run's `BlockSource` policy (`replay/source.py`: offloaded
for a whole load, streamed from the checkpoint); how a block is pruned is its `engine.BlockPruner`
(method, sequential groups, MoE statistics, the team of processes); what else happens to a block is
a per-block hook: `--refine block` (`RefineHook`: the dense stream and the refinement) and the
resume state (`_save`). Every step's wall time goes into `timings` (`Timings`), which add up to the
run's total.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from tsenor_cli.errors import Interrupted, UsageError
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.progress import Progress, bar, logger
from tsenor_cli.pruning.background import WRITER_DEPTH, BackgroundWriter
from tsenor_cli.pruning.config import PruneConfig
from tsenor_cli.pruning.distributed import Team
from tsenor_cli.pruning.engine import BlockPruner
from tsenor_cli.pruning.finite import check_finite
from tsenor_cli.pruning.gather import MoeOptions, observe_blocks
from tsenor_cli.pruning.observe import BlockObservation
from tsenor_cli.pruning.output import interruption, sparsity_record
from tsenor_cli.pruning.outside import REASON as OUTSIDE_REASON
from tsenor_cli.pruning.outside import prune_outside
from tsenor_cli.pruning.phases import phase
from tsenor_cli.pruning.plan import PrunePlan, say_ruled, weight_plan
from tsenor_cli.pruning.refine import refine_pruned_block
from tsenor_cli.pruning.registry import get_pruner
from tsenor_cli.pruning.report import versions
from tsenor_cli.pruning.resume import ResumeStore
from tsenor_cli.pruning.slots import LinearSlot, check_compatibility, linear_slots
from tsenor_cli.pruning.types import LayerRecord
from tsenor_cli.pruning.writer import CheckpointSink, WeightCounts
from tsenor_cli.replay import BlockCall, BlockSource, capture_block_calls, capture_block_inputs, run_block
from tsenor_cli.replay.source import CPU
from tsenor_cli.runfiles import BlockRefinement, ContextRecord, DataSource, PruneReport, ResumeState
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
            saved = f"the resume state holds blocks 1-{self.done}: rerun the same command to continue"
        else:
            saved = "no block was finished: rerunning the same command starts over"
        return interruption(signal_name, where, saved)


# The run's phases in the order a run meets them; `Timings.line` prints them in this order.
RUN_PHASES = (
    "plan",
    "load",
    "calibrate",
    "watch",
    "statistics",
    "method",
    "solver",
    "refine",
    "rerun",
    "save",
    "write",
)


@dataclass
class Timings:
    """Wall seconds per phase of a run (`RUN_PHASES`), each measured once, none nested in another, so
    they add up to the time they cover; `other` is what is left of the total."""

    seconds: dict[str, float] = field(default_factory=dict)
    # Seconds of work on another thread (the background writer's "save"): they overlap the phases, so
    # they are shown beside the sum, never in it.
    background: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def line(self, total: float) -> str:
        """ "time 12.3 s: load 1.0 s, calibrate 0.5 s, …, other 0.1 s" (phases that took no time left out)."""
        parts = [(name, self.seconds[name]) for name in (*RUN_PHASES, "eval") if self.seconds.get(name)]
        other = total - sum(seconds for _, seconds in parts)
        shown = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in (*parts, ("other", max(other, 0.0))))
        beside = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.background.items() if seconds)
        return f"time {total:.1f} s: {shown}" + (f" (in the background, overlapping them: {beside})" if beside else "")


@dataclass(frozen=True)
class _Payload:
    """What the background writer needs of block `index` for `ResumeStore.save_block`, taken when the
    block is done (`PruneRun._save`): its parameters, the next block's inputs (whole, on rank 0; None
    after the last block) and the dense stream's, the records so far and the calibration's description."""

    index: int
    block: dict[str, torch.Tensor]
    hidden: torch.Tensor | None
    dense: torch.Tensor | None
    records: list[LayerRecord]
    refinement: tuple[BlockRefinement, ...]
    calibration: str
    calibration_source: DataSource


def _owned(tensor: torch.Tensor | None, buffer: torch.Tensor | None) -> torch.Tensor | None:
    """`tensor` as the background writer may hold it: copied to the CPU when it is the loop's `buffer`
    (written again by a later block), else as it is (a gathered copy, or None)."""
    return tensor.to(CPU, copy=True) if tensor is not None and tensor is buffer else tensor


@dataclass
class Start:
    """Where the block loop starts: the first block to prune (0, or the resume state's next block), the
    records of the blocks before it, this rank's shard of that block's input `hidden` (S_r, T, H; None
    once every block is done), what the model passes each block (`calls`), and the calibration text's
    description and source. With --refine block: `dense`, the same shard of that block's input in the
    dense model (the dense stream, pruning/refine.py), and the records of the blocks refined before it."""

    first: int
    records: list[LayerRecord]
    hidden: torch.Tensor | None
    calls: Sequence[BlockCall]
    calibration: str
    calibration_source: DataSource
    dense: torch.Tensor | None = None
    refinement: tuple[BlockRefinement, ...] = ()


@dataclass(frozen=True)
class BlockPlan:
    """The run's weight matrices once the blocks' dense forwards were watched: slots, those left dense
    (`ignored`) or skipped (the pattern does not fit), the records of block parameters that are not
    matmul weights (per block), and each watched block's observation."""

    slots: list[LinearSlot]
    ignored: dict[str, str]
    skipped: dict[str, str]
    unused: dict[int, list[LayerRecord]]
    observed: dict[int, BlockObservation]


class RefineHook:
    """`--refine block` as a per-block hook: the dense stream (S_r, T, H) runs through each dense block
    before it is pruned (in place: its outputs are the refinement's targets and the next block's dense
    inputs), and once pruned the block trains towards them (`refine.refine_pruned_block`)."""

    def __init__(self, run: PruneRun, dense: torch.Tensor, refined: tuple[BlockRefinement, ...]) -> None:
        self.run = run
        self.dense = dense
        self.refined = list(refined)

    def before(self, block: nn.Module, call: BlockCall) -> None:
        with phase("dense stream"), self.run.timings.phase("refine"), self.run.team.agreed():
            run_block(block, self.dense, call, self.dense, self.run.device)

    def after(
        self,
        block: nn.Module,
        index: int,
        call: BlockCall,
        records: list[LayerRecord],
        hidden: torch.Tensor,
        out: torch.Tensor,
    ) -> bool:
        """Refine block `index` → whether `out` now holds its outputs on `hidden` (a kept refinement's
        last error pass wrote them, so the block need not run again)."""
        run, cfg = self.run, self.run.cfg
        with phase("refine"), run.timings.phase("refine"), run.team.agreed():
            prefix = run.structure.full_name(index, "")
            fresh, written = refine_pruned_block(
                block, index, prefix, records, hidden, call, self.dense, cfg.refine,
                seed=cfg.seed, device=run.device, team=run.team, nsamples=cfg.nsamples, progress=run.say, outputs=out,
            )  # fmt: skip
        self.refined += fresh
        return written


class PruneRun:
    """One prune run under the output lock (module docstring).

    store: the resume state's store when the run saves one (None with --no-resume-state); state: the
    interrupted run's state to continue (None for a fresh run); point: where the run is, for the line an
    interruption prints; stop: polled before each block; after_block(i): runs once block i is done and
    its resume state handed to the background writer, which finishes it however the run ends (tests
    simulate a kill with it; a real kill during the write: tests/test_background_writer.py); built: a
    model already in memory to prune instead of loading `cfg.model`; started: the run's start
    (`time.perf_counter()`), for the report's seconds.
    """

    def __init__(
        self,
        cfg: PruneConfig,
        ctx: RunContext,
        plan: PrunePlan,
        *,
        output: Path,
        team: Team,
        device: torch.device,
        dtype: torch.dtype,
        say: Progress,
        point: RunPoint,
        store: ResumeStore | None = None,
        state: ResumeState | None = None,
        stop: StopRequest | None = None,
        after_block: Callable[[int], None] | None = None,
        built: LoadedModel | None = None,
        started: float | None = None,
    ) -> None:
        self.cfg, self.ctx, self.plan = cfg, ctx, plan
        self.output, self.team, self.device, self.dtype = output, team, device, dtype
        self.say, self.point, self.store, self.state = say, point, store, state
        self.stop, self.after_block, self.built = stop, after_block, built
        self.started = time.perf_counter() if started is None else started
        self.timings = Timings()

    @property
    def structure(self) -> ModelStructure:
        return self.loaded.structure

    def execute(self) -> PruneReport:
        """Load, calibrate, watch, prune every block, prune the selected linears outside the language
        model, and write (module docstring) → the report (every rank's)."""
        cfg, team = self.cfg, self.team
        with self.timings.phase("load"):
            self.loaded, slots, calib = self.load()
        structure = self.structure
        beyond = self.plan.beyond
        linears = {w.name: cast(nn.Linear, self.loaded.model.get_submodule(w.name)) for w in beyond}
        if structure.outside:
            dense = [name for name in structure.outside if not any(w.name.startswith(f"{name}.") for w in beyond)]
            if dense:
                self.say(f"left dense, outside the language model {structure.base_name}: {', '.join(dense)}")
        if beyond and team.is_root:
            # The report says it per record too; a user who asked for --method wanda must see it now.
            logger.warning("--targets selects %d linear(s) outside the language model: %s", len(beyond), OUTSIDE_REASON)
        if self.plan.seqlen < cfg.seqlen:
            logger.warning(
                "--seqlen %d is longer than the model's %d positions; calibrating with %d",
                cfg.seqlen, self.plan.seqlen, self.plan.seqlen,
            )  # fmt: skip
        self.source = BlockSource(structure, self.device, checkpoint=self.loaded.checkpoint, checked=self._finite_block)
        folder = self.store.root if self.store is not None else None
        self.writer = BackgroundWriter(WRITER_DEPTH)
        self.sink = CheckpointSink(
            self.loaded, self.output, streamed=self.source.streamed, folder=folder, team=team,
            max_shard_size=cfg.max_shard_size, dtype=cfg.dtype, writer=self.writer, save_format=cfg.save_format,
        )  # fmt: skip
        # The writer drains (and its thread ends) before the sink removes its folder of kept blocks.
        with contextlib.closing(self.sink), self.writer:
            with self.timings.phase("calibrate"):
                begin = self.calibrate(calib)
            with self.timings.phase("watch"):
                plan = self.watch(slots, begin)
            records, refined = self.prune_blocks(begin, plan)
            self._drain()  # every block's files complete before the write reads or follows them
            records += prune_outside(linears, beyond, cfg.layer, self.say)
            self.say(f"writing {self.output}")
            self.point.writing = True
            metadata = sparsity_record(cfg, records, cfg.solver_that_runs(self.device))
            with self.timings.phase("write"):
                report = self.sink.write(lambda counts: self.report(counts, records, refined, begin), metadata)
        # The report (file and summary alike) holds the phases up to its making, its "other" the rest; this
        # line has every phase, the write included, and the writer thread's time beside them.
        self.timings.background["save"] = self.writer.busy
        self.say(self.timings.line(time.perf_counter() - self.started))
        return report

    def _finite_block(self, block: nn.Module, index: int) -> None:
        """The check of each block a streamed run reads from the checkpoint: its weights finite."""
        check_finite(
            block.named_parameters(prefix=f"{self.structure.blocks_name}.{index}"),
            where=f"model {self.cfg.model}",
            fix="the checkpoint is corrupt; re-download or re-convert it (nothing was written)",
        )

    def load(self) -> tuple[LoadedModel, list[LinearSlot], CalibrationData | None]:
        """Load the model on the CPU (unless `built`) and, for a fresh run, its calibration text → (the
        model, its linear slots, the calibration data or None when a resume state supplies the inputs).
        With `cfg.stream` and a safetensors checkpoint on disk only what lies outside the decoder blocks
        is read (`models/streaming.py`); anything else (a pickle checkpoint, a hub id, a model built in
        memory) is loaded whole, with one line saying so.

        Every weight is checked finite, and the nn.Linear layers against the pattern, before calibration."""
        from tsenor_cli.data.calibration import calibration_batches
        from tsenor_cli.models.loading import load_model

        cfg, team, state = self.cfg, self.team, self.state
        fresh: list[CalibrationData] = []

        def calibrate(_config: Any, tokenizer: Any) -> None:
            # Before the weights load: calibration text too short for --nsamples × --seqlen is found in
            # seconds, not after minutes of reading a large checkpoint.
            with phase("calibration"):
                batches = calibration_batches(
                    cfg.calib_data, tokenizer, self.ctx, nsamples=cfg.nsamples, seqlen=self.plan.seqlen, seed=cfg.seed
                )
            fresh.append(batches)

        with team.agreed():
            if self.built is not None:
                if cfg.stream:
                    self.say("the model is built in memory, not read from a checkpoint: it is held whole")
                loaded = self.built
                if state is None:
                    calibrate(loaded.model.config, loaded.tokenizer)
            else:
                loaded = load_model(
                    cfg.model, self.ctx, dtype=self.dtype, device="cpu", trust_remote_code=cfg.trust_remote_code,
                    progress=self.say, before_weights=calibrate if state is None else None, check_tokenizer=True,
                    stream=cfg.stream,
                )  # fmt: skip
            _check_loaded(cfg, loaded)
            slots = linear_slots(loaded.structure)
            ignored = self.plan.ignored  # the plan's selection (module docstring), not made again here
            # The nn.Linear layers are checked now, before calibration; the other matrices once the forward
            # has shown their orientation and role (`watch`). A one-output layer is a gate (observe.py),
            # left dense then whatever its shape.
            linear_only = [s for s in slots if not s.param and s.full_name not in ignored and s.out_features > 1]
            if linear_only:
                check_compatibility(linear_only, cfg.pattern, skip=cfg.skip_incompatible)
        return loaded, slots, fresh[0] if fresh else None

    def calibrate(self, calib: CalibrationData | None) -> Start:
        """The input of the first block to prune: from the resume state (its blocks restored into the model,
        unless streamed: the write reads them from its files), or captured from the calibration tokens by the
        model's own forward, this rank's shard of them (block 0 read for it when streamed).

        The activations live between blocks on the device, or on the CPU with --offload-activations (each
        sample then streamed to the device when the block needs it). With --refine block the dense stream
        starts as the same input (fresh) or comes from the resume state beside it."""
        cfg, team, store, state, structure = self.cfg, self.team, self.store, self.state, self.structure
        storage = CPU if cfg.offload_activations else self.device
        shard = team.shard(cfg.nsamples)
        with team.agreed():
            if state is not None and store is not None:
                if not self.source.streamed:
                    store.restore_blocks(structure.blocks, state)
                begin = Start(
                    state.next_block, list(state.records), None, (), state.calibration, state.calibration_source
                )
                begin.refinement = state.refinement
                if begin.first < len(structure.blocks):
                    rows = shard if team.distributed else None
                    begin.hidden = store.load_hidden(state, storage, rows=rows)
                    if cfg.refine.on:
                        begin.dense = store.load_hidden(state, storage, rows=rows, stream="dense")
                    with self.source.resident(0, to=CPU):  # the record runs block 0 once to learn its output type
                        begin.calls = capture_block_calls(structure, int(begin.hidden.shape[1]))
                return begin
            assert calib is not None  # a fresh run read its calibration text while loading
            self.say(f"calibration: {calib.source_description}, {tuple(calib.input_ids.shape)} tokens")
            if team.distributed:
                self.say(f"{team.world_size} processes, {shard.stop - shard.start} samples on rank 0")
            with phase("capture"), self.source.resident(0, to=CPU):
                inputs = capture_block_inputs(structure, calib.input_ids[shard], storage)
            dense = inputs.hidden.clone() if cfg.refine.on else None
            return Start(0, [], inputs.hidden, inputs.calls, str(calib.source_description), calib.source, dense)

    def watch(self, slots: list[LinearSlot], begin: Start) -> BlockPlan:
        """Watch the dense forward of the blocks left to prune (one sample; a streamed run reads each block
        for it and releases it) and settle the run's weight matrices from what they multiply by
        (`plan.weight_plan`), checking them against the pattern as the nn.Linear layers were. A kind of
        weight left dense by a rule is said once on stderr. The selection is the plan's (`PrunePlan.selection`)."""
        cfg, team, structure = self.cfg, self.team, self.structure
        observed: dict[int, BlockObservation] = {}
        if begin.hidden is not None:
            with phase("capture"), team.agreed():
                observed = observe_blocks(self.source, begin.hidden[:1], begin.calls, begin.first)
        with team.agreed():
            accounted = weight_plan(structure, slots, observed, self.plan.selection)
            say_ruled(accounted)
            candidates = [s for s in accounted.slots if s.full_name not in accounted.ignored]
            skipped = check_compatibility(candidates, cfg.pattern, skip=cfg.skip_incompatible)
            if cfg.targets and begin.first == 0:
                _check_targets_run(candidates, begin.calls, has_outside=bool(self.plan.beyond))
        matrices = sum(s.matrices for s in accounted.slots)
        blocks = f"{len(structure.blocks)} blocks in {structure.blocks_name}"
        self.say(f"{structure.model_type}: {blocks}, {matrices} weight matrices")
        if accounted.ignored:
            self.say(f"leaving {len(accounted.ignored)} weight(s) dense (--ignore/--targets, routers and gates)")
        return BlockPlan(accounted.slots, accounted.ignored, skipped, accounted.unused, observed)

    def prune_blocks(self, begin: Start, plan: BlockPlan) -> tuple[list[LayerRecord], tuple[BlockRefinement, ...]]:
        """The block loop → every layer's record and every refined block's (`prune_one`, per block)."""
        cfg = self.cfg
        pruner = BlockPruner(
            self.structure, plan.slots, get_pruner(cfg.method), cfg.layer, self.device, logger.debug,
            skipped=plan.skipped, ignored=plan.ignored, sequential=cfg.sequential,
            moe=MoeOptions(cfg.moe_calibration, cfg.moe_min_tokens), team=self.team,
        )  # fmt: skip
        records = list(begin.records)
        refine = RefineHook(self, begin.dense, begin.refinement) if begin.dense is not None else None
        hidden = begin.hidden  # (S_r, T, H) this rank's shard of the input of the next block
        buffer = torch.empty_like(hidden) if hidden is not None else None
        blocks = len(self.structure.blocks)
        for index in bar(range(begin.first, blocks), total=blocks - begin.first, desc="blocks", unit="block"):
            # The ranks stop together, at the same block, even when the signal reached only some of them.
            signal_name = self.team.first_set(self.stop.name) if self.stop is not None else None
            if signal_name is not None:
                self._drain()  # the line names every finished block as committed: its writes land first
                raise self.point.interrupted(self.output, saving=self.store is not None, signal_name=signal_name)
            assert hidden is not None and buffer is not None  # set whenever a block is left to prune
            self.point.current = index
            records += self.prune_one(index, pruner, plan, begin, records, hidden, buffer, refine)
            hidden, buffer = buffer, hidden
            if self.after_block is not None:
                self.after_block(index)
        return records, tuple(refine.refined) if refine is not None else begin.refinement

    def prune_one(
        self,
        index: int,
        pruner: BlockPruner,
        plan: BlockPlan,
        begin: Start,
        records: list[LayerRecord],
        hidden: torch.Tensor,
        out: torch.Tensor,
        refine: RefineHook | None,
    ) -> list[LayerRecord]:
        """Block `index`: read it (`source.load`: from the checkpoint when streamed) onto the device; the
        refinement's dense stream; prune its matrices group by group (`BlockPruner.prune`); refine it;
        run it once more so the next block sees the pruned outputs `out` (not needed after a kept
        refinement, whose last error pass wrote them); back to the CPU; the resume state; release it
        (kept on disk first for the write when streamed without a resume state) → its records."""
        start = time.perf_counter()
        block = self.source.load(index)
        call = begin.calls[index].to(self.device)
        if refine is not None:
            refine.before(block, call)
        pruned_before = time.perf_counter()
        mine = pruner.prune(block, index, hidden, call, plan.observed.get(index))
        self._add_prune_time(mine, time.perf_counter() - pruned_before)
        mine += plan.unused.get(index, [])
        rerun = True
        if refine is not None:
            rerun = not refine.after(block, index, call, [*records, *mine], hidden, out)
        if rerun:
            with phase("rerun"), self.timings.phase("rerun"), self.team.agreed():
                run_block(block, hidden, call, out, self.device)  # the next block sees the pruned outputs
        self.source.park(index)
        if self.store is not None:
            self._save(index, block, [*records, *mine], begin, out, refine)
        # With a resume state, rank 0's block is done once committed (`_commit`, on the writer's thread);
        # the other ranks write nothing and count it done now.
        if self.store is None or not self.team.is_root:
            self.point.done = index + 1
        self.point.current = None
        with phase("save"), self.timings.phase("save"):  # a streamed run without a resume state: its block file
            self.sink.keep(index, block)
        self.source.release(index)
        self.say(self._block_line(index, mine, time.perf_counter() - start))
        return mine

    def _add_prune_time(self, records: list[LayerRecord], seconds: float) -> None:
        """Split `BlockPruner.prune`'s wall time into the method's (its updates, less the solver's), the
        mask solver's (both from the records) and the statistics (the rest: the watched and hooked passes)."""
        method = sum(r.seconds or 0.0 for r in records if r.status == "pruned")
        solver = sum(r.solver_seconds or 0.0 for r in records if r.status == "pruned")
        self.timings.add("solver", solver)
        self.timings.add("method", max(method - solver, 0.0))
        self.timings.add("statistics", max(seconds - method, 0.0))

    def _block_line(self, index: int, records: list[LayerRecord], seconds: float) -> str:
        """The one progress line of a finished block (each matrix's own line is at DEBUG: `tsenor -v`)."""
        pruned = [r for r in records if r.status == "pruned"]
        dense = len(records) - len(pruned)
        worst = max((r.recon_error or 0.0 for r in pruned), default=None)
        errors = f", worst rel. error {worst:.4f}" if worst is not None else ""
        left = f", {dense} left dense" if dense else ""
        return f"block {index + 1}/{len(self.structure.blocks)}: {len(pruned)} pruned{left}{errors}, {seconds:.1f}s"

    def _save(
        self,
        index: int,
        block: nn.Module,
        records: list[LayerRecord],
        begin: Start,
        hidden: torch.Tensor,
        refine: RefineHook | None,
    ) -> None:
        """Rank 0 queues the resume state after block `index` for the background writer (`_commit`): its
        pruned weights, the next block's inputs gathered from every rank, the dense stream with --refine
        block. The time here (the gather, the snapshot, a wait for the writer) is "save"."""
        assert self.store is not None
        cfg, team = self.cfg, self.team
        last = index == len(self.structure.blocks) - 1
        with phase("save"), self.timings.phase("save"):
            whole = None if last else team.gather_samples(hidden, cfg.nsamples)
            whole_dense = None if last or refine is None else team.gather_samples(refine.dense, cfg.nsamples)
            refinement = tuple(refine.refined) if refine is not None else begin.refinement

            def snapshot() -> _Payload:
                # The loop writes into its hidden-state buffers again (the rerun two blocks on writes
                # `hidden`'s buffer, the next dense forward `refine.dense` in place): what a queued write
                # reads must be its own copy. A distributed gather is a new tensor already, and the
                # block's parameters are not changed once it is done (streamed, `release` swaps them for
                # meta tensors and the state dict keeps the pruned ones alive until written).
                dense = refine.dense if refine is not None else None
                return _Payload(
                    index, dict(block.state_dict()), _owned(whole, hidden), _owned(whole_dense, dense),
                    list(records), refinement, begin.calibration, begin.calibration_source,
                )  # fmt: skip

            with team.agreed():
                if team.is_root:
                    self.writer.submit(snapshot, self._commit)

    def _commit(self, payload: _Payload) -> None:
        """On the writer's thread: `ResumeStore.save_block` (its files, their sha256s, the state JSON last),
        then the run's point counts the block done, so an interruption's line names only committed blocks."""
        assert self.store is not None
        self.state = self.store.save_block(
            payload.index, payload.block, payload.hidden, self.state, payload.records, self.cfg.result_hash(),
            payload.calibration, payload.calibration_source, len(self.structure.blocks), dense=payload.dense,
            refinement=payload.refinement,
        )  # fmt: skip
        self.point.done = payload.index + 1

    def _drain(self) -> None:
        """Wait for the background writer (its time is "save"); every rank learns of a failed write."""
        with phase("save"), self.timings.phase("save"), self.team.agreed():
            self.writer.drain()

    def report(
        self, counts: WeightCounts, records: list[LayerRecord], refined: tuple[BlockRefinement, ...], begin: Start
    ) -> PruneReport:
        """tsenor_report.json's content: the settings that decided the weights, the layer records, the
        calibration's source, the densities of the pruned model, the refined blocks' records."""
        cfg, team, device = self.cfg, self.team, self.device
        settings_dict = {
            **cfg.result_fields(),
            "result_hash": cfg.result_hash(),  # what a rerun of the same command compares (output.finished_run)
            "device": str(device),
            "seqlen": self.plan.seqlen,
            "solver": cfg.solver_that_runs(device),
            # Provenance: the result does not depend on it (docs/reliability.md), the timings do.
            "threads": torch.get_num_threads(),
        }
        if team.distributed:
            settings_dict["processes"] = team.world_size
        p = cfg.pattern
        return PruneReport(
            method=cfg.method,
            pattern=None if p.kind == "unstructured" else p,
            sparsity=float(p.sparsity),
            settings=settings_dict,
            layers=tuple(records),
            calibration=begin.calibration,
            seconds=time.perf_counter() - self.started,
            output=str(cfg.output),
            command=cfg.command,
            versions=versions(),
            resumed_from_block=begin.first if begin.first else None,
            calibration_source=begin.calibration_source,
            context=ContextRecord.of(self.ctx),
            model_params=counts.model_params,
            model_nonzero=counts.model_nonzero,
            linear_params=counts.linear_params,
            linear_nonzero=counts.linear_nonzero,
            refinement=refined,
            phases=dict(self.timings.seconds),
        )


def _check_targets_run(candidates: Sequence[LinearSlot], calls: Sequence[BlockCall], *, has_outside: bool) -> None:
    """A --targets selection that leaves no matrix to prune (every one it names is left dense: not a
    matmul weight of its block's forward, or no nn.Linear in a block the text-only forward skips, whose
    orientation no forward shows: `idle.prune_unreached`) is refused, as a selection that matches nothing
    is (`selection.excluded_layers`), instead of writing a dense copy with exit 0. Weights of blocks the
    text-only forward skips (Mllama's cross-attention layers) are prunable (`pruning/idle.py`)."""
    if has_outside or any(calls[s.block].runs or not s.param for s in candidates):
        return
    shown = ", ".join(sorted({s.full_name for s in candidates})[:3]) or "no weight matrix of the decoder blocks"
    raise UsageError(
        f"--targets selects nothing tsenor can prune ({shown}: each is left dense), so nothing would be "
        "pruned; target nn.Linear layers or other matmul weights of the decoder blocks, or drop --targets"
    )


def _check_loaded(cfg: PruneConfig, loaded: LoadedModel) -> None:
    """All weights at once, before calibration: a NaN in the last block should not cost a run to find. A
    streamed run's blocks are still on the meta device: each is checked when it is read (`BlockSource.load`),
    the first time by the watch pass, before any block is pruned."""
    check_finite(
        ((name, p) for name, p in loaded.model.named_parameters() if not p.is_meta),
        where=f"model {cfg.model}",
        fix="the checkpoint is corrupt; re-download or re-convert it (nothing was written)",
    )
