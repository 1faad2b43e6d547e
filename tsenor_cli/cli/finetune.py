"""`tsenor finetune RUN_DIR --output DIR`: continue training a pruned checkpoint with its mask fixed."""

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
    LimitOpt,
    MaxWindowsOpt,
    OfflineOpt,
    OutputDirOpt,
    PplOpt,
    TasksOpt,
    given_values,
    in_panel,
    parse_limit,
    parse_list,
    parse_ppl_datasets,
    with_fields,
)
from tsenor_cli.data.sources import NAMED_TEXTS
from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.finetune.config import CALIBRATION_DATA, FINETUNE_FIELDS, FinetuneConfig

if TYPE_CHECKING:
    from tsenor_cli.runfiles import FinetuneReport
    from tsenor_cli.settings import RunContext


def _check_data(data: str, given: dict[str, Any]) -> None:
    if data == CALIBRATION_DATA:
        if "seqlen" in given:
            raise UsageError(
                "--seqlen does not apply to --data calibration, whose windows are the prune's own (its --seqlen); "
                "drop --seqlen"
            )
        return
    if data not in NAMED_TEXTS and not Path(data).expanduser().is_file():
        raise InputNotFoundError(
            f"--data {data} is not a readable file nor one of {', '.join(NAMED_TEXTS)}, {CALIBRATION_DATA}; "
            f"pass c4, wikitext2, ptb, {CALIBRATION_DATA} or an existing .txt/.jsonl/.json.gz/.parquet file"
        )


def summary(report: FinetuneReport) -> str:
    """A few human lines: what was trained, the loss and the perplexity before → after."""
    lines = [
        f"fine-tuned {report.run_dir} ({report.pattern['pattern']} {report.pattern['kind']}, mask fixed): "
        f"{report.steps} steps, {report.tokens} tokens ({report.epochs:.2f} passes over {report.windows} windows), "
        f"{report.seconds_per_step:.2f} s/step",
        f"data: {report.data}",
    ]
    teacher = report.settings.get("teacher")
    for name, curve in (("distillation loss" if teacher else "loss", report.loss_curve), ("ce", report.ce_curve)):
        if curve:
            first, last = curve[0], curve[-1]
            lines.append(f"{name}: {first[1]:.4f} (step {first[0]}) → {last[1]:.4f} (step {last[0]})")
    before, after = report.ppl("before"), report.ppl("after")
    lines.extend(f"{name} ppl: {before.get(name, float('nan')):.3f} → {after[name]:.3f}" for name in after)
    lines.append(
        f"{report.output} already held this run (fine-tuned in {report.seconds:.1f} s); nothing written"
        if report.found_finished
        else f"wrote {report.output} in {report.seconds:.1f} s"
    )
    return "\n".join(lines)


EVAL = "Evaluation (before and after)"
# `--bf16`: the old spelling of `--dtype bf16`; hidden, accepted for one release.
Bf16AliasOpt = Annotated[
    bool, typer.Option("--bf16", hidden=True, help="Old spelling of --dtype bf16, accepted for one release.")
]


@app.command("finetune", cls=Command)
@with_fields(FINETUNE_FIELDS)
def finetune_cmd(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., help="Checkpoint folder written by tsenor prune (its --output)."),
    output: OutputDirOpt = None,
    force: ForceOpt = False,
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its last checkpoint."),
    ppl: in_panel(PplOpt, EVAL) = PPL,  # type: ignore[valid-type]
    max_windows: in_panel(MaxWindowsOpt, EVAL) = None,  # type: ignore[valid-type]
    tasks: in_panel(TasksOpt, EVAL) = None,  # type: ignore[valid-type]
    limit: in_panel(LimitOpt, EVAL) = None,  # type: ignore[valid-type]
    bf16: Bf16AliasOpt = False,
    dry_run: DryRunOpt = False,
    as_json: JsonOpt = False,
    data_dir: DataDirOpt = None,
    offline: OfflineOpt = False,
    **settings: Any,
) -> None:
    """Fine-tune a pruned checkpoint with its sparsity pattern fixed; verify passes on the result."""
    if output is None:
        raise UsageError("--output is required; pass the folder for the fine-tuned checkpoint")
    given = given_values(ctx, FINETUNE_FIELDS)
    if bf16:
        if given.get("dtype", "bf16") != "bf16":
            raise UsageError(f"--bf16 and --dtype {given['dtype']} disagree; pass --dtype bf16 alone")
        given["dtype"] = "bf16"
    _check_data(given.get("data", FINETUNE_FIELDS[0].default), given)
    run_ctx = run_context(ctx, data_dir, offline)
    cfg = FinetuneConfig(
        run_dir=run_dir.expanduser(),
        output=output.expanduser(),
        **given,
        ppl_datasets=parse_ppl_datasets(ppl),
        max_windows=max_windows,
        tasks=parse_list(tasks, "--tasks"),
        limit=parse_limit(limit),
        force=force,
        resume=resume,
        command=command_line(),
    )
    if dry_run:
        _dry_run(cfg, run_ctx, as_json=as_json)
        return
    from tsenor_cli.finetune.run import finetune
    from tsenor_cli.interrupt import stop_on_signals

    # As for prune: SIGTERM/SIGUSR1/SIGUSR2 finish the step in hand and save it, Ctrl-C stops at once;
    # both end in one line saying what was saved (exit 75 / 130).
    with stop_on_signals() as stop:
        report = finetune(cfg, run_ctx, stop=stop)
    if run_ctx.distributed.is_root:  # the main process reports for the run (it alone evaluates and writes)
        typer.echo(json.dumps(report.to_json(), indent=2) if as_json else summary(report))


def _dry_run(cfg: FinetuneConfig, run_ctx: RunContext, *, as_json: bool) -> None:
    """Print the plan (text or JSON) and end as the run would: exit 5 when it cannot fit."""
    from tsenor_cli.finetune.plan import plan_finetune

    plan = plan_finetune(cfg, run_ctx)
    typer.echo(json.dumps(plan.to_dict(), indent=2) if as_json else "\n".join(plan.lines()))
    plan.check()
