"""The log handler that prints above tqdm bars (`progress._BarSafeHandler`) and what `-q` silences."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tqdm.auto import tqdm

from tsenor_cli.progress import configure_logging, logger

REPO_ROOT = Path(__file__).resolve().parents[1]


class _InterruptedLock:
    """A lock whose acquire is cut short by Ctrl-C, as a SIGINT arriving inside it does; its release,
    like threading.RLock's, refuses a lock this thread does not hold."""

    def __init__(self) -> None:
        self.inner = threading.RLock()

    def acquire(self, *args: object, **kwargs: object) -> bool:
        raise KeyboardInterrupt

    def release(self) -> None:
        self.inner.release()


@pytest.fixture
def interrupted_lock() -> Iterator[None]:
    before = tqdm.get_lock()
    tqdm.set_lock(_InterruptedLock())
    try:
        yield
    finally:
        tqdm.set_lock(before)


def test_a_line_goes_to_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging(logging.INFO)
    logger.info("block 1/8")
    assert stream.getvalue() == "block 1/8\n"


def test_ctrl_c_while_a_line_is_written_stays_a_keyboard_interrupt(
    monkeypatch: pytest.MonkeyPatch, interrupted_lock: None
) -> None:
    """tqdm.write alone released its lock in a `finally` after an interrupted acquire: the Ctrl-C became
    "RuntimeError: cannot release un-acquired lock" (exit 1 instead of 130)."""
    monkeypatch.setattr("sys.stderr", io.StringIO())
    configure_logging(logging.INFO)
    with pytest.raises(RuntimeError, match="un-acquired"):
        tqdm.write("what tqdm alone does")  # the failure this handler avoids, shown on tqdm itself
    with pytest.raises(KeyboardInterrupt):
        logger.info("block 2/8")


def test_quiet_foreign_output_silences_the_process_stderr_under_q_only(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a library writes to file descriptor 2 itself (a subprocess's stderr, as lm-eval's `git describe`)
    is dropped inside `quiet_foreign_output` under -q, shown otherwise; stderr is back after the block."""
    import subprocess
    import sys

    from tsenor_cli.progress import quiet_foreign_output

    def child_writes(text: str) -> None:
        subprocess.run([sys.executable, "-c", f"import sys; sys.stderr.write({text!r})"], check=True)

    monkeypatch.setattr(logger, "level", logging.INFO)
    with quiet_foreign_output():
        child_writes("shown\n")
    monkeypatch.setattr(logger, "level", logging.WARNING)  # what configure_logging sets for -q
    with quiet_foreign_output():
        child_writes("dropped\n")
    child_writes("after\n")
    assert capfd.readouterr().err == "shown\nafter\n"


@pytest.mark.realdata
def test_quiet_eval_with_a_zero_shot_task_prints_only_its_result(tiny: Path, data_dir: Path, tmp_path: Path) -> None:
    """`tsenor -q eval --tasks piqa` run outside a git checkout: stdout holds the result table, stderr nothing
    (without -q the same command shows lm-eval's bars, its warnings and git's "fatal: not a git repository")."""
    import subprocess
    import sys

    def run(*root: str, out: str) -> subprocess.CompletedProcess[str]:
        argv = [*root, "eval", "--model", str(tiny), "--tasks", "piqa", "--limit", "4", "--ppl", "none"]
        argv += ["--data-dir", str(data_dir), "--offline", "--output", str(tmp_path / out)]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.run(
            [sys.executable, "-m", "tsenor_cli", *argv], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return proc

    plain = run(out="plain")
    assert "Running loglikelihood requests" in plain.stderr and "not a git repository" in plain.stderr
    quiet = run("-q", out="quiet")
    assert quiet.stderr == ""
    lines = quiet.stdout.splitlines()
    assert lines[0].startswith(f"model {tiny} (llama, float32, cpu)") and lines[-1].startswith("took ")
    assert lines[1:-1] == plain.stdout.splitlines()[1:-1]  # the table: task, piqa's scores, the average
    assert [line.split()[0] for line in lines[1:-1]] == ["task", "piqa", "average"]
    # piqa's acc with lm-eval's standard error, recorded in eval.json: 4 documents, sqrt(p(1-p)/3).
    acc, stderr = float(lines[2].split()[1]), float(lines[2].split()[3])
    assert stderr == pytest.approx(math.sqrt(acc * (1 - acc) / 3), abs=1e-4)
    recorded = json.loads((tmp_path / "quiet" / "eval.json").read_text())["zeroshot"]["tasks"]["piqa"]
    assert recorded["acc_stderr"] == pytest.approx(stderr, abs=1e-4)
