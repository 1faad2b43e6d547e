"""`tsenor prune`: parse and cross-check flags, hand a frozen `PruneConfig` to the library."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
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
from tsenor_cli.data.sources import data_folder, read_text_records
from tsenor_cli.errors import EXIT_SIGINT, InputNotFoundError, Interrupted, UsageError
from tsenor_cli.nm import parse_nm
from tsenor_cli.pruning.config import PruneConfig
from tsenor_cli.pruning.output import human_bytes
from tsenor_cli.pruning.refine import DEFAULT_EPOCHS, DEFAULT_LR, REFINE_MODES, RefineConfig
from tsenor_cli.pruning.registry import PRUNERS
from tsenor_cli.pruning.types import LayerPruneConfig, SparsityPattern
from tsenor_cli.solver import METHODS
from tsenor_cli.yamlfile import read_yaml

if TYPE_CHECKING:
    from tsenor_cli.pruning.api import PrunePlan

NAMED_CALIBRATION = ("c4", "wikitext2", "ptb")
# --method choices, straight from the registry (typer shows an Enum's values as the choices).
MethodChoice = StrEnum("MethodChoice", {name: name for name in PRUNERS})  # type: ignore[misc]
# --config keys and the type each must have; anything else in the file is refused.
CONFIG_KEYS: dict[str, type] = {
    "model": str,
    "nm": str,
    "sparsity": float,
    "transposable": bool,
    "method": str,
    "solver": str,
    "calib_data": str,
    "nsamples": int,
    "seqlen": int,
    "seed": int,
    "dtype": str,
    "device": str,
    "trust_remote_code": bool,
    "sequential": bool,
    "skip_incompatible": bool,
    "ignore": list,
    "targets": list,
    "output": str,
    "offload_activations": bool,
    "moe_calibration": str,
    "moe_min_tokens": int,
    "refine": str,
    "refine_epochs": int,
    "refine_lr": float,
}


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


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML recipe into {option: value}, refusing unknown keys and wrongly typed values."""
    data = read_yaml(path, f"--config {path}", "configs/smollm2-alps-16x32.yaml")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path} must hold a mapping of option: value; fix the file")
    return validate_recipe(data, f"--config {path}")


def validate_recipe(data: Mapping[Any, Any], where: str) -> dict[str, Any]:
    """Check a recipe mapping {option: value} against `CONFIG_KEYS` → {key: value} with `-` spelled `_`.

    `where` starts every error message (e.g. "--config recipe.yaml" or "sweep.yaml base"), so one
    validator serves `tsenor prune --config` and the sweep files' `base` and `axes`. Ints are accepted
    where a float is wanted; bools are never accepted as ints.
    """
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in CONFIG_KEYS:
            raise UsageError(f"{where}: unknown key {raw_key!r}; known keys: {', '.join(CONFIG_KEYS)}")
        want = CONFIG_KEYS[key]
        if key == "nm" and not isinstance(value, str):
            raise UsageError(
                f'{where}: nm must be a quoted string like "16:32" (unquoted YAML reads 16:32 as a base-60 number)'
            )
        if want is list:
            values[key] = _pattern_list(where, key, value)
            continue
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise UsageError(f"{where}: {key} must be a {want.__name__}, got {value!r}")
        values[key] = value
    return values


def _pattern_list(where: str, key: str, value: Any) -> list[str]:
    """A recipe's ignore/targets: one pattern string or a list of them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise UsageError(
        f"{where}: {key} must be a pattern string or a list of them (e.g. ['*.mlp.down_proj']), got {value!r}"
    )


def _given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` was typed on the command line (not its default, nor the environment).

    Compared by the enum member's name: the enum lives in typer's vendored click, which is not public.
    """
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def recipe_defaults() -> dict[str, Any]:
    """The value `tsenor prune` uses for each recipe key left unset: the defaults of its flags.

    Read from `prune_cmd`'s signature so the flags stay the one definition of the defaults (a plain
    default for the shared `Annotated` options of cli/options.py, a typer.Option's for the others).
    """
    params = inspect.signature(prune_cmd).parameters
    defaults = {key: params[key].default for key in CONFIG_KEYS}
    return {key: getattr(value, "default", value) for key, value in defaults.items()}


def merge_config(ctx: typer.Context, given: dict[str, Any], config: Path | None) -> dict[str, Any]:
    """Values from --config, overridden by flags given explicitly on the command line."""
    if config is None:
        return given
    merged = dict(given)
    for key, value in load_config_file(config).items():
        if not _given_on_command_line(ctx, key):
            merged[key] = value
    return merged


def build_config(values: dict[str, Any], *, force: bool, resume: bool, command: str) -> PruneConfig:
    """Cross-check the merged options and freeze them into a `PruneConfig`."""
    if not values.get("model"):
        raise UsageError("--model is required; pass a checkpoint directory, a hub id or smollm2-135m")
    nm, sparsity = values.get("nm"), values.get("sparsity")
    if (nm is None) == (sparsity is None):
        raise UsageError("pass exactly one of --nm N:M (e.g. --nm 16:32) or --sparsity S (e.g. --sparsity 0.5)")
    if nm is not None:
        parsed = parse_nm(str(nm))
        pattern = SparsityPattern.from_nm(parsed.n, parsed.m, transposable=bool(values["transposable"]))
    else:
        if not values["transposable"]:
            raise UsageError("--no-transposable applies to --nm patterns only; drop it when using --sparsity")
        pattern = SparsityPattern.unstructured(float(sparsity))  # type: ignore[arg-type]
    calib = str(values["calib_data"])
    if calib not in NAMED_CALIBRATION:
        path = Path(calib).expanduser()
        if not path.is_file():
            raise InputNotFoundError(
                f"--calib-data {calib} is not a readable file nor one of {', '.join(NAMED_CALIBRATION)}; "
                "pass c4, wikitext2, ptb or an existing .txt/.jsonl/.json.gz/.parquet file"
            )
        read_text_records(path)  # its contents too (format, `text` fields, not empty), before the model loads
    output = values.get("output")
    return PruneConfig(
        model=str(values["model"]),
        layer=LayerPruneConfig(pattern=pattern, solver=str(values["solver"])),
        method=str(values["method"]),
        calib_data=calib,
        nsamples=int(values["nsamples"]),
        seqlen=int(values["seqlen"]),
        seed=int(values["seed"]),
        dtype=None if values["dtype"] in (None, "auto") else str(values["dtype"]),
        device=str(values["device"]),
        trust_remote_code=bool(values["trust_remote_code"]),
        sequential=bool(values["sequential"]),
        skip_incompatible=bool(values["skip_incompatible"]),
        ignore=tuple(values.get("ignore") or ()),
        targets=tuple(values.get("targets") or ()),
        output=Path(output).expanduser() if output else None,
        force=force,
        resume=resume,
        command=command,
        offload_activations=bool(values.get("offload_activations", False)),
        moe_calibration=str(values.get("moe_calibration") or "routed"),
        moe_min_tokens=None if values.get("moe_min_tokens") is None else int(values["moe_min_tokens"]),
        refine=RefineConfig(
            str(values.get("refine", "none")),
            values.get("refine_epochs", DEFAULT_EPOCHS),
            values.get("refine_lr", DEFAULT_LR),
        ),
    )


@app.command("prune", cls=Command)
def prune_cmd(
    ctx: typer.Context,
    model: str | None = typer.Option(
        None, "--model", help="Required (here or in --config): embedded name (smollm2-135m), checkpoint dir or hub id."
    ),
    nm: str | None = typer.Option(
        None, "--nm", help="N:M pattern, e.g. 16:32 (transposable unless --no-transposable)."
    ),
    sparsity: float | None = typer.Option(None, "--sparsity", help="Unstructured sparsity instead of N:M, e.g. 0.5."),
    transposable: bool = typer.Option(True, "--transposable/--no-transposable", help="Transposable N:M tiles."),
    method: MethodChoice = typer.Option("alps", "--method", help="Pruning method."),
    solver: str = typer.Option(
        "auto",
        "--solver",
        help=f"Transposable mask solver: {', '.join(METHODS)} (auto: exact flow on CPU, tsenor on CUDA).",
    ),
    calib_data: str = typer.Option("c4", "--calib-data", help="c4, wikitext2, ptb or a text/jsonl file."),
    nsamples: int = typer.Option(128, "--nsamples", min=1, help="Calibration sequences."),
    seqlen: int = typer.Option(2048, "--seqlen", min=1, help="Calibration sequence length (capped by the model)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the calibration sampling."),
    dtype: DtypeOpt = DTYPE,
    device: DeviceOpt = DEVICE,
    trust_remote_code: TrustRemoteCodeOpt = False,
    sequential: bool = typer.Option(
        True,
        "--sequential/--no-sequential",
        help="Prune the linears that read the same input together, group after group "
        "(LLaMA: (q,k,v), (o), (gate,up), (down)), re-running the block between groups.",
    ),
    skip_incompatible: bool = typer.Option(False, "--skip-incompatible", help="Leave layers M does not divide dense."),
    ignore: list[str] | None = typer.Option(
        None,
        "--ignore",
        metavar="<pattern>",
        help="Leave matching linears dense (repeatable): glob on full names ('*.mlp.down_proj') or 're:REGEX'.",
    ),
    targets: list[str] | None = typer.Option(
        None,
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
        False,
        "--offload-activations",
        help="Keep the calibration activations on the CPU and move one sample at a time to the device "
        "(same result, device memory for one block and one sample).",
    ),
    moe_calibration: str = typer.Option(
        "routed",
        "--moe-calibration",
        help="Statistics of expert matrices: 'routed' (the tokens the router sends each expert) or 'all' "
        "(every calibration token through every expert, for the statistics only).",
    ),
    moe_min_tokens: int | None = typer.Option(
        None,
        "--moe-min-tokens",
        min=1,
        help="With routed statistics, an expert that received fewer tokens takes every-token statistics "
        "(default: its input dimension); the report names each such expert.",
    ),
    refine: str = typer.Option(
        "none",
        "--refine",
        help=f"After each block is pruned: {' or '.join(REFINE_MODES)}. 'block' trains the block's remaining "
        "weights (the mask fixed) so that its output matches the dense block's on the calibration samples.",
    ),
    refine_epochs: int = typer.Option(
        DEFAULT_EPOCHS, "--refine-epochs", help="With --refine block: passes over the calibration samples per block."
    ),
    refine_lr: float = typer.Option(DEFAULT_LR, "--refine-lr", help="With --refine block: Adam's learning rate."),
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
        "refine": refine,
        "refine_epochs": refine_epochs,
        "refine_lr": refine_lr,
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
                + (f" + refine {human_bytes(estimate.refine)}" if estimate.refine else "")
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
    typer.echo(report.to_markdown().split("\n| layer")[0].rstrip())
    typer.echo(f"wrote {cfg.output} ({totals['layers_pruned']} layers pruned in {report.seconds:.1f} s)")


def _launch(ctx: typer.Context, nproc: int) -> None:
    """Run this same command in `nproc` processes (torchrun's launcher) and exit with its status: 0, or
    the failing rank's exit code after rank 0's `error:` line."""
    from tsenor_cli.cli import launch_arguments
    from tsenor_cli.pruning.distributed import launch

    code = launch(launch_arguments(ctx), nproc)
    if code:
        raise typer.Exit(code)
