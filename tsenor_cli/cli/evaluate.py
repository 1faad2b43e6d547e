"""`tsenor eval MODEL`: perplexity (WikiText2, PTB, C4) and optional zero-shot tasks."""

from __future__ import annotations

import json

import typer

from tsenor_cli.cli.app import Command, app, command_line, run_context
from tsenor_cli.cli.options import (
    DEVICE,
    DTYPE,
    KERNELS_DEFAULT,
    PPL,
    DataDirOpt,
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    KernelsOpt,
    LimitOpt,
    MaxWindowsOpt,
    ModelAliasOpt,
    ModelArg,
    OfflineOpt,
    OutputDirOpt,
    PplOpt,
    TasksOpt,
    TrustRemoteCodeOpt,
    in_panel,
    parse_batch_size,
    parse_limit,
    parse_ppl_datasets,
    parse_tasks,
    pick_model,
)
from tsenor_cli.errors import EXIT_SIGINT, Interrupted

MODEL, PERPLEXITY, ZEROSHOT = "Model", "Perplexity", "Zero-shot (lm-eval)"


# The options of `tsenor eval` alone (those several commands share are in cli/options.py).
_STREAM = typer.Option(
    None,
    "--stream/--no-stream",
    show_default="stream where it can",
    rich_help_panel=MODEL,
    help="Perplexity block by block: one decoder block in memory at a time, read from the checkpoint's "
    "safetensors when its turn comes. By default wherever it can (a safetensors folder, perplexity only, "
    "no --device-map); --stream insists (refused with --tasks), --no-stream loads the model whole.",
)
_DEVICE_MAP = typer.Option(
    None,
    "--device-map",
    rich_help_panel=MODEL,
    help="'auto': spread the whole model over the GPUs present, then the CPU (accelerate), for zero-shot "
    "tasks on a model larger than one GPU; --device is then not used.",
)
_SEQLEN = typer.Option(
    None, "--seqlen", rich_help_panel=PERPLEXITY, help="Perplexity window (default 2048, capped by the model)."
)
_NUM_FEWSHOT = typer.Option(
    0, "--num-fewshot", min=0, rich_help_panel=ZEROSHOT, help="Few-shot examples for zero-shot tasks."
)
_BATCH_SIZE = typer.Option("auto", "--batch-size", rich_help_panel=ZEROSHOT, help="Batch size (integer or 'auto').")


@app.command("eval", cls=Command)
def eval_cmd(
    ctx: typer.Context,
    model: ModelArg = None,
    model_option: ModelAliasOpt = None,
    dtype: in_panel(DtypeOpt, MODEL) = DTYPE,  # type: ignore[valid-type]
    device: in_panel(DeviceOpt, MODEL) = DEVICE,  # type: ignore[valid-type]
    trust_remote_code: in_panel(TrustRemoteCodeOpt, MODEL) = False,  # type: ignore[valid-type]
    kernels: in_panel(KernelsOpt, MODEL) = KERNELS_DEFAULT,  # type: ignore[valid-type]
    stream: bool | None = _STREAM,
    device_map: str | None = _DEVICE_MAP,
    ppl: in_panel(PplOpt, PERPLEXITY) = PPL,  # type: ignore[valid-type]
    seqlen: int | None = _SEQLEN,
    max_windows: in_panel(MaxWindowsOpt, PERPLEXITY) = None,  # type: ignore[valid-type]
    tasks: in_panel(TasksOpt, ZEROSHOT) = None,  # type: ignore[valid-type]
    num_fewshot: int = _NUM_FEWSHOT,
    limit: in_panel(LimitOpt, ZEROSHOT) = None,  # type: ignore[valid-type]
    batch_size: str = _BATCH_SIZE,
    output: OutputDirOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
    data_dir: DataDirOpt = None,
    offline: OfflineOpt = False,
) -> None:
    """Evaluate a model: perplexity (SparseGPT protocol) and optional lm-eval zero-shot tasks."""
    from tsenor_cli.evaluation.runner import EvalConfig, EvalModel, evaluate_into
    from tsenor_cli.models.loading import LoadOptions
    from tsenor_cli.report.markdown import eval_table

    # Validate every option before the (slow) model load, so a typo fails at once.
    model = pick_model(model, model_option)
    cfg = EvalConfig(
        ppl_datasets=parse_ppl_datasets(ppl),
        tasks=parse_tasks(tasks),
        num_fewshot=num_fewshot,
        limit=parse_limit(limit),
        batch_size=parse_batch_size(batch_size),
        seqlen=seqlen,
        max_windows=max_windows,
        command=command_line(),
        stream=stream is not False,
        kernels=kernels,
    )
    run_ctx = run_context(ctx, data_dir, offline)
    cfg.check(run_ctx, stream=bool(stream), device_map=device_map)
    how = LoadOptions(trust_remote_code=trust_remote_code, device_map=device_map, check_tokenizer=True)
    try:
        report = evaluate_into(EvalModel(model, dtype, device, how), cfg, run_ctx, output=output, force=force)
    except KeyboardInterrupt:
        # eval.json is written only once every metric is in, so nothing is left half-done.
        raise Interrupted("interrupted while evaluating; nothing was written", EXIT_SIGINT) from None
    typer.echo(json.dumps(report.to_json(), indent=2) if as_json else eval_table(report))
