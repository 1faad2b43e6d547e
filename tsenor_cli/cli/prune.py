"""`tsenor prune`: parse and cross-check flags, hand a frozen `PruneConfig` to the library.

The settings' flags are generated from `pruning/settings/table.ALL_FIELDS` (`cli/options.with_fields`), the
same table as the recipe keys and `PruneConfig`'s defaults; this module declares only the flags that
are not settings of the run (what to do with it: --dry-run, --eval, --nproc, --config, --json …).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tsenor_cli.cli.app import Command, app, command_line, run_context
from tsenor_cli.cli.options import (
    PPL,
    DataDirOpt,
    DryRunOpt,
    ForceOpt,
    JsonOpt,
    MaxWindowsOpt,
    OfflineOpt,
    PplOpt,
    TasksOpt,
    given_values,
    in_panel,
    parse_ppl_datasets,
    parse_tasks,
    with_fields,
)
from tsenor_cli.errors import UsageError
from tsenor_cli.pruning.settings.recipe import build_config, overlay, read_recipe
from tsenor_cli.pruning.settings.table import ALL_FIELDS

if TYPE_CHECKING:
    from tsenor_cli.compress import Compressed, Ranks
    from tsenor_cli.evaluation.runner import EvalConfig
    from tsenor_cli.pruning.settings.config import PruneConfig
    from tsenor_cli.runfiles import EvalReport
    from tsenor_cli.settings import RunContext

RUN = "Run"
EVAL = "Evaluation (--eval)"
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume/--no-resume-state",
        rich_help_panel=RUN,
        help="Save a resume state after each block and continue an interrupted run of the same settings "
        "(default; --resume is accepted). --no-resume-state saves none.",
    ),
]
NprocOpt = Annotated[
    int,
    typer.Option(
        "--nproc",
        min=1,
        rich_help_panel=RUN,
        help="Prune with this many processes on this node (torchrun; one GPU each with --device cuda, "
        "gloo on the CPU); with --dry-run, estimate the memory of each.",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", rich_help_panel=RUN, help="YAML recipe; flags typed on the command line override it."),
]
EvalOpt = Annotated[
    bool, typer.Option("--eval", rich_help_panel=EVAL, help="Evaluate the pruned checkpoint afterwards (eval.json).")
]


def merge_config(given: dict[str, Any], config: Path | None) -> dict[str, Any]:
    """The --config recipe's values, overridden by the settings typed on the command line."""
    return given if config is None else overlay(read_recipe(config), given)


@app.command("prune", cls=Command)
@with_fields(ALL_FIELDS)
def prune_cmd(
    ctx: typer.Context,
    force: ForceOpt = False,
    resume: ResumeOpt = True,
    nproc: NprocOpt = 1,
    config: ConfigOpt = None,
    dry_run: in_panel(DryRunOpt, RUN) = False,  # type: ignore[valid-type]
    run_eval: EvalOpt = False,
    ppl: in_panel(PplOpt, EVAL) = PPL,  # type: ignore[valid-type]
    tasks: in_panel(TasksOpt, EVAL) = None,  # type: ignore[valid-type]
    max_windows: in_panel(MaxWindowsOpt, EVAL) = None,  # type: ignore[valid-type]
    as_json: JsonOpt = False,
    data_dir: DataDirOpt = None,
    offline: OfflineOpt = False,
    **settings: Any,
) -> None:
    """Prune a model to (transposable) N:M or unstructured sparsity, block by block."""
    run_ctx = run_context(ctx, data_dir, offline)
    if nproc > 1 and run_ctx.distributed.distributed:
        raise UsageError(
            f"--nproc {nproc} given inside a torchrun process (rank {run_ctx.distributed.rank} of "
            f"{run_ctx.distributed.world_size}); drop --nproc, torchrun already started the processes"
        )
    command = command_line()
    recipe = merge_config(given_values(ctx, ALL_FIELDS), config)
    cfg = build_config(recipe, force=force, resume=resume, command=command)
    # Checked before pruning: a typo must not surface after hours of work.
    eval_cfg = _eval_config(run_eval, dry_run, ppl, tasks, max_windows, run_ctx)
    if dry_run:
        _dry_run(cfg, run_ctx, nproc, as_json=as_json)
        return
    _check_calibration_source(cfg, run_ctx)
    if nproc > 1 and not cfg.distill.on:
        _launch(ctx, cfg, nproc)
        return
    from tsenor_cli.compress import compress
    from tsenor_cli.interrupt import stop_on_signals

    ranks = _stage_ranks(ctx, nproc) if nproc > 1 else None  # the ranks prune, this process distils
    with stop_on_signals() as stop:
        outcome = compress(cfg, run_ctx, eval_cfg, stop=stop, ranks=ranks)
    if run_ctx.distributed.is_root:  # rank 0 reports (and evaluates) for the run
        _print_result(outcome, as_json=as_json)


def _check_calibration_source(cfg: PruneConfig, run_ctx: RunContext) -> None:
    """A named calibration text with the hub off and no data folder: say so before loading (not for a
    run that reads no text: `plan.reads_data`)."""
    from tsenor_cli.data.sources import NAMED_TEXTS, data_folder
    from tsenor_cli.pruning.plan.plan import reads_data

    if cfg.calib_data in NAMED_TEXTS and reads_data(cfg):
        data_folder(run_ctx, cfg.calib_data)


def _dry_run(cfg: PruneConfig, run_ctx: RunContext, nproc: int, *, as_json: bool) -> None:
    """Print the plan (text or JSON), with --distill-steps the distillation's after it, and end as the run
    would (`advice.check_plan`, `FinetunePlan.check`)."""
    from tsenor_cli.pruning.plan.advice import check_plan
    from tsenor_cli.pruning.plan.plan import plan_model
    from tsenor_cli.pruning.plan.render import plan_dict, plan_lines

    processes = max(nproc, run_ctx.distributed.world_size)
    plan = plan_model(cfg, run_ctx, world_size=processes)
    distill = None
    if cfg.distill.on:
        from tsenor_cli.compress import distill_plan

        distill = distill_plan(cfg, run_ctx)
    if as_json:
        typer.echo(json.dumps(plan_dict(plan) | ({"distill": distill.to_dict()} if distill else {}), indent=2))
    else:
        then = ["", "then the distillation (--distill-steps):", *distill.lines()] if distill else []
        typer.echo("\n".join([*plan_lines(plan, cfg), *then]))
    check_plan(plan, cfg, processes)
    if distill is not None:
        from tsenor_cli.compress import DISTILL_FIT_FLAGS

        distill.check(fix=DISTILL_FIT_FLAGS)


def _eval_config(
    run_eval: bool,
    dry_run: bool,
    ppl: str,
    tasks: str | None,
    max_windows: int | None,
    run_ctx: RunContext,
) -> EvalConfig | None:
    """--eval's settings, checked (datasets, tasks, their sources) before anything runs; None without --eval.
    The evaluation records this process's command line, as the prune does."""
    if not run_eval:
        if tasks is not None:
            raise UsageError("--tasks applies with --eval only; add --eval or drop --tasks")
        return None
    if dry_run:
        raise UsageError("--eval cannot run with --dry-run (there is no checkpoint); drop one of them")
    from tsenor_cli.evaluation.runner import EvalConfig

    eval_cfg = EvalConfig(
        ppl_datasets=parse_ppl_datasets(ppl), tasks=parse_tasks(tasks), max_windows=max_windows, command=command_line()
    )
    if not eval_cfg.ppl_datasets and not eval_cfg.tasks:
        raise UsageError("--eval with --ppl none and no --tasks evaluates nothing; pass --ppl or --tasks")
    eval_cfg.check_sources(run_ctx)
    return eval_cfg


def _print_result(outcome: Compressed, *, as_json: bool) -> None:
    """The run's summary (from the reports' data) and the evaluation's table, or their JSON."""
    from tsenor_cli.report.markdown import eval_table, prune_summary

    report, distilled, evaluation = outcome.prune, outcome.distill, outcome.evaluation
    if as_json:
        parts = {"prune": report.to_json()} | ({"distill": distilled.to_json()} if distilled is not None else {})
        parts |= {"eval": evaluation.to_json()} if evaluation is not None else {}
        typer.echo(json.dumps(parts if len(parts) > 1 else parts["prune"], indent=2))
        return
    if evaluation is not None:
        typer.echo(eval_table(evaluation))
    totals = report.totals()
    typer.echo("\n".join(prune_summary(report)))
    if distilled is None:
        typer.echo(_outcome(report.output, f"{totals['layers_pruned']} layers pruned in {report.seconds:.1f} s",
                            found=report.found_finished, evaluation=evaluation))  # fmt: skip
        return
    resumed = distilled.resumed_from_step
    how = (
        f"in {distilled.seconds:.1f} s"
        if resumed is None
        else f"resumed after step {resumed}, {distilled.seconds:.1f} s"
    )
    done = (
        f"{totals['layers_pruned']} layers pruned in {report.seconds:.1f} s, then distilled for {distilled.steps} "
        f"steps, {distilled.tokens} tokens, {how}"
    )
    typer.echo(_outcome(distilled.output, done, found=distilled.found_finished, evaluation=evaluation))


def _outcome(output: str | None, done: str, *, found: bool, evaluation: EvalReport | None) -> str:
    """The last line: what was written, or that a rerun of a finished run's command found it all done (and
    whether it evaluated it, when its eval.json was not this command's)."""
    from tsenor_cli.runfiles import EVAL_FILE

    if not found:
        return f"wrote {output} ({done})"
    if evaluation is not None and not evaluation.found_finished:
        return f"{output} already held this run ({done}); evaluated it into its {EVAL_FILE}"
    return f"{output} already held this run ({done}); nothing written"


def _stage_ranks(ctx: typer.Context, nproc: int) -> Ranks:
    """--nproc K with --distill-steps: the K ranks run the prune of the stage (`launch.stage_arguments`); a
    failed or stopped one ends this command with the ranks' exit code (their line printed)."""

    def ranks(stage_cfg: PruneConfig) -> None:
        from tsenor_cli.cli.app import launch_arguments
        from tsenor_cli.pruning.run.launch import launch_prune, stage_arguments

        assert stage_cfg.output is not None
        args = stage_arguments(launch_arguments(ctx), stage_cfg.output)
        if code := launch_prune(args, stage_cfg, nproc, stage=True):
            raise typer.Exit(code)

    return ranks


def _launch(ctx: typer.Context, cfg: PruneConfig, nproc: int) -> None:
    """Run this same command in `nproc` processes (`pruning/run/launch.py`) and exit with the run's status."""
    from tsenor_cli.cli.app import launch_arguments
    from tsenor_cli.pruning.run.launch import launch_prune

    if code := launch_prune(launch_arguments(ctx), cfg, nproc):
        raise typer.Exit(code)
