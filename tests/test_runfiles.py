"""The small records of a run and a sweep folder (runfiles.py): each carries its schema_version and reads
what earlier versions wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tsenor_cli.errors import SchemaError
from tsenor_cli.runfiles import (
    CONFIG_FILE,
    FINETUNE_STATE_FILE,
    FINETUNE_STATE_VERSION,
    PRUNE_STATE_VERSION,
    RESUME_DIR,
    RESUME_STATE_FILE,
    SPARSITY_FILE,
    SPARSITY_KEY,
    STATUS_FILE,
    SUBMISSION_FILE,
    BlockRefinement,
    DataSource,
    FinetuneState,
    LayerRecord,
    ResumeState,
    RunStatus,
    SparsityRecord,
    Submission,
    block_file,
    hidden_file,
    read_sparsity,
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


def test_prune_resume_state_round_trips_and_reads_the_files_written_as_version() -> None:
    state = ResumeState(
        config_hash="abc",
        next_block=2,
        blocks=3,
        hidden=hidden_file(1),
        files={block_file(0): 10, block_file(1): 11, hidden_file(1): 12},
        records=[LayerRecord(block=0, name="model.layers.0.mlp.down_proj", out_features=8, in_features=16,
                             status="pruned", recon_error=0.25, density=0.5)],
        calibration="c4: 4 x 64",
        calibration_source=DataSource(kind="offline"),
        refinement=(BlockRefinement(block=0, error_before=0.3, error_after=0.2, kept=True, steps=4, seconds=1.5),),
    )  # fmt: skip
    written = json.loads(json.dumps(state.to_json()))
    assert written["schema_version"] == PRUNE_STATE_VERSION and "version" not in written
    assert ResumeState.from_json(written, RESUME_STATE_FILE) == state
    legacy = {("version" if key == "schema_version" else key): value for key, value in written.items()}
    assert ResumeState.version_of(legacy) == PRUNE_STATE_VERSION
    assert ResumeState.from_json(legacy, RESUME_STATE_FILE) == state
    with pytest.raises(SchemaError, match=r"state\.json lacks or mistypes 'files'"):
        ResumeState.from_json({k: v for k, v in written.items() if k != "files"}, RESUME_STATE_FILE)


def _sparsity_record() -> SparsityRecord:
    from tsenor_cli.pattern import SparsityPattern

    records = [
        LayerRecord(0, "model.layers.0.mlp.up_proj", 8, 4, "pruned"),
        LayerRecord(0, "model.layers.0.mlp.experts.gate_up_proj[1]", 8, 4, "pruned", param="x.gate_up_proj", expert=1),
        LayerRecord(0, "model.layers.0.mlp.gate", 1, 4, "ignored", reason="a gate"),
        LayerRecord(1, "model.layers.1.cross_attn.q_proj", 8, 4, "skipped", reason="never runs"),
    ]
    pattern = SparsityPattern.parse("2:4", transposable=True)
    return SparsityRecord.of("wanda", pattern, records, solver="flow", solver_requested="auto")


def test_sparsity_record_round_trips_and_config_json_keeps_a_summary(tmp_path: Path) -> None:
    record = _sparsity_record()
    assert [w.param for w in record.pruned] == ["model.layers.0.mlp.up_proj.weight", "x.gate_up_proj"]
    assert record.pruned[1].expert == 1 and record.pruned[1].shape == (8, 4)
    assert [(w.status, w.reason) for w in record.dense] == [("ignored", "a gate"), ("skipped", "never runs")]
    (tmp_path / CONFIG_FILE).write_text(json.dumps({SPARSITY_KEY: record.summary()}))
    (tmp_path / SPARSITY_FILE).write_text(json.dumps(record.to_json()))
    assert read_sparsity(tmp_path) == record
    summary = record.summary()
    assert (summary["weights_pruned"], summary["weights_dense"], summary["record"]) == (2, 2, SPARSITY_FILE)
    assert "pruned" not in summary and len(json.dumps(summary)) < 400


def test_sparsity_in_config_json_of_older_checkpoints_still_reads(tmp_path: Path) -> None:
    """Before v0.3 config.json held the whole record: `pruned_weights` (v0.2) or `pruned_modules` only."""
    record = _sparsity_record()
    v02 = {
        **record.pattern.metadata(),
        "method": "wanda",
        "solver": "flow",
        "solver_requested": "auto",
        "pruned_modules": list(record.pruned_modules),
        "pruned_weights": [{**w.to_json()} for w in record.pruned],
        "skipped_modules": ["model.layers.1.cross_attn.q_proj"],
        "ignored_modules": ["model.layers.0.mlp.gate"],
        "tsenor_version": "0.2.0",
    }
    (tmp_path / CONFIG_FILE).write_text(json.dumps({SPARSITY_KEY: v02}))
    old = read_sparsity(tmp_path)
    assert old is not None and old.pruned == record.pruned and old.pattern == record.pattern
    assert {(w.name, w.status) for w in old.dense} == {(w.name, w.status) for w in record.dense}
    v01 = {k: v for k, v in v02.items() if k != "pruned_weights"}
    (tmp_path / CONFIG_FILE).write_text(json.dumps({SPARSITY_KEY: v01}))
    oldest = read_sparsity(tmp_path)
    assert oldest is not None
    assert [(w.param, w.shape) for w in oldest.pruned] == [(f"{n}.weight", None) for n in record.pruned_modules]
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"model_type": "llama"}))
    assert read_sparsity(tmp_path) is None


def test_a_missing_or_contradicting_sparsity_file_is_one_error(tmp_path: Path) -> None:
    from tsenor_cli.errors import InputNotFoundError, VerificationError
    from tsenor_cli.pattern import SparsityPattern

    record = _sparsity_record()
    (tmp_path / CONFIG_FILE).write_text(json.dumps({SPARSITY_KEY: record.summary()}))
    with pytest.raises(InputNotFoundError, match=f"lacks {SPARSITY_FILE}"):
        read_sparsity(tmp_path)
    other = {**record.to_json(), **SparsityPattern.parse("4:8", transposable=True).metadata()}
    (tmp_path / SPARSITY_FILE).write_text(json.dumps(other))
    with pytest.raises(VerificationError, match="record different patterns"):
        read_sparsity(tmp_path)
    (tmp_path / SPARSITY_FILE).write_text(json.dumps({**record.to_json(), "schema_version": 9}))
    with pytest.raises(SchemaError, match="upgrade tsenor"):
        read_sparsity(tmp_path)
