"""Library entry points: `prune_model(cfg, ctx) -> PruneReport` and `plan_model(cfg, ctx) -> PrunePlan` (dry run).

`ctx` (settings.RunContext) says where calibration data and hub models may come from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
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
    BlockInputs,
    LinearSlot,
    MoeOptions,
    capture_block_calls,
    capture_block_inputs,
    check_compatibility,
    incompatible_slots,
    linear_slots,
    observe_blocks,
    observed_slots,
    prune_block,
    run_block,
)
from tsenor_cli.pruning.finite import check_finite
from tsenor_cli.pruning.memory import HostEstimate, check_fits, host_estimate
from tsenor_cli.pruning.observe import BlockObservation
from tsenor_cli.pruning.output import (
    check_free_space,
    check_not_input,
    check_output_location,
    finished_run,
    output_lock,
    output_path,
    prepare_output,
    write_checkpoint,
)
from tsenor_cli.pruning.phases import phase
from tsenor_cli.pruning.refine import refine_pruned_block
from tsenor_cli.pruning.registry import get_pruner
from tsenor_cli.pruning.report import versions
from tsenor_cli.pruning.resume import ResumeState, ResumeStore
from tsenor_cli.pruning.selection import excluded_layers, matches
from tsenor_cli.pruning.types import LayerRecord
from tsenor_cli.runfiles import ContextRecord, PatternInfo, PruneReport
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.models.structure import ModelStructure


def _dtype_and_device(cfg: PruneConfig, ctx: RunContext | None = None) -> tuple[torch.dtype, torch.device]:
    """The run's dtype and this rank's device: in a distributed run `--device cuda` means the GPU of the
    rank's LOCAL_RANK (one GPU per process)."""
    from tsenor_cli.models.loading import default_dtype, parse_dtype, resolve_device

    device = resolve_device(cfg.device)
    if ctx is not None and ctx.distributed.distributed and device.type == "cuda" and device.index is None:
        device = resolve_device(f"cuda:{ctx.distributed.local_rank}")
    dtype = parse_dtype(cfg.dtype)
    return (dtype if dtype is not None else default_dtype(device)), device


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


def sparsity_metadata(cfg: PruneConfig, records: list[LayerRecord], solver: str | None) -> dict[str, Any]:
    """What config.json records under `tsenor_sparsity` (read back by `tsenor verify`).

    solver: the transposable solver that ran (`PruneConfig.solver_that_runs`), None for other
    patterns; `solver_requested` keeps the name asked for ("auto")."""
    from tsenor_cli import __version__

    p = cfg.pattern
    return {
        "method": cfg.method,
        "pattern": p.label,
        "kind": p.kind,
        "n": p.n,
        "m": p.m,
        "sparsity": p.sparsity,
        "transposable": p.transposable,
        "solver": solver,
        "solver_requested": cfg.layer.solver if p.transposable else None,
        "pruned_modules": [r.name for r in records if r.status == "pruned"],
        # Where each pruned matrix lives in the model's own parameters (`tsenor verify` reads them back
        # through transformers' loading, whatever key layout save_pretrained gave the files).
        "pruned_weights": [
            {
                "name": r.name,
                "param": r.param or f"{r.name}.weight",
                "expert": r.expert,
                "transposed": r.transposed,
                "shape": [r.out_features, r.in_features],
            }
            for r in records
            if r.status == "pruned"
        ],
        "skipped_modules": [r.name for r in records if r.status == "skipped"],
        "ignored_modules": [r.name for r in records if r.status == "ignored"],
        "tsenor_version": __version__,
    }


def nonzero_counts(parameters: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(entries, nonzero entries) over `parameters`, each counted once however often it is listed."""
    unique = {id(p): p for p in parameters}.values()
    return sum(p.numel() for p in unique), sum(int(torch.count_nonzero(p)) for p in unique)


def decoder_matrices(structure: ModelStructure) -> list[torch.Tensor]:
    """Every parameter of two or more dimensions of the decoder blocks: the weights the report accounts for."""
    return [p for block in structure.blocks for p in block.parameters() if p.dim() >= 2]


def _observed_plan(
    structure: ModelStructure,
    static: Sequence[LinearSlot],
    observed: dict[int, BlockObservation],
    cfg: PruneConfig,
    say: Progress,
) -> tuple[list[LinearSlot], dict[str, str], dict[str, str], dict[int, list[LayerRecord]]]:
    """The run's weight matrices once the blocks' forwards were watched: (slots, ignored, skipped, the
    records of block parameters that are not matmul weights, per block).

    Slots of watched blocks take their orientation, experts and role from the watch; routers and gates are
    left dense unless a --targets pattern names them; other patterns and the compatibility check as for
    nn.Linear layers. A kind of weight left dense by a rule is said once on stderr.
    """
    slots: list[LinearSlot] = []
    unused: dict[int, list[LayerRecord]] = {}
    for index in range(len(structure)):
        if index not in observed:
            slots += [s for s in static if s.block == index]
            continue
        watched = observed[index]
        seen = {s.param_name: s for s in observed_slots(structure, index, watched)}
        # nn.Linear layers that never ran keep their slot: prune_block names them in its error.
        kept = list(seen.values()) + [
            s for s in static if s.block == index and s.param_name not in seen and not s.param
        ]
        slots += kept
        block = structure.blocks[index]
        in_slots = {s.param_name for s in kept}
        for name, why in watched.unused.items():
            if name not in in_slots:
                shape = tuple(block.get_parameter(name).shape)
                full = structure.full_name(index, name)
                unused.setdefault(index, []).append(
                    LayerRecord(index, full, int(shape[-2]), int(shape[-1]), "ignored", why, param=full)
                )
    names = [s.full_name for s in slots]
    ignored = excluded_layers(names, cfg.ignore, cfg.targets)
    targeted = {n for n in names if any(matches(p, n) for p in cfg.targets)}
    ruled: dict[str, int] = {}
    for slot in slots:
        if slot.role != "weight" and slot.full_name not in targeted:
            ignored[slot.full_name] = f"{slot.role}, left dense (--targets {slot.full_name} prunes it)"
            ruled[slot.role] = ruled.get(slot.role, 0) + 1
    for role, count in ruled.items():
        logger.warning(
            "leaving %d %s(s) dense: routing decisions are fragile (--targets names one to prune it)", count, role
        )
    if unused:
        count = sum(len(v) for v in unused.values())
        logger.warning(
            "%d decoder weight(s) are not matmul weights of their block's forward and stay dense (see the report)",
            count,
        )
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
    _, device = _dtype_and_device(cfg, ctx)
    try:
        with joined(place, device) as team:
            with team.agreed():
                if team.is_root:
                    check_output_location(output)
                plan = plan_model(cfg, ctx, progress=say)
                check_not_input(output, plan.source)
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
                        check_free_space(output, plan.checkpoint_bytes, to_write)
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
    """The run itself, under the output lock (held by rank 0): load (unless `built`), prune block by
    block (rank 0 saving the state), write (rank 0).

    Each rank holds the whole model on the CPU and its shard of the calibration samples. The phases, each
    one call here or in `prune_block`, are marked with `phases.phase` for `tsenor bench prune`: block
    input capture (`capture_block_inputs`), per group the statistics (`group_input_stats` /
    `group_inputs` and `Team.ordered_statistics`) and the method (`_prune_linear`: mask solver,
    ADMM/OBS updates, CG), the block re-run (`run_block`), the resume state (`save_block`), the final
    save (`write_checkpoint`).
    """
    from tsenor_cli.data.calibration import CalibrationData, calibration_batches
    from tsenor_cli.models.loading import config_value, load_model

    spec = get_pruner(cfg.method)
    dtype, device = _dtype_and_device(cfg, ctx)
    # Where the calibration activations live between blocks: the device, or the CPU with
    # --offload-activations, each sample then streamed to the device when the block needs it.
    storage = torch.device("cpu") if cfg.offload_activations else device
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
            )
        model, structure = loaded.model, loaded.structure
        # All weights at once, before calibration: a NaN in the last block should not cost a run to find.
        check_finite(
            model.named_parameters(),
            where=f"model {cfg.model}",
            fix="the checkpoint is corrupt; re-download or re-convert it (nothing was written)",
        )
        slots = linear_slots(structure)
        ignored = excluded_layers([s.full_name for s in slots], cfg.ignore, cfg.targets)
        # The nn.Linear layers are checked now, before calibration; the other matrices once the forward
        # has shown their orientation and role (`_observed_plan`).
        # A one-output layer is a gate (observe.py), left dense then whatever its shape.
        linear_only = [s for s in slots if not s.param and s.full_name not in ignored and s.out_features > 1]
        if linear_only:
            check_compatibility(linear_only, cfg.pattern, skip=cfg.skip_incompatible)
    blocks = structure.blocks
    if structure.outside:
        say(f"left dense, outside the language model {structure.base_name}: {', '.join(structure.outside)}")
    seqlen = min(cfg.seqlen, loaded.max_positions or cfg.seqlen)
    if seqlen < cfg.seqlen:
        logger.warning(
            "--seqlen %d is longer than the model's %d positions; calibrating with %d", cfg.seqlen, seqlen, seqlen
        )
    config_hash = cfg.result_hash()

    records: list[LayerRecord] = []
    first = 0
    hidden: torch.Tensor | None = None  # (S_r, T, H) this rank's shard of the input of the next block
    dense: torch.Tensor | None = None  # with --refine: the same in the dense model (refine.py)
    refined = list(state.refinement) if state is not None else []
    shard = team.shard(cfg.nsamples)
    with team.agreed():
        if state is not None and store is not None:
            first = state.next_block
            store.restore_blocks(blocks, state)
            records = list(state.records)
            calibration, calibration_source = state.calibration, state.calibration_source
            if first < len(blocks):
                hidden = store.load_hidden(state, storage, rows=shard if team.distributed else None)
                if cfg.refine.on:
                    dense = store.load_hidden(state, storage, rows=shard if team.distributed else None, stream="dense")
                calls = capture_block_calls(structure, int(hidden.shape[1]))
        else:
            (calib,) = fresh
            calibration = str(calib.source_description)
            calibration_source = calib.source
            say(f"calibration: {calibration}, {tuple(calib.input_ids.shape)} tokens")
            if team.distributed:
                say(f"{team.world_size} processes, {shard.stop - shard.start} samples on rank 0")
            with phase("capture"):
                inputs = capture_block_inputs(structure, calib.input_ids[shard], storage)
            hidden, calls = inputs.hidden, inputs.calls
            dense = hidden.clone() if cfg.refine.on else None

    observed: dict[int, BlockObservation] = {}
    if hidden is not None:
        with phase("capture"), team.agreed():
            observed = observe_blocks(structure, hidden[:1], calls, first, device)
    with team.agreed():
        slots, ignored, skipped, unused = _observed_plan(structure, slots, observed, cfg, say)
    matrices = sum(s.matrices for s in slots)
    say(f"{structure.model_type}: {len(blocks)} blocks in {structure.blocks_name}, {matrices} weight matrices")
    if ignored:
        say(f"leaving {len(ignored)} weight(s) dense (--ignore/--targets, routers and gates)")
    moe = MoeOptions(cfg.moe_calibration, cfg.moe_min_tokens)
    buffer = torch.empty_like(hidden) if hidden is not None else None
    for index in bar(range(first, len(blocks)), total=len(blocks) - first, desc="blocks", unit="block"):
        # The ranks stop together, at the same block, even when the signal reached only some of them.
        signal_name = team.first_set(stop.name) if stop is not None else None
        if signal_name is not None:
            raise point.interrupted(output, saving=store is not None, signal_name=signal_name)
        assert hidden is not None and buffer is not None  # set whenever a block is left to prune
        point.current = index
        say(f"block {index + 1}/{len(blocks)}")
        block = blocks[index]
        block.to(device)
        call = calls[index].to(device)
        if dense is not None:
            with team.agreed():
                run_block(block, dense, call, dense, device)  # in place: the dense outputs, refinement's targets
        records += prune_block(
            block,
            index,
            structure,
            slots,
            skipped,
            hidden,
            call,
            spec,
            cfg.layer,
            sequential=cfg.sequential,
            device=device,
            progress=say,
            ignored=ignored,
            team=team,
            moe=moe,
            observation=observed.get(index),
        )
        records += unused.get(index, [])
        if dense is not None:
            with team.agreed():
                prefix = structure.full_name(index, "")
                args = (block, index, prefix, records, hidden, call, dense, cfg.refine)
                refined += refine_pruned_block(
                    *args, seed=cfg.seed, device=device, team=team, nsamples=cfg.nsamples, progress=say
                )
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
                            calibration,
                            calibration_source,
                            len(blocks),
                            dense=whole_dense,
                            refinement=tuple(refined),
                        )
        point.done, point.current = index + 1, None
        if after_block is not None:
            after_block(index)

    solver = cfg.solver_that_runs(device)
    settings_dict = {
        **cfg.result_fields(),
        "result_hash": cfg.result_hash(),  # what a rerun of the same command compares (output.finished_run)
        "device": str(device),
        "seqlen": seqlen,
        "solver": solver,
        # Provenance: the result does not depend on it (docs/reliability.md), the timings do.
        "threads": torch.get_num_threads(),
    }
    if team.distributed:
        settings_dict["processes"] = team.world_size
    p = cfg.pattern
    model_params, model_nonzero = nonzero_counts(list(model.parameters()))
    linear_params, linear_nonzero = nonzero_counts(decoder_matrices(structure))
    report = PruneReport(
        method=cfg.method,
        pattern=PatternInfo(p.n, p.m, p.transposable) if p.kind in ("transposable", "nm") else None,
        sparsity=float(p.sparsity),
        settings=settings_dict,
        layers=tuple(records),
        calibration=calibration,
        seconds=time.perf_counter() - start,
        output=str(cfg.output),
        command=cfg.command,
        versions=versions(),
        resumed_from_block=first if first else None,
        calibration_source=calibration_source,
        context=ContextRecord.of(ctx),
        model_params=model_params,
        model_nonzero=model_nonzero,
        linear_params=linear_params,
        linear_nonzero=linear_nonzero,
        refinement=tuple(refined),
    )
    say(f"writing {output}")
    point.writing = True
    with phase("save"), team.agreed():
        if team.is_root:
            write_checkpoint(
                model,
                loaded.tokenizer,
                output,
                report,
                sparsity_metadata(cfg, records, solver),
                loaded.processor_files,
            )
    return report


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak device memory of one rank (bytes), by what holds it.

    block: the largest decoder block's parameters; activations: this rank's calibration hidden states
    entering and leaving the block, (S_r, T, H) twice, or one sample's with --offload-activations, plus
    in a distributed run the group's linear inputs kept for the ordered sums (S_r, T, in) (on the CPU
    with --offload-activations); statistics: the input statistics (XᵀX and column norms) of a block's
    linears taken as one group, in a distributed run twice (the sums in flight to the next rank) plus one
    linear's being added; workspace: the method's buffers for the largest linear (weights, mask,
    ADMM/OBS state, damped H and its factorization). With --refine block, activations also hold the
    dense stream (S_r, T, H) (one sample with --offload-activations), and refine: the largest block in
    float32 with its gradients and Adam's two moments, its weights before refinement in the run's dtype,
    and one sample's forward kept for backward (each of the block's matrices' input and output, float32).
    """

    rank: int
    block: int
    activations: int
    statistics: int
    workspace: int
    refine: int = 0

    @property
    def total(self) -> int:
        return self.block + self.activations + self.statistics + self.workspace + self.refine

    def to_dict(self) -> dict[str, int]:
        return {
            "rank": self.rank,
            "block": self.block,
            "activations": self.activations,
            "statistics": self.statistics,
            "workspace": self.workspace,
            "refine": self.refine,
            "total": self.total,
        }


def estimate_device_memory(
    block_params: Sequence[int],
    candidates: Sequence[LinearSlot],
    *,
    nsamples: int,
    seqlen: int,
    hidden_size: int,
    width: int,
    needs_gram: bool,
    iterative: bool,
    world_size: int = 1,
    offload_activations: bool = False,
    sequential: bool = True,
    refine: bool = False,
) -> list[MemoryEstimate]:
    """One `MemoryEstimate` per rank. block_params: parameter count of each block; candidates: the linears
    to prune (at least one); width: bytes per element of the model's dtype (statistics are float32);
    refine: --refine block (`MemoryEstimate.refine`)."""
    from tsenor_cli.pruning.distributed import shard_bounds

    blocks = len(block_params)
    stats_size = [sum(s.in_features**2 + s.in_features for s in candidates if s.block == i) for i in range(blocks)]
    statistics = 4 * max(stats_size)
    kept_features = 0  # per token, the linear inputs a distributed rank keeps for one group
    if world_size > 1:
        statistics = 2 * statistics + 4 * max(s.in_features**2 + s.in_features for s in candidates)
        per_block = [sum(s.in_features for s in candidates if s.block == i) for i in range(blocks)]
        # One group's linears read one input (LLaMA's q,k,v; gate,up); without --sequential the block is
        # one group and every linear's input counts (an upper bound: shared inputs are kept once).
        kept_features = max(s.in_features for s in candidates) if sequential else max(per_block)
    biggest = max(candidates, key=lambda s: s.out_features * s.in_features)
    workspace = 4 * biggest.out_features * biggest.in_features * (8 if iterative else 3)
    if needs_gram:
        workspace += 3 * 8 * biggest.in_features**2  # damped/normalized H, its inverse or eigenvectors
    estimates = []
    for rank, (start, stop) in enumerate(shard_bounds(nsamples, world_size)):
        rows = 1 if offload_activations else stop - start
        activations = 2 * rows * seqlen * hidden_size * width  # block inputs and outputs
        if not offload_activations:
            activations += (stop - start) * seqlen * kept_features * width
        training = 0
        if refine:
            activations += rows * seqlen * hidden_size * width  # the dense stream
            largest = max(block_params)
            features = max(
                sum(s.matrices * (s.in_features + s.out_features) for s in candidates if s.block == i)
                for i in range(blocks)
            )
            training = largest * (4 * 4 + width) + 4 * seqlen * (features + 4 * hidden_size)
        estimates.append(MemoryEstimate(rank, max(block_params) * width, activations, statistics, workspace, training))
    return estimates


@dataclass(frozen=True)
class PrunePlan:
    """What a run would do, without loading weights: layers, compatibility, memory and disk estimates (bytes).

    checkpoint_bytes: the pruned checkpoint's weights; resume_bytes: the most the resume state holds at
    once (every block's parameters and two (S, T, H) hidden-state files while one replaces the other).
    device_memory: the peak device memory of each rank (one for a single process); device_bytes: the
    largest of them; host_memory: the peak host memory of one process (`memory.HostEstimate`).
    """

    model: str
    method: str
    pattern: str
    source: str
    model_type: str
    slots: tuple[LinearSlot, ...]
    incompatible: dict[str, str]
    ignored: dict[str, str]
    seqlen: int
    nsamples: int
    params: int
    cpu_bytes: int
    device_memory: tuple[MemoryEstimate, ...]
    device: str
    dtype: str
    blocks: int
    checkpoint_bytes: int
    resume_bytes: int
    host_memory: HostEstimate

    @property
    def device_bytes(self) -> int:
        return max(estimate.total for estimate in self.device_memory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "method": self.method,
            "pattern": self.pattern,
            "source": self.source,
            "model_type": self.model_type,
            "layers": [
                {
                    "name": s.full_name,
                    "shape": [s.out_features, s.in_features],
                    "compatible": s.full_name not in self.incompatible,
                    "reason": self.incompatible.get(s.full_name),
                    "ignored": self.ignored.get(s.full_name),
                }
                for s in self.slots
            ],
            "incompatible": len(self.incompatible),
            "ignored": len(self.ignored),
            "seqlen": self.seqlen,
            "nsamples": self.nsamples,
            "params": self.params,
            "estimated_cpu_bytes": self.cpu_bytes,
            "estimated_host_bytes_per_process": self.host_memory.to_dict(),
            "estimated_device_bytes": self.device_bytes,
            "estimated_device_bytes_per_rank": [estimate.to_dict() for estimate in self.device_memory],
            "estimated_checkpoint_bytes": self.checkpoint_bytes,
            "estimated_resume_state_bytes": self.resume_bytes,
            "blocks": self.blocks,
            "device": self.device,
            "dtype": self.dtype,
        }


def plan_model(
    cfg: PruneConfig, ctx: RunContext, progress: Progress | None = None, *, world_size: int | None = None
) -> PrunePlan:
    """The dry-run plan, from the model built on the meta device (no weights read, nothing written).

    The structure and the linears come from the same discovery as a run. The sequential groups need a
    real forward (`engine.linear_groups`), so the Gram-matrix estimate takes all of a block's pruned
    linears at once: exact without --sequential, an upper bound with it. world_size: the processes
    the device memory is estimated for (default: this run's, `ctx.distributed`).
    """
    from tsenor_cli.models.loading import config_value, meta_model, read_config, resolve_source
    from tsenor_cli.models.structure import discover_structure

    dtype, device = _dtype_and_device(cfg, ctx)
    source, is_local = resolve_source(cfg.model, ctx, progress=progress)
    # load_model's own reading, so the plan fails with the run's line
    config = read_config(cfg.model, source, is_local, ctx, trust_remote_code=cfg.trust_remote_code)
    model = meta_model(config, trust_remote_code=cfg.trust_remote_code)
    structure = discover_structure(model)
    slots = linear_slots(structure)
    ignored = excluded_layers([s.full_name for s in slots], cfg.ignore, cfg.targets)
    candidates = [s for s in slots if s.full_name not in ignored]
    # Only nn.Linear layers can be checked before the forward is watched: the orientation and role (router,
    # gate: left dense whatever their shape) of other matrices are found at run time (engine.observed_slots).
    bad = incompatible_slots([c for c in candidates if not c.param and c.out_features > 1], cfg.pattern)
    max_pos = config_value(config, "max_position_embeddings")
    seqlen = min(cfg.seqlen, int(max_pos)) if max_pos else cfg.seqlen
    width = torch.finfo(dtype).bits // 8
    params = sum(p.numel() for p in model.parameters())
    per_block = [sum(p.numel() for p in b.parameters()) for b in structure.blocks]
    hidden = int(config_value(config, "hidden_size"))
    spec = get_pruner(cfg.method)
    memory = estimate_device_memory(
        per_block,
        candidates,
        nsamples=cfg.nsamples,
        seqlen=seqlen,
        hidden_size=hidden,
        width=width,
        needs_gram=spec.needs_gram,
        iterative=spec.iterative,
        world_size=world_size if world_size is not None else ctx.distributed.world_size,
        offload_activations=cfg.offload_activations,
        sequential=cfg.sequential,
        refine=cfg.refine.on,
    )
    host = host_estimate(
        memory[0],  # shard_bounds gives rank 0 the most samples
        device=device,
        params=params,
        nsamples=cfg.nsamples,
        seqlen=seqlen,
        hidden_size=hidden,
        width=width,
        rows=-(-cfg.nsamples // len(memory)),
        offload_activations=cfg.offload_activations,
        refine=cfg.refine.on,
    )
    return PrunePlan(
        model=cfg.model,
        method=cfg.method,
        pattern=cfg.pattern.label,
        source=source,
        model_type=structure.model_type,
        slots=tuple(slots),
        incompatible=bad,
        ignored=ignored,
        seqlen=seqlen,
        nsamples=cfg.nsamples,
        params=params,
        cpu_bytes=params * width,
        device_memory=tuple(memory),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        blocks=len(structure),
        checkpoint_bytes=params * width,
        # With --refine the hidden-state files hold the dense stream too.
        resume_bytes=sum(per_block) * width + (4 if cfg.refine.on else 2) * cfg.nsamples * seqlen * hidden * width,
        host_memory=host,
    )
