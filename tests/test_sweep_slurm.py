"""`tsenor sweep --executor slurm` against a real SLURM (scripts/slurm_setup.sh; .ci/run starts one).

Tiny 4-block models so that a task can be caught mid-prune. Skipped, with the reason, when no SLURM
controller answers here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers_cli import invoke

from tsenor_cli.runfiles import MODEL_DIR, RESUME_DIR, RESUME_STATE_FILE
from tsenor_cli.sweep.spec import name_part


def _no_slurm_reason() -> str | None:
    missing = [cmd for cmd in ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel") if shutil.which(cmd) is None]
    if missing:
        return f"{', '.join(missing)} not found (start one with: sudo bash scripts/slurm_setup.sh)"
    try:
        proc = subprocess.run(["sinfo", "--noheader"], capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    if proc.returncode != 0:
        return "the SLURM controller does not answer: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return None


_REASON = _no_slurm_reason()
if _REASON is not None:
    pytest.skip(f"no SLURM here: {_REASON}", allow_module_level=True)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.realdata]

TIMEOUT_S = 600
# Seconds between a requeued task's release and its kill: more than the 1 s of slurmd's credential clock.
RELEASE_AFTER_S = 2
FAST = {"nsamples": 2, "seqlen": 32, "calib_data": "wikitext2"}
EVAL = {"ppl": ["wikitext2"], "max_windows": 1, "seqlen": 64}


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ppl(run_dir: Path) -> dict[str, float]:
    return {k: v["ppl"] for k, v in json.loads((run_dir / "eval.json").read_text())["perplexity"].items()}


def _status(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "status.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@pytest.fixture(scope="module")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=4)


@pytest.fixture(scope="module")
def grid(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 points: magnitude (seconds) and ALPS (tens of seconds a run, so it can be caught mid-prune)."""
    return _write(
        tmp_path_factory.mktemp("grid") / "grid.yaml",
        {
            "name": "{method}-{nm}",
            "base": {"model": str(tiny), **FAST},
            "axes": {"method": ["magnitude", "alps"], "nm": ["2:4", "4:8"]},
            "eval": EVAL,
        },
    )


@pytest.fixture(scope="module")
def local_sweep(grid: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "sweep"
    result = invoke(["sweep", str(grid), "--output", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _queued_job_ids() -> set[str]:
    """The ids of every job in the queue. Compared as sets, not as squeue's whole table, whose TIME column
    moves while any job runs (CI once had an earlier test's job still ending there)."""
    listing = subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, check=True)
    return set(listing.stdout.split())


def _requeued_and_settled(job: str) -> bool:
    """Pending again, and its previous attempt's batch script has ended (no BatchHost): releasing the
    hold earlier lets that attempt's exit be recorded against the new one, which then ends at once."""
    fields = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True, timeout=30, check=False
    ).stdout.split()
    return (
        "JobState=PENDING" in fields
        and "Reason=BeginTime" in fields
        and not any(f.startswith("BatchHost=") for f in fields)
    )


def _mid_prune_job(run_dir: Path) -> str | None:
    """The SLURM job of a run that has committed a block and has blocks left to prune, else None."""
    state = run_dir / MODEL_DIR / RESUME_DIR / RESUME_STATE_FILE
    try:
        committed = json.loads(state.read_text())
    except (OSError, json.JSONDecodeError):  # not written yet, or replaced while read
        return None
    job = _status(run_dir).get("job_id")
    return str(job) if job and committed["next_block"] < committed["blocks"] else None


def _interrupt_mid_prune(out: Path, errors: list[str]) -> None:
    """Stop each ALPS task once its first block is saved: alps-2x4 by `scontrol requeue` (preemption),
    alps-4x8 by submitit's time-limit signal (USR2: checkpoint, then it requeues itself). SLURM holds a
    requeued batch job for about two minutes; once the old attempt is gone `starttime=now+RELEASE_AFTER_S`
    ends the wait. Not `now`: slurmd revokes a killed job's credential with a time in whole seconds, and
    refuses to launch the job again within that second. CI once saw it ("Job 155 already killed, do not
    launch batch job" in slurmd.log, killed and relaunched at 19:36:27) and the task ended unfinished.

    Both runs are watched in one loop: the two tasks run side by side, and waiting for one before
    looking at the other once let alps-4x8 finish its last block first (CI, 2026-11-24)."""
    try:
        deadline = time.monotonic() + TIMEOUT_S
        how = {"alps-2x4": ["scontrol", "requeue"], "alps-4x8": ["scancel", "--signal=USR2"]}
        interrupted: dict[str, str] = {}
        while len(interrupted) < len(how):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sorted(set(how) - set(interrupted))} never reached a saved block mid-prune")
            for name, command in how.items():
                job = None if name in interrupted else _mid_prune_job(out / "runs" / name)
                if job is not None:
                    subprocess.run([*command, job], check=True, capture_output=True, timeout=30)
                    interrupted[name] = job
            time.sleep(0.05)
        for name, job in interrupted.items():
            while not _requeued_and_settled(job):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} ({job}) was not requeued")
                time.sleep(0.2)
            release = f"starttime=now+{RELEASE_AFTER_S}"
            subprocess.run(["scontrol", "update", f"jobid={job}", release], check=True, timeout=30)
    except (OSError, subprocess.SubprocessError, TimeoutError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")


def test_job_array_equals_local_and_requeued_tasks_end_identical(grid: Path, local_sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "slurm"
    errors: list[str] = []
    interrupter = threading.Thread(target=_interrupt_mid_prune, args=(out, errors), daemon=True)
    interrupter.start()
    slurm = ["--executor", "slurm", "--array-parallelism", "2", "--time", "10", "--wait"]
    result = invoke(["sweep", str(grid), "--output", str(out), *slurm])
    interrupter.join(timeout=60)
    assert not errors, errors
    assert result.exit_code == 0, result.output

    scripts = list((out / ".submitit").glob("*_submission.sh"))
    assert len(scripts) == 1 and "#SBATCH --array=0-3%2" in scripts[0].read_text()  # one array, 2 at a time
    views = {v["name"]: v for v in json.loads(invoke(["sweep", "status", str(out), "--json"]).output)}
    assert set(views) == {"magnitude-2x4", "magnitude-4x8", "alps-2x4", "alps-4x8"}
    array = {str(v["job_id"]).split("_")[0] for v in views.values()}
    assert len(array) == 1 and all(v["state"] == "done" for v in views.values())

    for name in views:
        got, want = out / "runs" / name, local_sweep / "runs" / name
        assert _sha256(got / "model" / "model.safetensors") == _sha256(want / "model" / "model.safetensors"), name
        assert _ppl(got) == _ppl(want), name
    for name, checkpointed in (("alps-2x4", False), ("alps-4x8", True)):
        run_dir = out / "runs" / name
        resumed = json.loads((run_dir / "tsenor_report.json").read_text())["resumed_from_block"]
        assert resumed is not None and 1 <= resumed < 4, name  # stopped mid-prune, continued at the next block
        assert _status(run_dir)["attempt"] == 2
        log = (run_dir / "log.txt").read_text()
        assert "attempt 1" in log and "attempt 2" in log and f"resuming after block {resumed}/4" in log
        # USR2 went through SweepTask.checkpoint and submitit's own requeue; the plain requeue did not.
        submitit_log = (out / ".submitit" / f"{views[name]['job_id']}_0_log.out").read_text()
        assert ("Calling checkpoint method." in submitit_log) is checkpointed, name
        assert ("Requeued job" in submitit_log) is checkpointed, name

    merged = invoke(["report", str(out), "--output", str(tmp_path / "report"), "--format", "json"])
    assert merged.exit_code == 0, merged.output
    rows = {row["run"]: row for row in json.loads(merged.stdout)["rows"]}
    assert set(rows) == set(views)
    assert all(rows[name]["ppl_wikitext2"] == _ppl(local_sweep / "runs" / name)["wikitext2"] for name in rows)


def test_a_failing_point_is_failed_with_its_error_and_the_others_finish(
    tiny: Path, data_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-model"
    sweep = _write(
        tmp_path / "s.yaml",
        {
            "name": "{model}",
            "base": {"method": "magnitude", "nm": "2:4", **FAST},
            "axes": {"model": [str(missing), str(tiny)]},
            "eval": EVAL,
        },
    )
    out = tmp_path / "out"
    result = invoke(["sweep", str(sweep), "--output", str(out), "--executor", "slurm", "--wait"])
    assert result.exit_code == 1 and "1 of 2 runs failed" in str(result.exception)
    views = {v["name"]: v for v in json.loads(invoke(["sweep", "status", str(out), "--json"]).output)}
    bad, good = views[name_part(str(missing))], views[name_part(str(tiny))]
    direct = invoke(["prune", "--model", str(missing), "--nm", "2:4", "--output", str(tmp_path / "x")])
    assert bad["state"] == "failed" and bad["error"] == str(direct.exception)
    assert good["state"] == "done" and (out / "runs" / good["name"] / "eval.json").is_file()
    assert bad["job_id"] != good["job_id"] and bad["job_id"].split("_")[0] == good["job_id"].split("_")[0]


def test_an_array_sbatch_refuses_is_one_line_and_leaves_nothing(tiny: Path, tmp_path: Path) -> None:
    sweep = _write(tmp_path / "s.yaml", {"base": {"model": str(tiny), "nm": "2:4", **FAST}, "eval": EVAL})
    out = tmp_path / "out"
    before = _queued_job_ids()
    result = invoke(["sweep", str(sweep), "--output", str(out), "--executor", "slurm", "--partition", "nosuch"])
    assert result.exit_code == 2
    message = str(result.exception)
    assert message.startswith("sbatch refused the job array: ") and "partition" in message and "\n" not in message
    assert not out.exists()
    assert _queued_job_ids() <= before  # nothing submitted (a job of an earlier test may have left meanwhile)
