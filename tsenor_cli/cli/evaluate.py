"""`tsenor eval --model M`: perplexity (WikiText2, PTB, C4) and optional zero-shot tasks."""

from __future__ import annotations

import json
import math
from typing import cast

import typer

from tsenor_cli import atomic
from tsenor_cli.cli import Command, app, command_line, run_context
from tsenor_cli.cli.options import (
    DEVICE,
    DTYPE,
    PPL,
    DataDirOpt,
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    LimitOpt,
    MaxWindowsOpt,
    OfflineOpt,
    OutputDirOpt,
    PplOpt,
    TasksOpt,
    TrustRemoteCodeOpt,
)
from tsenor_cli.data.sources import DATASET_NAMES, DatasetName, data_folder
from tsenor_cli.errors import EXIT_SIGINT, Interrupted, OutputExistsError, UsageError
from tsenor_cli.evaluation.runner import STREAM_TASKS, EvalConfig, evaluate_model
from tsenor_cli.models.loading import load_model, parse_dtype
from tsenor_cli.progress import logger
from tsenor_cli.runfiles import EVAL_FILE, EvalReport
from tsenor_cli.settings import RunContext


def parse_list(text: str | None, option: str) -> tuple[str, ...]:
    """ "a,b , c" → ("a", "b", "c"); "" or "none" → (); empty items are refused."""
    if text is None or text.strip().lower() in ("", "none"):
        return ()
    items = tuple(item.strip() for item in text.split(","))
    if any(not item for item in items):
        raise UsageError(f"{option} {text!r} has an empty item; pass a comma-separated list like a,b")
    return items


def parse_ppl_datasets(text: str | None) -> tuple[DatasetName, ...]:
    items = parse_list(text, "--ppl")
    unknown = [item for item in items if item not in DATASET_NAMES]
    if unknown:
        raise UsageError(
            f"unknown --ppl dataset(s) {', '.join(unknown)}; use a subset of {','.join(DATASET_NAMES)} or none"
        )
    return cast(tuple[DatasetName, ...], items)


def parse_tasks(text: str | None) -> tuple[str, ...]:
    """--tasks "a,b" → ("a", "b"), refusing unknown or repeated names (before any model is loaded)."""
    tasks = parse_list(text, "--tasks")
    if not tasks:
        return ()
    _check_zeroshot_available()
    from tsenor_cli.evaluation.zeroshot import validate_tasks

    return validate_tasks(tasks)


def check_data_sources(cfg: EvalConfig, ctx: RunContext) -> None:
    """Refuse perplexity datasets with no source under `ctx` (hub off, no data folder) before loading a model."""
    for name in cfg.ppl_datasets:
        data_folder(ctx, name)


def parse_batch_size(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError as exc:
        raise UsageError(f"--batch-size {text!r} must be a positive integer or 'auto'") from exc
    if value < 1:
        raise UsageError(f"--batch-size {value} must be a positive integer or 'auto'")
    return value


def parse_limit(text: str | None) -> int | float | None:
    """lm-eval's limit: an integer document count, or a fraction in (0, 1]."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError as exc:
        raise UsageError(f"--limit {text!r} must be a document count or a fraction in (0, 1]") from exc


def format_table(report: EvalReport) -> str:
    """A human table: one row per perplexity dataset, then zero-shot accuracies when run."""
    lines = [f"model {report.model} ({report.model_type}, {report.dtype}, {report.device}), seqlen {report.seqlen}"]
    if report.perplexity:
        lines.append(f"{'dataset':<10} {'ppl':>12} {'windows':>8} {'tokens':>9}  data")
        for name, entry in report.perplexity.items():
            ppl = f"{entry.ppl:.3f}" if math.isfinite(entry.ppl) else str(entry.ppl)
            kind = entry.data_source.kind if entry.data_source is not None else "unrecorded"
            lines.append(f"{name:<10} {ppl:>12} {entry.windows:>8} {entry.tokens:>9}  {kind}")
    if report.zeroshot is not None:
        lines.append(f"{'task':<14} {'acc':>8} {'acc_norm':>9}")
        for task in report.zeroshot.tasks:
            # WinoGrande, RTE, BoolQ define only acc
            norm_text = "-" if task.acc_norm is None else f"{task.acc_norm:.4f}"
            lines.append(f"{task.name:<14} {task.acc:>8.4f} {norm_text:>9}")
        lines.append(f"{'average (acc)':<14} {report.zeroshot.average:>8.4f}")
    lines.extend(f"data {name}: {entry.data}" for name, entry in report.perplexity.items())
    lines.append(f"took {report.seconds:.1f} s")
    return "\n".join(lines)


@app.command("eval", cls=Command)
def eval_cmd(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", help="Embedded name (smollm2-135m), local checkpoint dir, or hub id."),
    ppl: PplOpt = PPL,
    tasks: TasksOpt = None,
    num_fewshot: int = typer.Option(0, "--num-fewshot", min=0, help="Few-shot examples for zero-shot tasks."),
    limit: LimitOpt = None,
    batch_size: str = typer.Option("auto", "--batch-size", help="Batch size (integer or 'auto')."),
    seqlen: int | None = typer.Option(None, "--seqlen", help="Perplexity window (default 2048, capped by the model)."),
    max_windows: MaxWindowsOpt = None,
    dtype: DtypeOpt = DTYPE,
    device: DeviceOpt = DEVICE,
    stream: bool = typer.Option(
        False,
        "--stream",
        help="Perplexity block by block: one decoder block in memory at a time, read from the checkpoint's "
        "safetensors when its turn comes (for models larger than host or GPU memory; not with --tasks).",
    ),
    device_map: str | None = typer.Option(
        None,
        "--device-map",
        help="'auto': spread the whole model over the GPUs present, then the CPU (accelerate), for zero-shot "
        "tasks on a model larger than one GPU; --device is then not used.",
    ),
    trust_remote_code: TrustRemoteCodeOpt = False,
    output: OutputDirOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
    data_dir: DataDirOpt = None,
    offline: OfflineOpt = False,
) -> None:
    """Evaluate a model: perplexity (SparseGPT protocol) and optional lm-eval zero-shot tasks."""
    # Validate every option before the (slow) model load, so a typo fails at once.
    cfg = EvalConfig(
        ppl_datasets=parse_ppl_datasets(ppl),
        tasks=parse_tasks(tasks),
        num_fewshot=num_fewshot,
        limit=parse_limit(limit),
        batch_size=parse_batch_size(batch_size),
        seqlen=seqlen,
        max_windows=max_windows,
        command=command_line(),
    )
    run_ctx = run_context(ctx, data_dir, offline)
    if not cfg.ppl_datasets and not cfg.tasks:
        raise UsageError("nothing to evaluate: --ppl none and no --tasks; pass --ppl wikitext2 or --tasks piqa")
    check_data_sources(cfg, run_ctx)
    if device_map is not None and device_map != "auto":
        raise UsageError(f"--device-map {device_map!r} is not supported; pass --device-map auto")
    if stream and cfg.tasks:
        raise UsageError(STREAM_TASKS)
    if stream and device_map is not None:
        raise UsageError("--stream and --device-map both place the model; pass one of them")
    torch_dtype = parse_dtype(dtype)
    target = output / EVAL_FILE if output is not None else None
    if target is not None:
        if output is not None and output.exists() and not output.is_dir():
            raise UsageError(f"--output {output} is a file; pass a directory")
        if target.exists() and not force:
            raise OutputExistsError(f"{target} already exists; pass --force to overwrite it or choose another --output")

    try:
        loaded = load_model(
            model,
            run_ctx,
            dtype=torch_dtype,
            device=device,
            trust_remote_code=trust_remote_code,
            check_tokenizer=True,
            stream=stream,
            device_map=device_map,
        )
        report = evaluate_model(loaded, cfg, run_ctx)
    except KeyboardInterrupt:
        # eval.json is written only once every metric is in, so nothing is left half-done.
        raise Interrupted("interrupted while evaluating; nothing was written", EXIT_SIGINT) from None
    payload = report.to_json()
    if target is not None:
        atomic.write_json(target, payload)
        logger.info("wrote %s", target)
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
    else:
        typer.echo(format_table(report))


def _check_zeroshot_available() -> None:
    try:
        import tsenor_cli.evaluation.zeroshot  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "tsenor_cli.evaluation.zeroshot":
            raise
        raise UsageError("zero-shot evaluation is not available in this build; omit --tasks") from exc
