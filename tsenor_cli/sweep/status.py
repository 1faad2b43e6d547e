"""The state of each run of a sweep, from the small files in its run directory and SLURM's queue.

A sweep folder DIR holds ``sweep.yaml`` (a copy of the sweep file last launched there) and
``runs/NAME/`` per run, with (names and schemas in `tsenor_cli.runfiles`):

- ``recipe.yaml``: the run's `tsenor prune --config` recipe (written before the run starts);
- ``model/``: the pruned checkpoint (and, while pruning, its resume state);
- ``eval.json``, ``tsenor_report.json``/``.md``: what `tsenor report` reads;
- ``log.txt``: the prune and eval output of every attempt;
- ``status.json``: written by the run itself (`RunStatus`): running, then done or failed with the
  one-line error, or pending when a signal stopped it (SLURM requeues it; locally, run the sweep again);
- ``submission.json``: written by the SLURM executor (`Submission`): the job id and when.

Kept free of heavy imports (no torch): the job process that watches the prune and eval subprocesses
imports this module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tsenor_cli.errors import InputNotFoundError
from tsenor_cli.runfiles import (
    EVAL_FILE,
    LOG_FILE,
    PRUNE_FILE,
    RUNS_DIR,
    SWEEP_FILE,
    read_json,
    read_status,
    read_submission,
)

STATES = ("pending", "running", "done", "failed")
# squeue states in which the task's processes exist; every other listed state is waiting.
_ACTIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING"}


def last_log_line(path: Path, tail_bytes: int = 8192) -> str | None:
    """The last non-empty line of a log (progress bars redraw with `\\r`: the last redraw counts)."""
    if not path.is_file():
        return None
    with path.open("rb") as handle:
        handle.seek(max(0, path.stat().st_size - tail_bytes))
        text = handle.read().decode("utf-8", errors="replace")
    lines = [line.strip() for line in text.replace("\r", "\n").split("\n")]
    return next((line for line in reversed(lines) if line), None)


def slurm_queue() -> dict[str, str] | None:
    """{job id: state} of this user's SLURM jobs, array tasks one by one (`12_3`); None when squeue is
    missing or fails, so callers keep the run's own last word instead of guessing."""
    if shutil.which("squeue") is None:
        return None
    try:
        proc = subprocess.run(
            ["squeue", "--me", "--noheader", "--array", "--format=%i|%T"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    queue = {}
    for line in proc.stdout.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id:
            queue[job_id] = state
    return queue


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class RunView:
    """A run as `tsenor sweep status` shows it."""

    name: str
    run_dir: Path
    state: str
    job_id: str | None = None
    attempt: int = 0
    elapsed_s: float | None = None
    last_log: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "job_id": self.job_id,
            "run_dir": str(self.run_dir),
            "attempt": self.attempt,
            "elapsed_s": self.elapsed_s,
            "last_log": self.last_log,
            "error": self.error,
        }


def resolve(
    name: str, run_dir: Path, *, complete: bool, queue: Mapping[str, str] | None, now: float | None = None
) -> RunView:
    """The state of one run: done when its results are complete on disk; otherwise the run's own
    status.json, checked against SLURM's queue (a job that left the queue without writing done or
    failed was killed: time limit, scancel, node failure) or, for a local run, against its process."""
    now = time.time() if now is None else now
    status = read_status(run_dir)
    submission = read_submission(run_dir)
    log = last_log_line(run_dir / LOG_FILE)
    attempt = status.attempt if status else 0
    elapsed = None
    if status is not None and status.started_at is not None:
        elapsed = (status.finished_at or now) - status.started_at

    def view(state: str, job_id: str | None = None, error: str | None = None, spent: float | None = None) -> RunView:
        return RunView(name, run_dir, state, job_id, attempt, spent, log, error)

    if complete:
        return view("done", status.job_id if status else None, spent=elapsed)
    started = status.started_at if status and status.started_at is not None else None
    if submission is not None and (started is None or submission.submitted_at > started):
        # Submitted after the last attempt began: the queue knows more than status.json.
        where = submission.job_id
        if queue is None:
            return view("pending", where)
        if where not in queue:
            return view("failed", where, f"job {where} ended before the run started; see its log in .submitit/")
        return view("running" if queue[where] in _ACTIVE else "pending", where)
    if status is None:
        return view("pending")
    if status.job_id is not None and queue is not None and status.job_id in queue:
        # The job is still queued or running (e.g. requeued after its last attempt wrote failed or
        # pending): SLURM's word is the current one.
        active = queue[status.job_id] in _ACTIVE
        return view("running" if active else "pending", status.job_id, spent=elapsed if active else None)
    if status.state == "done":
        # Done with other eval settings than the sweep's current ones.
        return view("pending")
    if status.state == "failed":
        return view("failed", status.job_id, status.error, elapsed)
    if status.job_id is not None:
        if queue is None:
            return view(status.state, status.job_id, spent=elapsed if status.state == "running" else None)
        return view(
            "failed",
            status.job_id,
            f"job {status.job_id} ended without finishing (time limit, scancel or node failure); see log.txt",
            elapsed,
        )
    local_host = status.host == os.uname().nodename
    if status.state == "running" and local_host and status.pid is not None and _process_alive(status.pid):
        return view("running", spent=elapsed)
    # A local run that stopped part-way: the next `tsenor sweep` continues it.
    return view("pending")


def is_sweep_dir(directory: Path) -> bool:
    return (directory / SWEEP_FILE).is_file() or (directory / RUNS_DIR).is_dir()


def collect(directory: Path, queue: Mapping[str, str] | None = None) -> list[RunView]:
    """Every run of the sweep folder: those of its sweep.yaml in order, then any other run directory.

    Without sweep.yaml (runs made before `tsenor sweep`, e.g. docs/results), a run is done when its
    eval.json exists.
    """
    from tsenor_cli.sweep.spec import load_sweep

    if not is_sweep_dir(directory):
        raise InputNotFoundError(
            f"{directory} is not a sweep folder (no {SWEEP_FILE} or {RUNS_DIR}/); pass the --output of tsenor sweep"
        )
    runs_dir = directory / RUNS_DIR
    spec_file = directory / SWEEP_FILE
    spec = load_sweep(spec_file, check_runs=False, max_runs=None) if spec_file.is_file() else None
    names: list[str] = []
    dense: dict[str, bool] = {}
    if spec is not None:
        for run in spec.iter_runs():
            names.append(run.name)
            dense[run.name] = run.dense
    if runs_dir.is_dir():
        names += sorted(p.name for p in runs_dir.iterdir() if p.is_dir() and p.name not in dense)
    views = []
    for name in names:
        run_dir = runs_dir / name
        if spec is not None and name in dense:
            complete = is_complete(run_dir, spec.eval.covered_by, dense=dense[name])
        else:
            complete = (run_dir / EVAL_FILE).is_file()
        views.append(resolve(name, run_dir, complete=complete, queue=queue))
    return views


def is_complete(run_dir: Path, covered_by: Callable[[Mapping[str, Any]], bool], *, dense: bool) -> bool:
    """eval.json covers what the sweep asks for (`EvalSpec.covered_by`) and, for a pruned run, the
    prune report is there: the run needs nothing more."""
    eval_path = run_dir / EVAL_FILE
    if not eval_path.is_file():
        return False
    if not dense and not (run_dir / PRUNE_FILE).is_file():
        return False
    return covered_by(read_json(eval_path))


def runs_text(n: int) -> str:
    """ "1 run", "3 runs"."""
    return f"{n} run" if n == 1 else f"{n} runs"


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


def status_table(views: list[RunView]) -> str:
    """`tsenor sweep status`'s table: one row per run (state, job, elapsed, last log line) and the counts."""
    width = max([len("run"), *(len(v.name) for v in views)])
    lines = [f"{'run':<{width}}  {'state':<8} {'job':<12} {'elapsed':>8}  last log line"]
    for v in views:
        last = f"error: {v.error}" if v.state == "failed" and v.error else v.last_log
        lines.append(
            f"{v.name:<{width}}  {v.state:<8} {v.job_id or '-':<12} {_elapsed(v.elapsed_s):>8}  {_clip(last, 90)}"
        )
    counts = {s: sum(v.state == s for v in views) for s in ("done", "running", "pending", "failed")}
    lines.append(f"{runs_text(len(views))}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)
