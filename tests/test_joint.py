"""Masks chosen with the weights inside block refinement (`--refine-mask-every`, pruning/block/joint.py): every
re-solved mask is feasible (each transposable tile keeps exactly N per row and per column), the masks do
move, the block error never rises, the same inputs give the same bytes, the scores are ALPS's, and the
option is refused where it cannot work; a tiny model through the CLI passes `tsenor verify`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import random_causal_lm

from tsenor_cli.errors import UsageError
from tsenor_cli.models.structure import discover_structure
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.joint import joint_scores
from tsenor_cli.pruning.block.refine import RefineJob, block_masks, refine_block
from tsenor_cli.pruning.methods.masks import choose_mask
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.pruning.settings.config import RefineConfig
from tsenor_cli.pruning.settings.recipe import build_config, read_recipe
from tsenor_cli.replay import capture_block_inputs, run_block
from tsenor_cli.runfiles import PRUNE_FILE
from tsenor_cli.solver import to_blocks

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
T816 = SparsityPattern.from_nm(8, 16, transposable=True)


def _block(pattern: SparsityPattern) -> tuple[Any, ...]:
    """A random 1-block LLaMA pruned to `pattern` by magnitude: (block, call, inputs, targets, masks)."""
    cpu = torch.device("cpu")
    model = random_causal_lm(num_layers=1, vocab_size=256)
    structure = discover_structure(model)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    captured = capture_block_inputs(structure, ids, cpu)
    block, call = structure.blocks[0], captured.calls[0]
    targets = torch.empty_like(captured.hidden)
    run_block(block, captured.hidden, call, targets)
    with torch.no_grad():
        for name in LINEARS:
            weight = block.get_submodule(name).weight
            weight.mul_(choose_mask(weight.abs(), pattern, "auto").mask)
    names = [structure.full_name(0, f"{n}.weight") for n in LINEARS]
    return block, call, captured.hidden, targets, block_masks(block, structure.full_name(0, ""), names)


def _refine(pattern: SparsityPattern, every: int) -> tuple[Any, ...]:
    block, call, inputs, targets, masks = _block(pattern)
    cfg = RefineConfig("block", 4, 3e-3, every, pattern=pattern)
    record = refine_block(RefineJob(block, 0, inputs, call, targets, cfg, 0, torch.device("cpu"), masks))
    return block, masks, record


def test_the_re_solved_masks_are_feasible_and_move_and_the_error_falls() -> None:
    block, masks, record = _refine(T816, 2)
    assert record.kept and record.error_after < record.error_before
    assert record.steps == 8 and record.mask_solves == 4 and record.mask_changed > 0
    moved = 0
    for name, pruned in masks.items():
        kept = block.get_parameter(name).detach() != 0
        tiles = to_blocks(kept, 16)  # (B, 16, 16)
        assert (tiles.sum(1) == 8).all() and (tiles.sum(2) == 8).all(), name  # exactly N per row and column
        assert not torch.signbit(block.get_parameter(name).detach()[~kept]).any(), name  # +0.0, never -0.0
        moved += int((kept == pruned).sum())  # kept now where pruned before
    assert moved > 0


def test_shadows_started_from_the_dense_weights_move_more_of_the_mask() -> None:
    pattern = T816
    block, call, inputs, targets, masks = _block(pattern)
    model = random_causal_lm(num_layers=1, vocab_size=256)  # the same seed: the block's dense weights
    dense = {name: model.get_parameter(f"model.layers.0.{name}").detach() for name in masks}
    runs = []
    for start in (None, dense):
        block.load_state_dict(_block(pattern)[0].state_dict())
        cfg = RefineConfig("block", 1, 1e-4, 1, pattern=pattern)
        rec = refine_block(RefineJob(block, 0, inputs, call, targets, cfg, 0, torch.device("cpu"), masks, dense=start))
        runs.append(rec.mask_changed)
        for name in masks:
            tiles = to_blocks(block.get_parameter(name).detach() != 0, 16)
            assert (tiles.sum(1) == 8).all() and (tiles.sum(2) == 8).all(), name
    assert runs[1] > runs[0]


def test_ordinary_n_m_keeps_n_in_every_group() -> None:
    pattern = SparsityPattern.from_nm(2, 4, transposable=False)
    block, masks, record = _refine(pattern, 2)
    assert record.kept and record.mask_solves == 4
    for name in masks:
        kept = block.get_parameter(name).detach() != 0
        assert (kept.reshape(kept.shape[0], -1, 4).sum(-1) == 2).all(), name


def test_same_inputs_same_bytes() -> None:
    first, _, a = _refine(T816, 3)
    second, _, b = _refine(T816, 3)
    assert (a.error_after, a.mask_changed) == (b.error_after, b.mask_changed)
    for (name, p), q in zip(first.named_parameters(), second.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_the_scores_are_alps_projection_scores() -> None:
    weight = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    column_sq = torch.tensor([4.0, 1.0], dtype=torch.float64)  # Σ x_j² over the tokens
    expected = torch.tensor([[4.0, 4.0], [36.0, 0.25]])  # (W_ij · ‖X_j‖)²
    assert torch.equal(joint_scores(weight, column_sq), expected)


def test_a_mask_period_needs_an_n_m_pattern() -> None:
    with pytest.raises(UsageError, match="needs an N:M pattern"):
        RefineConfig("block", 2, 1e-3, 4)
    with pytest.raises(UsageError, match="needs an N:M pattern"):
        RefineConfig("block", 2, 1e-3, 4, pattern=SparsityPattern.unstructured(0.5))
    with pytest.raises(UsageError, match="--refine-mask-every -1"):
        RefineConfig("block", 2, 1e-3, -1, pattern=T816)
    cfg = build_config({"model": "m", "nm": "16:32", "refine": "block", "refine_mask_every": 8}, force=False,
                       resume=True, command="")  # fmt: skip
    assert cfg.refine.mask_every == 8 and cfg.refine.pattern == cfg.matrix.pattern
    assert cfg.result_fields()["refine"]["mask_every"] == 8  # type: ignore[index]


def test_a_tiny_model_through_the_cli(tiny_llama: Callable[..., Path], calib: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    flags = ["--nm", "8:16", "--method", "sparsegpt", "--data", str(calib), "--nsamples", "4", "--seqlen", "32"]
    flags += ["--refine", "block", "--refine-mask-every", "1", "--no-resume-state"]
    result = invoke(["prune", str(tiny_llama(num_layers=2)), *flags, "--output", str(out)])
    assert result.exit_code == 0, result.output
    refined = json.loads((out / PRUNE_FILE).read_text())["refinement"]
    assert [r["mask_solves"] for r in refined] == [2, 2]  # 4 samples: 1 step an epoch, 2 epochs
    assert verify_checkpoint(out).ok


@pytest.mark.parametrize("name", ["quality-16x32.yaml", "quality-2x4.yaml"])
def test_the_quality_recipes_prune_a_tiny_model(
    name: str, tiny_llama: Callable[..., Path], calib: Path, tmp_path: Path
) -> None:
    """The recipes carry no model key, refine, and run through the CLI on a tiny model (calibration made
    small on the command line, which overrides the recipe)."""
    recipe = Path(__file__).resolve().parents[1] / "configs" / name
    values = read_recipe(recipe)
    assert "model" not in values and values["refine"] == "block" and values["transposable"] is True
    out = tmp_path / "out"
    flags = ["--config", str(recipe), "--data", str(calib), "--nsamples", "4", "--seqlen", "32"]
    result = invoke(["prune", str(tiny_llama(num_layers=2)), *flags, "--output", str(out), "--no-resume-state"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / PRUNE_FILE).read_text())
    assert len(report["refinement"]) == 2 and verify_checkpoint(out).ok
