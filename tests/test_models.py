"""Model resolution/loading and the decoder adapter (block-by-block forward == full forward)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_tiny import LOCAL_CTX, make_tiny_llama

from tsenor_cli.errors import IncompatibleModelError, InputNotFoundError, UsageError
from tsenor_cli.models.adapters import LLAMA_LINEAR_GROUPS, adapter_for, supported_model_types
from tsenor_cli.models.loading import LoadedModel, default_dtype, load_model, parse_dtype


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {t: make_tiny_llama(root / t, model_type=t, seed=i) for i, t in enumerate(("llama", "mistral", "qwen2"))}


def blockwise_logits(loaded: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """Run embeddings → every decoder block via the adapter → norm → lm_head: (B, T) → (B, T, V)."""
    model, adapter = loaded.model, loaded.adapter
    hidden = adapter.embed(model, input_ids)  # (B, T, H)
    layers = adapter.decoder_layers(model)
    for index, layer in enumerate(layers):
        kwargs = adapter.block_forward_kwargs(model, hidden, attention_mask, layer_index=index)
        hidden = layer(hidden, **kwargs)
    return adapter.lm_head(model)(adapter.final_norm(model)(hidden))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_blockwise_forward_matches_full_model(tiny_dirs: dict[str, Path], model_type: str) -> None:
    loaded = load_model(str(tiny_dirs[model_type]), LOCAL_CTX)
    assert loaded.model.config.model_type == model_type
    ids = torch.randint(0, 2000, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = loaded.model(ids).logits
        mine = blockwise_logits(loaded, ids)
    torch.testing.assert_close(mine, full, atol=1e-5, rtol=1e-5)


def test_blockwise_forward_with_padding_mask(tiny_dirs: dict[str, Path]) -> None:
    loaded = load_model(str(tiny_dirs["llama"]), LOCAL_CTX)
    ids = torch.randint(0, 2000, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0  # right padding in the second row
    with torch.no_grad():
        full = loaded.model(ids, attention_mask=mask).logits
        mine = blockwise_logits(loaded, ids, mask)
        kwargs = loaded.adapter.block_forward_kwargs(loaded.model, loaded.adapter.embed(loaded.model, ids), mask)
    assert kwargs["attention_mask"] is not None  # padding cannot use SDPA's is_causal shortcut
    assert kwargs["use_cache"] is False and kwargs["past_key_values"] is None
    torch.testing.assert_close(mine[mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-5)


def test_loaded_model_fields_and_linears(tiny_dirs: dict[str, Path]) -> None:
    loaded = load_model(str(tiny_dirs["llama"]), LOCAL_CTX)
    assert not loaded.model.training
    assert loaded.source == str(tiny_dirs["llama"].resolve())
    assert next(loaded.model.parameters()).dtype == torch.float32  # CPU default
    assert loaded.adapter.linear_groups == LLAMA_LINEAR_GROUPS
    block = loaded.adapter.decoder_layers(loaded.model)[0]
    linears = loaded.adapter.block_linears(block)
    assert list(linears) == [name for group in LLAMA_LINEAR_GROUPS for name in group]
    # hidden 64, 4 heads of 16, 2 KV heads, intermediate 128 (tests/helpers_tiny.py defaults)
    shapes = {name: tuple(lin.weight.shape) for name, lin in linears.items()}
    assert shapes["self_attn.q_proj"] == (64, 64) and shapes["self_attn.k_proj"] == (32, 64)
    assert shapes["mlp.gate_proj"] == (128, 64) and shapes["mlp.down_proj"] == (64, 128)


def test_load_dtype_and_device(tiny_dirs: dict[str, Path], device: torch.device) -> None:
    loaded = load_model(str(tiny_dirs["llama"]), LOCAL_CTX, dtype=torch.bfloat16, device=device)
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
    assert "--model /path" in message and "drop --offline" in message and "--model smollm2-135m" in message


def test_unsupported_model_type(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    with pytest.raises(IncompatibleModelError, match="'gpt2' is not supported; supported types: llama, mistral, qwen2"):
        load_model(str(tmp_path), LOCAL_CTX)
    with pytest.raises(IncompatibleModelError, match="supported types"):
        adapter_for("falcon")
    assert supported_model_types() == ("llama", "mistral", "qwen2")


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_blockwise_matches_full(smollm2_path: Path) -> None:
    loaded = load_model("smollm2-135m", LOCAL_CTX)
    assert loaded.source == str(smollm2_path.resolve())
    assert len(loaded.adapter.decoder_layers(loaded.model)) == 30
    shapes = {n: tuple(m.weight.shape) for n, m in loaded.adapter.block_linears(loaded.model.model.layers[0]).items()}
    assert shapes["self_attn.k_proj"] == (192, 576) and shapes["mlp.down_proj"] == (576, 1536)
    text = "The quick brown fox jumps over the lazy dog. Transposable N:M sparsity accelerates training."
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        full = loaded.model(ids).logits
        mine = blockwise_logits(loaded, ids)
    torch.testing.assert_close(mine, full, atol=1e-4, rtol=1e-4)
