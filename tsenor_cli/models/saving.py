"""Write a checkpoint tensor by tensor, with exactly the files ``save_pretrained`` writes, never holding the model.

``model.save_pretrained(folder, max_shard_size=S, save_original_format=False)`` (what tsenor wrote until
now) takes the whole state dict at once. `save_streamed` writes the same folder from an iterator of
(key, tensor) pairs: each tensor is written into its shard at its place as it arrives and then dropped,
so host memory holds one tensor, whatever the model's size. What it writes, and how it matches
transformers 5 (`tests/test_saving.py` compares the two byte for byte):

- which tensors: the model's state dict less the tied duplicates, as transformers' own
  ``remove_tied_weights_from_state_dict`` decides on the model (a meta-device skeleton is enough: tied
  parameters are one object there too), less ``_keys_to_ignore_on_save``; the tensors in state-dict order;
- the shards: huggingface_hub's split (``split_state_dict_into_shards_factory``): in that order, a new
  shard when the next tensor would pass ``max_shard_size``, a tensor larger than that alone in a shard of
  its own; one shard is ``model.safetensors``, several are ``model-0000k-of-0000n.safetensors`` with
  ``model.safetensors.index.json`` (``total_parameters``, ``total_size``, ``weight_map``; sorted keys,
  indent 2);
- each shard: a safetensors file with ``{"format": "pt"}`` metadata. Its header (the tensors' order in
  the file, their offsets, the padding) is fixed by the names, dtypes and shapes alone, so it is written
  first and each tensor's bytes go to their offset when the tensor comes (`tensorfile.py`). The order is
  safetensors' own, read from the header safetensors writes for one-element stand-ins of the same names
  and dtypes;
- config.json (``dtype`` and ``architectures`` set as save_pretrained sets them), generation_config.json
  for a model that generates, a remote-code model's code files (transformers' ``custom_object_save``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from tsenor_cli.errors import UsageError
from tsenor_cli.models.checkpoint import INDEX_NAME
from tsenor_cli.packed.files import PackedWriter, quantization_entry, record_patterns
from tsenor_cli.packed.layout import MatrixPattern
from tsenor_cli.runfiles import SPARSITY_KEY, SparsityRecord, shard_names
from tsenor_cli.tensorfile import TensorSpec, file_header, tensor_bytes

# save_pretrained's default; tsenor's outputs pass their own (pruning/run/output.MAX_SHARD_SIZE, `SavedModel`).
DEFAULT_MAX_SHARD_SIZE = "50GB"
SAFETENSORS_METADATA = {"format": "pt"}


def saved_tensors(model: Any) -> list[TensorSpec]:
    """The tensors save_pretrained(save_original_format=False) writes for `model` (real or on the meta
    device), in the order it writes them: see the module docstring."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    for ignored in getattr(model, "_keys_to_ignore_on_save", None) or ():
        kept.pop(ignored, None)
    return [TensorSpec(key, tuple(tensor.shape), tensor.dtype) for key, tensor in kept.items()]


# Left in a config by the conversion that made the source (transformers' GGUF loader names the GGUF's
# model there), not settings of the model.
STRAY_CONFIG_KEYS = ("_model_name_or_path",)
# How the tokenizer was loaded (transformers 5 records its from_pretrained flags in init_kwargs), not
# settings of the tokenizer: a copy of the output must not load offline-only.
STRAY_TOKENIZER_KEYS = ("local_files_only", "is_local", "trust_remote_code", "cache_dir", "force_download", "token")

# huggingface_hub's units for a shard size ("2GB", "500MB"): decimal, as its parse_size_to_int reads them.
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(size: int | str) -> int:
    """Bytes of a shard size: an integer, or digits and a unit of `SIZE_UNITS` ("2GB", "1.5 GB"); UsageError
    for anything else."""
    if isinstance(size, int):
        value: float = size
    else:
        text = size.strip()
        unit = text[-2:].upper()
        try:
            value = float(text[:-2].strip()) * SIZE_UNITS[unit]
        except (KeyError, ValueError):
            raise UsageError(f"shard size {size!r} is not a size; pass digits and a unit, e.g. 2GB or 500MB") from None
    if value <= 0:
        raise UsageError(f"shard size {size!r} must be positive, e.g. 2GB")
    return int(value)


def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int | str) -> list[list[TensorSpec]]:
    """huggingface_hub's split of `specs` (in order) into shards of at most `max_shard_size` bytes: a tensor
    that would pass it starts a new shard, one larger than it is a shard of its own (placed before the
    shard being filled, as the hub's split places it)."""
    limit = parse_size(max_shard_size)
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if spec.nbytes > limit:
            shards.append([spec])
            continue
        if size + spec.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        shards.append(current)
    return shards


def _shard_of(shards: Sequence[Sequence[TensorSpec]]) -> dict[str, tuple[int, TensorSpec]]:
    """{key: (its shard's number, its spec)}; ValueError for a key listed twice."""
    where: dict[str, tuple[int, TensorSpec]] = {}
    for number, shard in enumerate(shards):
        for spec in shard:
            if spec.key in where:
                raise ValueError(f"tensor {spec.key} is listed twice")
            where[spec.key] = (number, spec)
    return where


def _checked_shard(
    key: str, tensor: torch.Tensor, where: Mapping[str, tuple[int, TensorSpec]], written: set[str]
) -> int:
    """The shard `key` goes to; ValueError for a key not in `where`, one `written` already, or a tensor
    whose shape or dtype is not its spec's."""
    if key not in where:
        raise ValueError(f"tensor {key} is not one the checkpoint holds")
    if key in written:
        raise ValueError(f"tensor {key} was given twice")
    number, spec = where[key]
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise ValueError(
            f"tensor {key} is {tuple(tensor.shape)} {tensor.dtype}, the checkpoint expects {spec.shape} {spec.dtype}"
        )
    return number


def write_weights(
    folder: Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    total_parameters: int,
) -> list[str]:
    """Write the safetensors shards (and the index when there are several) of `specs` into `folder`,
    taking each tensor from `tensors` as it comes; returns the shard file names.

    tensors: (key, tensor) once per spec, in any order (the state-dict order keeps one shard open at a
    time); each must have its spec's shape and dtype. ValueError for a key not in `specs`, one given twice,
    a shape or dtype other than its spec's, or a spec never given (the files are then incomplete: write
    into a temporary folder, as `atomic.atomic_dir` gives).
    """
    shards = plan_shards(specs, max_shard_size)
    names = shard_names(len(shards))
    where = _shard_of(shards)
    left = [len(shard) for shard in shards]
    positions: list[dict[str, int]] = [{} for _ in shards]
    written: set[str] = set()
    handles: dict[int, IO[bytes]] = {}
    try:
        for key, tensor in tensors:
            number = _checked_shard(key, tensor, where, written)
            if number not in handles:
                header, positions[number] = file_header(shards[number], SAFETENSORS_METADATA)
                handles[number] = (folder / names[number]).open("wb")
                handles[number].write(header)
            handle = handles[number]
            handle.seek(positions[number][key])
            handle.write(tensor_bytes(tensor))
            written.add(key)
            left[number] -= 1
            if left[number] == 0:
                handles.pop(number).close()
    finally:
        for handle in handles.values():
            handle.close()
    missing = [spec.key for spec in specs if spec.key not in written]
    if missing:
        raise ValueError(f"{len(missing)} tensors were never given, e.g. {missing[0]}")
    if len(shards) > 1:
        index = {
            "metadata": {"total_parameters": total_parameters, "total_size": sum(spec.nbytes for spec in specs)},
            "weight_map": {spec.key: names[number] for number, shard in enumerate(shards) for spec in shard},
        }
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return names


def write_packed_weights(
    folder: Path,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    patterns: Mapping[str, MatrixPattern],
    *,
    max_shard_size: int | str,
    total_parameters: int,
) -> list[str]:
    """The packed checkpoint's shards of `specs` (docs/reference/packed-format.md): each tensor of `tensors`
    packed under patterns[its key] when it has one, else stored as it is; ValueError as `write_weights`."""
    writer = PackedWriter(folder, parse_size(max_shard_size))
    by_key = {spec.key: spec for spec in specs}
    for key, tensor in tensors:
        spec = by_key.pop(key, None)
        if spec is None:
            raise ValueError(f"tensor {key} is not one the checkpoint holds, or was given twice")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"tensor {key} is {tuple(tensor.shape)} {tensor.dtype}, the checkpoint expects {spec}")
        writer.add(key, tensor, patterns.get(key))
    if by_key:
        raise ValueError(f"{len(by_key)} tensors were never given, e.g. {next(iter(by_key))}")
    return writer.finish(total_parameters)


def model_tensors(model: Any, specs: Sequence[TensorSpec]) -> Iterable[tuple[str, torch.Tensor]]:
    """(key, tensor) of `specs` taken from `model`'s state dict (a model held whole), in their order."""
    state = model.state_dict()
    return ((spec.key, state[spec.key]) for spec in specs)


def _cast_spec(spec: TensorSpec, dtype: torch.dtype | None) -> TensorSpec:
    """`spec` as written in `dtype`: floating tensors take it, the others (ids, masks) keep theirs."""
    if dtype is None or not spec.dtype.is_floating_point:
        return spec
    return TensorSpec(spec.key, spec.shape, dtype)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def save_streamed(
    folder: Path,
    model: Any,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    layout: Mapping[str, str] | None = None,
    packed: Mapping[str, MatrixPattern] | None = None,
) -> list[str]:
    """What ``model.save_pretrained(folder, max_shard_size=…, save_original_format=False)`` writes, with the
    weights from `tensors` (key, tensor) one at a time (None: from `model` itself); returns the shard names.

    model: the transformers model the checkpoint is of, whole or a skeleton on the meta device (its
    config, generation config, class, dtype, parameter count and tied weights are what is read from it);
    its config gets ``dtype`` and ``architectures`` as save_pretrained sets them. tensors: every tensor of
    `saved_tensors(model)` once (`write_weights`). dtype: write the floating tensors in it, as
    ``model.to(dtype).save_pretrained(…)`` would (None: as they are), each cast as it passes. layout:
    {own key: key to write} (`source_layout`: the source checkpoint's names; a key it lacks keeps its own).
    packed: {own key: pattern} of the matrices to pack (`write_packed_weights`; config.json then gets the
    packed format's ``quantization_config``); None: the dense files save_pretrained writes.
    Write into a temporary folder (`atomic.atomic_dir`): a failure leaves the files incomplete.
    """
    from transformers.dynamic_module_utils import custom_object_save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    original = saved_tensors(model)
    named = layout or {}
    specs = [_cast_spec(TensorSpec(named.get(s.key, s.key), s.shape, s.dtype), dtype) for s in original]
    model.config.dtype = str(dtype or model.dtype).removeprefix("torch.")
    model.config.architectures = [type(model).__name__]
    if model.is_remote_code():
        custom_object_save(model, str(folder), config=model.config)
    if packed is not None:
        model.config.quantization_config = quantization_entry()
    try:
        model.config.save_pretrained(folder)
    finally:
        if packed is not None:
            del model.config.quantization_config  # the model in memory is dense
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
    given = model_tensors(model, original) if tensors is None else tensors
    written = ((named.get(key, key), tensor if dtype is None else _cast(tensor, dtype)) for key, tensor in given)
    total = int(model.num_parameters())
    if packed is not None:
        patterns = {named.get(key, key): pattern for key, pattern in packed.items()}
        return write_packed_weights(
            folder, specs, written, patterns, max_shard_size=max_shard_size, total_parameters=total
        )
    return write_weights(folder, specs, written, max_shard_size=max_shard_size, total_parameters=total)


def drop_stray_keys(config: Any) -> None:
    """Remove `STRAY_CONFIG_KEYS` from a transformers config (and its text config) before it is saved."""
    getter = getattr(config, "get_text_config", None)
    for where in {id(c): c for c in (config, getter(decoder=True) if getter is not None else config)}.values():
        for key in STRAY_CONFIG_KEYS:
            if key in vars(where):
                delattr(where, key)


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """tokenizer.save_pretrained without `STRAY_TOKENIZER_KEYS` in its tokenizer_config.json."""
    from transformers.tokenization_utils_base import TOKENIZER_CONFIG_FILE

    tokenizer.save_pretrained(folder)
    path = folder / TOKENIZER_CONFIG_FILE
    if path.is_file():
        settings = json.loads(path.read_text(encoding="utf-8"))
        kept = {key: value for key, value in settings.items() if key not in STRAY_TOKENIZER_KEYS}
        if kept != settings:
            path.write_text(json.dumps(kept, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class SavedModel:
    """What `save_model` writes of a model (a plain record): `model` and `tokenizer`, in `max_shard_size`
    shards (`--max-shard-size`).

    tensors: the weights as (key, tensor) one at a time (`pruning/run/writer.py`: a model whose blocks are on
    the meta device); None: `model`'s own. dtype: the dtype the floating weights are written in
    (`models.loading.output_dtype`: --dtype, else the checkpoint's own); None: the model's.
    layout: {the model's own key: the key to write} (`LoadedModel.layout`, `source_layout`): the tensors
    are saved under the source checkpoint's own names, so every class that loaded the source loads the
    output with the same keys (Mllama's ``language_model.model.layers…`` loads as
    ``MllamaForConditionalGeneration`` and, text only, as ``MllamaForCausalLM``; written under the
    model's names ``model.language_model.layers…`` the second finds none of its weights). None: the
    model's own names (``save_original_format=False``), which load with the model's own class: a hub
    source, pickle weights, or a layout transformers converts (Mixtral's per-expert ``w1/w2/w3`` merged
    into fused stacks) rather than renames. `tsenor_sparsity.json` lists the model's own parameter names;
    `tsenor verify` maps them to the files' keys the same way. packed: the pruned matrices of the sparsity
    record packed (`tsenor_cli.packed`); False: dense."""

    model: Any
    tokenizer: Any
    max_shard_size: int | str
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None
    dtype: torch.dtype | None = None
    layout: Mapping[str, str] | None = None
    packed: bool = False


def save_model(folder: Path, saved: SavedModel, sparsity: SparsityRecord) -> None:
    """save_pretrained's files of `saved` into `folder` (a temporary folder: `runfiles.write.write_model_folder`;
    safetensors, sharded, written tensor by tensor by `save_streamed`, byte for byte what save_pretrained
    writes) + the tokenizer, config.json with the sparsity's summary. What the source's conversion or our
    loading left in the config and the tokenizer's settings (`STRAY_CONFIG_KEYS`, `STRAY_TOKENIZER_KEYS`)
    is not written."""
    model = saved.model
    setattr(model.config, SPARSITY_KEY, sparsity.summary())
    drop_stray_keys(model.config)
    packed = record_patterns(sparsity) if saved.packed else None
    save_streamed(
        folder, model, saved.tensors, max_shard_size=saved.max_shard_size, dtype=saved.dtype,
        layout=saved.layout, packed=packed,
    )  # fmt: skip
    save_tokenizer(saved.tokenizer, folder)


def source_layout(model: Any, keys: Iterable[str]) -> dict[str, str] | None:
    """{the model's own key: the checkpoint key it was loaded from} for a checkpoint holding `keys`: each key
    renamed as from_pretrained renames it (transformers' conversion mapping for the model's class, e.g.
    Mllama's ``language_model.model.layers.0…`` → ``model.language_model.layers.0…``), so that the output
    can be written in the source's layout and load with every class the source loads with.

    None when the layout is not a renaming: a key that transformers converts (Mixtral's per-expert
    ``w1/w2/w3`` merged into fused stacks), or two keys renamed onto one. model: real or on the meta device.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    own = model.state_dict()
    layout: dict[str, str] = {}
    for key in keys:
        renamed, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, own)
        if converted is not None or renamed in layout:
            return None
        layout[renamed] = key
    return layout
