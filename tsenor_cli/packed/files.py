"""The packed checkpoint's shards: written tensor by tensor with bounded memory; their metadata read back.

`PackedWriter.add(key, tensor, pattern)` takes the checkpoint's tensors one at a time (a pruned matrix
with its `MatrixPattern`, anything else with None, stored as it is); a packed matrix's size is only known
once it is encoded (an unstructured one keeps a count of its own), so each shard's tensor bytes go to a
data file as they come and the shard is assembled (header, then the bytes) when it is full: host memory
holds one tensor. Shards follow huggingface_hub's split rule on the stored sizes, in the order given; in
each shard the data lie in safetensors' own order (`tensorfile.file_header`): a shard's entries and data
are those ``safetensors.torch.save_file`` writes for its tensors, whatever order they came in, so a packed
prune and `tsenor pack` of its dense twin write the same bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tsenor_cli.errors import PackedFormatError, one_line
from tsenor_cli.packed.layout import MatrixPattern, decode, encode
from tsenor_cli.runfiles import CONFIG_FILE, INDEX_NAME, WEIGHTS_NAME, PrunedWeight, SparsityRecord, shard_names
from tsenor_cli.tensorfile import DTYPE_NAMES, TensorSpec, file_header

# Version 2 adds stacks of experts and transposed (Conv1D) parameters to the records; a version-1 file is
# a version-2 file without them, read as it is.
FORMAT_VERSION = 2
READABLE_VERSIONS = ("1", "2")
QUANT_METHOD = "tsenor_packed"
VERSION_KEY = "tsenor_packed_version"
PATTERNS_KEY = "tsenor_patterns"
# Bytes copied at a time from a shard's data file into the shard.
_COPY_CHUNK = 1 << 24


# The dtypes a packed file's tensors can have (safetensors' names: `tensorfile.DTYPE_NAMES`).
_STORED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8)


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file: the file, the first byte's offset from the
    file's start, the byte count, the dtype and the shape (from the file's header); the loader drops its
    memory map's pages of them once the matrix is decoded (`packed.pages`)."""

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def stored_tensors(path: Path, keys: Iterable[str]) -> dict[str, StoredTensor]:
    """{key: StoredTensor} of `keys` in the safetensors file `path`, from its header alone (a file safe_open
    has read already, which checks its offsets); PackedFormatError for a key it lacks or a dtype a packed
    matrix's tensors never have."""
    names = {DTYPE_NAMES[dtype]: dtype for dtype in _STORED_DTYPES}
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    found = {}
    for key in keys:
        entry = header.get(key)
        if not isinstance(entry, dict) or entry.get("dtype") not in names:
            raise PackedFormatError(f"{path}: packed tensor {key} is missing or of another dtype; re-copy it")
        start, end = entry["data_offsets"]
        found[key] = StoredTensor(path, 8 + length + start, end - start, names[entry["dtype"]], tuple(entry["shape"]))
    return found


@dataclass
class _Shard:
    """One shard being filled: its tensors (spec, offset in the data file) in the order they came, its
    patterns, its data file and size."""

    data: Path
    tensors: dict[str, tuple[TensorSpec, int]]
    patterns: dict[str, dict[str, Any]]
    size: int = 0

    def assemble(self, path: Path, metadata: Mapping[str, str]) -> None:
        """Write the shard as the safetensors file `path`: the header, then each tensor's bytes copied from
        the data file in the file's order."""
        header, offsets = file_header([spec for spec, _ in self.tensors.values()], metadata)
        with path.open("wb") as out, self.data.open("rb") as data:
            out.write(header)
            for key in sorted(offsets, key=offsets.__getitem__):
                spec, start = self.tensors[key]
                data.seek(start)
                left = spec.nbytes
                while left:
                    chunk = data.read(min(left, _COPY_CHUNK))
                    if not chunk:
                        raise OSError(f"{self.data} ended before {key}'s bytes")
                    out.write(chunk)
                    left -= len(chunk)


class PackedWriter:
    """The packed checkpoint's weight files in `folder` (a temporary folder: `atomic.atomic_dir`).

    max_shard_size: bytes of a shard (a parsed --max-shard-size). `add` every tensor once, then `finish`."""

    def __init__(self, folder: Path, max_shard_size: int) -> None:
        self.folder = Path(folder)
        self.limit = max_shard_size
        self.done: list[_Shard] = []
        self.current: _Shard | None = None

    def add(self, key: str, tensor: torch.Tensor, pattern: MatrixPattern | None) -> None:
        """Store `tensor` under `key`: packed (values under `key`, the code under key + its suffix) when
        `pattern` is given, else as it is."""
        tensor = tensor.detach().to("cpu").contiguous()
        if pattern is None:
            parts = [(key, tensor)]
        else:
            pattern = pattern.fitted(tuple(tensor.shape))
            values, code = encode(tensor, pattern)
            parts = [(key, values), (key + pattern.suffix, code)]
        size = sum(t.numel() * t.element_size() for _, t in parts)
        shard = self._shard_for(size)
        if pattern is not None:
            shard.patterns[key] = pattern.to_json()
        with shard.data.open("ab") as handle:
            for name, part in parts:
                shard.tensors[name] = (TensorSpec.of(name, part), shard.size)
                handle.write(part.reshape(-1).view(torch.uint8).numpy().data)
                shard.size += part.numel() * part.element_size()

    def _shard_for(self, size: int) -> _Shard:
        """The shard the next `size` bytes go to: a new one when they would pass the limit (huggingface_hub's rule)."""
        if self.current is not None and self.current.size and self.current.size + size > self.limit:
            self.done.append(self.current)
            self.current = None
        if self.current is None:
            self.current = _Shard(self.folder / f".shard-{len(self.done)}.data", {}, {})
            self.current.data.touch()
        return self.current

    def finish(self, total_parameters: int) -> list[str]:
        """Write every shard (and the index, with `total_parameters`, when there are several) → the shard
        file names."""
        shards = [*self.done, *([self.current] if self.current is not None else [])]
        names = shard_names(max(len(shards), 1))
        weight_map: dict[str, str] = {}
        for shard, name in zip(shards, names, strict=False):
            patterns = json.dumps(dict(sorted(shard.patterns.items())))  # by name, as the data are
            metadata = {"format": "pt", VERSION_KEY: str(FORMAT_VERSION), PATTERNS_KEY: patterns}
            shard.assemble(self.folder / name, metadata)
            shard.data.unlink()
            weight_map.update(dict.fromkeys(shard.tensors, name))
        if len(shards) > 1:
            total = sum(shard.size for shard in shards)
            sizes = {"total_parameters": total_parameters, "total_size": total}
            index: dict[str, Any] = {"metadata": sizes, "weight_map": weight_map}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return names[: len(shards)]


def read_patterns(path: Path, metadata: Mapping[str, str] | None) -> dict[str, MatrixPattern] | None:
    """{key: pattern} of the packed matrices of the shard `path` whose header metadata is `metadata`; None
    for a file that is not packed. PackedFormatError for an unknown format version or a bad record."""
    if not metadata or VERSION_KEY not in metadata:
        return None
    version = metadata[VERSION_KEY]
    if version not in READABLE_VERSIONS:
        raise PackedFormatError(
            f"{path} is packed in format version {version}; this tsenor reads versions {', '.join(READABLE_VERSIONS)}: "
            "upgrade tsenor, or unpack it with the tsenor that wrote it"
        )
    try:
        records = json.loads(metadata.get(PATTERNS_KEY, "{}"))
    except json.JSONDecodeError as exc:
        raise PackedFormatError(f"{path}: its {PATTERNS_KEY} metadata is not JSON ({one_line(str(exc))})") from exc
    if not isinstance(records, dict):
        raise PackedFormatError(f"{path}: its {PATTERNS_KEY} metadata is not a mapping of tensor names")
    return {str(key): MatrixPattern.from_json(value, f"{path} {key}") for key, value in records.items()}


def decode_matrix(
    key: str, values: torch.Tensor, code: torch.Tensor, pattern: MatrixPattern, where: Path
) -> torch.Tensor:
    """The dense weight `key` of the file `where`; its errors name both."""
    try:
        return decode(values, code, pattern)
    except PackedFormatError as exc:
        raise PackedFormatError(f"{where}: packed tensor {key}: {exc}; the file is damaged: re-copy it") from exc


def weight_files(folder: Path) -> Iterator[Path]:
    """The safetensors files of a checkpoint folder (single file, or the shards its index names)."""
    single, index = folder / WEIGHTS_NAME, folder / INDEX_NAME
    if single.is_file():
        yield single
    elif index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        yield from (folder / name for name in dict.fromkeys(weight_map.values()))


def quantization_entry() -> dict[str, Any]:
    """config.json's ``quantization_config`` of a packed checkpoint: what transformers dispatches its loading on."""
    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION}


def is_packed_entry(entry: Any) -> bool:
    """Whether a config's ``quantization_config`` (as config.json holds it) is the packed format's."""
    return isinstance(entry, dict) and entry.get("quant_method") == QUANT_METHOD


def drop_packed_entry(config: Any) -> None:
    """Remove the packed format's ``quantization_config`` from a transformers `config` read from a packed
    folder (any other quantization entry stays): it describes the files, not the model. tsenor's readers
    decode the matrices, as transformers' load does before it drops the entry too, so a run's config
    describes a dense model, and a dense output written from it is not declared packed."""
    if is_packed_entry(getattr(config, "quantization_config", None)):
        del config.quantization_config


def declares_packed(folder: Path) -> bool:
    """Whether the config.json of `folder` says its weights are packed (an unreadable config says not)."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and is_packed_entry(config.get("quantization_config"))


def record_patterns(sparsity: SparsityRecord) -> dict[str, MatrixPattern]:
    """{parameter: pattern} of the pruned parameters a packed checkpoint packs: a whole 2-D parameter, a
    transposed one (Conv1D: the pattern is the matrix's as pruned) and a stack of experts whose every
    expert was pruned; a stack some of whose experts were left dense (an expert no calibration token
    reached) is stored dense, as its dense experts follow no pattern."""
    pattern = sparsity.pattern
    stacks: dict[str, list[PrunedWeight]] = {}
    found: dict[str, MatrixPattern] = {}
    for entry in sparsity.pruned:
        if entry.shape is None:
            continue
        if entry.expert is not None:
            stacks.setdefault(entry.param, []).append(entry)
            continue
        found[entry.param] = MatrixPattern.of(
            pattern.kind, pattern.n, pattern.m, entry.shape, transposed=entry.transposed
        )
    dense_names = [weight.name for weight in sparsity.dense]
    for param, entries in stacks.items():
        experts = sorted(entry.expert for entry in entries if entry.expert is not None)
        base = entries[0].name.rpartition("[")[0]
        whole = experts == list(range(len(experts))) and not any(name.startswith(base + "[") for name in dense_names)
        if whole and len({(entry.shape, entry.transposed) for entry in entries}) == 1:
            first = entries[0]
            assert first.shape is not None  # entries without a shape were skipped above
            found[param] = MatrixPattern.of(
                pattern.kind, pattern.n, pattern.m, first.shape, experts=len(experts), transposed=first.transposed
            )
    return found
