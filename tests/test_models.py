"""Model resolution/loading and the discovered decoder structure (the nine families: test_architectures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_tiny import LOCAL_CTX, blockwise_forward, full_forward

from tsenor_cli.errors import IncompatibleModelError, InputNotFoundError, UsageError
from tsenor_cli.models.loading import default_dtype, load_model, parse_dtype


def test_loaded_model_fields_and_linears(tiny: Path) -> None:
    loaded = load_model(str(tiny), LOCAL_CTX)
    assert not loaded.model.training
    assert loaded.source == str(tiny.resolve())
    assert next(loaded.model.parameters()).dtype == torch.float32  # CPU default
    structure = loaded.structure
    assert structure.model_type == "llama" and structure.base is loaded.model.model
    assert structure.blocks is loaded.model.model.layers and structure.blocks_name == "model.layers"
    linears = structure.block_linears(0)
    assert list(linears) == [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    assert structure.full_name(1, "mlp.up_proj") == "model.layers.1.mlp.up_proj"
    # hidden 64, 4 heads of 16, 2 KV heads, intermediate 128 (tests/helpers_tiny.py defaults)
    shapes = {name: tuple(lin.weight.shape) for name, lin in linears.items()}
    assert shapes["self_attn.q_proj"] == (64, 64) and shapes["self_attn.k_proj"] == (32, 64)
    assert shapes["mlp.gate_proj"] == (128, 64) and shapes["mlp.down_proj"] == (64, 128)


def test_load_dtype_and_device(tiny: Path, device: torch.device) -> None:
    loaded = load_model(str(tiny), LOCAL_CTX, dtype=torch.bfloat16, device=device)
    param = next(loaded.model.parameters())
    assert param.dtype == torch.bfloat16 and param.device.type == device.type
    assert default_dtype(torch.device("cuda")) == torch.bfloat16
    assert default_dtype(torch.device("cpu")) == torch.float32


def test_parse_dtype() -> None:
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("float32") == torch.float32
    assert parse_dtype("auto") is None and parse_dtype(None) is None
    with pytest.raises(UsageError, match="unknown dtype 'int8'"):
        parse_dtype("int8")


def test_missing_model_dir(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-checkpoint"
    with pytest.raises(InputNotFoundError, match=f"{missing}.*does not exist"):
        load_model(str(missing), LOCAL_CTX)


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(InputNotFoundError, match=r"has no config\.json"):
        load_model(str(tmp_path), LOCAL_CTX)


def test_unknown_hub_id_offline() -> None:
    """The offline policy comes from the context (no HF_HUB_OFFLINE needed): the local HF cache only."""
    with pytest.raises(InputNotFoundError) as info:
        load_model("tsenor-nonexistent-org/no-such-model", LOCAL_CTX)
    message = str(info.value)
    assert "tsenor-nonexistent-org/no-such-model is not in the local HF cache" in message
    assert "as MODEL" in message and "drop --offline" in message and "MODEL smollm2-135m" in message
    assert "--model" not in message  # the old flag is hidden from --help: a hint names what the help shows


def test_a_config_without_a_causal_lm_class_is_refused(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("t5", num_layers=1, d_model=32, num_heads=2, d_ff=64).save_pretrained(tmp_path)
    with pytest.raises(IncompatibleModelError, match="model type 't5' has no causal-LM class in transformers"):
        load_model(str(tmp_path), LOCAL_CTX)


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_blockwise_matches_full(smollm2_path: Path) -> None:
    loaded = load_model("smollm2-135m", LOCAL_CTX)
    assert loaded.source == str(smollm2_path.resolve())
    assert len(loaded.structure) == 30
    shapes = {n: tuple(m.weight.shape) for n, m in loaded.structure.block_linears(0).items()}
    assert shapes["self_attn.k_proj"] == (192, 576) and shapes["mlp.down_proj"] == (576, 1536)
    text = "The quick brown fox jumps over the lazy dog. Transposable N:M sparsity accelerates training."
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    expected_hidden, expected_logits = full_forward(loaded.model, ids)
    hidden, logits = blockwise_forward(loaded.model, ids)
    torch.testing.assert_close(hidden, expected_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
