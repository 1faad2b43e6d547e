"""The architecture-agnostic engine on tiny random models of nine decoder families (built offline).

For each family: the block-by-block replay of what the model's own forward passes its blocks gives the
model's final hidden states and logits; the sequential groups found by observation are the expected
ones; a 2-block prune through `prune_model` writes a checkpoint that `verify` passes and that
transformers loads. Sliding windows are 8 tokens and the sequences longer, so a wrong mask shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_tiny import (
    ARCHITECTURES,
    LOCAL_CTX,
    SLIDING_WINDOW,
    blockwise_forward,
    full_forward,
    make_tiny_llama,
    random_causal_lm,
)
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.models.structure import discover_structure
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block.gather import linear_groups
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.replay import BlockCall, call_difference, capture_block_calls, capture_block_inputs, run_block

FAMILIES = sorted(ARCHITECTURES)
LLAMA_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
EXPECTED_GROUPS = {family: LLAMA_GROUPS for family in FAMILIES} | {
    "phi3": (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
}
SEQ_LEN = 24  # > SLIDING_WINDOW


def _model(family: str, seed: int = 0) -> nn.Module:
    return random_causal_lm(family, seed=seed, **ARCHITECTURES[family])


def _ids(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def test_the_nine_families_are_covered() -> None:
    assert (
        sorted(["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite"]) == FAMILIES
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_blockwise_replay_reproduces_the_model(family: str) -> None:
    model = _model(family)
    assert model.config.model_type == family
    ids = _ids(3, seed=1)
    expected_hidden, expected_logits = full_forward(model, ids)
    hidden, logits = blockwise_forward(model, ids)
    torch.testing.assert_close(hidden, expected_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_are_found_by_observation(family: str) -> None:
    model = _model(family)
    structure = discover_structure(model)
    assert structure.blocks_name == "model.layers" and len(structure) == 2
    inputs = capture_block_inputs(structure, _ids(1, seed=2), torch.device("cpu"))
    for index in range(len(structure)):
        observed = linear_groups(
            structure.blocks[index], structure.block_linears(index), inputs.calls[index], inputs.hidden
        )
        assert observed.groups == EXPECTED_GROUPS[family]
        assert set(observed.calls.values()) == {1}
        assert sorted(observed.order) == sorted(structure.linears[index])


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3_text"])
def test_replayed_masks_are_the_sliding_window_ones(family: str) -> None:
    """The recorded masks hide keys more than a window back (so a plain causal mask would differ), Gemma-3's
    local and global layers get their own rotary embeddings, and where full and sliding layers mix,
    replaying one layer's arguments for the other changes its output."""
    model = _model(family)
    structure = discover_structure(model)
    calls = capture_block_calls(structure, SEQ_LEN)
    layer_types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * len(structure)
    for call, layer_type in zip(calls, layer_types, strict=True):
        mask = call.kwargs["attention_mask"]
        if layer_type == "sliding_attention":
            assert isinstance(mask, torch.Tensor)
            allowed = mask if mask.dtype == torch.bool else mask == 0  # (1, 1, T, T)
            assert bool(allowed[0, 0, SEQ_LEN - 1, SEQ_LEN - 1]) and bool(allowed[0, 0, SEQ_LEN - 1, SEQ_LEN - 8])
            assert not bool(allowed[0, 0, SEQ_LEN - 1, SEQ_LEN - 1 - SLIDING_WINDOW])
    if family == "gemma3_text":  # local (sliding) and global layers get different rotary embeddings
        cos_local, cos_global = (call.kwargs["position_embeddings"][0] for call in calls)
        assert not torch.allclose(cos_local, cos_global)
    if len(set(layer_types)) > 1:
        assert call_difference(calls[0], calls[1]) == "attention_mask"
        hidden = capture_block_inputs(structure, _ids(1, seed=3), torch.device("cpu")).hidden
        right, wrong = torch.empty_like(hidden), torch.empty_like(hidden)
        run_block(structure.blocks[1], hidden, calls[1], right)
        run_block(structure.blocks[1], hidden, calls[0], wrong)
        assert not torch.allclose(right, wrong, atol=1e-4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Saved tiny checkpoints (SmolLM2 tokenizer, vocabulary 49152) by family, made on first use."""
    root = tmp_path_factory.mktemp("families")

    class Lazy(dict[str, Path]):
        def __missing__(self, family: str) -> Path:
            self[family] = make_tiny_llama(root / family, model_type=family, **ARCHITECTURES[family])
            return self[family]

    return Lazy()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["magnitude", "sparsegpt"])
def test_two_block_prune_verifies_and_loads(
    family: str, method: str, checkpoints: dict[str, Path], calibration_text: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "pruned"
    cfg = PruneConfig(
        model=str(checkpoints[family]),
        matrix=MatrixPruneConfig(SparsityPattern.from_nm(16, 32, transposable=True)),
        method=method,
        calib_data=str(calibration_text),
        nsamples=2,
        seqlen=SEQ_LEN,
        output=out,
    )
    report = prune_model(cfg, LOCAL_CTX)
    linears = sum(len(names) for names in discover_structure(_model(family)).linears)
    assert [r.status for r in report.layers] == ["pruned"] * linears
    assert all(r.density == pytest.approx(0.5) for r in report.layers)
    verified = verify_checkpoint(out)
    assert verified.ok and len(verified.layers) == linears
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == family
    with torch.no_grad():
        logits = model(_ids(1, seed=4)).logits
    assert bool(torch.isfinite(logits).all())
    totals = json.loads((out / "tsenor_report.json").read_text())["totals"]
    assert totals["linear_density"] == pytest.approx(0.5)
    assert 0.5 < totals["model_density"] < 1.0  # embeddings and norms stay dense


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def test_a_model_without_a_block_list_is_refused_in_one_line() -> None:
    with pytest.raises(IncompatibleModelError) as info:
        discover_structure(_NoBlocks())
    message = str(info.value)
    assert message.startswith("no decoder block list (nn.ModuleList of repeated blocks) found in _NoBlocks")
    assert "\n" not in message


class _TokenGatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden) * gate


class _TokenGatedModel(nn.Module):
    """Passes its blocks a gate computed from the token values: not replayable from one record."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_TokenGatedBlock(), _TokenGatedBlock()])

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        hidden = self.embed(input_ids)
        gate = (input_ids > 0).to(hidden.dtype)[..., None]  # (B, T, 1)
        for layer in self.layers:
            hidden = layer(hidden, gate=gate)
        return hidden


def test_token_dependent_block_arguments_are_refused() -> None:
    structure = discover_structure(_TokenGatedModel())
    assert structure.blocks_name == "layers" and structure.linears == (("proj",), ("proj",))
    with pytest.raises(IncompatibleModelError, match="the gate that the model passes block 0 depends on the token"):
        capture_block_inputs(structure, torch.randint(1, 16, (2, 5)), torch.device("cpu"))


class _Twice(nn.Module):
    """A hand-made block: a and b read the same tensor, c a view of it, d an equal tensor computed apart,
    e reads a's output, f is shared (runs twice) and g never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.e, self.f, self.g = (nn.Linear(4, 4) for _ in range(7))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden * 2.0
        y = hidden * 2.0  # equal values, other memory
        out = self.a(x) + self.b(x) + self.c(x.view(x.shape)) + self.d(y)
        return self.f(self.f(self.e(out)))


def test_groups_follow_memory_not_values_and_call_counts_are_recorded() -> None:
    block = _Twice()
    linears = {name: getattr(block, name) for name in "abcdefg"}
    observed = linear_groups(block, linears, BlockCall((), {}), torch.randn(1, 3, 4))
    assert observed.groups == (("a", "b", "c"), ("d",), ("e",), ("f",))
    assert observed.calls == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1, "f": 2, "g": 0}
