"""Tiny random decoder LMs for fast tests (shared by the model, data, eval, engine and architecture tests).

`make_tiny_llama(path)` writes config.json + model.safetensors + the SmolLM2 tokenizer files (copied
from the materialized embedded checkpoint, so token ids are real) and returns `path`; `random_causal_lm`
builds the same kind of model in memory. `ARCHITECTURES` holds, per supported family, the config
settings a tiny model needs (head_dim 16 where the family's default is large; sliding windows of 8
tokens, shorter than the test sequences, where the family has them). Weights come from a seeded
torch.Generator, so the same arguments give the same model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from tsenor_cli.settings import RunContext, cache_dir_default

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SLIDING_WINDOW = 8
# model_type → config overrides on top of make_tiny_llama's sizes (hidden 64, 4 heads of 16, 2 KV heads).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": SLIDING_WINDOW},  # every layer slides
    # layer_types: block 0 full attention, block 1 sliding (layers >= max_window_layers slide)
    "qwen2": {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW, "max_window_layers": 1},
    "qwen3": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": SLIDING_WINDOW},  # alternates sliding / full from block 0
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],  # local and global rotary embeddings too
    },
    "phi3": {},  # fused qkv_proj and gate_up_proj
    "olmo2": {},  # q/k norms after the projections, norms after attention and MLP
    "granite": {},  # embedding, residual, attention and logits multipliers
}


# For loading local or embedded models in tests: no data folder, the hub never contacted.
LOCAL_CTX = RunContext(data_dir=None, offline=True, cache_dir=cache_dir_default())


def smollm2_dir() -> Path:
    from tsenor_cli.models.embedded import materialize

    return materialize("smollm2-135m", LOCAL_CTX.cache_dir)


def random_causal_lm(
    model_type: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 256,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    **config_overrides: Any,
) -> Any:
    """A random fp32 `model_type` causal LM of the given size, in eval mode (config_overrides: e.g. ARCHITECTURES)."""
    from transformers import AutoConfig, AutoModelForCausalLM

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
        **config_overrides,
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
    return model.eval()


def make_tiny_llama(path: Path, *, vocab_size: int | None = None, **model_options: Any) -> Path:
    """Save `random_causal_lm(vocab_size=..., **model_options)` to `path`, with the SmolLM2 tokenizer files.

    model_options: random_causal_lm's (model_type, sizes, seed, config overrides).
    vocab_size defaults to the SmolLM2 tokenizer's (49152) so the copied tokenizer is consistent.
    """
    from transformers import AutoConfig

    tok_src = smollm2_dir()
    if vocab_size is None:
        vocab_size = int(AutoConfig.from_pretrained(tok_src).vocab_size)
    model = random_causal_lm(vocab_size=vocab_size, **model_options)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for fname in TOKENIZER_FILES:
        src = tok_src / fname
        if src.is_file():
            shutil.copy2(src, path / fname)
    return path


def _hidden_of(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def full_forward(model: Any, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids: (B, T) → (the last decoder block's output (B, T, H), logits (B, T, V)) of the model's own forward."""
    from tsenor_cli.models.structure import discover_structure

    last: list[torch.Tensor] = []
    block = discover_structure(model).blocks[-1]
    handle = block.register_forward_hook(lambda _m, _a, out: last.append(_hidden_of(out)))
    try:
        logits = model(input_ids).logits
    finally:
        handle.remove()
    return last[0], logits


@torch.no_grad()
def blockwise_forward(model: Any, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's path: captured block-0 inputs replayed through every block with the recorded arguments.

    input_ids: (B, T) → (last block's output (B, T, H), logits (B, T, V)). The logits come from the model's
    own forward with the last block's output replaced by the replayed one, so whatever the model does
    after the blocks (final norm, logit scaling or soft-capping) is its own.
    """
    from tsenor_cli.models.structure import discover_structure
    from tsenor_cli.pruning.engine import capture_block_inputs, run_block

    structure = discover_structure(model)
    inputs = capture_block_inputs(structure, input_ids, torch.device("cpu"))
    hidden = inputs.hidden  # (B, T, H)
    for index, block in enumerate(structure.blocks):
        out = torch.empty_like(hidden)
        run_block(block, hidden, inputs.calls[index], out)
        hidden = out

    def replace(_module: Any, _args: Any, output: Any) -> Any:
        return hidden if isinstance(output, torch.Tensor) else (hidden, *output[1:])

    handle = structure.blocks[-1].register_forward_hook(replace)
    try:
        logits = model(input_ids).logits
    finally:
        handle.remove()
    return hidden, logits
