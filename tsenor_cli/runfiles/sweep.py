"""The sweep folder (`tsenor sweep --output`): its file names and the state files a sweep's runs write.

A sweep folder holds `SWEEP_FILE` and `RUNS_DIR`/NAME per run: `RECIPE_FILE`, the run folder in
`MODEL_DIR`, `EVAL_FILE` and the prune reports beside it, `LOG_FILE`, `STATUS_FILE` (`RunStatus`) and
`SUBMISSION_FILE` (`Submission`), each written here through `tsenor_cli.atomic` (the log appended to as the
run's subprocesses write it); a SLURM sweep's submitit files are in `SUBMITIT_DIR`.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tsenor_cli import atomic
from tsenor_cli.runfiles.run import PRUNE_REPORTS
from tsenor_cli.runfiles.schema import _flat_json, read_json_file

SWEEP_FILE = "sweep.yaml"
RUNS_DIR = "runs"
RECIPE_FILE = "recipe.yaml"
MODEL_DIR = "model"
STATUS_FILE = "status.json"
SUBMISSION_FILE = "submission.json"
LOG_FILE = "log.txt"
SUBMITIT_DIR = ".submitit"  # submitit's own files of a SLURM sweep: its scripts and the jobs' logs
# The version of status.json and submission.json (each carries its own `schema_version`).
STATUS_VERSION = 1


@dataclass(frozen=True)
class RunStatus:
    """``status.json``: written by a sweep's run itself (times are Unix seconds; job_id None when run locally).

    state: running, then done or failed with the one-line `error`, or pending when a signal stopped it.
    """

    state: str
    attempt: int = 0
    job_id: str | None = None
    host: str | None = None
    pid: int | None = None
    step: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    note: str | None = None
    schema_version: int = STATUS_VERSION

    def to_json(self) -> dict[str, Any]:
        return {**_flat_json(self), "schema_version": STATUS_VERSION}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunStatus:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Submission:
    """``submission.json``: written by the SLURM executor once sbatch returned the job id."""

    job_id: str
    submitted_at: float
    schema_version: int = STATUS_VERSION

    def to_json(self) -> dict[str, Any]:
        return {**_flat_json(self), "schema_version": STATUS_VERSION}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Submission:
        return cls(job_id=str(data["job_id"]), submitted_at=float(data["submitted_at"]))


def read_status(run_dir: Path) -> RunStatus | None:
    data = read_json_file(run_dir / STATUS_FILE)
    return None if data is None else RunStatus.from_json(data)


def write_status(run_dir: Path, status: RunStatus) -> None:
    atomic.write_json(run_dir / STATUS_FILE, status.to_json())


def read_submission(run_dir: Path) -> Submission | None:
    data = read_json_file(run_dir / SUBMISSION_FILE)
    return None if data is None else Submission.from_json(data)


def write_submission(run_dir: Path, submission: Submission) -> None:
    atomic.write_json(run_dir / SUBMISSION_FILE, submission.to_json())


def make_run_dir(run_dir: Path) -> None:
    """The folder of one run of a sweep (`RUNS_DIR`/NAME), made when missing."""
    run_dir.mkdir(parents=True, exist_ok=True)


def write_recipe(run_dir: Path, text: str) -> None:
    """The run's `RECIPE_FILE`, which its prune reads with --config."""
    atomic.write_text(run_dir / RECIPE_FILE, text)


def write_sweep_file(directory: Path, text: str) -> None:
    """The sweep folder's `SWEEP_FILE`: a copy of the sweep file, which `tsenor sweep status` and `tsenor
    report` read."""
    atomic.write_text(directory / SWEEP_FILE, text)


def open_log(run_dir: Path) -> BinaryIO:
    """The run's `LOG_FILE`, opened to append (the subprocesses' output goes to it as it comes)."""
    return (run_dir / LOG_FILE).open("ab")


def keep_reports(model_dir: Path, run_dir: Path) -> None:
    """The prune's reports (`PRUNE_REPORTS`) of the run folder `model_dir` copied beside it into `run_dir`,
    where they stay when the checkpoint is not kept."""
    for report in PRUNE_REPORTS:
        atomic.write_bytes(run_dir / report, (model_dir / report).read_bytes())


def remove_folders(folders: Sequence[Path]) -> None:
    """Remove each of `folders` with what it holds (a run's checkpoint not kept, what a refused submission
    left); a missing one is skipped."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
