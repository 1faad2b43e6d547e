"""`tsenor finetune RUN_DIR --output DIR`: continue training a pruned checkpoint with its mask fixed."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from tsenor_cli.cli import Command, app, command_line, run_context
from tsenor_cli.cli.options import (
    DEVICE,
    PPL,
    DataDirOpt,
    DeviceOpt,
    ForceOpt,
    JsonOpt,
    LimitOpt,
    MaxWindowsOpt,
    OfflineOpt,
    OutputDirOpt,
    PplOpt,
    TasksOpt,
    TrustRemoteCodeOpt,
    parse_limit,
    parse_list,
    parse_ppl_datasets,
)
from tsenor_cli.data.sources import NAMED_TEXTS
from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.finetune.run import FinetuneConfig
from tsenor_cli.runfiles import FinetuneReport


def _check_data(data: str) -> None:
    if data not in NAMED_TEXTS and not Path(data).expanduser().is_file():
        raise InputNotFoundError(
            f"--data {data} is not a readable file nor one of {', '.join(NAMED_TEXTS)}; "
            "pass c4, wikitext2, ptb or an existing .txt/.jsonl/.json.gz/.parquet file"
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
    lines.append(f"wrote {report.output} in {report.seconds:.1f} s")
    return "\n".join(lines)


@app.command("finetune", cls=Command)
def finetune_cmd(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., help="Checkpoint folder written by tsenor prune (its --output)."),
    output: OutputDirOpt = None,
    force: ForceOpt = False,
    data: str = typer.Option("c4", "--data", help="Training text: c4, wikitext2, ptb or a text/jsonl file."),
    seqlen: int = typer.Option(512, "--seqlen", min=2, help="Tokens per training window."),
    max_steps: int = typer.Option(200, "--max-steps", min=1, help="Optimizer steps."),
    lr: float = typer.Option(2e-5, "--lr", help="Peak learning rate (AdamW, linear decay to 0)."),
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="Windows per micro-batch (per process)."),
    grad_accum: int = typer.Option(1, "--grad-accum", min=1, help="Micro-batches per optimizer step."),
    warmup: int = typer.Option(0, "--warmup", min=0, help="Linear warm-up steps."),
    seed: int = typer.Option(0, "--seed", help="Seed of the document order, data order and Trainer."),
    bf16: bool = typer.Option(False, "--bf16", help="bf16 autocast (weights stay fp32 while training)."),
    ppl: PplOpt = PPL,
    max_windows: MaxWindowsOpt = None,
    tasks: TasksOpt = None,
    limit: LimitOpt = None,
    eval_every: int = typer.Option(0, "--eval-every", min=0, help="Perplexity every K steps (0: before/after)."),
    save_every: int = typer.Option(100, "--save-every", min=0, help="Checkpoint for --resume every K steps."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its last checkpoint."),
    teacher: str | None = typer.Option(
        None, "--teacher", help="Distil from this dense model (the one pruned): hub id, folder or embedded name."
    ),
    distill_weight: float = typer.Option(
        1.0, "--distill-weight", help="Share of the distillation loss; the rest is cross-entropy (needs --teacher)."
    ),
    distill_temperature: float = typer.Option(
        1.0, "--distill-temperature", help="Softmax temperature of the distillation loss (needs --teacher)."
    ),
    device: DeviceOpt = DEVICE,
    trust_remote_code: TrustRemoteCodeOpt = False,
    as_json: JsonOpt = False,
    data_dir: DataDirOpt = None,
    offline: OfflineOpt = False,
) -> None:
    """Fine-tune a pruned checkpoint with its sparsity pattern fixed; verify passes on the result."""
    if output is None:
        raise UsageError("--output is required; pass the folder for the fine-tuned checkpoint")
    _check_data(data)
    run_ctx = run_context(ctx, data_dir, offline)
    cfg = FinetuneConfig(
        run_dir=run_dir.expanduser(),
        output=output.expanduser(),
        data=data,
        seqlen=seqlen,
        max_steps=max_steps,
        lr=lr,
        batch_size=batch_size,
        grad_accum=grad_accum,
        warmup=warmup,
        seed=seed,
        bf16=bf16,
        ppl_datasets=parse_ppl_datasets(ppl),
        max_windows=max_windows,
        tasks=parse_list(tasks, "--tasks"),
        limit=parse_limit(limit),
        eval_every=eval_every,
        save_every=save_every,
        device=device,
        trust_remote_code=trust_remote_code,
        teacher=teacher,
        distill_weight=distill_weight,
        distill_temperature=distill_temperature,
        force=force,
        resume=resume,
        command=command_line(),
    )
    from tsenor_cli.finetune.run import finetune
    from tsenor_cli.interrupt import stop_on_signals

    # As for prune: SIGTERM/SIGUSR1/SIGUSR2 finish the step in hand and save it, Ctrl-C stops at once;
    # both end in one line saying what was saved (exit 75 / 130).
    with stop_on_signals() as stop:
        report = finetune(cfg, run_ctx, stop=stop)
    typer.echo(json.dumps(report.to_json(), indent=2) if as_json else summary(report))
