"""Methods that need no data take no calibration pass (issue 47, item 3; `PrunerSpec.needs_data`).

`tsenor prune smollm2-135m --nm 2:4 --method magnitude` pushed the default 128 × 2048 tokens through
every block (1.1 GiB of activations in the dry run) and gathered statistics it never read: 1 block of
30 after 300 s. Now a method that reads no data reads no text (a run without any data source works),
its blocks run on one stand-in sample of a few tokens (for the watch that shows each weight's
orientation and to hand each block its input), no statistics are gathered, and the dry run estimates
no activations of size. With `--refine block` the calibration is read for the refinement alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import LOCAL_CTX, make_tiny_llama

from tsenor_cli.data.calibration import STAND_IN_SEQLEN
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block import engine
from tsenor_cli.pruning.methods import magnitude
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.plan.plan import plan_model
from tsenor_cli.pruning.plan.render import plan_lines
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.settings.config import PruneConfig, RefineConfig
from tsenor_cli.runfiles import PRUNE_FILE

TWO_FOUR = MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True))


def _cfg(model: Path, output: Path | None, method: str = "magnitude", **changes: Any) -> PruneConfig:
    return PruneConfig(model=str(model), matrix=TWO_FOUR, method=method, output=output, **changes)


def _no_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any statistics pass over the calibration inputs fails the test."""

    def fail(*_args: Any, **_kwargs: Any) -> None:
        pytest.fail("a statistics pass ran for a method that reads no data")

    for name in ("group_input_stats", "group_inputs", "unit_input_stats"):
        monkeypatch.setattr(engine, name, fail)


def test_the_dry_run_shows_no_calibration_and_no_activations(tiny_llama: Callable[..., Path]) -> None:
    """Default flags (c4, 128 × 2048, here capped at the model's 512 positions): wanda's plan holds the
    activations, magnitude's holds one stand-in sample of a few tokens per process."""
    model = tiny_llama(num_layers=2)
    magnitude_plan = plan_model(_cfg(model, None), LOCAL_CTX)
    wanda_plan = plan_model(_cfg(model, None, "wanda"), LOCAL_CTX)
    assert not magnitude_plan.calibrate and wanda_plan.calibrate
    assert (magnitude_plan.calibration_samples, magnitude_plan.calibration_seqlen) == (1, STAND_IN_SEQLEN)
    assert (wanda_plan.calibration_samples, wanda_plan.calibration_seqlen) == (128, 512)
    hidden = 64 * 4  # width × fp32 bytes
    stand_in = 2 * 1 * STAND_IN_SEQLEN * hidden  # (S, T, H) entering and leaving a block: 2 KiB
    assert magnitude_plan.device_memory[0].activations <= stand_in
    assert wanda_plan.device_memory[0].activations >= 2 * 128 * 512 * hidden
    assert magnitude_plan.host_memory.tokens <= 16 * STAND_IN_SEQLEN  # int64 ids
    cfg = _cfg(model, None)
    first = next(iter(plan_lines(magnitude_plan, cfg)))
    assert first.endswith("no calibration (magnitude reads no data)") and "c4" not in first
    assert next(iter(plan_lines(wanda_plan, _cfg(model, None, "wanda")))).endswith("calibration c4 128×512")
    result = invoke(["prune", str(model), "--nm", "2:4", "--method", "magnitude", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["calibration"] is False


def test_a_magnitude_run_reads_no_data_gathers_no_statistics_and_prunes_by_the_weights(
    tiny_llama: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No data folder and the hub off: the default calibration text c4 has no source, and the run needs
    none (it used to refuse or read it). Each pruned matrix is the magnitude prune of its dense weight;
    the records carry no reconstruction error (no inputs to measure it on) and the report says no data
    was read."""
    from safetensors.torch import load_file

    model = tiny_llama(num_layers=2)
    _no_statistics(monkeypatch)
    out = tmp_path / "out"
    monkeypatch.delenv("TSENOR_DATA_DIR", raising=False)
    result = invoke(["prune", str(model), "--nm", "2:4", "--method", "magnitude", "--output", str(out), "--offline"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / PRUNE_FILE).read_text())
    assert report["calibration_source"]["kind"] == "none"
    assert report["calibration"].startswith("none (magnitude reads no data")
    pruned = [layer for layer in report["layers"] if layer["status"] == "pruned"]
    assert len(pruned) == 14 and all(layer["recon_error"] is None for layer in pruned)
    dense, sparse = load_file(model / "model.safetensors"), load_file(out / "model.safetensors")
    for layer in pruned:
        key = f"{layer['name']}.weight"
        expected = magnitude.prune(dense[key].float(), None, TWO_FOUR).weight
        assert torch.equal(sparse[key], expected.to(sparse[key].dtype)), key


def test_a_magnitude_run_equals_the_same_run_with_real_calibration_data(
    tiny_llama: Callable[..., Path], tmp_path: Path, calibration_text: Path
) -> None:
    """The weights do not depend on the data: the stand-in run writes the checkpoint a run on real text
    wrote (`--refine block` off), whole or streamed."""
    model = tiny_llama(num_layers=2)
    outputs = {}
    for stream in (True, False):
        out = tmp_path / f"stream-{stream}"
        cfg = _cfg(model, out, calib_data=str(calibration_text), nsamples=4, seqlen=16, stream=stream)
        prune_model(cfg, LOCAL_CTX)
        outputs[stream] = (out / "model.safetensors").read_bytes()
    assert outputs[True] == outputs[False]


def test_refine_block_reads_the_calibration_for_the_refinement_only(
    tiny_llama: Callable[..., Path], tmp_path: Path, calibration_text: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--refine block trains each block towards the dense outputs on the calibration text: the plan reads
    it (its activations are estimated), the run reads it, and still no statistics pass runs."""
    model = tiny_llama(num_layers=2)
    cfg = _cfg(
        model, tmp_path / "out", calib_data=str(calibration_text), nsamples=4, seqlen=16,
        refine=RefineConfig("block", epochs=1),
    )  # fmt: skip
    plan = plan_model(cfg, LOCAL_CTX)
    assert plan.calibrate and plan.calibration_seqlen == 16
    _no_statistics(monkeypatch)
    report = prune_model(cfg, LOCAL_CTX)
    assert report.calibration_source is not None and report.calibration_source.kind == "file"
    assert len(report.refinement) == 2


def test_an_moe_stack_is_pruned_by_magnitude_without_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts of a fused stack (Qwen3-MoE), each from its weights alone, no statistics pass."""
    folder = make_tiny_llama(
        tmp_path / "moe", model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        head_dim=16, num_layers=1,
    )  # fmt: skip
    _no_statistics(monkeypatch)
    report = prune_model(_cfg(folder, tmp_path / "out"), LOCAL_CTX)
    experts = [r for r in report.layers if r.expert is not None and r.status == "pruned"]
    assert len(experts) == 2 * 4  # gate_up and down, 4 experts each
    assert all(r.recon_error is None and r.density == pytest.approx(0.5) for r in experts)


@pytest.mark.slow
@pytest.mark.realmodel
def test_a_default_magnitude_prune_of_smollm2_reads_no_calibration(tmp_path: Path) -> None:
    """The audit's command with default flags (128 × 2048 calibration asked for, none read; it had done 1
    block of 30 after 300 s): the run reads no text, its blocks run on the stand-in's one sample of a few
    tokens, and no statistics are gathered (no reconstruction error to report). Its speed is measured, not
    tested (docs/reliability.md: seconds per block on the 2-core machine)."""
    from helpers_tiny import smollm2_dir

    cfg = _cfg(smollm2_dir(), tmp_path / "x")  # every other setting at its default
    assert (cfg.nsamples, cfg.seqlen, cfg.calib_data) == (128, 2048, "c4")
    report = prune_model(cfg, LOCAL_CTX)
    assert report.calibration_source is not None and report.calibration_source.kind == "none"
    assert "1×4 stand-in tokens" in report.calibration, report.calibration
    pruned = [r for r in report.layers if r.status == "pruned"]
    assert len(pruned) == 30 * 7 and all(r.recon_error is None for r in pruned)


def test_an_interrupted_magnitude_run_resumes_to_the_same_checkpoint(
    tiny_llama: Callable[..., Path], tmp_path: Path
) -> None:
    """The resume state holds the stand-in sample (one row) as any run's hidden states; the rerun continues
    from it and writes the uninterrupted run's bytes."""
    from tsenor_cli.errors import Interrupted

    model = tiny_llama(num_layers=2)
    reference, out = tmp_path / "reference", tmp_path / "out"
    prune_model(_cfg(model, reference, resume=False), LOCAL_CTX)

    def ctrl_c(index: int) -> None:
        if index == 0:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="the resume state holds block 1"):
        prune_model(_cfg(model, out), LOCAL_CTX, after_block=ctrl_c)
    report = prune_model(_cfg(model, out), LOCAL_CTX)
    assert report.resumed_from_block == 1
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
