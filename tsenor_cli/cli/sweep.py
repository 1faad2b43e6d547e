"""`tsenor sweep SWEEP.yaml --output DIR` (a grid of prune + eval runs) and `tsenor sweep status DIR`."""

from __future__ import annotations

import json
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from tsenor_cli.cli import Command, app, run_context
from tsenor_cli.cli.options import DataDirOpt, ForceOpt, JsonOpt, OfflineOpt, OutputDirOpt
from tsenor_cli.errors import OutputExistsError, UsageError
from tsenor_cli.sweep.spec import MAX_RUNS, SlurmOptions, parse_time
from tsenor_cli.sweep.status import RunView


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


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def _summary(total: int, done: int, todo: int) -> str:
    """The sweep's first line: "3 runs: 1 done, 1 to run, 1 already queued or running"."""
    busy = total - done - todo
    return f"{_runs(total)}: {done} done, {todo} to run" + (f", {busy} already queued or running" if busy else "")


def _elapsed(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _clip(text: str | None, width: int) -> str:
    if not text:
        return "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def _status_table(views: list[RunView]) -> str:
    width = max([len("run"), *(len(v.name) for v in views)])
    lines = [f"{'run':<{width}}  {'state':<8} {'job':<12} {'elapsed':>8}  last log line"]
    for v in views:
        last = f"error: {v.error}" if v.state == "failed" and v.error else v.last_log
        lines.append(
            f"{v.name:<{width}}  {v.state:<8} {v.job_id or '-':<12} {_elapsed(v.elapsed_s):>8}  {_clip(last, 90)}"
        )
    counts = {s: sum(v.state == s for v in views) for s in ("done", "running", "pending", "failed")}
    lines.append(f"{_runs(len(views))}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


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
    from tsenor_cli.sweep.executors import (
        SUBMITIT_DIR,
        SweepFailedError,
        check_slurm,
        check_sweep_folder,
        plan_sweep,
        prepare,
        record_sweep,
        run_local,
        submit_slurm,
        undo_prepare,
        wait_for,
    )
    from tsenor_cli.sweep.spec import load_sweep
    from tsenor_cli.sweep.status import slurm_queue

    spec = load_sweep(sweep_file, max_runs=max_runs)
    options = _slurm_options(
        spec.slurm,
        {
            "partition": partition,
            "account": account,
            "qos": qos,
            "time": time_limit,
            "gpus_per_task": gpus_per_task,
            "cpus_per_task": cpus_per_task,
            "mem": mem,
            "array_parallelism": array_parallelism,
        },
        sbatch_opt,
    )
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"--output {output} is a file; pass a directory for the sweep")
    if wait and executor is not Executor.slurm:
        raise UsageError("--wait applies to --executor slurm (the local executor always waits); drop it")
    directory = output.resolve()
    check_sweep_folder(sweep_file, directory, force=force)
    queue = slurm_queue()

    def echo(message: str) -> None:
        typer.echo(message, err=True)

    if dry_run:
        # Streamed, one line per run: a grid raised by --max-runs to millions is never held in memory.
        width = max(len("run"), *(len(run.name) for run in spec.iter_runs()))
        typer.echo(f"{'run':<{width}}  {'state':<8} {'action':<7} on disk")
        counts = {"done": 0, "run": 0, "skip": 0}
        for p in plan_sweep(spec, directory, run_ctx, queue=queue):
            action = "run" if p.launchable(queue) else "skip"
            counts["done" if p.view.state == "done" else action] += 1
            typer.echo(f"{p.spec.name:<{width}}  {p.view.state:<8} {action:<7} {p.on_disk}")
        typer.echo(_summary(counts["done"] + counts["run"] + counts["skip"], counts["done"], counts["run"]))
        return
    planned = list(plan_sweep(spec, directory, run_ctx, queue=queue))
    todo = [p for p in planned if p.launchable(queue)]
    done = sum(p.view.state == "done" for p in planned)
    summary = _summary(len(planned), done, len(todo))
    echo(summary)
    if not todo:
        return
    if executor is Executor.slurm:
        check_slurm()
    fresh, had_submitit = not directory.exists(), (directory / SUBMITIT_DIR).exists()
    created = prepare(directory, todo, sweep_file)
    if executor is Executor.local:
        record_sweep(sweep_file, directory)
        outcome = run_local(todo, echo, spec.eval.covered_by)
        failed = [name for name, state in outcome.items() if state == "failed"]
        elsewhere = [name for name, state in outcome.items() if state == "running"]
        if elsewhere:
            echo(
                f"{_runs(len(elsewhere))} still running in another sweep ({', '.join(elsewhere)}); "
                f"follow them with: tsenor sweep status {output}"
            )
    else:
        try:
            submit_slurm(todo, directory, options, echo)
        except UsageError:
            undo_prepare(directory, created, fresh=fresh, had_submitit=had_submitit)
            raise
        record_sweep(sweep_file, directory)
        if not wait:
            echo(f"follow it with: tsenor sweep status {output}")
            return
        views = wait_for(directory, [p.spec.name for p in todo], echo, slurm_queue)
        failed = [v.name for v in views if v.state == "failed"]
    from tsenor_cli.sweep.status import collect

    typer.echo(_status_table(collect(directory, slurm_queue())))
    if failed:
        raise SweepFailedError(
            f"{len(failed)} of {_runs(len(todo))} failed ({', '.join(failed)}); their errors are above and in "
            "DIR/runs/NAME/log.txt; fix them and run the sweep again (finished runs are skipped)"
        )


@sweep_app.command("status", cls=Command)
def sweep_status(
    directory: Path = typer.Argument(..., help="A sweep folder (the --output of tsenor sweep)."),
    as_json: JsonOpt = False,
) -> None:
    """Each run's state (pending, running, done, failed), SLURM job id, elapsed time and last log line."""
    from tsenor_cli.sweep.status import collect, slurm_queue

    views = collect(directory, slurm_queue())
    if as_json:
        typer.echo(json.dumps([v.to_json() for v in views], indent=2))
    else:
        typer.echo(_status_table(views))
