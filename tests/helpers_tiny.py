"""Tiny random decoder LMs for fast tests (shared by the model, data, eval, engine and architecture tests).

`make_tiny_llama(path)` writes config.json + model.safetensors + the SmolLM2 tokenizer files (copied
from the materialized embedded checkpoint, so token ids are real) and returns `path`; `random_causal_lm`
builds the same kind of model in memory. `ARCHITECTURES` holds, per supported family, the config
settings a tiny model needs (head_dim 16 where the family's default is large; sliding windows of 8
tokens, shorter than the test sequences, where the family has them). Weights come from a seeded
torch.Generator, so the same arguments give the same model.

`MULTIMODAL` holds, per model type, a tiny config of a model whose language model is not the whole
model (Gemma-3, LLaVA, Qwen2-VL, Qwen2.5-VL, Idefics3, SmolVLM, Mllama: a vision tower, a projector
and a text decoder) or whose blocks are of several classes (Jamba, Mllama); `make_tiny_model` saves
one with the SmolLM2 tokenizer files and a processor file.

`sparsegpt_config` is the prune the resume and streaming tests share: SparseGPT (data-dependent masks,
so a wrong block input changes them), transposable 2:4 with the exhaustive solver, 4 × 32 tokens.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tsenor_cli.settings import RunContext, cache_dir_default

if TYPE_CHECKING:
    from tsenor_cli.pruning.settings.config import PruneConfig

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


# The text decoder of every MULTIMODAL model: LLaMA-sized as above, the SmolLM2 vocabulary.
TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 16,
}
QWEN_VL_TEXT = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
QWEN_VL_VISION = {"depth": 1, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
QWEN_VL_TOKENS = {"image_token_id": 49150, "video_token_id": 49151, "vision_start_token_id": 49149}
# model_type → the keyword arguments of its config (AutoConfig.for_model).
MULTIMODAL: dict[str, dict[str, Any]] = {
    "gemma3": {
        "text_config": {
            **TEXT,
            "head_dim": 16,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "vision_config": VISION,
        "mm_tokens_per_image": 4,
    },
    "llava": {
        "text_config": {"model_type": "llama", **TEXT},
        "vision_config": {"model_type": "clip_vision_model", **VISION, "projection_dim": 32},
        "image_token_index": 49151,
    },
    "qwen2_vl": {
        "text_config": QWEN_VL_TEXT,
        "vision_config": {**QWEN_VL_VISION, "embed_dim": 32, "hidden_size": 64},
        **QWEN_VL_TOKENS,
    },
    "qwen2_5_vl": {
        "text_config": QWEN_VL_TEXT,
        "vision_config": {
            **QWEN_VL_VISION,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [0],
        },
        **QWEN_VL_TOKENS,
    },
    "idefics3": {
        "text_config": {"model_type": "llama", **TEXT},
        "vision_config": VISION,
        "scale_factor": 2,
        "image_token_id": 49151,
    },
    "smolvlm": {
        "text_config": {"model_type": "llama", **TEXT},
        "vision_config": VISION,
        "scale_factor": 2,
        "image_token_id": 49151,
    },
    # Three blocks: self-attention, cross-attention to the image (skipped on text), self-attention.
    "mllama": {
        "text_config": {**TEXT, "num_hidden_layers": 3, "cross_attention_layers": [1]},
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_global_layers": 1,
            "attention_heads": 2,
            "image_size": 32,
            "patch_size": 16,
            "vision_output_dim": 64,
            "intermediate_layers_indices": [0],
            "max_num_tiles": 1,
            "supported_aspect_ratios": [[1, 1]],
        },
    },
    # Block 0: Mamba mixer and a dense MLP; block 1: attention and a mixture of 4 experts.
    "jamba": {
        **TEXT,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 16,
    },
}
# A processor file for make_tiny_model to save beside the weights (its content only needs to survive).
PROCESSOR_FILE = ("preprocessor_config.json", '{"do_resize": true, "size": {"height": 32, "width": 32}}\n')

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
    return randomized(AutoModelForCausalLM.from_config(config), seed)


def randomized(model: Any, seed: int) -> Any:
    """`model` with seeded random weights, in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                # RMSNorm weights near 1 keep activations in a realistic range.
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model.eval()


def random_model(model_type: str, *, seed: int = 0, **config_overrides: Any) -> Any:
    """A random fp32 `MULTIMODAL[model_type]` model, whole: the image-text-to-text class where transformers
    has one (Mllama's causal-LM class would be its text model alone), else the causal-LM class."""
    from transformers import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )

    config = AutoConfig.for_model(model_type, **{**MULTIMODAL[model_type], **config_overrides})
    auto = AutoModelForImageTextToText if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING else AutoModelForCausalLM
    return randomized(auto.from_config(config, dtype=torch.float32), seed)


def make_tiny_model(path: Path, model_type: str, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Save `random_model(model_type, ...)` to `path` with the SmolLM2 tokenizer files and `PROCESSOR_FILE`."""
    model = random_model(model_type, seed=seed, **config_overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for fname in TOKENIZER_FILES:
        src = smollm2_dir() / fname
        if src.is_file():
            shutil.copy2(src, path / fname)
    name, content = PROCESSOR_FILE
    (path / name).write_text(content, encoding="utf-8")
    return path


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
    from tsenor_cli.replay import capture_block_inputs, run_block

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


def sparsegpt_config(model: Path, calib: Path, output: Path | None, **changes: Any) -> PruneConfig:
    """The shared test prune of `model` on the text file `calib` into `output`, with `changes` on top."""
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig
    from tsenor_cli.pruning.settings.config import PruneConfig

    base = PruneConfig(
        model=str(model),
        matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True), solver="exhaustive"),
        method="sparsegpt",
        calib_data=str(calib),
        nsamples=4,
        seqlen=32,
        output=output,
    )
    return replace(base, **changes)


def refine_config(model: Path, calib: Path, output: Path | None, **changes: Any) -> PruneConfig:
    """The shared refined test prune: SparseGPT transposable 8:16 on 5 samples (odd: two processes get 3
    and 2, and an epoch's last step holds one sample), `--refine block` for 2 epochs at lr 1e-3, without a
    resume state; `changes` on top."""
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig
    from tsenor_cli.pruning.settings.config import RefineConfig

    base = sparsegpt_config(
        model,
        calib,
        output,
        matrix=MatrixPruneConfig(SparsityPattern.from_nm(8, 16, transposable=True)),
        nsamples=5,
        resume=False,
        refine=RefineConfig("block", 2, 1e-3),
    )
    return replace(base, **changes)
