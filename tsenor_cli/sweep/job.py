"""One run of a sweep: `tsenor prune --resume`, then `tsenor eval`, each in its own subprocess.

The same function serves both executors: the local one calls `run_job` in a loop, SLURM array tasks
call a `SweepTask` (submitit). Subprocesses keep one run's crash, bad model path or out-of-memory kill
from taking down the others, and their output, appended to the run's log.txt, holds the one-line
`error: ...` that status.json reports. This module imports no torch: the process that waits on the
subprocesses stays small.

Stopping. A SLURM requeue, preemption or scancel sends SIGTERM to every process of the task, the
prune subprocess included; the run records the interruption (status pending) instead of a failure,
and the requeued task resumes the prune from its last saved block. Before a time limit SLURM sends
submitit's signal (SIGUSR2, `--signal`): the prune subprocess ignores it, and `SweepTask.checkpoint`
forwards SIGTERM to it, waits until it has stopped (today at once, keeping the state of the last
finished block; a prune that finishes the current block on SIGTERM is waited for) and lets submitit
requeue the task. Evaluation has no resume state: an interrupted eval starts again.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from submitit import JobEnvironment
from submitit.helpers import Checkpointable, DelayedSubmission

from tsenor_cli.errors import TsenorError
from tsenor_cli.runfiles import (
    EVAL_FILE,
    LOG_FILE,
    MODEL_DIR,
    PRUNE_REPORTS,
    RECIPE_FILE,
    RunStatus,
    keep_reports,
    open_log,
    read_status,
    remove_folders,
    write_status,
)

ERROR_PREFIX = "error: "
# Exit statuses of a subprocess stopped by a signal: killed by it, or exiting 128+N after handling it.
STOP_CODES = {
    -signal.SIGTERM: "SIGTERM",
    128 + signal.SIGTERM: "SIGTERM",
    -signal.SIGINT: "SIGINT",
    128 + signal.SIGINT: "SIGINT",
}


class RunInterrupted(TsenorError):
    """A signal stopped a run part-way; its resume state is kept (exit 130, as for Ctrl-C)."""

    exit_code = 130


@dataclass(frozen=True)
class RunJob:
    """Everything a run needs, resolved when the sweep is launched (picklable, no spec parsing in the job).

    python: the interpreter that runs `-m tsenor_cli` (the launching one, so SLURM tasks use the same
    environment); cwd: where relative paths of the recipe resolve (the launch directory);
    environment: the tsenor/HF variables the subprocesses get explicitly (sbatch may not export the
    launching shell's); model: what a dense run evaluates; eval_args: `tsenor eval` flags.
    """

    name: str
    run_dir: Path
    python: str
    cwd: Path
    eval_args: tuple[str, ...]
    dense: bool = False
    model: str = ""
    keep_checkpoint: bool = True
    environment: tuple[tuple[str, str], ...] = ()

    def command(self, *args: str) -> list[str]:
        """`env VAR=value ... python -m tsenor_cli ARGS`: the variables are set for the child only."""
        env = [f"{key}={value}" for key, value in self.environment]
        return [*(["env", *env] if env else []), self.python, "-m", "tsenor_cli", *args]

    def prune_command(self) -> list[str]:
        return self.command(
            "prune",
            "--config",
            str(self.run_dir / RECIPE_FILE),
            "--output",
            str(self.run_dir / MODEL_DIR),
            "--resume",
        )

    def eval_command(self) -> list[str]:
        model = self.model if self.dense else str(self.run_dir / MODEL_DIR)
        return self.command("eval", model, *self.eval_args, "--output", str(self.run_dir), "--force")


class ChildWatch:
    """The subprocess a run is waiting on, and the signal that asked the run to stop (if any)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped_by: str | None = None

    def stop_and_wait(self, reason: str) -> None:
        """Ask the subprocess to stop (SIGTERM) and wait until it has exited.

        Called from a signal handler while the run may be blocked in `Popen.wait`, which holds a
        lock this thread cannot take again; `os.waitpid` waits without it.
        """
        self.stopped_by = reason
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            _, wait_status = os.waitpid(proc.pid, 0)
        except ChildProcessError:
            return  # reaped by the run's own wait meanwhile
        proc.returncode = os.waitstatus_to_exitcode(wait_status)


def _ignore_scheduler_signals() -> None:
    # SLURM delivers --signal (SIGUSR2 for submitit) to every process of the task; its default action
    # kills. The parent handles it (checkpoint) and stops the prune with SIGTERM instead.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _error_line(output: str, step: str, returncode: int) -> str:
    """The CLI's one-line `error: ...` from a failed step's output, else what the process died of."""
    lines = [line.strip() for line in output.replace("\r", "\n").splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(ERROR_PREFIX):
            return line[len(ERROR_PREFIX) :]
    if returncode < 0:
        why = f"killed by {signal.Signals(-returncode).name}"
        if -returncode == signal.SIGKILL:
            why += " (out of memory?)"
    else:
        why = f"exited with code {returncode}"
    return f"{step} {why}" + (f": {lines[-1]}" if lines else "")


def _run_step(job: RunJob, step: str, cmd: list[str], watch: ChildWatch) -> tuple[int, str]:
    """Run one subprocess with its output appended to log.txt → (return code, its output)."""
    with open_log(job.run_dir) as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        start = log.tell()
        watch.proc = subprocess.Popen(
            cmd,
            cwd=job.cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_ignore_scheduler_signals,
        )
        try:
            returncode = watch.proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached the subprocess too (same process group); let it finish stopping.
            watch.proc.wait()
            raise
        finally:
            watch.proc = None
    with (job.run_dir / LOG_FILE).open("rb") as log:
        log.seek(start)
        output = log.read().decode("utf-8", errors="replace")
    return returncode, output


def _set_status(job: RunJob, **changes: Any) -> RunStatus:
    status = replace(read_status(job.run_dir) or RunStatus(state="pending"), **changes)
    write_status(job.run_dir, status)
    return status


def _what_is_kept(step: str | None) -> str:
    return "the evaluation starts again" if step == "eval" else "the prune's resume state is kept"


def mark_interrupted(job: RunJob, reason: str, step: str | None) -> None:
    """status pending, with why: the run is neither done nor failed and continues when run again."""
    during = f" during {step}" if step else ""
    _set_status(job, state="pending", note=f"interrupted by {reason}{during}; {_what_is_kept(step)}")


def _start_attempt(job: RunJob, job_id: str | None) -> None:
    """status.json says the run is running this attempt (one more than the last), and its log says so too."""
    previous = read_status(job.run_dir)
    status = RunStatus(
        state="running",
        attempt=(previous.attempt if previous else 0) + 1,
        job_id=job_id,
        host=os.uname().nodename,
        pid=os.getpid(),
        started_at=time.time(),
    )
    write_status(job.run_dir, status)
    with open_log(job.run_dir) as log:
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"=== {job.name}: attempt {status.attempt}{f' (job {job_id})' if job_id else ''}, {when}\n".encode())


def _on_sigterm(watch: ChildWatch, job_id: str | None) -> Callable[[int, FrameType | None], None]:
    """The SIGTERM handler of a run: the stop is recorded in `watch`, and passed on to a local subprocess."""

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        watch.stopped_by = "SIGTERM"
        # Under SLURM the subprocess gets the same SIGTERM from slurmstepd; a second one could turn a
        # prune's orderly stop into an abrupt one. Locally (`kill` of tsenor sweep) it gets none.
        if job_id is None and watch.proc is not None and watch.proc.returncode is None:
            watch.proc.send_signal(signal.SIGTERM)

    return on_sigterm


def _steps(job: RunJob) -> list[tuple[str, list[str]]]:
    """(step, command) of what the run has left: the prune unless its checkpoint is complete (or the run is
    dense), then the evaluation."""
    steps: list[tuple[str, list[str]]] = []
    if not job.dense and not (job.run_dir / MODEL_DIR / PRUNE_REPORTS[0]).is_file():
        steps.append(("prune", job.prune_command()))
    steps.append(("eval", job.eval_command()))
    return steps


def run_job(job: RunJob, *, job_id: str | None = None, watch: ChildWatch | None = None) -> str:
    """Prune (resumable) and evaluate one run → "done" or "failed" (the error is in status.json).

    A pruned checkpoint that is complete is not pruned again (interrupted during eval). Raises
    `RunInterrupted` when a signal stopped it. job_id: the SLURM job, None when run locally.
    """
    watch = watch or ChildWatch()
    _start_attempt(job, job_id)
    in_main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _on_sigterm(watch, job_id)) if in_main else None
    step: str | None = None
    try:
        model_dir = job.run_dir / MODEL_DIR
        for step, cmd in _steps(job):
            if watch.stopped_by is not None:
                break
            _set_status(job, step=step)
            returncode, output = _run_step(job, step, cmd, watch)
            if watch.stopped_by is None and returncode in STOP_CODES:
                # The subprocess got the stop signal before this process did (SLURM signals them in
                # turn); the interruption is the same.
                watch.stopped_by = STOP_CODES[returncode]
            if watch.stopped_by is not None:
                break
            if returncode != 0:
                _set_status(job, state="failed", finished_at=time.time(), error=_error_line(output, step, returncode))
                return "failed"
            if step == "prune":
                keep_reports(model_dir, job.run_dir)
        if watch.stopped_by is not None:
            mark_interrupted(job, watch.stopped_by, step)
            raise RunInterrupted(
                f"run {job.name} was stopped by {watch.stopped_by} during {step}; run the sweep again to "
                f"continue it ({_what_is_kept(step)})"
            )
        if not (job.run_dir / EVAL_FILE).is_file():
            raise AssertionError(f"tsenor eval exited 0 without writing {job.run_dir / EVAL_FILE}")
        if not job.keep_checkpoint and model_dir.exists():
            remove_folders([model_dir])
        _set_status(job, state="done", step=None, finished_at=time.time(), error=None, note=None)
        return "done"
    except KeyboardInterrupt:
        mark_interrupted(job, "SIGINT", step)
        raise
    except OSError as exc:
        _set_status(job, state="failed", finished_at=time.time(), error=f"{type(exc).__name__}: {exc}")
        return "failed"
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


class SweepTask(Checkpointable):
    """What a SLURM array task runs: `run_job` with the task's job id; requeued on submitit's signal.

    checkpoint(): stop the running subprocess (SIGTERM), wait for it, record the interruption and hand
    submitit the same task to requeue. The watched subprocess is not pickled.
    """

    def __init__(self, job: RunJob) -> None:
        self.job = job
        self._watch = ChildWatch()

    def __call__(self) -> str:
        try:
            return run_job(self.job, job_id=JobEnvironment().job_id, watch=self._watch)
        except RunInterrupted:
            # SLURM requeues (or cancelled) the task; status.json says so, the job result does not matter.
            return "interrupted"

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        reason = "SIGUSR2 (time limit or preemption)"
        self._watch.stop_and_wait(reason)
        mark_interrupted(self.job, reason, (read_status(self.job.run_dir) or RunStatus("pending")).step)
        return DelayedSubmission(SweepTask(self.job))

    def __getstate__(self) -> dict[str, Any]:
        return {"job": self.job}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.job = state["job"]
        self._watch = ChildWatch()
