"""Blocks the model's text-only forward skips (Mllama's cross-attention layers), pruned (`pruning/block/idle.py`).

The idle block's own forward runs on the text hidden states that reach it with the arguments the model
lends it from its running blocks: what the text reaches is pruned by the method on those statistics
(held here against the method run on statistics computed by hand), the rest by magnitude (held against
`magnitude.prune` on the dense weight); the replay of the block stays the identity. End to end on the
tiny Mllama: `--targets`/`--ignore` on the idle block, streamed against whole bit for bit, verify, and
`--targets` that prunes nothing refused on text, MoE and multimodal models.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import make_tiny_model, random_model
from safetensors.torch import load_file, save_file
from test_moe import MOE
from torch import nn

from tsenor_cli.errors import UsageError
from tsenor_cli.models.structure import ModelStructure, discover_structure
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.engine import BlockPruner
from tsenor_cli.pruning.block.idle import MAGNITUDE_REASON, TEXT_REASON
from tsenor_cli.pruning.block.slots import LinearSlot, linear_slots
from tsenor_cli.pruning.methods import magnitude, sparsegpt
from tsenor_cli.pruning.methods.registry import get_pruner
from tsenor_cli.pruning.methods.stats import InputStats
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.run.steps import check_targets_run as _check_targets_run
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.replay import BlockCall, capture_block_calls, capture_block_inputs, run_block
from tsenor_cli.runfiles import PruneReport

PATTERN = SparsityPattern.from_nm(2, 4, transposable=True)
LAYER = MatrixPruneConfig(PATTERN, solver="exhaustive")
CPU = torch.device("cpu")
SEQ_LEN = 24
IDLE = 1  # the tiny Mllama's cross-attention block (helpers_tiny.MULTIMODAL["mllama"])


def _transposable(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """Exactly n nonzeros in every row and every column of every m×m tile of `weight` (out, in)."""
    out_features, in_features = weight.shape
    tiles = weight.ne(0).reshape(out_features // m, m, in_features // m, m)
    return bool((tiles.sum(dim=3) == n).all() and (tiles.sum(dim=1) == n).all())


def _block_inputs(model: nn.Module, seed: int = 0) -> tuple[ModelStructure, tuple[BlockCall, ...], torch.Tensor]:
    """(structure, calls, the hidden states (S, T, H) entering block IDLE) of `model` on random tokens:
    block 0's dense outputs, which the model's forward would hand the block after it."""
    structure = discover_structure(model)
    ids = torch.randint(3, 1000, (3, SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    captured = capture_block_inputs(structure, ids, CPU)
    hidden = torch.empty_like(captured.hidden)
    run_block(structure.blocks[0], captured.hidden, captured.calls[0], hidden)
    return structure, captured.calls, hidden


def _pruner(structure: ModelStructure, method: str = "sparsegpt", **options: Any) -> BlockPruner:
    return BlockPruner(structure, linear_slots(structure), get_pruner(method), LAYER, CPU, lambda _m: None, **options)


def _stats(inputs: torch.Tensor) -> InputStats:
    """The statistics of (S, T, in) inputs added one sample at a time, as the engine adds them."""
    stats = InputStats(inputs.shape[-1], gram=True, device=CPU)
    for j in range(inputs.shape[0]):
        stats.add(inputs[j : j + 1])
    return stats


@pytest.fixture(scope="module")
def mllama() -> tuple[ModelStructure, tuple[BlockCall, ...], torch.Tensor]:
    return _block_inputs(random_model("mllama"))


def test_the_idle_block_gets_the_arguments_of_the_running_block_before_it(
    mllama: tuple[ModelStructure, tuple[BlockCall, ...], torch.Tensor],
) -> None:
    """Mllama's text model calls every decoder layer with the same keywords: the idle block's record
    carries block 0's, not to run (its replay is the identity); `running()` runs it."""
    _structure, calls, _hidden = mllama
    idle, lender = calls[IDLE], calls[0]
    assert idle.idle and not lender.idle and not calls[2].idle
    assert idle.kwargs.keys() == lender.kwargs.keys() and idle.hidden_keyword == lender.hidden_keyword
    assert all(idle.kwargs[key] is lender.kwargs[key] for key in idle.kwargs)
    assert not idle.as_running().idle and idle.as_running().kwargs is idle.kwargs


def test_mllama_cross_attention_is_pruned_from_the_text_that_reaches_it(
    mllama: tuple[ModelStructure, tuple[BlockCall, ...], torch.Tensor],
) -> None:
    """q_proj, the one linear the text reaches before the forward stops for want of image features, is
    SparseGPT on the statistics of input_layernorm(the hidden states reaching the block), computed here
    by hand; k/v/o and the MLP are magnitude on their dense weights. All transposable 2:4, each record
    saying how; the same twice; the replay of the pruned block is still the identity."""
    structure, calls, hidden = mllama
    dense = structure.blocks[IDLE]
    results = []
    for _ in range(2):
        block = copy.deepcopy(dense)
        records = _pruner(structure).prune(block, IDLE, hidden, calls[IDLE])
        results.append((block.state_dict(), records))
    (weights, records), (again, records_again) = results
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert [(r.name, r.reason, r.recon_error) for r in records] == [
        (r.name, r.reason, r.recon_error) for r in records_again
    ]
    prefix = structure.full_name(IDLE, "")
    local = [r.name.removeprefix(prefix) for r in records]
    assert local[0] == "cross_attn.q_proj" and sorted(local) == sorted(structure.linears[IDLE])
    with torch.no_grad():
        stats = _stats(dense.input_layernorm(hidden))
        expected_q = sparsegpt.prune(dense.cross_attn.q_proj.weight.detach().clone(), stats, LAYER).weight
    assert torch.equal(weights["cross_attn.q_proj.weight"], expected_q)
    for record, name in zip(records, local, strict=True):
        weight = weights[f"{name}.weight"]
        assert record.status == "pruned" and record.density == 0.5 and _transposable(weight), name
        if name == "cross_attn.q_proj":
            assert record.reason == TEXT_REASON and record.recon_error is not None
            continue
        assert record.reason is not None and record.reason.startswith(MAGNITUDE_REASON), name
        assert "AttributeError" in record.reason and record.recon_error is None
        expected = magnitude.prune(dense.get_parameter(f"{name}.weight").detach(), None, LAYER).weight
        assert torch.equal(weight, expected), name
    block = copy.deepcopy(dense)
    block.load_state_dict(weights)
    out = torch.empty_like(hidden)
    run_block(block, hidden, calls[IDLE], out)
    assert torch.equal(out, hidden)


def test_ignored_and_skipped_linears_of_the_idle_block_stay_dense(
    mllama: tuple[ModelStructure, tuple[BlockCall, ...], torch.Tensor],
) -> None:
    structure, calls, hidden = mllama
    block = copy.deepcopy(structure.blocks[IDLE])
    q, down = structure.full_name(IDLE, "cross_attn.q_proj"), structure.full_name(IDLE, "mlp.down_proj")
    pruner = _pruner(structure, ignored={q: "matched --ignore *.q_proj"}, skipped={down: "does not fit"})
    records = {r.name: r for r in pruner.prune(block, IDLE, hidden, calls[IDLE])}
    assert (records[q].status, records[q].reason) == ("ignored", "matched --ignore *.q_proj")
    assert (records[down].status, records[down].reason) == ("skipped", "does not fit")
    dense = structure.blocks[IDLE]
    assert torch.equal(block.cross_attn.q_proj.weight, dense.cross_attn.q_proj.weight)
    assert torch.equal(block.mlp.down_proj.weight, dense.mlp.down_proj.weight)
    assert sum(r.status == "pruned" for r in records.values()) == 5


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        return hidden + self.proj(hidden)


class _GatedBlock(_Block):
    """Skipped by the text forward; its own forward needs nothing the text lacks."""


class _StuckBlock(_Block):
    """Skipped by the text forward; its forward reads `memory` (None on text) before any linear runs."""

    def forward(self, hidden: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        return hidden + self.proj(memory.expand_as(hidden))  # type: ignore[union-attr]


class _BrokenBlock(_Block):
    """Skipped by the text forward; its forward fails with an error that is no missing input."""

    def forward(self, hidden: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(hidden) @ torch.ones(3, 3)


class _Text(nn.Module):
    def __init__(self, idle: type[_Block]) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), idle(), _Block()])

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            if type(layer) is _Block:
                hidden = layer(hidden)
        return hidden


def _toy(idle: type[_Block]) -> tuple[ModelStructure, tuple[BlockCall, ...], torch.Tensor]:
    torch.manual_seed(0)
    model = _Text(idle)
    structure = discover_structure(model)
    ids = torch.randint(0, 16, (3, 8), generator=torch.Generator().manual_seed(1))
    calls = capture_block_calls(structure, 8)
    hidden = torch.empty(3, 8, 8)
    run_block(structure.blocks[0], model.embed(ids).detach(), calls[0], hidden)
    return structure, calls, hidden


def test_an_idle_block_whose_forward_finishes_on_text_is_calibrated_whole() -> None:
    structure, calls, hidden = _toy(_GatedBlock)
    assert calls[IDLE].idle
    block = copy.deepcopy(structure.blocks[IDLE])
    (record,) = _pruner(structure).prune(block, IDLE, hidden, calls[IDLE])
    assert record.reason == TEXT_REASON and record.recon_error is not None
    dense = structure.blocks[IDLE].proj.weight.detach().clone()
    assert torch.equal(block.proj.weight, sparsegpt.prune(dense, _stats(hidden), LAYER).weight)


def test_an_idle_block_that_stops_before_any_linear_is_pruned_by_magnitude_with_the_reason() -> None:
    structure, calls, hidden = _toy(_StuckBlock)
    block = copy.deepcopy(structure.blocks[IDLE])
    (record,) = _pruner(structure, method="wanda").prune(block, IDLE, hidden, calls[IDLE])
    assert record.status == "pruned" and record.reason is not None and record.recon_error is None
    assert record.reason.startswith(MAGNITUDE_REASON) and "AttributeError: 'NoneType' object" in record.reason
    dense = structure.blocks[IDLE].proj.weight.detach()
    assert torch.equal(block.proj.weight, magnitude.prune(dense, None, LAYER).weight)


def test_an_idle_block_failing_for_another_reason_stops_the_run() -> None:
    """Only a missing input ends the idle forward quietly: a shape error is the model's, raised."""
    structure, calls, hidden = _toy(_BrokenBlock)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        _pruner(structure).prune(copy.deepcopy(structure.blocks[IDLE]), IDLE, hidden, calls[IDLE])


def test_a_targets_selection_left_wholly_dense_is_refused() -> None:
    """An idle block's nn.Linear is prunable; its other matrices, whose orientation no forward shows, are
    not: a selection of only those (or of nothing) is refused, unless it names linears outside the LM."""
    calls = (BlockCall((), {}), BlockCall((), {}).as_idle())
    linear = LinearSlot(1, "proj", "layers.1.proj", 8, 8)
    bare = LinearSlot(1, "table", "layers.1.table", 8, 8, param="table")
    _check_targets_run([linear, bare], calls, has_outside=False)
    _check_targets_run([bare], calls, has_outside=True)
    for candidates in ([bare], []):
        with pytest.raises(UsageError, match=r"^--targets selects nothing tsenor can prune .*drop --targets$"):
            _check_targets_run(candidates, calls, has_outside=False)


# ---------------------------------------------------------------- end to end on the tiny Mllama


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Mllama saved by transformers (legacy tensor names: loaded whole) and the same weights under
    the model's own parameter names (read block by block: streamed)."""
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("idle")
    legacy = make_tiny_model(root / "legacy", "mllama")
    own = root / "own"
    shutil.copytree(legacy, own)
    model = AutoModelForImageTextToText.from_pretrained(legacy)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(own / "model.safetensors"))
    return {"legacy": legacy, "own": own}


def _prune(source: Path, calibration_text: Path, out: Path, *extra: str) -> tuple[Any, PruneReport | None]:
    args = ["prune", "--model", str(source), "--method", "sparsegpt", "--nm", "2:4", "--nsamples", "2"]
    args += ["--seqlen", str(SEQ_LEN), "--calib-data", str(calibration_text), "--output", str(out), *extra]
    result = invoke(args)
    if result.exit_code != 0:
        return result, None
    return result, PruneReport.from_json(json.loads((out / "tsenor_report.json").read_text()))


def _idle_block(name: str) -> bool:
    return f".layers.{IDLE}." in name


def test_streamed_and_whole_runs_prune_the_idle_block_bit_for_bit(
    sources: dict[str, Path], calibration_text: Path, tmp_path: Path
) -> None:
    """The default (streamed) run of the own-names checkpoint, its whole run and the legacy checkpoint's
    (loaded whole) write the same tensors; every idle-block linear is pruned, transposable 2:4 in the
    saved checkpoint, and verify passes."""
    runs: dict[str, PruneReport | None] = {}
    for name, source, extra in (
        ("streamed", sources["own"], ()),
        ("whole", sources["own"], ("--no-stream",)),
        ("legacy", sources["legacy"], ()),
    ):
        result, runs[name] = _prune(source, calibration_text, tmp_path / name, *extra)
        assert result.exit_code == 0, result.output
    streamed = load_file(str(tmp_path / "streamed" / "model.safetensors"))
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert streamed.keys() == whole.keys() and all(torch.equal(streamed[k], whole[k]) for k in streamed)
    from transformers import AutoModelForImageTextToText

    # The legacy checkpoint's output keeps its tensor names: compared through the class that loads both.
    legacy = AutoModelForImageTextToText.from_pretrained(tmp_path / "legacy").state_dict()
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "whole").state_dict()
    assert legacy.keys() == loaded.keys() and all(torch.equal(legacy[k], loaded[k]) for k in legacy)
    report = runs["streamed"]
    assert report is not None
    idle = [r for r in report.layers if _idle_block(r.name)]
    assert len(idle) == 7 and all(r.status == "pruned" for r in idle)
    for record in idle:
        assert _transposable(streamed[f"{record.name}.weight"]), record.name
    # The own-names copy is no checkpoint MllamaForCausalLM loads (test_multimodal's verify test): verify
    # the legacy one's output, written under its source's names.
    verified = verify_checkpoint(tmp_path / "legacy")
    assert verified.ok and {c.name for c in verified.layers} >= {r.name for r in idle}


def test_targets_naming_only_the_idle_block_prune_exactly_it(
    sources: dict[str, Path], calibration_text: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result, report = _prune(sources["own"], calibration_text, out, "--targets", f"*.layers.{IDLE}.*")
    assert result.exit_code == 0 and report is not None, result.output
    pruned = {r.name for r in report.layers if r.status == "pruned"}
    assert len(pruned) == 7 and all(_idle_block(name) for name in pruned)
    assert all(r.status == "ignored" for r in report.layers if not _idle_block(r.name))
    source, written = load_file(str(sources["own"] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {key for key in source if not torch.equal(source[key], written[key])}
    assert changed == {f"{name}.weight" for name in pruned}
    assert all(check.ok for check in verify_checkpoint(out).layers)


def test_ignore_keeps_the_idle_block_dense_and_verify_lists_it(
    sources: dict[str, Path], calibration_text: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "out"
    result, report = _prune(sources["legacy"], calibration_text, out, "--ignore", f"*.layers.{IDLE}.*")
    assert result.exit_code == 0 and report is not None, result.output
    idle = [r for r in report.layers if _idle_block(r.name)]
    assert len(idle) == 7 and all(r.status == "ignored" and "matched --ignore" in str(r.reason) for r in idle)
    source = AutoModelForImageTextToText.from_pretrained(sources["legacy"]).state_dict()
    written = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    assert all(torch.equal(source[f"{r.name}.weight"], written[f"{r.name}.weight"]) for r in idle)
    verified = verify_checkpoint(out)
    assert verified.ok and {(w.name, w.status) for w in verified.dense} >= {(r.name, "ignored") for r in idle}
    shown = invoke(["verify", str(out)])
    assert shown.exit_code == 0 and "dense: 7 ignored (matched --ignore" in shown.output, shown.output


@pytest.mark.parametrize("kind", ["text", "moe", "multimodal"])
def test_targets_that_prune_nothing_are_refused_on_every_kind_of_model(
    kind: str,
    tiny_llama: Callable[..., Path],
    sources: dict[str, Path],
    calibration_text: Path,
    tmp_path: Path,
) -> None:
    """--targets and --ignore naming the same weights (the idle block's on Mllama, now prunable) leave
    nothing to prune: one line, exit 2, dry run or not, nothing written."""
    source, pattern = {
        "text": (tiny_llama(), "*.mlp.*"),
        "moe": (tiny_llama(model_type="mixtral", **MOE["mixtral"]), "*.experts*"),
        "multimodal": (sources["legacy"], f"*.layers.{IDLE}.*"),
    }[kind]
    out = tmp_path / "out"
    for extra in (("--dry-run",), ()):
        result, _ = _prune(source, calibration_text, out, "--targets", pattern, "--ignore", pattern, *extra)
        assert result.exit_code == 2, result.output
        message = str(result.exception)
        assert "leave none of the" in message and "to prune" in message and "\n" not in message
        assert not out.exists()


def test_the_records_of_a_report_name_every_idle_linear_once(
    sources: dict[str, Path], calibration_text: Path, tmp_path: Path
) -> None:
    """The summary's counts follow the records: the idle block's linears count as pruned."""
    result, report = _prune(sources["legacy"], calibration_text, tmp_path / "out")
    assert result.exit_code == 0 and report is not None, result.output
    names = [r.name for r in report.layers]
    assert len(names) == len(set(names)) == 21
    pruned = sum(r.status == "pruned" for r in report.layers)
    assert pruned == 21 and report.linear_nonzero * 2 == report.linear_params
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"{pruned} matrices pruned, 0 left dense" in card
