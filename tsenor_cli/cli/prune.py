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
    parse_ppl_datasets,
    parse_tasks,
)
from tsenor_cli.data.sources import NAMED_TEXTS, data_folder
from tsenor_cli.errors import UsageError
from tsenor_cli.pruning.config import PruneConfig
from tsenor_cli.pruning.recipe import RECIPE_DEFAULTS, RECIPE_KEYS, build_config, read_recipe
from tsenor_cli.pruning.refine import REFINE_MODES
from tsenor_cli.pruning.registry import PRUNERS
from tsenor_cli.solver import METHODS

if TYPE_CHECKING:
    from tsenor_cli.evaluation.runner import EvalConfig
    from tsenor_cli.runfiles import EvalReport, PruneReport
    from tsenor_cli.settings import RunContext

# --method choices, straight from the registry (typer shows an Enum's values as the choices).
MethodChoice = StrEnum("MethodChoice", {name: name for name in PRUNERS})  # type: ignore[misc]
# The recipe keys' flags default to the recipe's defaults (pruning/recipe.py): a key left unset means the
# same on the command line, in a --config file and in a sweep file.
D = RECIPE_DEFAULTS


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
    stream: bool = typer.Option(
        D["stream"],
        "--stream",
        help="Read each decoder block from the safetensors checkpoint when it is pruned and write the output "
        "from the pruned blocks' files: host memory of one block, not one model (same output, bit for bit).",
    ),
    max_shard_size: str = typer.Option(
        D["max_shard_size"], "--max-shard-size", help="Largest safetensors shard of the output, e.g. 2GB, 500MB."
    ),
    refine: str = typer.Option(
        D["refine"],
        "--refine",
        help=f"After each block is pruned: {' or '.join(REFINE_MODES)}. 'block' trains the block's remaining "
        "weights (the mask fixed) so that its output matches the dense block's on the calibration samples.",
    ),
    refine_epochs: int = typer.Option(
        D["refine_epochs"],
        "--refine-epochs",
        help="With --refine block: passes over the calibration samples per block.",
    ),
    refine_lr: float = typer.Option(D["refine_lr"], "--refine-lr", help="With --refine block: Adam's learning rate."),
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
    run_ctx = run_context(ctx, data_dir, offline)
    if nproc > 1 and run_ctx.distributed.distributed:
        raise UsageError(
            f"--nproc {nproc} given inside a torchrun process (rank {run_ctx.distributed.rank} of "
            f"{run_ctx.distributed.world_size}); drop --nproc, torchrun already started the processes"
        )
    command = command_line()
    cfg = build_config(merge_config(ctx, _recipe_flags(ctx), config), force=force, resume=resume, command=command)
    # Checked before pruning: a typo must not surface after hours of work.
    eval_cfg = _eval_config(run_eval, dry_run, ppl, tasks, max_windows, command, run_ctx)
    if not dry_run and cfg.calib_data in NAMED_TEXTS:
        data_folder(run_ctx, cfg.calib_data)  # the hub off and no data folder: say so before loading
    if dry_run:
        from tsenor_cli.pruning.plan import plan_model

        processes = max(nproc, run_ctx.distributed.world_size)
        plan = plan_model(cfg, run_ctx, world_size=processes)
        typer.echo(json.dumps(plan.to_dict(), indent=2) if as_json else "\n".join(plan.lines(cfg)))
        plan.check(cfg, processes)
        return
    if nproc > 1:
        _launch(ctx, cfg, nproc)
        return
    from tsenor_cli.interrupt import stop_on_signals
    from tsenor_cli.pruning.api import prune_and_evaluate

    with stop_on_signals() as stop:
        report, evaluation = prune_and_evaluate(cfg, run_ctx, eval_cfg, stop=stop)
    if run_ctx.distributed.is_root:  # rank 0 reports (and evaluates) for the run
        _print_result(report, evaluation, as_json=as_json)


def _recipe_flags(ctx: typer.Context) -> dict[str, Any]:
    """The recipe keys' values as the flags give them (their defaults where not typed)."""
    values = {key: ctx.params[key] for key in RECIPE_KEYS}
    values["method"] = str(getattr(values["method"], "value", values["method"]))
    values["ignore"], values["targets"] = list(values["ignore"] or []), list(values["targets"] or [])
    return values


def _eval_config(
    run_eval: bool,
    dry_run: bool,
    ppl: str,
    tasks: str | None,
    max_windows: int | None,
    command: str,
    run_ctx: RunContext,
) -> EvalConfig | None:
    """--eval's settings, checked (datasets, tasks, their sources) before anything runs; None without --eval."""
    if not run_eval:
        if tasks is not None:
            raise UsageError("--tasks applies with --eval only; add --eval or drop --tasks")
        return None
    if dry_run:
        raise UsageError("--eval cannot run with --dry-run (there is no checkpoint); drop one of them")
    from tsenor_cli.evaluation.runner import EvalConfig

    eval_cfg = EvalConfig(
        ppl_datasets=parse_ppl_datasets(ppl), tasks=parse_tasks(tasks), max_windows=max_windows, command=command
    )
    if not eval_cfg.ppl_datasets and not eval_cfg.tasks:
        raise UsageError("--eval with --ppl none and no --tasks evaluates nothing; pass --ppl or --tasks")
    eval_cfg.check_sources(run_ctx)
    return eval_cfg


def _print_result(report: PruneReport, evaluation: EvalReport | None, *, as_json: bool) -> None:
    """The run's summary (from the report's data) and the evaluation's table, or their JSON."""
    from tsenor_cli.report.markdown import eval_table, prune_summary

    if as_json:
        payload = report.to_json() if evaluation is None else {"prune": report.to_json(), "eval": evaluation.to_json()}
        typer.echo(json.dumps(payload, indent=2))
        return
    if evaluation is not None:
        typer.echo(eval_table(evaluation))
    totals = report.totals()
    typer.echo("\n".join(prune_summary(report)))
    typer.echo(f"wrote {report.output} ({totals['layers_pruned']} layers pruned in {report.seconds:.1f} s)")


def _launch(ctx: typer.Context, cfg: PruneConfig, nproc: int) -> None:
    """Run this same command in `nproc` processes (`pruning/launch.py`) and exit with the run's status."""
    from tsenor_cli.cli import launch_arguments
    from tsenor_cli.pruning.launch import launch_prune

    if code := launch_prune(launch_arguments(ctx), cfg, nproc):
        raise typer.Exit(code)
