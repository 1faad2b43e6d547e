"""What the layer-wise pruning engine needs to know about a decoder architecture.

The engine (paper Section 4, layer-wise reconstruction as in SparseGPT/Wanda/ALPS) runs the decoder
blocks one at a time on calibration activations. For that it needs: the block list, the embedding and
rotary pieces that produce the first block's input, the prunable linears of a block in the order their
inputs become available, and the keyword arguments a block's ``forward`` takes with the installed
transformers (5.x): position ids, rotary ``position_embeddings``, no KV cache and the causal mask.

LLaMA, Mistral and Qwen2 share this decoder structure, so one adapter serves all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tsenor_cli.errors import IncompatibleModelError

# Sequential groups: every linear in a group reads the same input, and a group's input only exists
# once the previous group's outputs are known (q/k/v → o → gate/up → down).
LLAMA_LINEAR_GROUPS: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


@dataclass(frozen=True)
class ModelAdapter:
    """Structural access to a LLaMA-like causal LM: ``model.model.{embed_tokens,layers,norm,rotary_emb}``."""

    name: str
    model_types: tuple[str, ...]
    linear_groups: tuple[tuple[str, ...], ...] = LLAMA_LINEAR_GROUPS

    @property
    def linear_names(self) -> tuple[str, ...]:
        """All prunable linears of one block, flattened in sequential-group order."""
        return tuple(name for group in self.linear_groups for name in group)

    def base(self, model: nn.Module) -> Any:
        """The decoder stack (``model.model``) of a causal LM."""
        inner = getattr(model, "model", None)
        if not isinstance(inner, nn.Module) or not hasattr(inner, "layers"):
            raise IncompatibleModelError(
                f"{type(model).__name__} has no .model.layers decoder stack; "
                f"pass a LLaMA-family causal LM ({', '.join(supported_model_types())})"
            )
        return inner

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        layers = self.base(model).layers
        if not isinstance(layers, nn.ModuleList):
            raise IncompatibleModelError(f"{type(model).__name__}.model.layers is not an nn.ModuleList")
        return layers

    def embed_tokens(self, model: nn.Module) -> nn.Module:
        return self.base(model).embed_tokens

    def rotary_emb(self, model: nn.Module) -> nn.Module:
        return self.base(model).rotary_emb

    def embed_and_rotary(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """(token embedding, rotary embedding) modules: what runs before block 0."""
        return self.embed_tokens(model), self.rotary_emb(model)

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.base(model).norm

    def lm_head(self, model: Any) -> nn.Module:
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Module):
            raise IncompatibleModelError(f"{type(model).__name__} has no output embedding (lm_head)")
        return head

    def embed(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: (B, T) long → hidden states (B, T, H) in the model's dtype."""
        return self.embed_tokens(model)(input_ids)

    def block_linears(self, block: nn.Module) -> dict[str, nn.Linear]:
        """The prunable linears of one decoder block by dotted name (e.g. "self_attn.q_proj")."""
        found: dict[str, nn.Linear] = {}
        for name in self.linear_names:
            module = block.get_submodule(name)
            if not isinstance(module, nn.Linear):
                raise IncompatibleModelError(
                    f"{name} in {type(block).__name__} is {type(module).__name__}, not nn.Linear"
                )
            found[name] = module
        return found

    def block_forward_kwargs(
        self,
        model: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        layer_index: int | None = None,
    ) -> dict[str, Any]:
        """Keyword arguments for ``block(hidden_states, **kwargs)``, the same the full model passes.

        hidden_states: (B, T, H), the input of the block (only its shape, dtype and device are used).
        attention_mask: optional (B, T) padding mask (1 = token, 0 = pad); None means no padding.
        layer_index: which block the kwargs are for; needed only when the model mixes full and
        sliding-window attention layers (Qwen2 with use_sliding_window), whose masks differ.
        Returns position_ids (1, T), position_embeddings (cos, sin) each (1, T, head_dim), the
        attention mask (None when SDPA's is_causal path applies), past_key_values=None, use_cache=False.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be (B, T, H), got shape {tuple(hidden_states.shape)}")
        base = self.base(model)
        config = base.config
        seq_len = hidden_states.shape[1]
        position_ids = torch.arange(seq_len, device=hidden_states.device).unsqueeze(0)  # (1, T)
        position_embeddings = base.rotary_emb(hidden_states, position_ids)
        layer_type = self._layer_type(config, layer_index)
        mask_kwargs: dict[str, Any] = {
            "config": config,
            "inputs_embeds": hidden_states,
            "attention_mask": attention_mask,
            "past_key_values": None,
            "position_ids": position_ids,
        }
        if layer_type == "full_attention":
            # Mistral applies its sliding window to every layer when config.sliding_window is set.
            uses_window = getattr(config, "model_type", "") == "mistral" and config.sliding_window is not None
            mask = (create_sliding_window_causal_mask if uses_window else create_causal_mask)(**mask_kwargs)
        elif layer_type == "sliding_attention":
            mask = create_sliding_window_causal_mask(**mask_kwargs)
        else:
            raise IncompatibleModelError(f"unsupported attention layer type {layer_type!r}")
        return {
            "attention_mask": mask,
            "position_ids": position_ids,
            "position_embeddings": position_embeddings,
            "past_key_values": None,
            "use_cache": False,
        }

    @staticmethod
    def _layer_type(config: Any, layer_index: int | None) -> str:
        layer_types = getattr(config, "layer_types", None)
        if not layer_types:
            return "full_attention"
        if layer_index is not None:
            return str(layer_types[layer_index])
        distinct = set(layer_types)
        if len(distinct) != 1:
            raise IncompatibleModelError(
                f"this model mixes attention layer types {sorted(distinct)}; "
                "pass layer_index to block_forward_kwargs for each block"
            )
        return str(layer_types[0])


LLAMA_LIKE = ModelAdapter(name="llama-like", model_types=("llama", "mistral", "qwen2"))

ADAPTERS: dict[str, ModelAdapter] = {model_type: LLAMA_LIKE for model_type in LLAMA_LIKE.model_types}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(ADAPTERS))


def adapter_for(model_type: str) -> ModelAdapter:
    """The adapter for a ``config.model_type``; IncompatibleModelError for any other architecture."""
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise IncompatibleModelError(
            f"model type {model_type!r} is not supported; supported types: {', '.join(supported_model_types())}"
        )
    return adapter


def adapter_for_model(model: nn.Module) -> ModelAdapter:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise IncompatibleModelError(f"{type(model).__name__} has no config.model_type; pass a HF causal LM")
    return adapter_for(model_type)
