"""Launch the runs of a sweep: the plan (what each run directory holds), then either executor.

- local: the runs one after another in this process (each run's prune and eval in subprocesses);
  finished runs are skipped and interrupted ones resume.
- slurm: one job array through submitit, at most `array_parallelism` tasks at a time; each task is a
  `SweepTask`, requeued on the time-limit or preemption signal.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tsenor_cli import settings
from tsenor_cli.errors import OutputBusyError, OutputExistsError, TsenorError, UsageError
from tsenor_cli.locks import folder_lock
from tsenor_cli.pruning.settings.recipe import validate_recipe
from tsenor_cli.runfiles import (
    EVAL_FILE,
    MODEL_DIR,
    PRUNE_FILE,
    RECIPE_FILE,
    RUNS_DIR,
    SUBMITIT_DIR,
    SWEEP_FILE,
    Submission,
    make_run_dir,
    read_status,
    remove_folders,
    resume_progress,
    write_recipe,
    write_submission,
    write_sweep_file,
)
from tsenor_cli.settings import RunContext
from tsenor_cli.sweep.job import RunJob, SweepTask, run_job
from tsenor_cli.sweep.spec import TOP_KEYS, RunSpec, SlurmOptions, SweepSpec
from tsenor_cli.sweep.status import RunView, collect, is_complete, is_sweep_dir, resolve, runs_text, slurm_queue
from tsenor_cli.yamlfile import load_yaml

POLL_SECONDS = 3.0


class SweepFailedError(TsenorError):
    """Some runs of a sweep failed (exit 1); the others finished."""

    exit_code = 1


@dataclass(frozen=True)
class PlannedRun:
    """A run of the sweep with its job, its current state and what its directory holds."""

    spec: RunSpec
    job: RunJob
    view: RunView
    on_disk: str

    def launchable(self, queue: Mapping[str, str] | None) -> bool:
        """Not done and not waiting or running in SLURM or in another local sweep."""
        if self.view.state == "failed":
            return True
        if self.view.state != "pending":
            return False
        return not (queue is not None and self.view.job_id is not None and self.view.job_id in queue)


def job_environment(ctx: RunContext) -> tuple[tuple[str, str], ...]:
    """The sweep's run context as the variables a run's subprocesses read (settings.py): an sbatch with
    --export=NONE, or a node whose shell profile differs, would otherwise run without the offline data
    or in online mode."""
    env: list[tuple[str, str]] = []
    if ctx.data_dir is not None:
        env.append((settings.DATA_DIR_ENV, str(ctx.data_dir.resolve())))
    env.append((settings.CACHE_DIR_ENV, str(ctx.cache_dir.resolve())))
    if ctx.offline:
        env += [("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")]
    if ctx.debug:
        env.append((settings.DEBUG_ENV, "1"))
    return tuple(env)


def _eval_args(spec: SweepSpec, run: RunSpec) -> tuple[str, ...]:
    """`tsenor eval` flags: the sweep's eval settings and the recipe's load options (dtype, device)."""
    recipe = run.recipe_dict()
    args = list(spec.eval.eval_args())
    for key in ("dtype", "device"):
        if key in recipe:
            args += [f"--{key}", str(recipe[key])]
    if recipe.get("trust_remote_code"):
        args.append("--trust-remote-code")
    return tuple(args)


def _on_disk(run_dir: Path, dense: bool) -> str:
    """A few words on what a run directory holds, for --dry-run."""
    if (run_dir / EVAL_FILE).is_file():
        return "evaluated"
    if (run_dir / MODEL_DIR / PRUNE_FILE).is_file():
        return "pruned, not evaluated"
    blocks = resume_progress(run_dir / MODEL_DIR)
    if blocks is not None:
        return f"resume state after {blocks} block(s)"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        return "started"
    return "-"


def _check_recipe(run: RunSpec, run_dir: Path) -> None:
    """A run directory made from another recipe would be resumed or skipped wrongly: refuse it."""
    path = run_dir / RECIPE_FILE
    if run.dense or not path.is_file():
        return
    old = validate_recipe(load_yaml(path.read_text()) or {}, str(path))
    new = run.recipe_dict()
    if old != new:
        key = next(k for k in sorted({*old, *new}) if old.get(k) != new.get(k))
        raise UsageError(
            f"{run_dir} was made with another recipe ({key}: {old.get(key)!r} there, {new.get(key)!r} now); "
            "use another --output or delete that run directory"
        )


def plan_sweep(
    spec: SweepSpec, directory: Path, ctx: RunContext, *, queue: Mapping[str, str] | None
) -> Iterator[PlannedRun]:
    """Each run of the sweep under DIRECTORY/runs/NAME with its state, one at a time (a dry run of a large
    grid streams); writes nothing.

    ctx: the sweep's run context, handed to every run's prune and eval (`job_environment`)."""
    runs_dir = directory / RUNS_DIR
    env = job_environment(ctx)
    for run in spec.iter_runs():
        run_dir = runs_dir / run.name
        _check_recipe(run, run_dir)
        job = RunJob(
            name=run.name,
            run_dir=run_dir,
            python=sys.executable,
            cwd=Path.cwd(),
            eval_args=_eval_args(spec, run),
            dense=run.dense,
            model=str(run.recipe_dict().get("model", "")),
            keep_checkpoint=spec.eval.keep_checkpoint,
            environment=env,
        )
        complete = is_complete(run_dir, spec.eval.covered_by, dense=run.dense)
        view = resolve(run.name, run_dir, complete=complete, queue=queue)
        yield PlannedRun(run, job, view, _on_disk(run_dir, run.dense))


def check_sweep_folder(sweep_file: Path, directory: Path, *, force: bool) -> None:
    """OutputExistsError (exit 4) unless `directory` is new, empty, or a folder of this same sweep; `force`
    takes any folder over (its sweep.yaml is then replaced by `sweep_file`).

    Same sweep: the recorded sweep.yaml holds the same base, axes, eval and name as `sweep_file` (its
    comments and slurm options may differ: a sweep is rerun with a longer --time). A folder of runs
    without sweep.yaml (made before `tsenor sweep`) is a sweep's too.
    """
    if force or not directory.is_dir():
        return
    recorded = directory / SWEEP_FILE
    if recorded.is_file():
        try:
            old = load_yaml(recorded.read_text()) or {}
        except yaml.YAMLError:
            old = None
        new = load_yaml(sweep_file.read_text()) or {}
        if not isinstance(old, dict):
            differ = ["its contents (not a sweep file)"]
        else:
            differ = [key for key in TOP_KEYS if key != "slurm" and old.get(key) != new.get(key)]
        if differ:
            raise OutputExistsError(
                f"--output {directory} holds another sweep: its {SWEEP_FILE} differs from {sweep_file} in "
                f"{', '.join(differ)}; pass --force to add this sweep's runs to it ({SWEEP_FILE} is replaced), "
                "or choose another --output"
            )
        return
    entries = sorted(p.name for p in directory.iterdir())
    if entries and not is_sweep_dir(directory):
        shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
        raise OutputExistsError(
            f"--output {directory} holds files that are not a sweep's ({shown}); pass --force to add the "
            "sweep's runs to it, or choose another --output"
        )


def prepare(directory: Path, todo: Sequence[PlannedRun], sweep_file: Path) -> list[Path]:
    """Write each run's recipe.yaml (the run prunes with --config it) → the run directories created here."""
    created = [p.job.run_dir for p in todo if not p.job.run_dir.exists()]
    for planned in todo:
        make_run_dir(planned.job.run_dir)
        if not planned.spec.dense:
            header = f"# Written by tsenor sweep from {sweep_file}; the run prunes with --config this file.\n"
            recipe = yaml.safe_dump(planned.spec.recipe_dict(), sort_keys=False)
            write_recipe(planned.job.run_dir, header + recipe)
    return created


def record_sweep(sweep_file: Path, directory: Path) -> None:
    """DIRECTORY/sweep.yaml: a copy of the sweep file, which `tsenor sweep status` and `tsenor report` read."""
    write_sweep_file(directory, sweep_file.read_text())


def run_local(
    todo: Sequence[PlannedRun], echo: Callable[[str], None], covered_by: Callable[[Mapping[str, Any]], bool]
) -> dict[str, str]:
    """Run each in turn → {name: "done" | "failed" | "running"}; a signal stops the loop (`RunInterrupted`).

    Several `tsenor sweep` processes may work on one folder at once: each run is claimed with the lock of
    its directory (`locks.folder_lock`) and checked again under it (`_claim_and_run`), so no run is ever
    run twice. A run another process holds is passed over and tried once more at the end; "running"
    means it was still held then. covered_by: the sweep's `EvalSpec.covered_by` (when a run is done).
    """
    outcome: dict[str, str] = {}
    held: list[PlannedRun] = []
    for i, planned in enumerate(todo, 1):
        state = _claim_and_run(planned, f"[{i}/{len(todo)}]", echo, covered_by)
        if state is None:
            held.append(planned)
        else:
            outcome[planned.job.name] = state
    for planned in held:  # the other process may have finished or died meanwhile
        outcome[planned.job.name] = _claim_and_run(planned, "[again]", echo, covered_by) or "running"
    return outcome


def _claim_and_run(
    planned: PlannedRun, tag: str, echo: Callable[[str], None], covered_by: Callable[[Mapping[str, Any]], bool]
) -> str | None:
    """Run one planned run under its directory's lock → its state, or None when another process holds it.

    Under the lock the run is looked at again: the plan was made when this sweep started, and another
    sweep may have run it since (a later attempt in status.json): then it is done or failed there and
    is not run again here. A run that other sweep left pending (interrupted) is continued.
    """
    job = planned.job

    def busy(holder: str) -> OutputBusyError:
        return OutputBusyError(holder)

    try:
        with folder_lock(job.run_dir, busy):
            status = read_status(job.run_dir)
            if is_complete(job.run_dir, covered_by, dense=job.dense):
                echo(f"{tag} {job.name}: done by another sweep meanwhile; skipped")
                return "done"
            if status is not None and status.attempt > planned.view.attempt and status.state == "failed":
                echo(f"{tag} {job.name}: failed in another sweep meanwhile ({status.error}); skipped")
                return "failed"
            echo(f"{tag} {job.name}: {'evaluating' if job.dense else 'pruning and evaluating'} ({job.run_dir})")
            start = time.perf_counter()
            state = run_job(job)
            echo(f"{tag} {job.name}: {state} in {time.perf_counter() - start:.0f} s")
            return state
    except OutputBusyError as exc:
        echo(f"{tag} {job.name}: running in another sweep ({exc}); passed over for now")
        return None


def check_slurm() -> None:
    """UsageError unless sbatch exists and the controller answers."""
    missing = [cmd for cmd in ("sbatch", "srun", "squeue", "sinfo") if shutil.which(cmd) is None]
    if missing:
        raise UsageError(
            f"--executor slurm: {', '.join(missing)} not found, so no SLURM is reachable here; "
            "run on a cluster login node or use --executor local"
        )
    try:
        proc = subprocess.run(
            ["sinfo", "--noheader", "--format=%P"], capture_output=True, text=True, timeout=30, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise UsageError("--executor slurm: the SLURM controller did not answer sinfo within 30 s") from exc
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise UsageError(f"--executor slurm: the SLURM controller does not answer ({why}); check `sinfo`")


def submit_slurm(
    todo: Sequence[PlannedRun], directory: Path, options: SlurmOptions, echo: Callable[[str], None]
) -> str:
    """Submit the runs as one job array → its job id; each run gets submission.json."""
    import submitit

    python = todo[0].job.python
    executor = submitit.SlurmExecutor(folder=directory / SUBMITIT_DIR, python=shlex.quote(python))
    executor.update_parameters(**options.executor_parameters(job_name=f"tsenor-sweep-{directory.name}"))
    # Before sbatch: a task that starts at once then records a later start than its submission.
    submitted_at = time.time()
    refusal = io.StringIO()
    try:
        # submitit prints sbatch's stderr itself before raising; it belongs in the one error line.
        with contextlib.redirect_stderr(refusal), executor.batch():
            jobs = [executor.submit(SweepTask(p.job)) for p in todo]
    except submitit.core.utils.FailedJobError as exc:
        lines = [line.strip() for line in (str(exc) or refusal.getvalue()).splitlines() if line.strip()]
        raise UsageError(
            f"sbatch refused the job array: {lines[-1] if lines else 'no message'}; check the slurm options"
        ) from exc
    for planned, job in zip(todo, jobs, strict=True):
        write_submission(planned.job.run_dir, Submission(job_id=str(job.job_id), submitted_at=submitted_at))
    array_id = str(jobs[0].job_id).split("_")[0]
    parallel = options.array_parallelism
    echo(
        f"submitted job {'array ' if len(jobs) > 1 else ''}{array_id}: {len(jobs)} run(s)"
        + (f", at most {parallel} at a time" if parallel and len(jobs) > 1 else "")
        + f", {options.time_min} min each; logs in {directory / SUBMITIT_DIR} and each run's log.txt"
    )
    return array_id


def wait_for(
    directory: Path,
    names: Sequence[str],
    echo: Callable[[str], None],
    queue: Callable[[], Mapping[str, str] | None],
    poll_s: float = POLL_SECONDS,
) -> list[RunView]:
    """Poll until every named run is done or failed → their views; prints each state change."""
    seen: dict[str, str] = {}
    wanted = set(names)
    while True:
        views = [v for v in collect(directory, queue()) if v.name in wanted]
        for view in views:
            if seen.get(view.name) != view.state:
                seen[view.name] = view.state
                echo(f"{view.name}: {view.state}" + (f" ({view.error})" if view.error else ""))
        if all(v.state in ("done", "failed") for v in views):
            return views
        time.sleep(poll_s)


def undo_prepare(directory: Path, created: Sequence[Path], *, fresh: bool, had_submitit: bool) -> None:
    """Remove what `prepare` and a refused submission left (sbatch refused the array): the whole folder
    when this sweep created it, else the run directories and the submitit folder it created."""
    if fresh:
        remove_folders([directory])
        return
    remove_folders([*created, *([] if had_submitit else [directory / SUBMITIT_DIR])])


def summary_line(total: int, done: int, todo: int) -> str:
    """The sweep's first line: "3 runs: 1 done, 1 to run, 1 already queued or running"."""
    busy = total - done - todo
    return f"{runs_text(total)}: {done} done, {todo} to run" + (f", {busy} already queued or running" if busy else "")


def dry_run_lines(spec: SweepSpec, output: Path, ctx: RunContext) -> Iterator[str]:
    """`tsenor sweep --dry-run`: one line per run with its state, the action and what its directory holds,
    then the summary; streamed, so a grid raised by --max-runs to millions is never held in memory."""
    directory = output.resolve()
    queue = slurm_queue()
    width = max(len("run"), *(len(run.name) for run in spec.iter_runs()))
    yield f"{'run':<{width}}  {'state':<8} {'action':<7} on disk"
    counts = {"done": 0, "run": 0, "skip": 0}
    for p in plan_sweep(spec, directory, ctx, queue=queue):
        action = "run" if p.launchable(queue) else "skip"
        counts["done" if p.view.state == "done" else action] += 1
        yield f"{p.spec.name:<{width}}  {p.view.state:<8} {action:<7} {p.on_disk}"
    yield summary_line(counts["done"] + counts["run"] + counts["skip"], counts["done"], counts["run"])


@dataclass(frozen=True)
class SweepResult:
    """What `run_sweep` did. views: every run of the folder at the end (None when nothing was left to run,
    or the array was submitted without waiting); failed: the runs of this sweep that failed; launched:
    how many it ran or submitted."""

    views: list[RunView] | None
    failed: tuple[str, ...] = ()
    launched: int = 0

    def check(self) -> None:
        """`SweepFailedError` (exit 1) naming the failed runs, if any."""
        if self.failed:
            raise SweepFailedError(
                f"{len(self.failed)} of {runs_text(self.launched)} failed ({', '.join(self.failed)}); their "
                "errors are above and in DIR/runs/NAME/log.txt; fix them and run the sweep again (finished runs "
                "are skipped)"
            )


@dataclass(frozen=True)
class SlurmLaunch:
    """A sweep sent to SLURM: the job array's sbatch options, and whether `run_sweep` waits for the array."""

    options: SlurmOptions
    wait: bool = False


def run_sweep(
    spec: SweepSpec,
    sweep_file: Path,
    output: Path,
    ctx: RunContext,
    *,
    slurm: SlurmLaunch | None,
    echo: Callable[[str], None],
) -> SweepResult:
    """Run every launchable point of the sweep in the folder `output`: locally one after another (`slurm`
    None), or as one SLURM job array (waiting for it with `slurm.wait`).

    Prints the summary first, prepares the run directories (recipe.yaml), records the sweep file
    (sweep.yaml), and undoes the preparation when sbatch refuses the array.
    """
    directory = output.resolve()
    queue = slurm_queue()
    planned = list(plan_sweep(spec, directory, ctx, queue=queue))
    todo = [p for p in planned if p.launchable(queue)]
    echo(summary_line(len(planned), sum(p.view.state == "done" for p in planned), len(todo)))
    if not todo:
        return SweepResult(None)
    if slurm is not None:
        check_slurm()
    fresh, had_submitit = not directory.exists(), (directory / SUBMITIT_DIR).exists()
    created = prepare(directory, todo, sweep_file)
    if slurm is None:
        record_sweep(sweep_file, directory)
        outcome = run_local(todo, echo, spec.eval.covered_by)
        failed = [name for name, state in outcome.items() if state == "failed"]
        elsewhere = [name for name, state in outcome.items() if state == "running"]
        if elsewhere:
            echo(
                f"{runs_text(len(elsewhere))} still running in another sweep ({', '.join(elsewhere)}); "
                f"follow them with: tsenor sweep status {output}"
            )
    else:
        try:
            submit_slurm(todo, directory, slurm.options, echo)
        except UsageError:
            undo_prepare(directory, created, fresh=fresh, had_submitit=had_submitit)
            raise
        record_sweep(sweep_file, directory)
        if not slurm.wait:
            echo(f"follow it with: tsenor sweep status {output}")
            return SweepResult(None)
        views = wait_for(directory, [p.spec.name for p in todo], echo, slurm_queue)
        failed = [v.name for v in views if v.state == "failed"]
    return SweepResult(collect(directory, slurm_queue()), tuple(failed), len(todo))
