"""Sub-block refinement (`--refine-regions sub-blocks`, pruning/block/regions.py): the regions found by
watching each family's forward (attention then MLP, split where the residual stream is read), an exact
hand reference for LLaMA's boundary, the fallback to the whole block, and whole runs through the CLI:
the block error falls, streamed equals whole, a killed run resumes to the same bytes, two processes
refine as one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_faults import Killed
from helpers_tiny import (
    make_tiny_llama,
    make_tiny_model,
    random_causal_lm,
    random_model,
    refine_config,
    sparsegpt_config,
)
from test_moe import MOE

from tsenor_cli.errors import UsageError
from tsenor_cli.models.structure import discover_structure
from tsenor_cli.pruning.block import refine
from tsenor_cli.pruning.block.refine import RefineJob, block_masks, dense_pass, refine_block
from tsenor_cli.pruning.block.regions import Regions, find_regions
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.pruning.settings.config import PruneConfig, RefineConfig
from tsenor_cli.replay import capture_block_inputs, run_block
from tsenor_cli.runfiles import PRUNE_FILE, PruneReport
from tsenor_cli.settings import RunContext

CPU = torch.device("cpu")
SUB = RefineConfig("block", 2, 1e-3, regions="sub-blocks")
# family → (config overrides, the children of the attention region, of the MLP region): what the forward
# shows, written out by hand for each family the tests build.
FAMILIES: dict[str, tuple[dict[str, Any], set[str], set[str]]] = {
    "llama": ({}, {"input_layernorm", "self_attn"}, {"post_attention_layernorm", "mlp"}),
    "gpt2": ({}, {"ln_1", "attn"}, {"ln_2", "mlp"}),
    "mixtral": (MOE["mixtral"], {"input_layernorm", "self_attn"}, {"post_attention_layernorm", "mlp"}),
    "qwen2_moe": (MOE["qwen2_moe"], {"input_layernorm", "self_attn"}, {"post_attention_layernorm", "mlp"}),
    # Post-norms read the attention's output before the residual addition: the boundary is after them.
    "gemma2": (
        {"head_dim": 16},
        {"input_layernorm", "self_attn", "post_attention_layernorm"},
        {"pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"},
    ),
    "olmo2": ({}, {"self_attn", "post_attention_layernorm"}, {"mlp", "post_feedforward_layernorm"}),
}


def _first_block(model: Any, index: int = 0, samples: int = 3) -> tuple[Any, Any, torch.Tensor]:
    structure = discover_structure(model)
    ids = torch.randint(3, 200, (samples, 12), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(structure, ids, CPU)
    hidden = captured.hidden
    for before in range(index):
        out = torch.empty_like(hidden)
        run_block(structure.blocks[before], hidden, captured.calls[before], out)
        hidden = out
    return structure.blocks[index], captured.calls[index], hidden


def _children(names: tuple[str, ...]) -> set[str]:
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_regions_are_attention_then_mlp(family: str) -> None:
    overrides, attention, mlp = FAMILIES[family]
    block, call, hidden = _first_block(random_causal_lm(family, **overrides))
    regions = find_regions(block, call, hidden[:1])
    assert isinstance(regions, Regions) and len(regions.boundaries) == 1
    assert [_children(p) for p in regions.params] == [attention, mlp]
    every = sorted(n for n, p in block.named_parameters() if p.is_floating_point())
    assert sorted(regions.params[0] + regions.params[1]) == every  # each parameter trains in one region


def test_llamas_boundary_is_the_residual_stream_after_the_attention() -> None:
    """Worked by hand: the dense values at the boundary are h = x + attention(norm(x)), and the block's
    output is h + mlp(norm2(h)), bit for bit."""
    block, call, hidden = _first_block(random_causal_lm("llama"))
    stream = hidden.clone()
    found, values, why = dense_pass(block, stream, call, CPU, SUB)
    assert why is None and found is not None and len(values) == 1
    with torch.no_grad():
        h = values[0]
        assert torch.equal(stream, h + block.mlp(block.post_attention_layernorm(h)))
        mid = block.self_attn(block.input_layernorm(hidden), **call.kwargs)[0]
        assert torch.allclose(h, hidden + mid, atol=1e-6)
    out = torch.empty_like(hidden)
    run_block(block, hidden, call, out)
    assert torch.equal(stream, out)  # the dense stream itself is what the block computes


def test_a_parallel_block_and_an_idle_block_are_refined_whole() -> None:
    """GPT-J's MLP reads the normed input, not the attention's output: no boundary, one line why, and the
    dense stream is the plain run's. Mllama's cross-attention block does not run on text: left alone."""
    block, call, hidden = _first_block(random_causal_lm("gptj", rotary_dim=8))
    stream = hidden.clone()
    found, values, why = dense_pass(block, stream, call, CPU, SUB)
    assert found is None and values == () and why is not None and "\n" not in why
    out = torch.empty_like(hidden)
    run_block(block, hidden, call, out)
    assert torch.equal(stream, out)
    model = random_model("mllama")
    idle, idle_call, idle_hidden = _first_block(model, 1)
    assert idle_call.idle and dense_pass(idle, idle_hidden.clone(), idle_call, CPU, SUB) == (None, (), None)


def test_sub_block_refinement_trains_each_region_and_lowers_the_block_error() -> None:
    block, call, hidden = _first_block(random_causal_lm("llama"), samples=6)
    stream = hidden.clone()
    found, values, _ = dense_pass(block, stream, call, CPU, SUB)
    names = [f"{n}.weight" for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in names:
            weight = block.get_parameter(name)
            weight.masked_fill_(torch.rand(weight.shape, generator=gen) < 0.5, 0.0)
    masks = block_masks(block, "", names)
    pruned = {n: p.detach().clone() for n, p in block.named_parameters()}
    job = RefineJob(block, 0, hidden, call, stream, SUB, 0, CPU, masks, regions=found, region_targets=values)
    record = refine_block(job)
    assert record.kept and record.error_after < record.error_before
    assert record.steps == 2 * 2 * 2  # two regions, two epochs, 6 samples at 4 a step
    for name, mask in masks.items():
        assert torch.equal(block.get_parameter(name) == 0, mask), name
    assert found is not None
    for region in found.params:  # every region trained
        assert any(not torch.equal(block.get_parameter(n), pruned[n]) for n in region)


# ---------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=2)


def _cfg(model: Path, calib: Path, output: Path, **changes: Any) -> PruneConfig:
    return refine_config(model, calib, output, **{"refine": SUB, **changes})


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _records(report: PruneReport) -> list[tuple[Any, ...]]:
    return [(b.block, b.error_before, b.error_after, b.kept, b.steps) for b in report.refinement]


def test_sub_blocks_through_the_cli_lower_every_block_error(tiny: Path, calib: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    flags = ["--nm", "8:16", "--method", "sparsegpt", "--data", str(calib), "--nsamples", "5", "--seqlen", "32"]
    result = invoke(["prune", str(tiny), *flags, "--refine", "block", "--refine-regions", "sub-blocks", "-o", str(out)])
    assert result.exit_code == 0, result.output
    report = PruneReport.from_json(json.loads((out / PRUNE_FILE).read_text()))
    assert report.settings["refine"]["regions"] == "sub-blocks"
    assert [b.block for b in report.refinement] == [0, 1]
    assert all(b.kept and b.error_after < b.error_before for b in report.refinement)
    assert all(b.steps == 2 * 2 * 2 for b in report.refinement)  # two regions of two epochs, 2 steps each
    assert verify_checkpoint(out).ok


def test_streamed_whole_and_resumed_sub_block_runs_are_the_same_bytes(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = prune_model(_cfg(tiny, calib, tmp_path / "whole", stream=False), data_ctx)
    streamed = prune_model(_cfg(tiny, calib, tmp_path / "streamed", stream=True), data_ctx)
    assert _records(streamed) == _records(whole) and any(b.kept for b in whole.refinement)
    assert _sha(tmp_path / "streamed" / "model.safetensors") == _sha(tmp_path / "whole" / "model.safetensors")
    out, steps, step = tmp_path / "killed", [0], refine._step

    def killed_in_block_1s_first_region(optimizer: torch.optim.Optimizer) -> None:
        steps[0] += 1
        if steps[0] == whole.refinement[0].steps + 2:  # block 1, its attention region's second step
            raise Killed
        step(optimizer)

    with monkeypatch.context() as patch:
        patch.setattr(refine, "_step", killed_in_block_1s_first_region)
        with pytest.raises(Killed):
            prune_model(_cfg(tiny, calib, out, resume=True), data_ctx)
    resumed = prune_model(_cfg(tiny, calib, out, resume=True), data_ctx)
    assert resumed.resumed_from_block == 1 and _records(resumed) == _records(whole)
    assert _sha(out / "model.safetensors") == _sha(tmp_path / "whole" / "model.safetensors")


def test_two_processes_refine_sub_blocks_as_one(tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path) -> None:
    from test_distributed import _spawn

    one = prune_model(_cfg(tiny, calib, tmp_path / "single"), data_ctx)
    outcomes = _spawn(tmp_path, [{"name": "sub", "cfg": _cfg(tiny, calib, tmp_path / "dist")}], data_ctx)
    assert [o["sub"] for o in outcomes] == ["ok", "ok"], outcomes
    two = PruneReport.from_json(json.loads((tmp_path / "dist" / PRUNE_FILE).read_text()))
    assert two.settings["processes"] == 2 and _records(two) == _records(one)
    assert _sha(tmp_path / "single" / "model.safetensors") == _sha(tmp_path / "dist" / "model.safetensors")


@pytest.mark.parametrize("family", ["gpt2", "mixtral", "mllama"])
def test_sub_blocks_run_on_conv1d_experts_and_cross_attention_models(
    family: str, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """GPT-2's Conv1D blocks, Mixtral's experts (their stacks' masks held) and Mllama (its cross-attention
    block idle on text: no record) through a whole run: the records are the running blocks', none got
    worse, and the checkpoint passes `tsenor verify`."""
    src = tmp_path / "src"
    if family == "mllama":
        make_tiny_model(src, "mllama")
    else:
        make_tiny_llama(src, model_type=family, **MOE.get(family, {}))
    out = tmp_path / "out"
    report = prune_model(sparsegpt_config(src, calib, out, refine=SUB, resume=False), data_ctx)
    expected = [0, 2] if family == "mllama" else [0, 1]  # Mllama's block 1 is its idle cross-attention block
    assert [b.block for b in report.refinement] == expected
    assert all(b.error_after < b.error_before if b.kept else b.error_after >= b.error_before for b in report.refinement)
    assert any(b.kept for b in report.refinement) and verify_checkpoint(out).ok


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--refine-regions", "layer"], "--refine-regions 'layer' is not one of block, sub-blocks"),
        (["--refine-regions", "sub-blocks", "--refine-mask-every", "2"], "--refine-mask-every needs --refine-regions"),
    ],
)
def test_bad_region_options_are_one_line_and_write_nothing(
    flags: list[str], message: str, tiny: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = invoke(["prune", str(tiny), "--nm", "8:16", "--refine", "block", *flags, "--output", str(out)])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, UsageError) and message in str(result.exception)
    assert "\n" not in str(result.exception) and not out.exists()


def test_the_regions_key_enters_the_result_fields_only_when_set() -> None:
    assert "regions" not in RefineConfig("block").result_fields()
    assert RefineConfig("block", regions="sub-blocks").result_fields()["regions"] == "sub-blocks"
    assert dataclasses.replace(SUB, regions="block") == RefineConfig("block", 2, 1e-3)


def test_the_plan_counts_the_boundary_values(tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path) -> None:
    from tsenor_cli.pruning.plan.plan import plan_model

    whole = plan_model(_cfg(tiny, calib, tmp_path / "o", refine=RefineConfig("block", 2, 1e-3), nsamples=8), data_ctx)
    sub = plan_model(_cfg(tiny, calib, tmp_path / "o", nsamples=8), data_ctx)
    width, hidden = 4, 64  # fp32, the tiny model's hidden size
    assert sub.device_memory[0].activations - whole.device_memory[0].activations == 8 * 32 * hidden * width
    assert sub.resume_bytes == whole.resume_bytes  # the boundary values are computed again, never saved
    assert not (tmp_path / "o").exists()
