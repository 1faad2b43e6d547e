"""Loading a packed checkpoint through transformers' quantizer extension point: its matrices made dense as they load.

config.json's ``quantization_config`` ({"quant_method": "tsenor_packed", ...}) makes transformers dispatch
the loading to the quantizer registered here (`register`, run when this module is imported, which
`import tsenor_cli` arranges the first time transformers' quantizers are imported). Its one conversion
takes each weight with its code tensor (``…weight`` + ``…weight_tsenor_mask`` or ``…weight_tsenor_index``)
and returns the dense weight (`packed.layout.decode`), so the model has no missing or unexpected keys and
is an ordinary dense model afterwards (the quantization entry is removed once the weights are in:
`save_pretrained` writes it dense).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from tsenor_cli.errors import PackedFormatError
from tsenor_cli.models.saving import source_layout
from tsenor_cli.packed.files import (
    FORMAT_VERSION,
    QUANT_METHOD,
    READABLE_VERSIONS,
    StoredTensor,
    decode_matrix,
    read_patterns,
    stored_tensors,
)
from tsenor_cli.packed.layout import SUFFIXES, MatrixPattern
from tsenor_cli.packed.pages import FAULT_BLOCK, MappedPages


class TsenorPackedConfig(QuantizationConfigMixin):
    """config.json's ``quantization_config`` of a packed checkpoint: the format version."""

    def __init__(self, format_version: int = FORMAT_VERSION, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
        self.format_version = format_version
        if str(format_version) not in READABLE_VERSIONS:
            raise PackedFormatError(
                f"the checkpoint is packed in format version {format_version}; this tsenor reads versions "
                f"{', '.join(READABLE_VERSIONS)}: upgrade tsenor"
            )


@dataclass(frozen=True)
class PackedSource:
    """One packed matrix of the checkpoint: its pattern and where its values and its code lie."""

    pattern: MatrixPattern
    values: StoredTensor
    code: StoredTensor


class PackedDecode(ConversionOps):
    """values + code → the dense weight, under the pattern its file records for the target parameter.

    The values and the code are the tensors transformers hands over: views of the shard's memory map (or
    their copies on the parameter's device). Each view faulted in pages of the map, which would stay in the
    process's resident set until the map closes, after the last weight, so the load's peak would hold the
    packed file's pages beside the dense matrices decoded from them; once a matrix is decoded, the map's
    pages of its values and code are dropped (`packed.pages`). The dense result is the parameter itself."""

    def __init__(self, quantizer: TsenorPackedQuantizer) -> None:
        self.quantizer = quantizer

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedDecode:
        # transformers deep-copies a converter for every checkpoint tensor it routes through it; the copies
        # must share the quantizer (its patterns are read-only), not clone every pattern record each time.
        return PackedDecode(self.quantizer)

    def convert(  # type: ignore[override]  # transformers passes full_layer_name by keyword
        self, input_dict: dict[str, Any], full_layer_name: str | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        def one(value: Any) -> torch.Tensor:
            return value[0] if isinstance(value, list) else value

        own = (kwargs.get("target_patterns") or ["weight"])[0]  # the values' name; the others are codes
        target = full_layer_name or own
        values = one(input_dict[own])
        codes = [name for name in input_dict if name != own]
        if not codes:
            return {target: self._stored_as_is(values)}
        source = self.quantizer.patterns.get(target)
        if source is None:
            raise PackedFormatError(f"{target} has a packed code but its file records no pattern for it")
        # Decoded where transformers placed the values (a GPU decodes faster), in the dtype it gave them.
        code_name = own + source.pattern.suffix
        if code_name not in input_dict:
            raise PackedFormatError(f"{target}: its file records a {source.pattern.encoding} code, not {codes[0]}")
        code = one(input_dict[code_name]).to(values.device)
        dense = decode_matrix(target, values, code, source.pattern, source.values.path)
        spans = [(part.offset, part.nbytes) for part in (source.values, source.code)]
        self.quantizer.pages.release(source.values.path, spans)
        return {target: dense}

    def _stored_as_is(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the file stores as it is (a norm, the embeddings): a small view of the shard's map is
        copied and its pages dropped, so that no later read of it (the first forward pass) maps again the
        large folio it shares with decoded matrices' pages; a large one (the embeddings) stays a view, read
        when first used, as a dense load leaves it."""
        if tensor.numel() * tensor.element_size() >= FAULT_BLOCK:
            return tensor
        span = self.quantizer.pages.view_span(tensor)
        if span is None:
            return tensor
        copy = tensor.clone()
        self.quantizer.pages.release(span[0], [span[1:]])
        return copy


class TsenorPackedQuantizer(HfQuantizer):
    """Reads the packed matrices' patterns from the shards' metadata before the weights load, decodes each
    one as it loads, and leaves a plain dense model."""

    requires_calibration = True
    # What the conversion sees: every weight (a packed one with its code) and every bias, which a packed
    # file stores as it is; a bias left a view of the shard's map would map again, when the forward pass
    # reads it, the large folio it shares with decoded matrices' bytes (`PackedDecode._stored_as_is`).
    serialized_names = {"weight": ["weight", *(f"weight{suffix}" for suffix in SUFFIXES)], "bias": ["bias"]}  # noqa: RUF012

    def __init__(self, quantization_config: QuantizationConfigMixin, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.patterns: dict[str, PackedSource] = {}
        self.pages = MappedPages()  # the shards' maps, for dropping the pages of consumed tensors

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> None:
        found: dict[str, PackedSource] = {}
        self.pages = MappedPages(Path(file) for file in kwargs.get("checkpoint_files") or ())
        for file in kwargs.get("checkpoint_files") or ():
            path = Path(file)
            with safe_open(str(path), framework="pt") as handle:
                patterns = read_patterns(path, handle.metadata()) or {}
            where = stored_tensors(path, [*patterns, *(key + pattern.suffix for key, pattern in patterns.items())])
            for key, pattern in patterns.items():
                found[key] = PackedSource(pattern, where[key], where[key + pattern.suffix])
        layout = source_layout(model, found) or {key: key for key in found}
        self.patterns = {own: found[key] for own, key in layout.items()}
        # A stack of experts is a parameter of its own name (``experts.gate_up_proj``, no ``.weight``): its
        # values and code are routed to the decoding by their last two names, which no linear's weight ends in.
        names = {".".join(key.split(".")[-2:]) for key in found if not key.endswith(".weight")}
        self.serialized_names = {
            **type(self).serialized_names,
            **{name: [name, *(name + suffix for suffix in SUFFIXES)] for name in sorted(names)},
        }

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> None:
        self.remove_quantization_config(model)

    def get_load_operations(self) -> dict[str, Any]:
        return {"dequantize": PackedDecode, "deserialize": PackedDecode}

    def get_weight_conversions(self) -> list[WeightConverter]:
        return [WeightConverter(names, param, [PackedDecode(self)]) for param, names in self.serialized_names.items()]

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return True


def register() -> None:
    """Register the packed format's config and quantizer with transformers (once per process)."""
    if QUANT_METHOD in AUTO_QUANTIZER_MAPPING:
        return
    register_quantization_config(QUANT_METHOD)(TsenorPackedConfig)
    register_quantizer(QUANT_METHOD)(TsenorPackedQuantizer)


def load(folder: str | Path, **kwargs: Any) -> Any:
    """The model of a checkpoint folder, packed or dense, with the class its config.json names (its
    ``architectures``), else AutoModelForCausalLM; kwargs go to ``from_pretrained``."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    return (cls or AutoModelForCausalLM).from_pretrained(str(folder), **kwargs)


register()
