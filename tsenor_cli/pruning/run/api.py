"""Library entry points: `prune(model, cfg) -> PruneReport` (the Python API: a path or a model in memory,
docs/guide/python-api.md), `prune_model(cfg, ctx) -> PruneReport` (the run: checks, plan, lock, then
`run.execute`, with the caller's extra block hooks and sinks, `pruning/run/seams.py`) and
`prune_and_evaluate` (`tsenor prune --eval`); the dry run's `plan_model` is in pruning/plan/plan.py.

`ctx` (settings.RunContext) says where calibration data and hub models may come from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tsenor_cli.errors import EXIT_RESUMABLE, EXIT_SIGINT, Interrupted, ResumeStateError, UsageError
from tsenor_cli.evaluation import runner
from tsenor_cli.evaluation.runner import EvalConfig
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.models.identity import identity_digest
from tsenor_cli.outputs import output_path
from tsenor_cli.phases import recording
from tsenor_cli.progress import Progress, sink
from tsenor_cli.pruning.block.distributed import Team, joined
from tsenor_cli.pruning.block.memory import check_fits
from tsenor_cli.pruning.block.outside import check_outside
from tsenor_cli.pruning.plan.plan import PrunePlan, dtype_and_device, plan_model
from tsenor_cli.pruning.run.card import refresh_card
from tsenor_cli.pruning.run.output import finished_prune
from tsenor_cli.pruning.run.run import RunPoint, RunSetup, execute
from tsenor_cli.pruning.run.seams import BlockHook, Sink
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.replay import BlockInputs, capture_block_inputs
from tsenor_cli.runfiles import EVAL_FILE, ContextRecord, EvalReport, PruneReport, ResumeState
from tsenor_cli.runfiles.output import (
    OutputRun,
    check_free_space,
    check_not_input,
    copied_bytes,
    finished_evaluation,
    output_run,
)
from tsenor_cli.runfiles.resume import ResumeStore
from tsenor_cli.runfiles.write import write_eval
from tsenor_cli.settings import RunContext

if TYPE_CHECKING:
    from tsenor_cli.models.loading import LoadedModel


def prune(
    model: str | Path | Any,
    cfg: PruneConfig,
    *,
    tokenizer: Any = None,
    ctx: RunContext | None = None,
    progress: Progress | None = None,
    hooks: Sequence[BlockHook] = (),
    sinks: Sequence[Sink] = (),
) -> PruneReport:
    """The Python entry point (docs/guide/python-api.md), as llm-compressor users call ``oneshot``: prune
    `model` under `cfg` into `cfg.output` → the run's report (what tsenor_report.json holds).

    model: a checkpoint folder, an embedded name or a hub id (replaces `cfg.model`), or a transformers
    model already in memory (a `PreTrainedModel`): then it is pruned in place and written to
    `cfg.output`, its config and tokenizer read from the folder it was loaded from
    (``model.name_or_path``; `tokenizer`, when given, is used instead of that folder's). ctx: where
    data and hub models come from (default: the environment, `RunContext.from_environment`). hooks,
    sinks: block hooks and sinks run after the run's own (`pruning/run/seams.py`, docs/guide/python-api.md)."""
    from tsenor_cli.models.loading import LoadedModel
    from tsenor_cli.models.structure import discover_structure

    ctx = ctx if ctx is not None else RunContext.from_environment()
    if isinstance(model, str | Path):
        return prune_model(replace(cfg, model=str(model)), ctx, progress, hooks=hooks, sinks=sinks)
    folder = str(getattr(model, "name_or_path", "") or "")
    if not folder or not Path(folder, "config.json").is_file():
        raise UsageError(
            "a model in memory is pruned with the config and tokenizer of the folder it was loaded from, and this "
            f"one's name_or_path ({folder or 'empty'}) holds no config.json; save it (save_pretrained), pass the folder"
        )
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    built = LoadedModel(
        model=model.eval(), tokenizer=tokenizer, name=folder, source=folder, structure=discover_structure(model)
    )
    return prune_model(replace(cfg, model=folder), ctx, progress, built=built, hooks=hooks, sinks=sinks)


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

    loaded = load_model(model, ctx, dtype=torch.float32, device="cpu")
    calib = calibration_batches(calib_data, loaded.tokenizer, ctx, nsamples=nsamples, seqlen=seqlen, seed=seed)
    return loaded, capture_block_inputs(loaded.structure, calib.input_ids, torch.device("cpu"))


def prune_model(
    cfg: PruneConfig,
    ctx: RunContext,
    progress: Progress | None = None,
    *,
    after_block: Callable[[int], None] | None = None,
    stop: StopRequest | None = None,
    built: LoadedModel | None = None,
    hooks: Sequence[BlockHook] = (),
    sinks: Sequence[Sink] = (),
) -> PruneReport:
    """Prune `cfg.model` block by block and write the checkpoint + reports to `cfg.output`.

    Before any weights are read the output location is checked (writable, not the input, room for the
    checkpoint and resume state). Then, under the output's lock until the checkpoint is in place: a killed
    run's leftovers are recovered, the folder's contents checked (`prepare_output`), and with `cfg.resume`
    an interrupted run of the same settings continued; its state is saved after every block
    (runfiles/resume.py) and goes away with the final swap.

    stop: polled before each block; once set (SIGTERM/SIGUSR1/SIGUSR2, tsenor_cli.interrupt) the run
    raises `Interrupted` (exit 75) with its resume state saved; Ctrl-C is `Interrupted` (exit 130).
    after_block(i): runs once block i is done and handed to the sinks (tests simulate a kill with it).
    built: a model in memory to prune instead of loading `cfg.model` (`tsenor bench prune`), which must
    then be a folder with its config.json and tokenizer. hooks, sinks: block hooks (every rank) and sinks
    (rank 0) run after the run's own (`pruning/run/seams.py`). Raises a `TsenorError` subclass for every
    input the user can fix, before any output exists.
    """
    start = time.perf_counter()
    place = ctx.distributed
    output = _checked_output(cfg, place.world_size)
    # In a distributed run rank 0 speaks for all: the other ranks' lines would repeat its own.
    say = sink(progress) if place.is_root else _silent
    point = RunPoint()
    dtype, device = dtype_and_device(cfg, ctx)

    def interrupted(signal_name: str | None) -> Interrupted:
        return point.interrupted(output, saving=cfg.resume, signal_name=signal_name)

    with (
        recording() as timings,
        output_run(output, interrupted, say=say, stop=stop) as folder,
        joined(place, device) as team,
    ):
        plan = _checked_plan(cfg, ctx, folder, team, say, built=built is not None)
        if built is not None:  # the plan is made from the folder's config.json: the model must be that one
            plan.check_model(built.structure, cfg.model)
        # Only rank 0 touches the output folder: it alone holds the lock and writes every file.
        with folder.locked(owner=team.is_root):
            opened = _open_output(cfg, folder, plan, team, say)
            if isinstance(opened, PruneReport):
                return opened
            store, state = opened
            point.blocks, point.done = plan.blocks, state.next_block if state is not None else 0
            run = RunSetup(
                cfg, ctx, plan, output, team, device, dtype, say, point, timings, start,
                store=store if cfg.resume else None, state=state, stop=stop, after_block=after_block,
                built=built, hooks=hooks, sinks=sinks,
            )  # fmt: skip
            timings.add("plan", time.perf_counter() - start)  # the checks, the plan, the lock
            return execute(run)


def _checked_output(cfg: PruneConfig, processes: int) -> Path:
    """The output folder, refused before any work when missing, or when a process would get no sample."""
    if cfg.output is None:
        raise UsageError("--output is required to prune; pass --output DIR (or --dry-run to only print the plan)")
    cfg.check_samples(processes, f"the {processes} processes of the run")
    return output_path(cfg.output)


def _checked_plan(
    cfg: PruneConfig,
    ctx: RunContext,
    folder: OutputRun,
    team: Team,
    say: Progress,
    *,
    built: bool = False,
) -> PrunePlan:
    """The run's plan (`plan_model`, made once: the run uses it), with what can be refused before the
    lock: the output location (writable, not the input), a checkpoint whose weights disagree with its
    config.json (not for a model `built` in memory: `PrunePlan.check_model` checks that one), the
    --targets selection outside the language
    model, and whether the run fits this machine (before the lock and the free-space check: a run that
    cannot fit allocates nothing)."""
    with team.agreed():
        if team.is_root:
            folder.check_location()
        plan = plan_model(cfg, ctx, progress=say, observe=False, conform=not built)
        check_not_input(folder.output, plan.source)
        check_outside(plan.outside_targets, cfg.pattern, skip=cfg.skip_incompatible)
        plan.check_processes()  # a matrix --nproc cannot prune is refused once, before any work
        check_fits(
            plan.host_memory,
            plan.device_bytes,
            team.device,
            nsamples=cfg.nsamples,
            seqlen=plan.seqlen,
            offload_activations=cfg.offload_activations,
        )
    return plan


def _open_output(
    cfg: PruneConfig, folder: OutputRun, plan: PrunePlan, team: Team, say: Progress
) -> PruneReport | tuple[ResumeStore, ResumeState | None]:
    """Under the lock (rank 0): recover a killed run's leftovers; the report of a finished run of the same
    settings (nothing to do); else the output's resume store, checked (`prepare_output`) with room for the
    checkpoint and resume state, and the interrupted run's state to continue (None: start fresh)."""
    output = folder.output
    state: ResumeState | None = None
    done: PruneReport | None = None
    with team.agreed():
        if team.is_root:
            folder.recover()
            done = None if cfg.force else finished_prune(output, cfg.result_hash(), cfg.save_format)
    done = team.broadcast_object(done)
    if done is not None:
        say(f"{output} already holds this run, finished with the same settings; nothing to do")
        return done
    with team.agreed():
        if team.is_root:
            store = folder.prepare(
                force=cfg.force, resume=cfg.resume, continue_hint="drop --no-resume-state to continue it"
            )
            state = _open_state(store, cfg, plan.blocks, say) if cfg.resume else None
            to_write = max(0, plan.resume_bytes - store.size()) if cfg.resume else 0
            # A streamed run without a resume state keeps its pruned blocks on disk until the write.
            kept = plan.blocks_bytes if cfg.stream and not cfg.resume else 0
            check_free_space(output, plan.checkpoint_bytes, to_write, kept, copied=copied_bytes(plan.source))
        else:
            store = ResumeStore(output)
    return store, team.broadcast_object(state)


def _silent(_message: str) -> None:
    """The progress sink of ranks other than 0."""


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


def prune_and_evaluate(
    cfg: PruneConfig, ctx: RunContext, eval_cfg: EvalConfig | None, *, stop: StopRequest | None = None
) -> tuple[PruneReport, EvalReport | None]:
    """`tsenor prune --eval`: prune (`prune_model`), then evaluate the checkpoint into its eval.json,
    block by block as `tsenor eval` does by default (`evaluation.runner.load_for_evaluation`: one block in
    memory at a time for a perplexity-only evaluation, `eval_cfg.stream`).

    Only rank 0 of a distributed run evaluates (the others return None), through `evaluate_checkpoint`.
    """
    report = prune_model(cfg, ctx, stop=stop)
    if eval_cfg is None or cfg.output is None or not ctx.distributed.is_root:
        return report, None
    return report, evaluate_checkpoint(cfg.output, ctx, eval_cfg, cfg, stop=stop, rerun=report.found_finished)


def evaluate_checkpoint(
    output: Path,
    ctx: RunContext,
    eval_cfg: EvalConfig,
    cfg: PruneConfig,
    *,
    stop: StopRequest | None = None,
    rerun: bool = False,
) -> EvalReport:
    """`--eval`: evaluate the finished checkpoint `output` into its eval.json (in `cfg`'s dtype and device) and
    refresh its model card's table. A stop signal stops it at once (it has no safe point;
    `StopRequest.at_once`), as Ctrl-C does: one line saying the checkpoint is complete and how to evaluate it.
    rerun: the run was found finished (a rerun of its command): an eval.json this command wrote is taken as
    it is (`finished_evaluation`), said as the evaluation's progress is."""
    identity = identity_digest(str(output)) if rerun else None
    if (done := finished_evaluation(output, eval_cfg.command, ContextRecord.of(ctx), identity)) is not None:
        sink(None)(f"{output / EVAL_FILE} holds this command's evaluation; nothing to do")
        return done
    try:
        with stop.at_once() if stop is not None else contextlib.nullcontext():
            loaded = runner.load_for_evaluation(str(output), ctx, eval_cfg, dtype=cfg.dtype, device=cfg.device)
            evaluation = runner.evaluate_model(loaded, eval_cfg, ctx)
    except KeyboardInterrupt:
        how = f"stopped by {stop.name}" if stop is not None and stop.name else "interrupted"
        raise Interrupted(
            f"{how} while evaluating; the checkpoint {output} is complete but has no {EVAL_FILE}: "
            f"run `tsenor eval {output} --output {output}`",
            EXIT_RESUMABLE if stop is not None and stop.name else EXIT_SIGINT,
        ) from None
    write_eval(output / EVAL_FILE, evaluation)
    refresh_card(output)  # the model card's evaluation table
    return evaluation
