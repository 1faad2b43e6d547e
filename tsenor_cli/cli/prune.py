"""`tsenor prune`: parse and cross-check flags, hand a frozen `PruneConfig` to the library."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

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
    MaxWindowsOpt,
    OfflineOpt,
    OutputDirOpt,
    PplOpt,
    TasksOpt,
    TrustRemoteCodeOpt,
)
from tsenor_cli.data.sources import data_folder
from tsenor_cli.errors import EXIT_SIGINT, Interrupted, UsageError
from tsenor_cli.pruning.config import PruneConfig
from tsenor_cli.pruning.output import human_bytes
from tsenor_cli.pruning.recipe import NAMED_CALIBRATION, RECIPE_DEFAULTS, build_config, read_recipe
from tsenor_cli.pruning.registry import PRUNERS
from tsenor_cli.solver import METHODS

if TYPE_CHECKING:
    from tsenor_cli.pruning.api import PrunePlan

# --method choices, straight from the registry (typer shows an Enum's values as the choices).
MethodChoice = StrEnum("MethodChoice", {name: name for name in PRUNERS})  # type: ignore[misc]
D = RECIPE_DEFAULTS


def _plan_verdict(plan: PrunePlan, cfg: PruneConfig, processes: int) -> None:
    """After the plan is printed: the run's own error (its exit code too) when the run would not fit in
    memory (`processes` of it on this machine), stop on an incompatible layer or have nothing to prune,
    so a dry run fails where the run would."""
    from tsenor_cli.models.loading import resolve_device
    from tsenor_cli.pruning.engine import check_compatibility
    from tsenor_cli.pruning.memory import check_fits

    check_fits(
        plan.host_memory,
        plan.device_bytes,
        resolve_device(plan.device),
        nsamples=cfg.nsamples,
        seqlen=plan.seqlen,
        offload_activations=cfg.offload_activations,
        processes=processes,
    )
    candidates = [s for s in plan.slots if s.full_name not in plan.ignored and not s.param and s.out_features > 1]
    check_compatibility(candidates, cfg.pattern, skip=cfg.skip_incompatible)


def _given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` was typed on the command line (not its default, nor the environment).

    Compared by the enum member's name: the enum lives in typer's vendored click, which is not public.
    """
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def merge_config(ctx: typer.Context, given: dict[str, Any], config: Path | None) -> dict[str, Any]:
    """Values from --config, overridden by flags given explicitly on the command line."""
    if config is None:
        return given
    merged = dict(given)
    for key, value in read_recipe(config).items():
        if not _given_on_command_line(ctx, key):
            merged[key] = value
    return merged


@app.command("prune", cls=Command)
def prune_cmd(
    ctx: typer.Context,
    model: str | None = typer.Option(
        D["model"],
        "--model",
        help="Required (here or in --config): embedded name (smollm2-135m), checkpoint dir or hub id.",
    ),
    nm: str | None = typer.Option(
        D["nm"], "--nm", help="N:M pattern, e.g. 16:32 (transposable unless --no-transposable)."
    ),
    sparsity: float | None = typer.Option(
        D["sparsity"], "--sparsity", help="Unstructured sparsity instead of N:M, e.g. 0.5."
    ),
    transposable: bool = typer.Option(
        D["transposable"], "--transposable/--no-transposable", help="Transposable N:M tiles."
    ),
    method: MethodChoice = typer.Option(D["method"], "--method", help="Pruning method."),
    solver: str = typer.Option(
        D["solver"],
        "--solver",
        help=f"Transposable mask solver: {', '.join(METHODS)} (auto: exact flow on CPU, tsenor on CUDA).",
    ),
    calib_data: str = typer.Option(D["calib_data"], "--calib-data", help="c4, wikitext2, ptb or a text/jsonl file."),
    nsamples: int = typer.Option(D["nsamples"], "--nsamples", min=1, help="Calibration sequences."),
    seqlen: int = typer.Option(
        D["seqlen"], "--seqlen", min=1, help="Calibration sequence length (capped by the model)."
    ),
    seed: int = typer.Option(D["seed"], "--seed", help="Seed of the calibration sampling."),
    dtype: DtypeOpt = DTYPE,
    device: DeviceOpt = DEVICE,
    trust_remote_code: TrustRemoteCodeOpt = False,
    sequential: bool = typer.Option(
        D["sequential"],
        "--sequential/--no-sequential",
        help="Prune the linears that read the same input together, group after group "
        "(LLaMA: (q,k,v), (o), (gate,up), (down)), re-running the block between groups.",
    ),
    skip_incompatible: bool = typer.Option(
        D["skip_incompatible"], "--skip-incompatible", help="Leave layers M does not divide dense."
    ),
    ignore: list[str] | None = typer.Option(
        D["ignore"],
        "--ignore",
        metavar="<pattern>",
        help="Leave matching linears dense (repeatable): glob on full names ('*.mlp.down_proj') or 're:REGEX'.",
    ),
    targets: list[str] | None = typer.Option(
        D["targets"],
        "--targets",
        metavar="<pattern>",
        help="Prune only matching linears (repeatable): glob on full names or 're:REGEX'.",
    ),
    output: OutputDirOpt = None,
    force: ForceOpt = False,
    resume: bool = typer.Option(
        True,
        "--resume/--no-resume-state",
        help="Save a resume state after each block and continue an interrupted run of the same settings "
        "(default; --resume is accepted). --no-resume-state saves none.",
    ),
    offload_activations: bool = typer.Option(
        D["offload_activations"],
        "--offload-activations",
        help="Keep the calibration activations on the CPU and move one sample at a time to the device "
        "(same result, device memory for one block and one sample).",
    ),
    moe_calibration: str = typer.Option(
        D["moe_calibration"],
        "--moe-calibration",
        help="Statistics of expert matrices: 'routed' (the tokens the router sends each expert) or 'all' "
        "(every calibration token through every expert, for the statistics only).",
    ),
    moe_min_tokens: int | None = typer.Option(
        D["moe_min_tokens"],
        "--moe-min-tokens",
        min=1,
        help="With routed statistics, an expert that received fewer tokens takes every-token statistics "
        "(default: its input dimension); the report names each such expert.",
    ),
    nproc: int = typer.Option(
        1,
        "--nproc",
        min=1,
        help="Prune with this many processes on this node (torchrun; one GPU each with --device cuda, "
        "gloo on the CPU); with --dry-run, estimate the memory of each.",
    ),
    config: Path | None = typer.Option(None, "--config", help="YAML recipe; explicit flags override its values."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (layers, shapes, memory); write nothing."),
    run_eval: bool = typer.Option(False, "--eval", help="Evaluate the pruned checkpoint afterwards (eval.json)."),
    ppl: PplOpt = PPL,
    tasks: TasksOpt = None,
    max_windows: MaxWindowsOpt = None,
    as_json: JsonOpt = False,
    data_dir: DataDirOpt = None,
    offline: OfflineOpt = False,
) -> None:
    """Prune a model to (transposable) N:M or unstructured sparsity, layer by layer."""
    given = {
        "model": model,
        "nm": nm,
        "sparsity": sparsity,
        "transposable": transposable,
        "method": str(method.value),
        "solver": solver,
        "calib_data": calib_data,
        "nsamples": nsamples,
        "seqlen": seqlen,
        "seed": seed,
        "dtype": dtype,
        "device": device,
        "trust_remote_code": trust_remote_code,
        "sequential": sequential,
        "skip_incompatible": skip_incompatible,
        "ignore": ignore or [],
        "targets": targets or [],
        "output": output,
        "offload_activations": offload_activations,
        "moe_calibration": moe_calibration,
        "moe_min_tokens": moe_min_tokens,
    }
    run_ctx = run_context(ctx, data_dir, offline)
    if nproc > 1 and run_ctx.distributed.distributed:
        raise UsageError(
            f"--nproc {nproc} given inside a torchrun process (rank {run_ctx.distributed.rank} of "
            f"{run_ctx.distributed.world_size}); drop --nproc, torchrun already started the processes"
        )
    command = command_line()
    cfg = build_config(merge_config(ctx, given, config), force=force, resume=resume, command=command)
    eval_cfg = None
    if run_eval:
        if dry_run:
            raise UsageError("--eval cannot run with --dry-run (there is no checkpoint); drop one of them")
        from tsenor_cli.cli.evaluate import check_data_sources, parse_ppl_datasets, parse_tasks
        from tsenor_cli.evaluation.runner import EvalConfig

        # Checked before pruning: a typo must not surface after hours of work.
        eval_cfg = EvalConfig(
            ppl_datasets=parse_ppl_datasets(ppl),
            tasks=parse_tasks(tasks),
            max_windows=max_windows,
            command=command,
        )
        if not eval_cfg.ppl_datasets and not eval_cfg.tasks:
            raise UsageError("--eval with --ppl none and no --tasks evaluates nothing; pass --ppl or --tasks")
        check_data_sources(eval_cfg, run_ctx)
    elif tasks is not None:
        raise UsageError("--tasks applies with --eval only; add --eval or drop --tasks")
    if not dry_run and cfg.calib_data in NAMED_CALIBRATION:
        data_folder(run_ctx, cfg.calib_data)  # the hub off and no data folder: say so before loading

    if dry_run:
        from tsenor_cli.pruning.api import plan_model

        processes = max(nproc, run_ctx.distributed.world_size)
        plan = plan_model(cfg, run_ctx, world_size=processes)
        if as_json:
            typer.echo(json.dumps(plan.to_dict(), indent=2))
            _plan_verdict(plan, cfg, processes)
            return
        typer.echo(
            f"plan: {cfg.method} {cfg.pattern.label} ({cfg.pattern.kind}) on {plan.model} "
            f"({plan.model_type}, {plan.params / 1e6:.1f}M params, {plan.dtype}), "
            f"calibration {cfg.calib_data} {plan.nsamples}×{plan.seqlen}"
        )
        typer.echo(f"{'layer':<44} {'shape':>13}  compatible")
        for slot in plan.slots:
            why = plan.incompatible.get(slot.full_name)
            shape = f"{slot.out_features}×{slot.in_features}"
            verdict = "yes" if why is None else "NO: " + why
            if slot.full_name in plan.ignored:
                verdict = "ignored: " + plan.ignored[slot.full_name]
            typer.echo(f"{slot.full_name:<44} {shape:>13}  {verdict}")
        host = plan.host_memory
        typer.echo(
            f"estimated memory: host {human_bytes(host.total)} ({host.describe()}"
            + (", in each process)" if len(plan.device_memory) > 1 else ")")
            + f", {plan.device} {human_bytes(plan.device_bytes)} peak"
            + (" per process" if len(plan.device_memory) > 1 else "")
            + (", activations offloaded" if cfg.offload_activations else "")
        )
        for estimate in plan.device_memory:
            typer.echo(
                f"  rank {estimate.rank}: {human_bytes(estimate.total)} = block {human_bytes(estimate.block)} "
                f"+ activations {human_bytes(estimate.activations)} + statistics {human_bytes(estimate.statistics)} "
                f"+ workspace {human_bytes(estimate.workspace)}"
            )
        _plan_verdict(plan, cfg, processes)
        return

    if nproc > 1:
        # Checked here too, so the line comes once and not from every process.
        if cfg.nsamples < nproc:
            raise UsageError(
                f"--nsamples {cfg.nsamples} is fewer than --nproc {nproc}; pass at least one calibration "
                "sample per process"
            )
        from tsenor_cli.models.loading import resolve_device

        resolve_device(cfg.device)
        _launch(ctx, nproc)
        return

    from tsenor_cli.interrupt import stop_on_signals
    from tsenor_cli.pruning.api import prune_model

    with stop_on_signals() as stop:
        report = prune_model(cfg, run_ctx, stop=stop)
    if not run_ctx.distributed.is_root:
        return  # rank 0 reports (and evaluates) for the run
    payload: dict[str, Any] = {"prune": report.to_json()}
    if eval_cfg is not None and cfg.output is not None:
        from tsenor_cli import atomic
        from tsenor_cli.cli.evaluate import format_table
        from tsenor_cli.evaluation.runner import evaluate_model
        from tsenor_cli.models.loading import load_model, parse_dtype
        from tsenor_cli.runfiles import EVAL_FILE

        try:
            loaded = load_model(str(cfg.output), run_ctx, dtype=parse_dtype(cfg.dtype), device=cfg.device)
            evaluation = evaluate_model(loaded, eval_cfg, run_ctx)
        except KeyboardInterrupt:
            raise Interrupted(
                f"interrupted while evaluating; the checkpoint {cfg.output} is complete but has no {EVAL_FILE}: "
                f"run `tsenor eval --model {cfg.output} --output {cfg.output}`",
                EXIT_SIGINT,
            ) from None
        atomic.write_json(cfg.output / EVAL_FILE, evaluation.to_json())
        payload["eval"] = evaluation.to_json()
        if not as_json:
            typer.echo(format_table(evaluation))
    if as_json:
        typer.echo(json.dumps(payload if eval_cfg is not None else payload["prune"], indent=2))
        return
    totals = report.totals()
    from tsenor_cli.report.markdown import prune_summary

    typer.echo("\n".join(prune_summary(report)))
    typer.echo(f"wrote {cfg.output} ({totals['layers_pruned']} layers pruned in {report.seconds:.1f} s)")


def _launch(ctx: typer.Context, nproc: int) -> None:
    """Run this same command in `nproc` processes (torchrun's launcher) and exit with its status: 0, or
    the failing rank's exit code after rank 0's `error:` line."""
    from tsenor_cli.cli import launch_arguments
    from tsenor_cli.pruning.distributed import launch

    code = launch(launch_arguments(ctx), nproc)
    if code:
        raise typer.Exit(code)
