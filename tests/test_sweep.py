"""`tsenor sweep`: sweep files (parsing, naming, refusals), run states, and the local executor on tiny models.

The SLURM executor is tested against a real SLURM in tests/test_sweep_slurm.py.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers_cli import invoke
from helpers_tiny import make_tiny_llama

from tsenor_cli.errors import UsageError
from tsenor_cli.runfiles import RunStatus, Submission, read_status, write_status, write_submission
from tsenor_cli.sweep.job import RunInterrupted, RunJob, SweepTask, _error_line, run_job
from tsenor_cli.sweep.spec import EvalSpec, load_sweep, name_part, parse_sweep, parse_time
from tsenor_cli.sweep.status import resolve

REPO_ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- sweep files -------------------------------------------------------------------------------------


def test_runs_are_the_product_of_the_axes_named_from_their_values() -> None:
    spec = parse_sweep(
        {"base": {"model": "m", "seed": 1}, "axes": {"method": ["alps", "wanda"], "nm": ["16:32", "2:4"]}}, "s.yaml"
    )
    runs = spec.runs()
    assert [r.name for r in runs] == [
        "method-alps_nm-16x32",
        "method-alps_nm-2x4",
        "method-wanda_nm-16x32",
        "method-wanda_nm-2x4",
    ]
    assert runs[1].recipe_dict() == {"model": "m", "seed": 1, "method": "alps", "nm": "2:4"}
    assert runs[1].values == (("method", "alps"), ("nm", "2:4"))


def test_name_template_formats_booleans_nm_paths_and_specs() -> None:
    spec = parse_sweep(
        {
            "name": "{method}-{nm}-{transposable:t|o}-s{seed:03d}-{model}",
            "base": {"model": "/data/ckpt/Llama-3.2-1B", "method": "alps"},
            "axes": {"nm": ["8:16"], "transposable": [True, False], "seed": [7]},
            "eval": {"dense": True},
        },
        "s.yaml",
    )
    assert [r.name for r in spec.runs()] == [
        "dense",
        "alps-8x16-t-s007-data-ckpt-Llama-3.2-1B",
        "alps-8x16-o-s007-data-ckpt-Llama-3.2-1B",
    ]
    assert spec.runs()[0].dense and spec.runs()[0].recipe_dict() == {"model": "/data/ckpt/Llama-3.2-1B"}


def test_dense_runs_one_per_model_axis_value() -> None:
    spec = parse_sweep({"axes": {"model": ["a/x", "b"], "nm": ["2:4"]}, "eval": {"dense": True}}, "s.yaml")
    assert [r.name for r in spec.runs()] == ["dense-a-x", "dense-b", "model-a-x_nm-2x4", "model-b_nm-2x4"]


def test_table2_sweep_names_the_committed_runs() -> None:
    """The shipped grid reproduces results_grid.py's names, so make results finds every committed run.

    Its solver is `auto`: the committed runs record `tsenor`, which on CPU ran the exact flow solver
    before the solvers were named by what runs (auto picks flow on CPU).
    """
    spec = load_sweep(REPO_ROOT / "configs" / "sweeps" / "table2.yaml")
    names = [r.name for r in spec.runs()]
    assert names[:3] == ["dense", "alps-16x32-t", "sparsegpt-16x32-t"] and names[-1] == "magnitude-8x32-o"
    committed = {p.name for p in (REPO_ROOT / "docs" / "results" / "runs").iterdir() if p.is_dir()}
    assert set(names) == committed and len(names) == 41
    alps = dict(spec.runs()[1].recipe)
    assert alps == {
        "model": "smollm2-135m",
        "solver": "auto",
        "calib_data": "c4",
        "nsamples": 64,
        "seqlen": 512,
        "seed": 0,
        "nm": "16:32",
        "transposable": True,
        "method": "alps",
    }
    assert spec.eval.eval_args() == (
        "--ppl",
        "wikitext2,ptb,c4",
        "--tasks",
        "piqa,arc_easy,arc_challenge,hellaswag,winogrande,rte,openbookqa,boolq",
        "--limit",
        "100",
        "--max-windows",
        "8",
        "--seqlen",
        "2048",
    )


def test_make_results_skips_every_committed_run() -> None:
    dry = invoke(["sweep", "configs/sweeps/table2.yaml", "--output", "docs/results", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.output.strip().splitlines()[-1] == "41 runs: 41 done, 0 to run"
    calib = invoke(["sweep", "configs/sweeps/calib128.yaml", "--output", "docs/results/calib128", "--dry-run"])
    assert calib.output.strip().splitlines()[-1] == "2 runs: 2 done, 0 to run"


def test_readme_sweep_file_parses() -> None:
    readme = (REPO_ROOT / "docs" / "guide" / "usage.md").read_text()  # the sweep file users copy
    block = re.search(r"```yaml\n(# my-sweep\.yaml.*?)```", readme, re.S)
    assert block is not None
    spec = parse_sweep(yaml.safe_load(block.group(1)), "README")
    runs = spec.runs()
    assert len(runs) == 2 + 8 and runs[0].name == "dense-meta-llama-Llama-3.2-1B"
    assert spec.slurm.time_min == 240 and spec.slurm.array_parallelism == 4


@pytest.mark.parametrize(
    ("text", "minutes"),
    [(90, 90), ("90", 90), ("1:30", 2), ("02:00:00", 120), ("1-00", 1440), ("1-02:30", 1590), ("0-00:00:59", 1)],
)
def test_slurm_times_in_minutes(text: str | int, minutes: int) -> None:
    assert parse_time(text, "--time") == minutes


def test_bad_slurm_time_is_refused() -> None:
    with pytest.raises(UsageError, match="not a SLURM time"):
        parse_time("two hours", "--time")


BAD_SWEEPS: dict[str, tuple[dict[str, Any], str]] = {
    "unknown top-level key": ({"base": {"model": "m", "nm": "2:4"}, "grid": {}}, "unknown top-level key 'grid'"),
    "unknown recipe key in base": ({"base": {"model": "m", "lr": 1}}, "base: unknown key 'lr'"),
    "unknown recipe key in axes": ({"base": {"model": "m"}, "axes": {"lr": [1]}}, "axes.lr[0]: unknown key 'lr'"),
    "empty axis": ({"base": {"model": "m", "nm": "2:4"}, "axes": {"method": []}}, "axes.method is empty"),
    "axis not a list": ({"base": {"model": "m", "nm": "2:4"}, "axes": {"method": "alps"}}, "must be a list"),
    "wrong type": (
        {"base": {"model": "m", "nm": "2:4"}, "axes": {"nsamples": [8, "many"]}},
        "axes.nsamples[1]: nsamples must be a int",
    ),
    "bool given as text": ({"base": {"model": "m", "nm": "2:4", "transposable": "yes"}}, "transposable must be a bool"),
    "nm a number": ({"base": {"model": "m"}, "axes": {"nm": [968]}}, "nm must be a pattern N:M such as 16:32, got 968"),
    "duplicate run names": (
        {"name": "{method}", "base": {"model": "m"}, "axes": {"method": ["alps"], "nm": ["2:4", "4:8"]}},
        "two runs are named 'alps'",
    ),
    "duplicate values": ({"base": {"model": "m"}, "axes": {"nm": ["2:4", "2:4"]}}, "two runs are named 'nm-2x4'"),
    "key in base and axes": ({"base": {"model": "m", "nm": "2:4"}, "axes": {"nm": ["4:8"]}}, "also set in base"),
    "output set": ({"base": {"model": "m", "nm": "2:4", "output": "x"}}, "output is set by the sweep"),
    "unknown template field": ({"name": "{lr}", "base": {"model": "m", "nm": "2:4"}}, "field {lr} is not a key"),
    "unknown eval key": ({"base": {"model": "m", "nm": "2:4"}, "eval": {"windows": 1}}, "eval: unknown key 'windows'"),
    "unknown task": ({"base": {"model": "m", "nm": "2:4"}, "eval": {"tasks": ["mmlu"]}}, "unknown zero-shot task"),
    "unknown dataset": ({"base": {"model": "m", "nm": "2:4"}, "eval": {"ppl": ["lambada"]}}, "unknown perplexity"),
    "nothing to evaluate": ({"base": {"model": "m", "nm": "2:4"}, "eval": {"ppl": []}}, "nothing to evaluate"),
    "unknown slurm key": ({"base": {"model": "m", "nm": "2:4"}, "slurm": {"gpus": 1}}, "slurm: unknown key 'gpus'"),
    "nm and sparsity": ({"base": {"model": "m", "nm": "2:4", "sparsity": 0.5}}, "run 'run': pass exactly one of"),
    "unknown method": ({"base": {"model": "m", "nm": "2:4"}, "axes": {"method": ["obs"]}}, "run 'method-obs': unknown"),
    "no model": ({"base": {"nm": "2:4"}}, "a model is required"),
}


@pytest.mark.parametrize("case", sorted(BAD_SWEEPS))
def test_bad_sweep_files_are_refused_with_one_line_before_anything_is_written(case: str, tmp_path: Path) -> None:
    data, message = BAD_SWEEPS[case]
    sweep = _write(tmp_path / "bad.yaml", data)
    out = tmp_path / "out"
    result = invoke(["sweep", str(sweep), "--output", str(out), "--executor", "slurm", "--wait"])
    assert result.exit_code == 2, (case, result.output)
    text = str(result.exception)
    assert message in text and "\n" not in text, (case, text)
    assert not out.exists()


def test_a_run_directory_from_another_recipe_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "out" / "runs" / "nm-2x4"
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text("model: m\nnm: '2:4'\nnsamples: 64\n")
    sweep = _write(tmp_path / "s.yaml", {"base": {"model": "m", "nsamples": 128}, "axes": {"nm": ["2:4"]}})
    result = invoke(["sweep", str(sweep), "--output", str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 2
    assert "made with another recipe (nsamples: 64 there, 128 now)" in str(result.exception)


def test_slurm_executor_without_slurm_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep = _write(tmp_path / "s.yaml", {"base": {"model": "m", "nm": "2:4"}})
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no sbatch, squeue, sinfo
    result = invoke(["sweep", str(sweep), "--output", str(tmp_path / "out"), "--executor", "slurm"])
    assert result.exit_code == 2
    assert "no SLURM is reachable here" in str(result.exception) and "--executor local" in str(result.exception)
    assert not (tmp_path / "out").exists()


def test_bad_sbatch_option_flag_is_refused(tmp_path: Path) -> None:
    sweep = _write(tmp_path / "s.yaml", {"base": {"model": "m", "nm": "2:4"}})
    result = invoke(["sweep", str(sweep), "--output", str(tmp_path / "o"), "--sbatch-opt", "exclusive", "--dry-run"])
    assert result.exit_code == 2 and "must be KEY=VALUE" in str(result.exception)


def test_flags_override_the_sweep_files_slurm_options(tmp_path: Path) -> None:
    from tsenor_cli.cli.sweep import _slurm_options

    spec = parse_sweep(
        {"base": {"model": "m", "nm": "2:4"}, "slurm": {"partition": "a", "time": 30, "sbatch": {"constraint": "x"}}},
        "s.yaml",
    )
    options = _slurm_options(spec.slurm, {"partition": "b", "time": "1:00:00", "mem": None}, ["--qos=high"])
    params = options.executor_parameters("j")
    assert params["partition"] == "b" and params["time"] == 60 and "mem" not in params
    assert params["additional_parameters"] == {"constraint": "x", "qos": "high"}


def test_an_output_that_is_a_file_is_exit_4_as_for_prune(tmp_path: Path) -> None:
    sweep = _write(tmp_path / "s.yaml", {"base": {"model": "m", "nm": "2:4"}})
    taken = tmp_path / "taken"
    taken.write_text("a file")
    result = invoke(["sweep", str(sweep), "--output", str(taken), "--dry-run"])
    assert (
        result.exit_code == 4 and str(result.exception) == f"--output {taken} is a file; pass a directory for the sweep"
    )


def test_another_sweep_file_into_a_sweep_folder_needs_force(tmp_path: Path) -> None:
    """A folder keeps the sweep it was made from: another grid (base, axes, eval, name) is refused with one
    line and exit 4, writing nothing, unless --force; comments and slurm options may change."""
    grid = {"base": {"model": str(tmp_path / "no-model"), "nm": "2:4"}, "axes": {"seed": [0, 1]}}
    first = _write(tmp_path / "a.yaml", {**grid, "slurm": {"time": 30}})
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.yaml").write_text(first.read_text())
    same = tmp_path / "again.yaml"
    same.write_text("# rerun with more time\n" + yaml.safe_dump({**grid, "slurm": {"time": 90}}))
    assert invoke(["sweep", str(same), "--output", str(out), "--dry-run"]).exit_code == 0

    other = _write(tmp_path / "b.yaml", {**grid, "axes": {"seed": [2]}})
    for extra in ([], ["--dry-run"]):
        refused = invoke(["sweep", str(other), "--output", str(out), *extra])
        assert refused.exit_code == 4, refused.output
        assert str(refused.exception) == (
            f"--output {out} holds another sweep: its sweep.yaml differs from {other} in axes; pass --force to "
            "add this sweep's runs to it (sweep.yaml is replaced), or choose another --output"
        )
    assert (out / "sweep.yaml").read_text() == first.read_text() and not (out / "runs").exists()

    # --force takes the folder over: the run is tried (and fails: there is no model) and sweep.yaml replaced.
    forced = invoke(["sweep", str(other), "--output", str(out), "--force"])
    assert forced.exit_code == 1 and "1 of 1 run failed (seed-2)" in str(forced.exception)
    assert (out / "sweep.yaml").read_text() == other.read_text()

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("not a sweep")
    refused = invoke(["sweep", str(other), "--output", str(notes), "--dry-run"])
    assert refused.exit_code == 4 and "holds files that are not a sweep's (todo.txt)" in str(refused.exception)


def test_a_grid_above_max_runs_is_refused_and_the_dry_run_streams(tmp_path: Path) -> None:
    """More than --max-runs points (10,000 by default) is refused with one line naming the count and the
    flag, before any run is built; a dry run of a large grid keeps no per-run objects: its memory grows by
    about a name and a line of output per run (it was 1.6 KB per run: 1.6 GB for a million)."""
    axes = {"seed": list(range(101)), "nsamples": list(range(1, 101))}
    big = _write(tmp_path / "big.yaml", {"base": {"model": "m", "nm": "2:4"}, "axes": axes})
    out = tmp_path / "out"
    refused = invoke(["sweep", str(big), "--output", str(out), "--dry-run"])
    assert refused.exit_code == 2
    assert str(refused.exception) == (
        f"{big} defines 10100 runs, more than --max-runs 10000; shorten its axes, or pass --max-runs 10100 "
        "to run them all"
    )
    assert not out.exists()
    assert "more than --max-runs 99" in str(invoke(["sweep", str(big), "-o", str(out), "--max-runs", "99"]).exception)

    def peak(seeds: int) -> int:
        grid = _write(tmp_path / f"g{seeds}.yaml", {"base": {"model": "m", "nm": "2:4"}, "axes": {
            "seed": list(range(seeds)), "nsamples": list(range(1, 11))}})  # fmt: skip
        # The objects of earlier tests set aside: in a worker that ran other test files first, the collector's
        # full passes wait on a share of every long-lived object, so the dry run's cyclic garbage can count in
        # its peak as if kept. Once seen: 1.6 KB per run in a run of five files on four workers, not
        # reproduced alone or after those files in one process.
        gc.collect()
        gc.freeze()
        tracemalloc.start()
        try:
            result = invoke(["sweep", str(grid), "--output", str(out), "--dry-run"])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            gc.unfreeze()
        assert (
            result.exit_code == 0
            and result.output.splitlines()[-1] == f"{10 * seeds} runs: 0 done, {10 * seeds} to run"
        )
        assert len(result.output.splitlines()) == 10 * seeds + 2  # a header, a line per run, the summary
        return peak

    peak(3)  # imports and caches of a first dry run
    assert peak(300) - peak(30) < 400 * (3000 - 300)


# --- run states ----------------------------------------------------------------------------------------


def test_eval_coverage_is_datasets_windows_tasks_and_limit() -> None:
    spec = EvalSpec(ppl=("wikitext2",), tasks=("piqa",), limit=100, max_windows=8)
    record = {
        "perplexity": {"wikitext2": {"ppl": 20.0}, "c4": {"ppl": 30.0}},
        "max_windows": 8,
        "zeroshot": {"tasks": {"piqa": {"acc": 0.6}}, "limit": 100},
    }
    assert spec.covered_by(record)
    assert not spec.covered_by({**record, "max_windows": 16})
    assert not spec.covered_by({**record, "zeroshot": {"tasks": {"piqa": {}}, "limit": 50}})
    assert not EvalSpec(ppl=("ptb",), max_windows=8).covered_by(record)
    assert EvalSpec(ppl=(), tasks=("piqa",), limit=100).covered_by({"perplexity": {}, **record})


def _status(run_dir: Path, **fields: Any) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_status(run_dir, RunStatus(**{"state": "running", "started_at": 100.0, **fields}))


def test_states_come_from_the_run_and_the_slurm_queue(tmp_path: Path) -> None:
    def state(run_dir: Path, queue: dict[str, str] | None, complete: bool = False) -> tuple[str, str | None]:
        view = resolve(run_dir.name, run_dir, complete=complete, queue=queue, now=130.0)
        return view.state, view.error

    submitted = tmp_path / "submitted"
    submitted.mkdir()
    write_submission(submitted, Submission(job_id="7_1", submitted_at=50.0))
    assert state(submitted, {"7_1": "PENDING"}) == ("pending", None)
    assert state(submitted, {"7_1": "RUNNING"}) == ("running", None)
    assert state(submitted, None) == ("pending", None)  # no squeue: nothing to contradict it
    gone = state(submitted, {})
    assert gone[0] == "failed" and "ended before the run started" in str(gone[1])

    running = tmp_path / "running"
    _status(running, job_id="7_2")
    write_submission(running, Submission(job_id="7_2", submitted_at=50.0))
    assert state(running, {"7_2": "RUNNING"}) == ("running", None)
    killed = state(running, {})
    assert killed[0] == "failed" and "ended without finishing" in str(killed[1])
    assert state(running, {}, complete=True) == ("done", None)

    requeued = tmp_path / "requeued"
    _status(requeued, state="failed", job_id="7_3", error="prune killed by SIGTERM")
    assert state(requeued, {"7_3": "PENDING"}) == ("pending", None)  # SLURM runs it again
    assert state(requeued, {}) == ("failed", "prune killed by SIGTERM")

    local = tmp_path / "local"
    _status(local, host=socket.gethostname(), pid=os.getpid())
    view = resolve("local", local, complete=False, queue=None, now=130.0)
    assert (view.state, view.elapsed_s) == ("running", 30.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _status(local, host=socket.gethostname(), pid=dead.pid)
    assert state(local, None) == ("pending", None)  # interrupted locally: the next sweep resumes it


def test_error_line_is_the_clis_one_line_error_else_how_the_step_died() -> None:
    output = "loading m\nTraceback...\nerror: model x does not exist; pass a folder\n"
    assert _error_line(output, "prune", 3) == "model x does not exist; pass a folder"
    assert _error_line("block 1/2\r  ... 40%\n", "prune", -signal.SIGKILL) == (
        "prune killed by SIGKILL (out of memory?): ... 40%"
    )
    assert _error_line("", "eval", 1) == "eval exited with code 1"


def _fake_job(tmp_path: Path, script: str) -> RunJob:
    """A run whose `python` is a shell script: the job's own logic without torch or a model."""
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    return RunJob(name="r", run_dir=run_dir, python=str(fake), cwd=tmp_path, eval_args=("--ppl", "wikitext2"))


def test_a_failing_step_records_its_one_line_error(tmp_path: Path) -> None:
    job = _fake_job(tmp_path, 'echo "loading"; echo "error: model m does not exist; pass a folder" >&2; exit 3\n')
    assert run_job(job) == "failed"
    status = read_status(job.run_dir)
    assert status is not None and (status.state, status.step, status.attempt) == ("failed", "prune", 1)
    assert status.error == "model m does not exist; pass a folder"
    log = (job.run_dir / "log.txt").read_text()
    assert "=== r: attempt 1" in log and f"$ {tmp_path / 'fake-python'} -m tsenor_cli prune --config" in log


def test_a_step_stopped_by_sigterm_leaves_the_run_pending(tmp_path: Path) -> None:
    job = _fake_job(tmp_path, "kill -TERM $$\n")  # as slurmstepd's SIGTERM on requeue or preemption
    with pytest.raises(RunInterrupted, match="stopped by SIGTERM during prune"):
        run_job(job, job_id="5_0")
    status = read_status(job.run_dir)
    assert status is not None and status.state == "pending" and status.job_id == "5_0"
    assert status.note == "interrupted by SIGTERM during prune; the prune's resume state is kept"
    assert resolve("r", job.run_dir, complete=False, queue={"5_0": "PENDING"}).state == "pending"


def test_checkpoint_stops_the_subprocess_and_requeues_the_same_run(tmp_path: Path) -> None:
    job = _fake_job(tmp_path, "exit 0\n")
    task = SweepTask(job)
    sleeper = subprocess.Popen(["sleep", "60"])
    task._watch.proc = sleeper
    write_status(job.run_dir, RunStatus(state="running", attempt=1, job_id="5_1", step="prune", started_at=1.0))
    again = task.checkpoint()
    assert sleeper.poll() == -signal.SIGTERM  # stopped and reaped
    status = read_status(job.run_dir)
    assert status is not None and status.state == "pending" and "SIGUSR2" in str(status.note)
    requeued = pickle.loads(pickle.dumps(again.function))
    assert isinstance(requeued, SweepTask) and requeued.job == job and requeued._watch.proc is None


def test_both_command_forms_and_status_of_a_missing_folder(tmp_path: Path) -> None:
    sweep = _write(tmp_path / "s.yaml", {"base": {"model": "m", "nm": "2:4"}, "axes": {"seed": [0, 1]}})
    short = invoke(["sweep", str(sweep), "--output", str(tmp_path / "o"), "--dry-run"])
    long = invoke(["sweep", "run", str(sweep), "--dry-run", "--output", str(tmp_path / "o")])
    assert short.exit_code == long.exit_code == 0 and short.output == long.output
    assert short.output.splitlines()[1].split() == ["seed-0", "pending", "run", "-"]
    assert not (tmp_path / "o").exists()
    missing = invoke(["sweep", "status", str(tmp_path / "o")])
    assert missing.exit_code == 3 and "not a sweep folder" in str(missing.exception)
    assert "status" in invoke(["sweep", "--help"]).output


# --- the local executor on tiny models -------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ppl(run_dir: Path) -> dict[str, float]:
    return {k: v["ppl"] for k, v in json.loads((run_dir / "eval.json").read_text())["perplexity"].items()}


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert proc.poll() is None, "the sweep ended before reaching the file it was waited on for"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.realdata
def test_local_sweep_runs_resumes_skips_and_reports(tmp_path: Path, data_dir: Path) -> None:
    tiny = make_tiny_llama(tmp_path / "tiny", num_layers=4)
    missing = tmp_path / "no-such-model"
    base = {"nsamples": 2, "seqlen": 32, "calib_data": "wikitext2", "method": "sparsegpt", "nm": "2:4"}
    evaluation = {"ppl": ["wikitext2"], "max_windows": 1, "seqlen": 64}
    grid = {"name": "{model}-{method}", "base": base, "eval": evaluation}
    sweep = _write(tmp_path / "s.yaml", {**grid, "axes": {"model": [str(tiny), str(missing)]}})
    out = tmp_path / "sweep"
    good, bad = f"{name_part(str(tiny))}-sparsegpt", f"{name_part(str(missing))}-sparsegpt"

    # SIGTERM to `tsenor sweep` once the first block's resume state is saved: it stops the prune, records
    # the run as pending and exits 130.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tsenor_cli", "sweep", str(sweep), "--output", str(out)], stderr=subprocess.PIPE
    )
    _wait_for(out / "runs" / good / "model" / ".tsenor-resume" / "state.json", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr.decode()
    assert f"error: run {good} was stopped by SIGTERM during prune" in stderr.decode()
    views = {v["name"]: v for v in json.loads(invoke(["sweep", "status", str(out), "--json"]).output)}
    assert (views[good]["state"], views[bad]["state"]) == ("pending", "pending")
    dry = invoke(["sweep", str(sweep), "--output", str(out), "--dry-run"])
    line = next(line for line in dry.output.splitlines() if line.startswith(good))
    assert line.split()[1:3] == ["pending", "run"] and "resume state after" in line

    result = invoke(["sweep", str(sweep), "--output", str(out)])
    assert result.exit_code == 1 and f"1 of 2 runs failed ({bad})" in str(result.exception)
    views = {v["name"]: v for v in json.loads(invoke(["sweep", "status", str(out), "--json"]).output)}
    assert views[good]["state"] == "done" and views[good]["job_id"] is None and views[good]["attempt"] == 2
    assert views[good]["run_dir"] == str(out / "runs" / good)
    # The one-line error is exactly what `tsenor prune` says about that model; the other run finished.
    direct = invoke(["prune", "--model", str(missing), "--nm", "2:4", "--output", str(tmp_path / "x")])
    assert views[bad]["state"] == "failed" and views[bad]["error"] == str(direct.exception)
    resumed = json.loads((out / "runs" / good / "tsenor_report.json").read_text())["resumed_from_block"]
    assert resumed is not None and 1 <= resumed < 4  # the interrupted prune continued where it stopped

    # The same run uninterrupted, by the same executor and streamed from its checkpoint (`stream: true`),
    # gives the same checkpoint and perplexity.
    reference = tmp_path / "reference"
    streamed = {**grid, "base": {**base, "stream": True}, "axes": {"model": [str(tiny)]}}
    ok = invoke(["sweep", str(_write(tmp_path / "r.yaml", streamed)), "-o", str(reference)])
    assert ok.exit_code == 0, ok.output
    got, want = out / "runs" / good, reference / "runs" / good
    assert _sha256(got / "model" / "model.safetensors") == _sha256(want / "model" / "model.safetensors")
    assert _ppl(got) == _ppl(want)

    # Again: the finished run is skipped (same attempt), the failed one is retried.
    again = invoke(["sweep", str(sweep), "--output", str(out)])
    assert again.exit_code == 1
    status = {name: json.loads((out / "runs" / name / "status.json").read_text()) for name in (good, bad)}
    assert status[good]["attempt"] == 2 and status[bad]["attempt"] == 2  # bad never started in the first sweep

    merged = invoke(["report", str(out), "--output", str(tmp_path / "report"), "--format", "json"])
    assert merged.exit_code == 0, merged.output
    rows = json.loads(merged.stdout)["rows"]
    assert [row["run"] for row in rows] == [good]
    assert rows[0]["ppl_wikitext2"] == _ppl(got)["wikitext2"]


@pytest.mark.slow
@pytest.mark.realdata
def test_two_sweeps_on_one_folder_share_the_runs_and_never_run_one_twice(tmp_path: Path, data_dir: Path) -> None:
    """Two real `tsenor sweep` processes on one folder: the second starts while the first runs its first
    point. Each run is claimed with its directory's lock and looked at again under it, so every point is
    pruned and evaluated exactly once (one attempt, one eval), and both sweeps end well."""
    tiny = make_tiny_llama(tmp_path / "tiny", num_layers=2)
    base = {"model": str(tiny), "nsamples": 2, "seqlen": 32, "calib_data": "wikitext2", "method": "magnitude"}
    grid = {"base": base, "axes": {"nm": ["2:4", "4:8", "1:4"]}, "eval": {"ppl": ["wikitext2"], "max_windows": 1}}
    sweep, out = _write(tmp_path / "s.yaml", grid), tmp_path / "sweep"
    names = ["nm-2x4", "nm-4x8", "nm-1x4"]
    command = [sys.executable, "-m", "tsenor_cli", "sweep", str(sweep), "--output", str(out)]
    first = subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ, "TSENOR_DATA_DIR": str(data_dir)})
    _wait_for(out / "runs" / names[0] / "status.json", first)
    second = subprocess.Popen(command, stderr=subprocess.PIPE, env={**os.environ, "TSENOR_DATA_DIR": str(data_dir)})
    errors = [proc.communicate(timeout=600)[1].decode() for proc in (first, second)]
    assert (first.returncode, second.returncode) == (0, 0), errors
    for name in names:
        status = read_status(out / "runs" / name)
        assert status is not None and (status.state, status.attempt) == ("done", 1), (name, status, errors)
        log = (out / "runs" / name / "log.txt").read_text()
        assert log.count(f"=== {name}: attempt") == 1 and log.count(" -m tsenor_cli eval ") == 1, (name, log)
    started = [line for text in errors for line in text.splitlines() if "pruning and evaluating" in line]
    assert sorted(line.split()[1].rstrip(":") for line in started) == sorted(names), errors
    assert not list((out / "runs").glob(".*.lock"))  # each run's lock file goes with its run
