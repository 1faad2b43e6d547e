"""Weight matrices that are not nn.Linear layers called as modules, on tiny random models built offline.

GPT-2's `Conv1D` layers (weight stored (in, out), run as ``addmm(bias, x, weight)``): the watch
(`pruning/block/observe.py`) sees each as a matrix stored transposed, the block replay reproduces the model's
logits, and a 2-block SparseGPT 2:4 prune through `tsenor prune` leaves every Conv1D at density 0.5,
verifies, loads with its class and generates. An ordinary (not transposable) 2:4 prune shows the
orientation: the 2-of-4 groups run along each output's inputs, i.e. down the columns of the stored
(in, out) weight.

A parameter multiplied as the left operand, ``W @ X`` (transformers' Jamba mixer:
``dt_proj.weight @ time_step.transpose(1, 2)``): its inputs are the columns of X, found by the watch,
against hand-computed ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import blockwise_forward, full_forward, make_tiny_llama, random_causal_lm, random_model
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.models.structure import discover_structure
from tsenor_cli.pruning.block.gather import MoeOptions, unit_input_stats
from tsenor_cli.pruning.block.observe import Use, observe_block, watching
from tsenor_cli.replay import block_output, capture_block_inputs, input_key

SEQ_LEN = 24
# Each block: c_attn (3H × H), attention's c_proj (H × H), c_fc (4H × H), the MLP's c_proj (H × 4H), as (out, in).
SHAPES = {"attn.c_attn": (192, 64), "attn.c_proj": (64, 64), "mlp.c_fc": (256, 64), "mlp.c_proj": (64, 256)}


def _ids(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def test_the_watch_sees_conv1d_weights_as_transposed_matrices() -> None:
    model = random_causal_lm("gpt2")
    structure = discover_structure(model)
    assert structure.blocks_name == "transformer.h" and structure.linears == ((), ())  # no nn.Linear at all
    inputs = capture_block_inputs(structure, _ids(1, 0), torch.device("cpu"))
    block, call = structure.blocks[0], inputs.calls[0]
    seen = observe_block(block, lambda: block_output(block, call, inputs.hidden), input_key=input_key)
    assert list(seen.units) == [f"{name}.weight" for name in SHAPES]
    for name, (out_features, in_features) in SHAPES.items():
        unit = seen.units[f"{name}.weight"]
        g = unit.geometry
        assert (g.experts, g.out_features, g.in_features, g.transposed) == (0, out_features, in_features, True)
        assert tuple(block.get_parameter(unit.param).shape) == (in_features, out_features)  # Conv1D's (in, out)
        assert unit.role == "weight" and unit.calls == 1
    assert seen.groups == tuple((f"{name}.weight",) for name in SHAPES)
    assert seen.unused == {}


def test_blockwise_replay_reproduces_gpt2() -> None:
    model = random_causal_lm("gpt2")
    ids = _ids(2, seed=1)
    expected_hidden, expected_logits = full_forward(model, ids)
    hidden, logits = blockwise_forward(model, ids)
    torch.testing.assert_close(hidden, expected_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("gpt2") / "src", model_type="gpt2")


def _prune(source: Path, out: Path, calibration: Path, *flags: str) -> None:
    args = ["prune", "--model", str(source), "--method", "sparsegpt", "--nm", "2:4", *flags]
    args += ["--nsamples", "2", "--seqlen", str(SEQ_LEN), "--calib-data", str(calibration), "--output", str(out)]
    result = invoke(args)
    assert result.exit_code == 0, result.output


def test_sparsegpt_2_4_prunes_every_conv1d_verifies_loads_and_generates(
    gpt2: Path, calibration_text: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    out = tmp_path / "out"
    _prune(gpt2, out, calibration_text)
    report = json.loads((out / "tsenor_report.json").read_text())
    layers = {layer["name"]: layer for layer in report["layers"]}
    expected = {f"transformer.h.{block}.{name}" for block in range(2) for name in SHAPES}
    assert set(layers) == expected
    for layer in layers.values():
        assert layer["status"] == "pruned" and layer["density"] == 0.5 and layer["transposed"]
    assert report["totals"]["linear_density"] == pytest.approx(0.5)
    verified = invoke(["verify", str(out)])
    assert verified.exit_code == 0, verified.output
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is GPT2LMHeadModel
    for name in expected:  # half of every stored (in, out) weight is zero; each 4×4 tile keeps 2 per row and column
        weight = model.get_parameter(f"{name}.weight")
        tiles = (weight != 0).reshape(weight.shape[0] // 4, 4, weight.shape[1] // 4, 4).transpose(1, 2)
        assert bool((tiles.sum(-1) == 2).all()) and bool((tiles.sum(-2) == 2).all())
    generated = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 6)


def test_ordinary_2_4_runs_along_each_outputs_inputs(gpt2: Path, calibration_text: Path, tmp_path: Path) -> None:
    """N:M groups are 4 consecutive inputs of one output: in Conv1D's (in, out) storage, 4 consecutive
    rows of one column; the rows (4 consecutive outputs of one input) are not 2:4 then."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    _prune(gpt2, out, calibration_text, "--no-transposable")
    model = AutoModelForCausalLM.from_pretrained(out)
    along_rows_too = 0
    for block in range(2):
        for name in SHAPES:
            kept = model.get_parameter(f"transformer.h.{block}.{name}.weight") != 0  # (in, out)
            assert bool((kept.reshape(-1, 4, kept.shape[1]).sum(1) == 2).all())  # per output, 2 of 4 inputs
            along_rows_too += int((kept.reshape(kept.shape[0], -1, 4).sum(-1) == 2).all())
    assert along_rows_too == 0


class _NormsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.LayerNorm(8), nn.LayerNorm(8)])


def test_blocks_without_weight_matrices_are_refused_in_one_line() -> None:
    with pytest.raises(IncompatibleModelError) as info:
        discover_structure(_NormsOnly())
    message = str(info.value)
    assert message.startswith("no weight matrix found in the LayerNorm blocks of _NormsOnly (layers)")
    assert "\n" not in message


class _LeftOperands(nn.Module):
    """a.weight (12, 8) multiplied as W @ X without calling `a`; b (8, 12) stored (in, out), used as bᵀ @ X."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Linear(8, 12, bias=False)
        self.b = nn.Parameter(torch.randn(8, 12, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 8)
        columns = x.transpose(1, 2)  # (B, 8, T): one token per column
        return (self.a.weight @ columns + self.b.T @ columns).transpose(1, 2)  # (B, T, 12)


def test_a_left_operand_is_a_matrix_whose_inputs_are_the_columns_of_the_right_one() -> None:
    block = _LeftOperands()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    seen = observe_block(block, lambda: block(x), input_key=input_key)
    a, b = seen.units["a.weight"], seen.units["b"]
    assert (a.geometry.out_features, a.geometry.in_features, a.geometry.transposed, a.left) == (12, 8, False, True)
    assert (b.geometry.out_features, b.geometry.in_features, b.geometry.transposed, b.left) == (12, 8, True, True)
    uses: list[Use] = []
    with watching(block, uses.append):
        block(x)
    assert [use.param for use in uses] == ["a.weight", "b"]
    for use in uses:  # each token's 8 inputs, in token order
        torch.testing.assert_close(use.rows, x.reshape(10, 8))


def test_jambas_dt_proj_statistics_are_the_columns_it_multiplies() -> None:
    """The Mamba mixer computes dt_proj.weight @ dt_layernorm(time_step)ᵀ: dt_proj's Gram matrix is that
    of dt_layernorm's outputs, caught here by a hook on the norm."""
    model = random_model("jamba")
    structure = discover_structure(model)
    inputs = capture_block_inputs(structure, _ids(2, 5), torch.device("cpu"))
    block, call = structure.blocks[0], inputs.calls[0]
    seen = observe_block(block, lambda: block_output(block, call, inputs.hidden[:1]), input_key=input_key)
    name = "mamba.dt_proj.weight"
    unit = seen.units[name]
    assert unit.left and (unit.geometry.out_features, unit.geometry.in_features) == (128, 16)
    normed: list[torch.Tensor] = []
    norm = block.get_submodule("mamba.dt_layernorm")
    handle = norm.register_forward_hook(lambda _m, _a, out: normed.append(out.reshape(-1, 16)))
    try:
        stats = unit_input_stats(block, {name: unit}, inputs.hidden, call, MoeOptions())
    finally:
        handle.remove()
    rows = torch.cat(normed)  # (2·T, 16)
    got = stats[name]
    assert not hasattr(got, "routed")
    torch.testing.assert_close(got.gram, rows.T @ rows, rtol=1e-5, atol=1e-5)  # type: ignore[union-attr]
