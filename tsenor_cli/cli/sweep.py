"""`tsenor sweep SWEEP.yaml --output DIR` (a grid of prune + eval runs) and `tsenor sweep status DIR`."""

from __future__ import annotations

import json
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from tsenor_cli.cli.app import Command, app, run_context
from tsenor_cli.cli.options import DataDirOpt, ForceOpt, JsonOpt, OfflineOpt, OutputDirOpt
from tsenor_cli.errors import OutputExistsError, UsageError
from tsenor_cli.sweep.spec import MAX_RUNS, SlurmOptions, parse_time


class _RunByDefault(TyperGroup):
    """`tsenor sweep SWEEP.yaml ...` means `tsenor sweep run SWEEP.yaml ...`: the issue's spelling, beside
    `tsenor sweep status DIR`. A first argument that is no subcommand (nor --help) selects `run`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


sweep_app = typer.Typer(
    rich_markup_mode=None,
    cls=_RunByDefault,
    no_args_is_help=True,
    help="Run a grid of prune + eval runs (locally or as a SLURM job array) and follow it. "
    "`tsenor sweep SWEEP.yaml -o DIR` is short for `tsenor sweep run SWEEP.yaml -o DIR`.",
)
app.add_typer(sweep_app, name="sweep")


class Executor(StrEnum):
    local = "local"
    slurm = "slurm"


def _slurm_options(spec_options: SlurmOptions, flags: dict[str, Any], sbatch_opt: list[str]) -> SlurmOptions:
    """The sweep file's `slurm:` mapping with the flags given on the command line on top."""
    changes = {k: v for k, v in flags.items() if v is not None}
    if "time" in changes:
        changes["time_min"] = parse_time(changes.pop("time"), "--time")
    if sbatch_opt:
        extra = dict(spec_options.sbatch)
        for item in sbatch_opt:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"--sbatch-opt {item!r} must be KEY=VALUE, e.g. --sbatch-opt constraint=a100")
            extra[key.strip().lstrip("-")] = value
        changes["sbatch"] = tuple(extra.items())
    return replace(spec_options, **changes)


@sweep_app.command("run", cls=Command)
def sweep_run(
    ctx: typer.Context,
    sweep_file: Path = typer.Argument(..., help="Sweep file (YAML): base, axes, eval, optional name and slurm."),
    output: OutputDirOpt = None,
    force: ForceOpt = False,
    executor: Executor = typer.Option(Executor.local, "--executor", help="local (one after another) or slurm."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the runs and what exists already; write nothing."),
    wait: bool = typer.Option(False, "--wait", help="With slurm: block until every run is done or failed."),
    partition: str | None = typer.Option(None, "--partition", help="SLURM partition."),
    account: str | None = typer.Option(None, "--account", help="SLURM account."),
    qos: str | None = typer.Option(None, "--qos", help="SLURM quality of service."),
    time_limit: str | None = typer.Option(
        None, "--time", help="Time limit per run: minutes or [D-]HH:MM:SS (default 60 min)."
    ),
    gpus_per_task: int | None = typer.Option(None, "--gpus-per-task", help="GPUs per run."),
    cpus_per_task: int | None = typer.Option(None, "--cpus-per-task", help="CPUs per run."),
    mem: str | None = typer.Option(None, "--mem", help="Memory per run, e.g. 32G."),
    array_parallelism: int | None = typer.Option(None, "--array-parallelism", help="Runs at the same time."),
    sbatch_opt: list[str] = typer.Option(
        [], "--sbatch-opt", metavar="<key=value>", help="Extra sbatch option KEY=VALUE (repeatable)."
    ),
    max_runs: int = typer.Option(
        MAX_RUNS, "--max-runs", min=1, help="Refuse a grid of more runs than this (a guard against a mistyped axis)."
    ),
    data_dir: DataDirOpt = None,
    offline: OfflineOpt = False,
) -> None:
    """Prune and evaluate every point of a grid; finished runs are skipped, interrupted ones resume.

    --output is the sweep folder; each run goes to DIR/runs/NAME. A folder made from another sweep file
    (other base, axes, eval or name) is refused unless --force. Several sweeps may run on one folder at
    once: each run is locked by the sweep that runs it, and the others pass over it.
    """
    if output is None:
        raise UsageError("--output is required; pass the sweep folder (each run goes to DIR/runs/NAME)")
    run_ctx = run_context(ctx, data_dir, offline)
    from tsenor_cli.sweep.executors import SlurmLaunch, check_sweep_folder, dry_run_lines, run_sweep
    from tsenor_cli.sweep.spec import load_sweep
    from tsenor_cli.sweep.status import status_table

    spec = load_sweep(sweep_file, max_runs=max_runs)
    flags: dict[str, Any] = {"partition": partition, "account": account, "qos": qos, "time": time_limit, "mem": mem}
    flags |= {"gpus_per_task": gpus_per_task, "cpus_per_task": cpus_per_task, "array_parallelism": array_parallelism}
    options = _slurm_options(spec.slurm, flags, sbatch_opt)
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"--output {output} is a file; pass a directory for the sweep")
    if wait and executor is not Executor.slurm:
        raise UsageError("--wait applies to --executor slurm (the local executor always waits); drop it")
    check_sweep_folder(sweep_file, output.resolve(), force=force)
    if dry_run:
        for line in dry_run_lines(spec, output, run_ctx):
            typer.echo(line)
        return
    slurm = SlurmLaunch(options, wait=wait) if executor is Executor.slurm else None
    result = run_sweep(spec, sweep_file, output, run_ctx, slurm=slurm, echo=_echo)
    if result.views is not None:
        typer.echo(status_table(result.views))
    result.check()


def _echo(message: str) -> None:
    """The sweep's progress lines, on stderr (stdout holds the tables)."""
    typer.echo(message, err=True)


@sweep_app.command("status", cls=Command)
def sweep_status(
    directory: Path = typer.Argument(..., help="A sweep folder (the --output of tsenor sweep)."),
    as_json: JsonOpt = False,
) -> None:
    """Each run's state (pending, running, done, failed), SLURM job id, elapsed time and last log line."""
    from tsenor_cli.sweep.status import collect, slurm_queue, status_table

    views = collect(directory, slurm_queue())
    if as_json:
        typer.echo(json.dumps([v.to_json() for v in views], indent=2))
    else:
        typer.echo(status_table(views))
