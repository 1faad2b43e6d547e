"""The small records of a run and a sweep folder (runfiles.py): each carries its schema_version and reads
what earlier versions wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tsenor_cli.errors import SchemaError
from tsenor_cli.runfiles import (
    FINETUNE_STATE_FILE,
    FINETUNE_STATE_VERSION,
    RESUME_DIR,
    RESUME_STATE_FILE,
    STATUS_FILE,
    SUBMISSION_FILE,
    FinetuneState,
    RunStatus,
    Submission,
    read_status,
    read_submission,
    resume_progress,
    write_status,
    write_submission,
)


def test_status_and_submission_round_trip_with_their_version(tmp_path: Path) -> None:
    status = RunStatus(state="failed", attempt=2, job_id="12_3", error="error: bad model")
    write_status(tmp_path, status)
    assert json.loads((tmp_path / STATUS_FILE).read_text())["schema_version"] == 1
    assert read_status(tmp_path) == status
    (tmp_path / STATUS_FILE).write_text(json.dumps({"state": "done", "attempt": 1}))  # before the field
    assert read_status(tmp_path) == RunStatus(state="done", attempt=1)
    write_submission(tmp_path, Submission(job_id="7", submitted_at=12.5))
    assert json.loads((tmp_path / SUBMISSION_FILE).read_text()) == {
        "job_id": "7", "submitted_at": 12.5, "schema_version": 1,
    }  # fmt: skip
    assert read_submission(tmp_path) == Submission("7", 12.5)
    assert read_status(tmp_path / "none") is None and read_submission(tmp_path / "none") is None


def test_finetune_state_reads_the_files_written_before_schema_version(tmp_path: Path) -> None:
    state = FinetuneState(config_hash="abc", eval_before={"perplexity": {}})
    state.write(tmp_path)
    assert json.loads((tmp_path / FINETUNE_STATE_FILE).read_text())["schema_version"] == FINETUNE_STATE_VERSION
    assert FinetuneState.read(tmp_path) == state
    (tmp_path / FINETUNE_STATE_FILE).write_text(json.dumps({"version": 1, "config_hash": "abc", "eval_before": None}))
    assert FinetuneState.read(tmp_path) == FinetuneState("abc", None, schema_version=1)
    (tmp_path / FINETUNE_STATE_FILE).write_text(json.dumps({"config_hash": "abc"}))
    assert FinetuneState.read(tmp_path) == FinetuneState("abc", None, schema_version=0)  # refused by finetune
    (tmp_path / FINETUNE_STATE_FILE).write_text("{")
    with pytest.raises(SchemaError, match="not valid JSON"):
        FinetuneState.read(tmp_path)
    assert FinetuneState.read(tmp_path / "none") is None


def test_resume_progress_is_the_states_next_block(tmp_path: Path) -> None:
    assert resume_progress(tmp_path) is None
    (tmp_path / RESUME_DIR).mkdir()
    (tmp_path / RESUME_DIR / RESUME_STATE_FILE).write_text(json.dumps({"version": 3, "next_block": 4}))
    assert resume_progress(tmp_path) == 4
    (tmp_path / RESUME_DIR / RESUME_STATE_FILE).write_text(json.dumps({"version": 3, "next_block": True}))
    assert resume_progress(tmp_path) is None
