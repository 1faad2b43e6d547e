"""Block refinement (`tsenor prune --refine block`, pruning/block/refine.py): the mask held exactly in fp32 and
bf16, the error never worse, the pattern kept for every method, resume inside a refinement, two
processes against one, recipe and sweep keys, bad options."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers_cli import invoke
from helpers_faults import Killed
from helpers_tiny import random_causal_lm, refine_config

from tsenor_cli.errors import UsageError
from tsenor_cli.models.structure import discover_structure
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block import refine
from tsenor_cli.pruning.block.refine import RefineJob, block_masks, refine_block
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.plan.plan import plan_model
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.pruning.settings.config import RefineConfig
from tsenor_cli.pruning.settings.recipe import build_config, validate_recipe
from tsenor_cli.replay import capture_block_inputs, run_block
from tsenor_cli.runfiles import PRUNE_FILE, RESUME_DIR, RESUME_STATE_FILE, PruneReport
from tsenor_cli.settings import RunContext
from tsenor_cli.sweep.spec import load_sweep

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=2)


_cfg = refine_config


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _report(output: Path) -> PruneReport:
    return PruneReport.from_json(json.loads((output / PRUNE_FILE).read_text()))


def _pruned_block(dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
    """A random 1-block LLaMA in `dtype` on `device`: (block, call, inputs (6, 16, 64), dense targets, masks),
    half of each linear's weights zeroed at random (the mechanism does not depend on the pattern)."""
    model = random_causal_lm(num_layers=1, vocab_size=256).to(dtype)
    structure = discover_structure(model)
    ids = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(structure, ids, device)
    block, call = structure.blocks[0].to(device), captured.calls[0].to(device)
    targets = torch.empty_like(captured.hidden)
    run_block(block, captured.hidden, call, targets)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in LINEARS:
            weight = block.get_submodule(name).weight
            weight.masked_fill_((torch.rand(weight.shape, generator=gen) < 0.5).to(device), 0.0)
    masks = block_masks(block, structure.full_name(0, ""), [structure.full_name(0, f"{n}.weight") for n in LINEARS])
    return block, call, captured.hidden, targets, masks


def _block_error(block: Any, call: Any, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    out = torch.empty_like(inputs)
    run_block(block, inputs, call, out)
    return float((out.double() - targets.double()).square().sum() / targets.double().square().sum())


# ---------------------------------------------------------------- the block, unit level


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refinement_holds_the_mask_exactly_and_lowers_the_block_error(dtype: torch.dtype, device: torch.device) -> None:
    block, call, inputs, targets, masks = _pruned_block(dtype, device)
    pruned = {name: p.detach().clone() for name, p in block.named_parameters()}
    outputs = torch.full_like(inputs, float("nan"))
    cfg = RefineConfig("block", 3, 1e-3)
    record = refine_block(RefineJob(block, 0, inputs, call, targets, cfg, 0, device, masks, outputs=outputs))
    assert record.kept and record.error_after < record.error_before and record.steps == 3 * 2  # 6 samples, 4 a step
    rerun = torch.empty_like(inputs)
    run_block(block, inputs, call, rerun, device)
    assert torch.equal(outputs, rerun)  # what the engine would compute: it skips that forward pass
    for name, mask in masks.items():
        weight = block.get_parameter(name).detach()
        assert weight.dtype == dtype
        assert torch.equal(weight == 0, mask), name  # zero exactly where pruned, nowhere else
        assert not torch.equal(weight[~mask], pruned[name][~mask]), name  # the kept weights trained
    # The recorded errors are those of the block as the run keeps it (its own dtype).
    assert record.error_after == pytest.approx(_block_error(block, call, inputs, targets), rel=1e-6)
    assert all(p.grad is None for p in block.parameters())


def test_a_refinement_that_does_not_help_leaves_the_pruned_block_bit_identical() -> None:
    cpu = torch.device("cpu")
    block, call, inputs, targets, masks = _pruned_block(torch.float32, cpu)
    pruned = {name: p.detach().clone() for name, p in block.named_parameters()}
    record = refine_block(RefineJob(block, 0, inputs, call, targets, RefineConfig("block", 1, 10.0), 0, cpu, masks))
    assert not record.kept and record.error_after > record.error_before
    assert all(torch.equal(p, pruned[name]) for name, p in block.named_parameters())
    assert record.error_before == pytest.approx(_block_error(block, call, inputs, targets), rel=1e-9)


def test_the_sample_order_is_drawn_from_the_seed_and_the_block() -> None:
    cpu = torch.device("cpu")
    results = []
    for seed in (0, 0, 1):
        block, call, inputs, targets, masks = _pruned_block(torch.float32, cpu)
        refine_block(RefineJob(block, 0, inputs, call, targets, RefineConfig("block", 1, 1e-3), seed, cpu, masks))
        results.append(torch.cat([p.detach().reshape(-1) for p in block.parameters()]))
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


@pytest.mark.parametrize(("per_step", "steps_per_epoch"), [(1, 6), (2, 3), (4, 2), (6, 1), (10, 1)])
@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_the_steps_take_the_samples_per_step_and_the_learning_rate_follows_the_schedule(
    per_step: int, steps_per_epoch: int, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 samples, `per_step` a step, 2 epochs: 2·⌈6/per_step⌉ Adam steps, each at the schedule's learning
    rate (cosine: lr·(1 + cos(π t/T))/2 at step t of T, worked by hand for T = 2: lr, lr/2)."""
    cpu = torch.device("cpu")
    block, call, inputs, targets, masks = _pruned_block(torch.float32, cpu)
    rates: list[float] = []
    sizes: list[int] = []
    take = refine._step

    def recording(optimizer: torch.optim.Optimizer) -> None:
        rates.append(optimizer.param_groups[0]["lr"])
        take(optimizer)

    def sizing(job: RefineJob, stage: Any, rows: list[int], divisor: float) -> None:
        sizes.append(len(rows))
        accumulate(job, stage, rows, divisor)

    accumulate = refine._accumulate
    monkeypatch.setattr(refine, "_step", recording)
    monkeypatch.setattr(refine, "_accumulate", sizing)
    cfg = RefineConfig("block", 2, 1e-3, samples_per_step=per_step, schedule=schedule)
    record = refine_block(RefineJob(block, 0, inputs, call, targets, cfg, 0, cpu, masks))
    total = 2 * steps_per_epoch
    assert record.steps == total == len(rates)
    assert sum(sizes) == 2 * 6 and max(sizes) == min(per_step, 6)
    if schedule == "constant":
        assert rates == [1e-3] * total
    else:
        expected = [1e-3 * (1 + math.cos(math.pi * t / total)) / 2 for t in range(total)]
        assert rates == pytest.approx(expected, rel=1e-12)
        if total == 2:
            assert rates == pytest.approx([1e-3, 5e-4], rel=1e-12)


def test_the_schedule_the_step_size_and_the_dtype_change_the_result_and_repeat_exactly() -> None:
    cpu = torch.device("cpu")
    results = {}
    for name, cfg in {
        "default": RefineConfig("block", 2, 1e-3),
        "default again": RefineConfig("block", 2, 1e-3),
        "one a step": RefineConfig("block", 2, 1e-3, samples_per_step=1),
        "cosine": RefineConfig("block", 2, 1e-3, schedule="cosine"),
        "bf16": RefineConfig("block", 2, 1e-3, dtype="bf16"),
        "bf16 again": RefineConfig("block", 2, 1e-3, dtype="bf16"),
    }.items():
        block, call, inputs, targets, masks = _pruned_block(torch.float32, cpu)
        record = refine_block(RefineJob(block, 0, inputs, call, targets, cfg, 0, cpu, masks))
        assert record.kept
        results[name] = torch.cat([p.detach().reshape(-1) for p in block.parameters()])
    assert torch.equal(results["default"], results["default again"])
    assert not torch.equal(results["default"], results["one a step"])
    assert not torch.equal(results["default"], results["cosine"])
    # bf16 autocast changes the gradients (it is on), repeats exactly, and keeps float32 weights.
    assert not torch.equal(results["default"], results["bf16"])
    assert torch.equal(results["bf16"], results["bf16 again"]) and results["bf16"].dtype == torch.float32


def test_the_weighted_squares_worked_by_hand() -> None:
    diff = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    assert torch.equal(refine._squares(diff, None), diff.square())
    assert torch.equal(refine._squares(diff, torch.tensor([2.0, 1.0])), torch.tensor([[2.0, 4.0], [18.0, 0.25]]))
    metric = torch.tensor([[2.0, 1.0], [1.0, 3.0]])  # rows' sums: e1ᵀMe1 = 2 − 4 + 12 = 10, e2ᵀMe2 = 18 + 3 + 0.75
    assert refine._squares(diff, metric).sum(-1).tolist() == [10.0, 21.75]


@pytest.mark.parametrize("kind", ["ones", "identity"])
def test_unit_feature_weights_refine_as_no_weights(kind: str) -> None:
    """All-one weights (H,) or the identity metric (H, H) are the plain objective: the same errors and the
    same weights after training (to float32 rounding: the metric's product sums in another order)."""
    cpu = torch.device("cpu")
    results = []
    for weights in (None, torch.ones(64) if kind == "ones" else torch.eye(64)):
        block, call, inputs, targets, masks = _pruned_block(torch.float32, cpu)
        cfg = RefineConfig("block", 2, 1e-3)
        record = refine_block(RefineJob(block, 0, inputs, call, targets, cfg, 0, cpu, masks, weights=weights))
        results.append((record, torch.cat([p.detach().reshape(-1) for p in block.parameters()])))
    (plain, trained), (weighted, trained_w) = results
    assert weighted.error_before == pytest.approx(plain.error_before, rel=1e-12)
    assert weighted.error_after == pytest.approx(plain.error_after, rel=1e-5)
    torch.testing.assert_close(trained_w, trained, rtol=1e-4, atol=1e-6)


def test_feature_weights_steer_the_refinement_towards_the_heavy_features() -> None:
    """Weighting the first half of the output features 100 to 1 leaves them a smaller share of the error
    than the plain objective does."""
    cpu = torch.device("cpu")
    heavy = torch.cat([torch.full((32,), 100.0), torch.ones(32)])
    shares = []
    for weights in (None, heavy):
        block, call, inputs, targets, masks = _pruned_block(torch.float32, cpu)
        cfg = RefineConfig("block", 3, 1e-3)
        refine_block(RefineJob(block, 0, inputs, call, targets, cfg, 0, cpu, masks, weights=weights))
        out = torch.empty_like(inputs)
        run_block(block, inputs, call, out)
        squares = (out - targets).double().square().sum((0, 1))
        shares.append(float(squares[:32].sum() / squares.sum()))
    assert shares[1] < shares[0]


# ---------------------------------------------------------------- whole runs


@pytest.mark.parametrize(
    ("method", "pattern"),
    [
        ("alps", SparsityPattern.from_nm(8, 16, transposable=True)),
        ("sparsegpt", SparsityPattern.from_nm(2, 4, transposable=False)),
        ("wanda", SparsityPattern.unstructured(0.5)),
        ("magnitude", SparsityPattern.from_nm(8, 16, transposable=True)),
    ],
)
def test_refined_runs_keep_the_pattern_and_never_raise_a_block_error(
    method: str, pattern: SparsityPattern, tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    report = prune_model(_cfg(tiny, calib, out, method=method, matrix=MatrixPruneConfig(pattern)), data_ctx)
    assert [b.block for b in report.refinement] == [0, 1]
    for b in report.refinement:
        assert b.error_after < b.error_before if b.kept else b.error_after >= b.error_before
    assert any(b.kept for b in report.refinement)
    assert verify_checkpoint(out).ok
    written = _report(out)
    assert written.refinement == report.refinement and written.settings["refine"]["mode"] == "block"
    assert "## Block refinement" in (out / "tsenor_report.md").read_text()


def test_refinement_that_never_helps_gives_the_checkpoint_of_a_run_without_it(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    plain = prune_model(_cfg(tiny, calib, tmp_path / "plain", refine=RefineConfig()), data_ctx)
    assert plain.refinement == () and "refine" not in plain.settings
    diverging = prune_model(_cfg(tiny, calib, tmp_path / "diverging", refine=RefineConfig("block", 1, 10.0)), data_ctx)
    assert [b.kept for b in diverging.refinement] == [False, False]
    assert _sha(tmp_path / "plain" / "model.safetensors") == _sha(tmp_path / "diverging" / "model.safetensors")


def test_the_block_outputs_a_kept_refinement_wrote_are_those_the_engine_would_compute(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept refinement's last error pass writes the next block's inputs, and the engine skips its own
    run of the block; a run that drops those outputs and runs the block again ends bit-identical."""
    from tsenor_cli.pruning.run import run as pruning_run

    forwards: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> None:
        forwards.append(int(args[1].shape[0]))
        run_block(*args, **kwargs)

    monkeypatch.setattr(pruning_run, "run_block", counted)
    shortcut = prune_model(_cfg(tiny, calib, tmp_path / "shortcut"), data_ctx)
    assert [b.kept for b in shortcut.refinement] == [True, True]
    skipping = len(forwards)
    forwards.clear()

    def rerun(job: RefineJob, *args: Any) -> tuple[list[Any], bool]:
        records, _ = refine.refine_pruned_block(dataclasses.replace(job, outputs=None), *args)
        return records, False

    monkeypatch.setattr(pruning_run, "refine_pruned_block", rerun)
    again = prune_model(_cfg(tiny, calib, tmp_path / "again"), data_ctx)
    assert len(forwards) == skipping + 2  # one run of each of the two blocks more
    assert [(b.error_before, b.error_after) for b in again.refinement] == [
        (b.error_before, b.error_after) for b in shortcut.refinement
    ]
    assert [r.recon_error for r in again.layers] == [r.recon_error for r in shortcut.layers]
    assert _sha(tmp_path / "again" / "model.safetensors") == _sha(tmp_path / "shortcut" / "model.safetensors")


def test_a_run_killed_inside_a_refinement_resumes_to_the_same_checkpoint(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = tmp_path / "reference"
    full = prune_model(_cfg(tiny, calib, reference), data_ctx)
    out = tmp_path / "out"
    steps = [0]
    step = refine._step

    def killed_in_block_1(optimizer: torch.optim.Optimizer) -> None:
        steps[0] += 1
        if steps[0] == full.refinement[0].steps + 2:  # the second step of block 1
            raise Killed
        step(optimizer)

    with monkeypatch.context() as patch:
        patch.setattr(refine, "_step", killed_in_block_1)
        with pytest.raises(Killed):
            prune_model(_cfg(tiny, calib, out, resume=True), data_ctx)
    assert json.loads((out / RESUME_DIR / RESUME_STATE_FILE).read_text())["next_block"] == 1
    resumed = prune_model(_cfg(tiny, calib, out, resume=True), data_ctx)
    assert resumed.resumed_from_block == 1
    assert _sha(out / "model.safetensors") == _sha(reference / "model.safetensors")

    def without_seconds(report: PruneReport) -> list[tuple[Any, ...]]:
        return [(b.block, b.error_before, b.error_after, b.kept, b.steps) for b in report.refinement]

    assert without_seconds(resumed) == without_seconds(full)


def test_a_streamed_run_refines_as_a_whole_load_also_when_resumed(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--stream reads each block from the checkpoint when the loop reaches it; the dense block runs on the
    dense stream after that read and before pruning, so the refined checkpoint and records are the whole
    load's, and a streamed run killed inside block 1's refinement resumes (the dense stream from its
    resume state) to the same files."""

    def without_seconds(report: PruneReport) -> list[tuple[Any, ...]]:
        return [(b.block, b.error_before, b.error_after, b.kept, b.steps) for b in report.refinement]

    whole = prune_model(_cfg(tiny, calib, tmp_path / "whole"), data_ctx)
    streamed = prune_model(_cfg(tiny, calib, tmp_path / "streamed", stream=True), data_ctx)
    assert any(b.kept for b in whole.refinement)
    assert without_seconds(streamed) == without_seconds(whole)
    assert _sha(tmp_path / "streamed" / "model.safetensors") == _sha(tmp_path / "whole" / "model.safetensors")
    out = tmp_path / "killed"
    steps = [0]
    step = refine._step

    def killed_in_block_1(optimizer: torch.optim.Optimizer) -> None:
        steps[0] += 1
        if steps[0] == whole.refinement[0].steps + 2:
            raise Killed
        step(optimizer)

    with monkeypatch.context() as patch:
        patch.setattr(refine, "_step", killed_in_block_1)
        with pytest.raises(Killed):
            prune_model(_cfg(tiny, calib, out, resume=True, stream=True), data_ctx)
    resumed = prune_model(_cfg(tiny, calib, out, resume=True, stream=True), data_ctx)
    assert resumed.resumed_from_block == 1 and without_seconds(resumed) == without_seconds(whole)
    assert _sha(out / "model.safetensors") == _sha(tmp_path / "whole" / "model.safetensors")


@pytest.mark.parametrize(
    "schedule",
    [
        RefineConfig("block", 2, 1e-3),
        # 3 samples a step across the ranks' 3 and 2 samples, the learning rate changing every step.
        RefineConfig("block", 2, 1e-3, samples_per_step=3, schedule="cosine"),
        # bf16 autocast: each rank's per-sample gradients are the one process's, bit for bit, too.
        RefineConfig("block", 2, 1e-3, dtype="bf16"),
    ],
    ids=["default", "3-a-step-cosine", "bf16"],
)
def test_two_processes_refine_as_one(
    schedule: RefineConfig, tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """The per-sample gradients are added in the step's order on every rank, the errors in sample order:
    the checkpoint and the records are one process's, bit for bit (Adam would amplify any fp32 rounding
    difference in a near-zero gradient to a step of the learning rate's size)."""
    from test_distributed import _spawn

    single = tmp_path / "single"
    one = prune_model(_cfg(tiny, calib, single, refine=schedule), data_ctx)
    dist = _cfg(tiny, calib, tmp_path / "dist", refine=schedule)
    outcomes = _spawn(tmp_path, [{"name": "refine", "cfg": dist}], data_ctx)
    assert [o["refine"] for o in outcomes] == ["ok", "ok"], outcomes
    two = _report(tmp_path / "dist")
    assert two.settings["processes"] == 2 and any(b.kept for b in two.refinement)
    assert [(b.block, b.error_before, b.error_after, b.kept, b.steps) for b in two.refinement] == [
        (b.block, b.error_before, b.error_after, b.kept, b.steps) for b in one.refinement
    ]
    assert _sha(single / "model.safetensors") == _sha(tmp_path / "dist" / "model.safetensors")


# ---------------------------------------------------------------- options, recipes, sweeps, plan


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--refine", "layer"], "--refine 'layer' is not one of none, block"),
        (["--refine", "block", "--refine-epochs", "0"], "--refine-epochs 0 must be a whole number >= 1"),
        (["--refine", "block", "--refine-lr", "0"], "--refine-lr 0.0 must be a positive number"),
        (["--refine", "block", "--refine-lr", "nan"], "--refine-lr nan must be a positive number"),
        (
            ["--refine", "block", "--refine-samples-per-step", "0"],
            "--refine-samples-per-step 0 must be a whole number >= 1",
        ),
        (["--refine", "block", "--refine-schedule", "linear"], "--refine-schedule 'linear' is not one of constant"),
        (["--refine", "block", "--refine-dtype", "fp16"], "--refine-dtype 'fp16' is not one of fp32, bf16"),
    ],
)
def test_bad_refine_options_are_one_line_and_write_nothing(
    flags: list[str], message: str, tiny: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = invoke(["prune", "--model", str(tiny), "--nm", "8:16", "--output", str(out), *flags])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, UsageError) and message in str(result.exception)
    assert "\n" not in str(result.exception) and not out.exists()


def test_recipe_and_sweep_keys(tmp_path: Path) -> None:
    recipe = validate_recipe({"refine": "block", "refine-epochs": 3, "refine_lr": 1}, "r.yaml")
    assert recipe == {"refine": "block", "refine_epochs": 3, "refine_lr": 1.0}
    cfg = build_config({"model": "m", "nm": "16:32", **recipe}, force=False, resume=True, command="")
    assert cfg.refine == RefineConfig("block", 3, 1.0)
    assert cfg.result_fields()["refine"] == {"mode": "block", "epochs": 3, "lr": 1.0, "samples_per_step": 4}
    tuned = validate_recipe(
        {"refine": "block", "refine_samples_per_step": 1, "refine_schedule": "cosine", "refine_dtype": "bf16"}, "r.yaml"
    )
    tuned_cfg = build_config({"model": "m", "nm": "16:32", **tuned}, force=False, resume=True, command="")
    assert tuned_cfg.refine == RefineConfig("block", samples_per_step=1, schedule="cosine", dtype="bf16")
    assert tuned_cfg.result_fields()["refine"] == {
        "mode": "block",
        "epochs": 2,
        "lr": 1e-3,
        "samples_per_step": 1,
        "schedule": "cosine",
        "dtype": "bf16",
    }
    default = build_config({"model": "m", "nm": "16:32"}, force=False, resume=True, command="")
    assert not default.refine.on and "refine" not in default.result_fields()
    with pytest.raises(UsageError, match="refine_epochs must be a int"):
        validate_recipe({"refine_epochs": "2"}, "r.yaml")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "base": {"model": "m", "nm": "16:32", "refine_lr": 0.001},
                "axes": {"refine": ["none", "block"], "refine_epochs": [1, 2]},
                "name": "{refine}-{refine_epochs}",
            }
        )
    )
    runs = load_sweep(sweep).runs()
    assert [r.name for r in runs] == ["none-1", "none-2", "block-1", "block-2"]
    assert runs[3].recipe_dict()["refine_epochs"] == 2 and runs[3].recipe_dict()["refine_lr"] == 0.001
    study = load_sweep(Path(__file__).parents[1] / "configs" / "sweeps" / "refine.yaml").runs()
    assert len(study) == 1 + 2 * 2 * 3 * 2 and "alps-16x32-t-block" in [r.name for r in study]
    sweep.write_text(yaml.safe_dump({"base": {"model": "m", "nm": "16:32"}, "axes": {"refine_epochs": [0]}}))
    with pytest.raises(UsageError, match="--refine-epochs 0"):
        load_sweep(sweep)


def test_the_plan_counts_the_dense_stream_and_the_training_memory(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    plain = plan_model(_cfg(tiny, calib, tmp_path / "o", refine=RefineConfig(), nsamples=8), data_ctx)
    refined = plan_model(_cfg(tiny, calib, tmp_path / "o", nsamples=8), data_ctx)
    a, b = plain.device_memory[0], refined.device_memory[0]
    width, hidden = 4, 64  # fp32, the tiny model's hidden size
    assert a.refine == 0 and b.activations - a.activations == 8 * 32 * hidden * width
    block = sum(p.numel() for p in random_causal_lm(num_layers=1).model.layers[0].parameters())
    assert b.refine > block * (4 * 4 + width)  # float32 weights, gradients, two moments, the copy before
    assert refined.resume_bytes - plain.resume_bytes == 2 * 8 * 32 * hidden * width
    assert not (tmp_path / "o").exists()


def test_the_study_table_divides_by_the_baseline_and_lists_each_block(tmp_path: Path) -> None:
    import importlib.util

    from tsenor_cli.runfiles import (
        EVAL_FILE,
        BlockRefinement,
        EvalReport,
        PerplexityRecord,
        TaskScore,
        ZeroShotResult,
    )

    spec = importlib.util.spec_from_file_location("refine_table", Path(__file__).parents[1] / "scripts/refine_table.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def run(
        name: str,
        seconds: float,
        ppl: float,
        refine: dict[str, Any] | None,
        blocks: tuple[Any, ...],
        zeroshot: ZeroShotResult | None = None,
        resumed_from_block: int | None = None,
    ) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        settings = {"refine": refine} if refine else {}
        pattern = SparsityPattern.from_nm(16, 32, transposable=True)
        report = PruneReport(
            "sparsegpt", pattern, 0.5, settings, (), "c", seconds, None, None, {}, resumed_from_block, refinement=blocks
        )
        (folder / PRUNE_FILE).write_text(json.dumps(report.to_json()))
        record = PerplexityRecord(ppl, 1.0, 512, 1, 512, "wt2", None, 1.0)
        evaluation = EvalReport("m", "m", "llama", "float32", "cpu", 512, 1, {"wikitext2": record}, zeroshot, {}, 1.0)
        (folder / EVAL_FILE).write_text(json.dumps(evaluation.to_json()))
        return folder

    base = run("base", 100.0, 50.0, None, ())
    blocks = (BlockRefinement(0, 0.2, 0.1, True, 4, 30.0), BlockRefinement(1, 0.1, 0.3, False, 4, 20.0))
    refined = run("e1", 150.0, 40.0, {"mode": "block", "epochs": 1, "lr": 1e-3}, blocks)
    text = script.tables(base, [refined])
    assert "| base | none | 50.00 | 100 | 1.00 | - | - |" in text
    assert "| e1 | 1 epoch(s), lr 0.001 | 40.00 | 150 | 1.50 | 50 | 1/2 |" in text
    assert "| 0 | 0.2000 → 0.1000 |" in text and "| 1 | 0.1000 → 0.3000 (not kept) |" in text
    # --plot draws the refined run's errors (a PNG) and leaves the table as printed.
    plot = tmp_path / "refine.png"
    assert script.main([str(base), str(refined), "--plot", str(plot), "--output", str(tmp_path / "t.md")]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "t.md").read_text() == text
    # Without a refined run there is nothing to draw, and no file.
    assert script.main([str(base), str(base), "--plot", str(tmp_path / "none.png")]) == 0
    assert not (tmp_path / "none.png").exists()
    # A zero-shot average adds a column, "-" for the runs without one.
    scores = tuple(TaskScore(t, acc, None, None, None, 100, None, "1") for t, acc in (("piqa", 0.6), ("rte", 0.5)))
    scored = run("zs", 120.0, 45.0, None, (), ZeroShotResult(scores, 0.55, "acc", 0, 100, "offline", "0.4"))
    text = script.tables(base, [scored])
    assert "| run | refine | wikitext2 ppl | zero-shot avg | prune s |" in text
    assert "| base | none | 50.00 | - | 100 | 1.00 | - | - |" in text
    assert "| zs | none | 45.00 | 55.00 (2 tasks, limit 100) | 120 | 1.20 | - | - |" in text
    # A resumed prune's seconds are its last attempt's: no ratio from it, nor against a resumed baseline.
    resumed = run("resumed", 40.0, 40.0, {"mode": "block", "epochs": 1, "lr": 1e-3}, blocks, None, 24)
    text = script.tables(base, [resumed])
    assert "| resumed | 1 epoch(s), lr 0.001 | 40.00 | 40 (last attempt, resumed at block 24) | - | 50 | 1/2 |" in text
    text = script.tables(resumed, [refined])
    assert "| e1 | 1 epoch(s), lr 0.001 | 40.00 | 150 | - | 50 | 1/2 |" in text
