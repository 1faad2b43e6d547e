"""Library entry points: `prune_model(cfg, ctx) -> PruneReport` and `prune_and_evaluate` (`tsenor prune
--eval`); the dry run's `plan_model` is in pruning/plan.py.

`ctx` (settings.RunContext) says where calibration data and hub models may come from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tsenor_cli import atomic
from tsenor_cli.errors import EXIT_RESUMABLE, EXIT_SIGINT, Interrupted, ResumeStateError, UsageError
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.progress import Progress, bar, logger, sink
from tsenor_cli.pruning.config import PruneConfig
from tsenor_cli.pruning.distributed import Team, joined
from tsenor_cli.pruning.engine import (
    BlockCall,
    BlockInputs,
    LinearSlot,
    MoeOptions,
    capture_block_calls,
    capture_block_inputs,
    check_compatibility,
    linear_slots,
    observe_blocks,
    prune_block,
    run_block,
)
from tsenor_cli.pruning.finite import check_finite
from tsenor_cli.pruning.memory import check_fits
from tsenor_cli.pruning.observe import BlockObservation
from tsenor_cli.pruning.output import (
    check_free_space,
    check_not_input,
    check_output_location,
    finished_run,
    output_lock,
    output_path,
    prepare_output,
    sparsity_record,
    write_checkpoint,
)
from tsenor_cli.pruning.outside import REASON as OUTSIDE_REASON
from tsenor_cli.pruning.outside import check_outside, outside_linears, prune_outside, selected_outside
from tsenor_cli.pruning.phases import phase
from tsenor_cli.pruning.plan import dtype_and_device, plan_model, say_ruled, weight_plan
from tsenor_cli.pruning.refine import refine_pruned_block
from tsenor_cli.pruning.registry import get_pruner
from tsenor_cli.pruning.report import versions
from tsenor_cli.pruning.resume import ResumeStore
from tsenor_cli.pruning.selection import excluded_layers
from tsenor_cli.pruning.streamed import BlockSource, WeightCounts
from tsenor_cli.pruning.types import LayerRecord
from tsenor_cli.runfiles import (
    EVAL_FILE,
    BlockRefinement,
    ContextRecord,
    DataSource,
    EvalReport,
    PruneReport,
    ResumeState,
    SparsityRecord,
)
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.data.calibration import CalibrationData
    from tsenor_cli.evaluation.runner import EvalConfig
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.models.structure import ModelStructure


def dense_calibration_inputs(
    model: str, ctx: RunContext, *, nsamples: int, seqlen: int, seed: int = 0, calib_data: str = "c4"
) -> tuple[LoadedModel, BlockInputs]:
    """The unpruned model (fp32 on CPU) and its calibration inputs: hidden states entering block 0
    (S, T, H) and what the model passes each block besides them.

    For analyses that walk the dense model block by block (scripts/pattern_cost.py,
    scripts/alps_layer_study.py); calibration data come from where `ctx` says.
    """
    from tsenor_cli.data.calibration import calibration_batches
    from tsenor_cli.models.loading import load_model

    loaded = load_model(model, ctx, dtype=torch.float32, device="cpu", trust_remote_code=False)
    calib = calibration_batches(calib_data, loaded.tokenizer, ctx, nsamples=nsamples, seqlen=seqlen, seed=seed)
    return loaded, capture_block_inputs(loaded.structure, calib.input_ids, torch.device("cpu"))


def _observed_plan(
    structure: ModelStructure,
    static: Sequence[LinearSlot],
    observed: dict[int, BlockObservation],
    cfg: PruneConfig,
    say: Progress,
    selectable: Sequence[str] = (),
) -> tuple[list[LinearSlot], dict[str, str], dict[str, str], dict[int, list[LayerRecord]]]:
    """The run's weight matrices once the blocks' forwards were watched: (slots, ignored, skipped, the
    records of block parameters that are not matmul weights, per block) (`plan.weight_plan`), and the
    compatibility check as for nn.Linear layers. A kind of weight left dense by a rule is said once on stderr.
    selectable: the linears outside the language model --targets may name (`pruning/outside.py`).
    """
    plan = weight_plan(structure, static, observed, cfg, selectable)
    slots, ignored, unused = plan.slots, plan.ignored, plan.unused
    say_ruled(plan)
    candidates = [s for s in slots if s.full_name not in ignored]
    skipped = check_compatibility(candidates, cfg.pattern, skip=cfg.skip_incompatible)
    return slots, ignored, skipped, unused


def prune_model(
    cfg: PruneConfig,
    ctx: RunContext,
    progress: Progress | None = None,
    *,
    after_block: Callable[[int], None] | None = None,
    stop: StopRequest | None = None,
    built: LoadedModel | None = None,
) -> PruneReport:
    """Prune `cfg.model` block by block and write the checkpoint + reports to `cfg.output`.

    Before any weights are read: the output location is checked (writable, not the input, room for
    the checkpoint and resume state). Then, holding the output's lock until the checkpoint is in
    place: a killed run's leftovers are recovered, the folder's contents checked (`prepare_output`),
    and with `cfg.resume` an interrupted run of the same settings is continued; its state is saved
    after every block (pruning/resume.py) and goes away with the final swap.

    stop: polled before each block; once set (the CLI sets it on SIGTERM/SIGUSR1/SIGUSR2,
    tsenor_cli.interrupt) the run raises `Interrupted` (exit 75) with its resume state saved.
    KeyboardInterrupt (Ctrl-C) becomes `Interrupted` (exit 130) saying what was saved.
    after_block(i) runs once block i is done and its resume state is saved (tests use it to simulate a
    kill). built: a model already in memory to prune instead of loading `cfg.model` (`tsenor bench
    prune`: random weights at a published shape); `cfg.model` must then be a folder with its config.json
    and tokenizer, which the plan and the checkpoint use. Raises a `TsenorError` subclass for every
    input the user can fix, before any output exists.
    """
    start = time.perf_counter()
    if cfg.output is None:
        raise UsageError("--output is required to prune; pass --output DIR (or --dry-run to only print the plan)")
    place = ctx.distributed
    if cfg.nsamples < place.world_size:
        raise UsageError(
            f"--nsamples {cfg.nsamples} is fewer than the {place.world_size} processes of the run; "
            "pass at least one calibration sample per process"
        )
    # In a distributed run rank 0 speaks for all: the other ranks' lines would repeat its own.
    say = sink(progress) if place.is_root else _silent
    output = output_path(cfg.output)
    point = _RunPoint()
    _, device = dtype_and_device(cfg, ctx)
    try:
        with joined(place, device) as team:
            with team.agreed():
                if team.is_root:
                    check_output_location(output)
                plan = plan_model(cfg, ctx, progress=say, observe=False)
                check_not_input(output, plan.source)
                check_outside(plan.beyond, cfg.pattern, skip=cfg.skip_incompatible)
                # Before the lock and the free-space check: a run that cannot fit allocates nothing.
                check_fits(
                    plan.host_memory,
                    plan.device_bytes,
                    device,
                    nsamples=cfg.nsamples,
                    seqlen=plan.seqlen,
                    offload_activations=cfg.offload_activations,
                )
            # Only rank 0 touches the output folder: it alone holds the lock and writes every file.
            with output_lock(output) if team.is_root else contextlib.nullcontext():
                state: ResumeState | None = None
                done: PruneReport | None = None
                with team.agreed():
                    if team.is_root:
                        for line in atomic.recover(output):
                            say(line)
                        done = None if cfg.force else finished_run(output, cfg.result_hash())
                done = team.broadcast_object(done)
                if done is not None:
                    say(f"{output} already holds this run, finished with the same settings; nothing to do")
                    return done
                with team.agreed():
                    if team.is_root:
                        store = prepare_output(
                            output,
                            force=cfg.force,
                            resume=cfg.resume,
                            continue_hint="drop --no-resume-state to continue it",
                        )
                        state = _open_state(store, cfg, plan.blocks, say) if cfg.resume else None
                        to_write = max(0, plan.resume_bytes - store.size()) if cfg.resume else 0
                        # A streamed run without a resume state keeps its pruned blocks on disk until the write.
                        kept = plan.blocks_bytes if cfg.stream and not cfg.resume else 0
                        check_free_space(output, plan.checkpoint_bytes, to_write, kept)
                    else:
                        store = ResumeStore(output)
                state = team.broadcast_object(state)
                point.blocks, point.done = plan.blocks, state.next_block if state is not None else 0
                saving = store if cfg.resume else None
                return _prune(cfg, ctx, output, saving, state, point, say, start, after_block, stop, team, built)
    except KeyboardInterrupt:
        raise point.interrupted(output, saving=cfg.resume, signal_name=stop.name if stop else None) from None


def _silent(_message: str) -> None:
    """The progress sink of ranks other than 0."""


@dataclass
class _RunPoint:
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
        verb = f"stopped by {signal_name}" if signal_name is not None else "interrupted"
        code = EXIT_RESUMABLE if signal_name is not None else EXIT_SIGINT
        if not total:
            return Interrupted(f"{verb} before pruning began; nothing was written", code)
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
        return Interrupted(f"{verb} {where}; {saved}", code)


def _open_state(store: ResumeStore, cfg: PruneConfig, blocks: int, say: Progress) -> ResumeState | None:
    """The state of an interrupted run to continue; a damaged or foreign one is discarded with --force."""
    try:
        state = store.load(cfg.result_hash(), blocks)
    except ResumeStateError as exc:
        if not cfg.force:
            raise
        say(f"--force: discarding {store.root} ({str(exc).split('; ')[0]})")
        store.discard()
        return None
    if state is not None:
        say(f"resuming after block {state.next_block}/{blocks} from {store.root} (an interrupted run, same settings)")
    return state


@dataclass
class _Start:
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
class _BlockPlan:
    """The run's weight matrices once the blocks' dense forwards were watched (`_observed_plan`): slots,
    those left dense (`ignored`) or skipped (the pattern does not fit), the records of block parameters
    that are not matmul weights (per block), and each watched block's observation."""

    slots: list[LinearSlot]
    ignored: dict[str, str]
    skipped: dict[str, str]
    unused: dict[int, list[LayerRecord]]
    observed: dict[int, BlockObservation]


def _prune(
    cfg: PruneConfig,
    ctx: RunContext,
    output: Path,
    store: ResumeStore | None,
    state: ResumeState | None,
    point: _RunPoint,
    say: Progress,
    start: float,
    after_block: Callable[[int], None] | None,
    stop: StopRequest | None,
    team: Team,
    built: LoadedModel | None,
) -> PruneReport:
    """The run itself, under the output lock (held by rank 0), in the steps docs/architecture.md names:
    load the model and read the calibration text (`_load`), capture the input of the first block to prune
    or restore it from the resume state (`_calibrate`), watch the blocks' dense forwards (`_watch`), prune
    block by block with rank 0 saving the state (`_prune_blocks`), then report and write (rank 0).

    Each rank holds the whole model on the CPU and its shard of the calibration samples. The phases, each
    one call here or in `prune_block`, are marked with `phases.phase` for `tsenor bench prune`: block
    input capture (`capture_block_inputs`), per group the statistics (`group_input_stats` /
    `group_inputs` and `Team.ordered_statistics`) and the method (`_prune_linear`: mask solver,
    ADMM/OBS updates, CG), the block re-run (`run_block`), the resume state (`save_block`), the final
    save (`write_checkpoint`).
    """
    dtype, device = dtype_and_device(cfg, ctx)
    loaded, slots, calib = _load(cfg, ctx, state, say, team, built, dtype)
    structure = loaded.structure
    linears = outside_linears(loaded.model, structure)
    beyond = selected_outside(linears, cfg.targets, cfg.ignore, cfg.pattern) if cfg.targets else ()
    if structure.outside:
        dense = [name for name in structure.outside if not any(w.name.startswith(f"{name}.") for w in beyond)]
        if dense:
            say(f"left dense, outside the language model {structure.base_name}: {', '.join(dense)}")
    if beyond and team.is_root:
        # The report says it per record too; a user who asked for --method wanda must see it now.
        logger.warning("--targets selects %d linear(s) outside the language model: %s", len(beyond), OUTSIDE_REASON)
    seqlen = min(cfg.seqlen, loaded.max_positions or cfg.seqlen)
    if seqlen < cfg.seqlen:
        logger.warning(
            "--seqlen %d is longer than the model's %d positions; calibrating with %d", cfg.seqlen, seqlen, seqlen
        )
    folder = store.root if store is not None else None
    where = f"model {cfg.model}"
    with contextlib.closing(
        BlockSource(structure, loaded.checkpoint, output=output, folder=folder, team=team, where=where)
    ) as source:
        begin = _calibrate(cfg, structure, store, state, calib, say, team, device, source)
        plan = _watch(cfg, structure, slots, begin, say, team, device, source, list(linears))
        records, refined = _prune_blocks(
            cfg, structure, begin, plan, output, store, state, point, say, after_block, stop, team, device, source
        )
        records += prune_outside(linears, beyond, cfg.layer, say)

        def report(counts: WeightCounts) -> PruneReport:
            return _report(cfg, ctx, counts, records, refined, begin, seqlen, start, team, device)

        say(f"writing {output}")
        point.writing = True
        metadata = sparsity_record(cfg, records, cfg.solver_that_runs(device))
        if not source.streamed:
            whole = report(WeightCounts.of(loaded.model, structure))
            _write(cfg, loaded, output, whole, metadata, team)
            return whole
        # Streamed: the tensors come from the block files one at a time, counted as they pass; rank 0's
        # report, made once they are written, is every rank's.
        counts = WeightCounts()
        made: list[PruneReport] = []

        def after_weights() -> PruneReport:
            made.append(report(counts))
            return made[0]

        tensors = source.tensors(loaded.model, counts) if team.is_root else None
        _write(cfg, loaded, output, after_weights, metadata, team, tensors)
        return team.broadcast_object(made[0] if made else None)


def _write(
    cfg: PruneConfig,
    loaded: LoadedModel,
    output: Path,
    report: PruneReport | Callable[[], PruneReport],
    metadata: SparsityRecord,
    team: Team,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> None:
    """Rank 0 writes the checkpoint and its reports (`output.write_checkpoint`; `report` may be a function
    making the report once the weights are written); tensors: the weights one at a time (a streamed run).
    The weights are written in --dtype, else the checkpoint's own dtype, under the source's key layout."""
    from tsenor_cli.models.loading import output_dtype

    with phase("save"), team.agreed():
        if team.is_root:
            write_checkpoint(
                loaded.model,
                loaded.tokenizer,
                output,
                report,
                metadata,
                loaded.processor_files,
                tensors=tensors,
                max_shard_size=cfg.max_shard_size,
                dtype=output_dtype(cfg.dtype, loaded.source_dtype, loaded.model.dtype),
                layout=loaded.layout,
            )


def _load(
    cfg: PruneConfig,
    ctx: RunContext,
    state: ResumeState | None,
    say: Progress,
    team: Team,
    built: LoadedModel | None,
    dtype: torch.dtype,
) -> tuple[LoadedModel, list[LinearSlot], CalibrationData | None]:
    """Load the model on the CPU (unless `built`) and, for a fresh run, its calibration text → (the
    model, its linear slots, the calibration data or None when a resume state supplies the inputs).
    With `cfg.stream` only what lies outside the decoder blocks is read (`models/streaming.py`); a
    folder of pickle weights is loaded whole (one warning line).

    Every weight is checked finite, and the nn.Linear layers against the pattern, before calibration."""
    from tsenor_cli.data.calibration import calibration_batches
    from tsenor_cli.models.loading import config_value, load_model

    fresh: list[CalibrationData] = []

    def calibrate(config: Any, tokenizer: Any) -> None:
        # Before the weights load: calibration text too short for --nsamples × --seqlen is found in
        # seconds, not after minutes of reading a large checkpoint.
        max_pos = config_value(config, "max_position_embeddings")
        seqlen = min(cfg.seqlen, int(max_pos)) if max_pos else cfg.seqlen
        with phase("calibration"):
            fresh.append(
                calibration_batches(cfg.calib_data, tokenizer, ctx, nsamples=cfg.nsamples, seqlen=seqlen, seed=cfg.seed)
            )

    if built is not None and cfg.stream:
        raise UsageError("a model built in memory cannot be streamed from its checkpoint; drop --stream")
    with team.agreed():
        if built is not None:
            loaded = built
            if state is None:
                calibrate(built.model.config, built.tokenizer)
        else:
            loaded = load_model(
                cfg.model,
                ctx,
                dtype=dtype,
                device="cpu",
                trust_remote_code=cfg.trust_remote_code,
                progress=say,
                before_weights=calibrate if state is None else None,
                check_tokenizer=True,
                stream=cfg.stream,
            )
        # All weights at once, before calibration: a NaN in the last block should not cost a run to find.
        # A streamed run's blocks are still on the meta device: each is checked when it is read
        # (`BlockSource.load`), the first time by the watch pass, before any block is pruned.
        check_finite(
            ((name, p) for name, p in loaded.model.named_parameters() if not p.is_meta),
            where=f"model {cfg.model}",
            fix="the checkpoint is corrupt; re-download or re-convert it (nothing was written)",
        )
        slots = linear_slots(loaded.structure)
        selectable = list(outside_linears(loaded.model, loaded.structure))
        ignored = excluded_layers([s.full_name for s in slots], cfg.ignore, cfg.targets, selectable=selectable)
        # The nn.Linear layers are checked now, before calibration; the other matrices once the forward
        # has shown their orientation and role (`_observed_plan`).
        # A one-output layer is a gate (observe.py), left dense then whatever its shape.
        linear_only = [s for s in slots if not s.param and s.full_name not in ignored and s.out_features > 1]
        if linear_only:
            check_compatibility(linear_only, cfg.pattern, skip=cfg.skip_incompatible)
    return loaded, slots, fresh[0] if fresh else None


def _calibrate(
    cfg: PruneConfig,
    structure: ModelStructure,
    store: ResumeStore | None,
    state: ResumeState | None,
    calib: CalibrationData | None,
    say: Progress,
    team: Team,
    device: torch.device,
    source: BlockSource,
) -> _Start:
    """The input of the first block to prune: from the resume state (its blocks restored into the model,
    unless streamed: the write reads them from its files), or captured from the calibration tokens by the
    model's own forward, this rank's shard of them (block 0 read for it when streamed).

    The activations live between blocks on the device, or on the CPU with --offload-activations (each
    sample then streamed to the device when the block needs it). With --refine block the dense stream
    starts as the same input (fresh) or comes from the resume state beside it."""
    storage = torch.device("cpu") if cfg.offload_activations else device
    shard = team.shard(cfg.nsamples)
    with team.agreed():
        if state is not None and store is not None:
            if not source.streamed:
                store.restore_blocks(structure.blocks, state)
            begin = _Start(state.next_block, list(state.records), None, (), state.calibration, state.calibration_source)
            begin.refinement = state.refinement
            if begin.first < len(structure.blocks):
                rows = shard if team.distributed else None
                begin.hidden = store.load_hidden(state, storage, rows=rows)
                if cfg.refine.on:
                    begin.dense = store.load_hidden(state, storage, rows=rows, stream="dense")
                with source.resident(0):  # the record runs block 0 once to learn its output type
                    begin.calls = capture_block_calls(structure, int(begin.hidden.shape[1]))
            return begin
        assert calib is not None  # a fresh run read its calibration text while loading
        say(f"calibration: {calib.source_description}, {tuple(calib.input_ids.shape)} tokens")
        if team.distributed:
            say(f"{team.world_size} processes, {shard.stop - shard.start} samples on rank 0")
        with phase("capture"), source.resident(0):
            inputs = capture_block_inputs(structure, calib.input_ids[shard], storage)
        dense = inputs.hidden.clone() if cfg.refine.on else None
        return _Start(0, [], inputs.hidden, inputs.calls, str(calib.source_description), calib.source, dense)


def _watch(
    cfg: PruneConfig,
    structure: ModelStructure,
    slots: list[LinearSlot],
    begin: _Start,
    say: Progress,
    team: Team,
    device: torch.device,
    source: BlockSource,
    selectable: Sequence[str] = (),
) -> _BlockPlan:
    """Watch the dense forward of the blocks left to prune (one sample; a streamed run reads each block
    for it and releases it) and settle the run's weight matrices from what they multiply by (`_observed_plan`)."""
    observed: dict[int, BlockObservation] = {}
    if begin.hidden is not None:
        with phase("capture"), team.agreed():
            observed = observe_blocks(
                structure, begin.hidden[:1], begin.calls, begin.first, device, resident=source.resident
            )
    with team.agreed():
        slots, ignored, skipped, unused = _observed_plan(structure, slots, observed, cfg, say, selectable)
    matrices = sum(s.matrices for s in slots)
    say(
        f"{structure.model_type}: {len(structure.blocks)} blocks in {structure.blocks_name}, {matrices} weight matrices"
    )
    if ignored:
        say(f"leaving {len(ignored)} weight(s) dense (--ignore/--targets, routers and gates)")
    return _BlockPlan(slots, ignored, skipped, unused, observed)


def _prune_blocks(
    cfg: PruneConfig,
    structure: ModelStructure,
    begin: _Start,
    plan: _BlockPlan,
    output: Path,
    store: ResumeStore | None,
    state: ResumeState | None,
    point: _RunPoint,
    say: Progress,
    after_block: Callable[[int], None] | None,
    stop: StopRequest | None,
    team: Team,
    device: torch.device,
    source: BlockSource,
) -> tuple[list[LayerRecord], tuple[BlockRefinement, ...]]:
    """The block loop → every layer's record and every refined block's. Per block: stop here if a signal
    asked to; read the block (`source.load`: from the checkpoint when streamed) and move it to the device;
    with --refine block run the dense block on the dense stream (in place: its outputs are the
    refinement's targets and the next block's dense inputs); prune its weight matrices group by group
    (`engine.prune_block`); with --refine block train its remaining weights towards those targets
    (`refine.refine_pruned_block`); run it once more so the next block sees the pruned outputs (not needed
    after a kept refinement, whose last error pass wrote them); back to the CPU; rank 0 saves the resume
    state; `source.release` frees a streamed block (kept on disk first when there is no resume state)."""
    blocks = structure.blocks
    spec = get_pruner(cfg.method)
    moe = MoeOptions(cfg.moe_calibration, cfg.moe_min_tokens)
    config_hash = cfg.result_hash()
    records = list(begin.records)
    refined = list(begin.refinement)
    hidden = begin.hidden  # (S_r, T, H) this rank's shard of the input of the next block
    dense = begin.dense  # with --refine block: the same in the dense model
    buffer = torch.empty_like(hidden) if hidden is not None else None
    for index in bar(range(begin.first, len(blocks)), total=len(blocks) - begin.first, desc="blocks", unit="block"):
        # The ranks stop together, at the same block, even when the signal reached only some of them.
        signal_name = team.first_set(stop.name) if stop is not None else None
        if signal_name is not None:
            raise point.interrupted(output, saving=store is not None, signal_name=signal_name)
        assert hidden is not None and buffer is not None  # set whenever a block is left to prune
        point.current = index
        say(f"block {index + 1}/{len(blocks)}")
        block = source.load(index)
        block.to(device)
        call = begin.calls[index].to(device)
        if dense is not None:
            with phase("dense stream"), team.agreed():
                run_block(block, dense, call, dense, device)  # in place: the dense outputs, refinement's targets
        records += prune_block(
            block,
            index,
            structure,
            plan.slots,
            plan.skipped,
            hidden,
            call,
            spec,
            cfg.layer,
            sequential=cfg.sequential,
            device=device,
            progress=say,
            ignored=plan.ignored,
            team=team,
            moe=moe,
            observation=plan.observed.get(index),
        )
        records += plan.unused.get(index, [])
        rerun = True
        if dense is not None:
            with phase("refine"), team.agreed():
                args = (block, index, structure.full_name(index, ""), records, hidden, call, dense, cfg.refine)
                fresh, written = refine_pruned_block(
                    *args, seed=cfg.seed, device=device, team=team, nsamples=cfg.nsamples, progress=say, outputs=buffer
                )
                refined += fresh
                rerun = not written  # a kept refinement's last error pass already wrote the block's outputs
        if rerun:
            with phase("rerun"), team.agreed():
                run_block(block, hidden, call, buffer, device)  # the next block sees the pruned outputs
        hidden, buffer = buffer, hidden
        block.to("cpu")
        if store is not None:
            last = index == len(blocks) - 1
            with phase("save"):
                whole = None if last else team.gather_samples(hidden, cfg.nsamples)
                whole_dense = None if last or dense is None else team.gather_samples(dense, cfg.nsamples)
                with team.agreed():
                    if team.is_root:
                        state = store.save_block(
                            index,
                            block,
                            whole,
                            state,
                            records,
                            config_hash,
                            begin.calibration,
                            begin.calibration_source,
                            len(blocks),
                            dense=whole_dense,
                            refinement=tuple(refined),
                        )
        source.release(index, keep=store is None)
        point.done, point.current = index + 1, None
        if after_block is not None:
            after_block(index)
    return records, tuple(refined)


def _report(
    cfg: PruneConfig,
    ctx: RunContext,
    counts: WeightCounts,
    records: list[LayerRecord],
    refined: tuple[BlockRefinement, ...],
    begin: _Start,
    seqlen: int,
    start: float,
    team: Team,
    device: torch.device,
) -> PruneReport:
    """tsenor_report.json's content: the settings that decided the weights, the layer records, the
    calibration's source, the densities of the pruned model, the refined blocks' records."""
    settings_dict = {
        **cfg.result_fields(),
        "result_hash": cfg.result_hash(),  # what a rerun of the same command compares (output.finished_run)
        "device": str(device),
        "seqlen": seqlen,
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
        seconds=time.perf_counter() - start,
        output=str(cfg.output),
        command=cfg.command,
        versions=versions(),
        resumed_from_block=begin.first if begin.first else None,
        calibration_source=begin.calibration_source,
        context=ContextRecord.of(ctx),
        model_params=counts.model_params,
        model_nonzero=counts.model_nonzero,
        linear_params=counts.linear_params,
        linear_nonzero=counts.linear_nonzero,
        refinement=refined,
    )


def prune_and_evaluate(
    cfg: PruneConfig, ctx: RunContext, eval_cfg: EvalConfig | None, *, stop: StopRequest | None = None
) -> tuple[PruneReport, EvalReport | None]:
    """`tsenor prune --eval`: prune (`prune_model`), then evaluate the checkpoint into its eval.json.

    Only rank 0 of a distributed run evaluates (the others return None). A stop signal during the
    evaluation stops it at once (it has no safe point; `StopRequest.at_once`), as Ctrl-C does: one line
    saying the checkpoint is complete and how to evaluate it.
    """
    report = prune_model(cfg, ctx, stop=stop)
    if eval_cfg is None or cfg.output is None or not ctx.distributed.is_root:
        return report, None
    from tsenor_cli.evaluation.runner import evaluate_model
    from tsenor_cli.models.loading import load_model, parse_dtype

    try:
        with stop.at_once() if stop is not None else contextlib.nullcontext():
            loaded = load_model(str(cfg.output), ctx, dtype=parse_dtype(cfg.dtype), device=cfg.device)
            evaluation = evaluate_model(loaded, eval_cfg, ctx)
    except KeyboardInterrupt:
        how = f"stopped by {stop.name}" if stop is not None and stop.name else "interrupted"
        raise Interrupted(
            f"{how} while evaluating; the checkpoint {cfg.output} is complete but has no {EVAL_FILE}: "
            f"run `tsenor eval --model {cfg.output} --output {cfg.output}`",
            EXIT_RESUMABLE if stop is not None and stop.name else EXIT_SIGINT,
        ) from None
    atomic.write_json(cfg.output / EVAL_FILE, evaluation.to_json())
    return report, evaluation
