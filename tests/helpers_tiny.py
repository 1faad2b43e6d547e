"""A tiny random LLaMA-family checkpoint for fast tests (shared by the model, data, eval and engine tests).

`make_tiny_llama(path)` writes config.json + model.safetensors + the SmolLM2 tokenizer files (copied
from the materialized embedded checkpoint, so token ids are real) and returns `path`. Weights come
from a seeded torch.Generator, so the same arguments give the same checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tsenor_cli.settings import RunContext, cache_dir_default

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# For loading local or embedded models in tests: no data folder, the hub never contacted.
LOCAL_CTX = RunContext(data_dir=None, offline=True, cache_dir=cache_dir_default())


def smollm2_dir() -> Path:
    from tsenor_cli.models.embedded import materialize

    return materialize("smollm2-135m", LOCAL_CTX.cache_dir)


def make_tiny_llama(
    path: Path,
    *,
    model_type: str = "llama",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> Path:
    """Save a random `model_type` (llama | mistral | qwen2) causal LM of the given size to `path`.

    vocab_size defaults to the SmolLM2 tokenizer's (49152) so the copied tokenizer is consistent.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    tok_src = smollm2_dir()
    if vocab_size is None:
        vocab_size = int(AutoConfig.from_pretrained(tok_src).vocab_size)
    config = AutoConfig.for_model(
        model_type,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        dtype="float32",
    )
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                # RMSNorm weights near 1 keep activations in a realistic range.
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for fname in TOKENIZER_FILES:
        src = tok_src / fname
        if src.is_file():
            shutil.copy2(src, path / fname)
    return path
