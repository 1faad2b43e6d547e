"""The safetensors weights of a local checkpoint folder, read tensor by tensor (no whole-model load).

A checkpoint holds its weights either in one ``model.safetensors`` or in shards named by
``model.safetensors.index.json`` (transformers' layout: ``{"metadata": …, "weight_map": {key: file}}``),
the same two files, in the same order of preference, that ``from_pretrained`` looks for.
`Checkpoint.open` reads only the headers: it checks every shard the index names exists, is a complete
safetensors file (safetensors checks that the header's offsets cover the file) and holds the keys the index
says it holds, so a bad checkpoint fails in one line before any weight is read:

- no safetensors weights at all (a folder of pickle ``pytorch_model*.bin``, or none): InputNotFoundError;
- a shard named in the index that is missing: InputNotFoundError (exit 3);
- an index that is not JSON or has no weight map, a key the index names that its shard lacks, a truncated
  or corrupt shard: BadInputError (exit 7).

Tensors are then read by key (`read`), each file memory-mapped only while its tensors are copied out
(``safe_open``), so host memory holds what was asked for, not the checkpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tsenor_cli.errors import BadInputError, InputNotFoundError, PackedFormatError, one_line
from tsenor_cli.packed.files import declares_packed, decode_matrix, read_patterns
from tsenor_cli.packed.layout import MatrixPattern
from tsenor_cli.runfiles import INDEX_NAME as INDEX_NAME
from tsenor_cli.runfiles import WEIGHTS_NAME as WEIGHTS_NAME

PICKLE_PATTERN = "pytorch_model*.bin"
# safetensors' dtype names (its header) → torch dtypes; what transformers checkpoints hold.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype` as stored in a safetensors file."""
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies and what it is, from its file's header: file (name in the folder), shape, dtype.

    A packed matrix (docs/reference/packed-format.md) is shown as the dense tensor it decodes to: its
    `pattern`, and `code`, the key of its code tensor in the same file; `nbytes` is then the dense size."""

    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pattern: MatrixPattern | None = None
    code: str | None = None

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


def _corrupt(path: Path, why: str) -> BadInputError | PackedFormatError:
    """The error of a file safetensors cannot read: a packed checkpoint's is the packed format's (exit 2)."""
    line = f"{path} is truncated or corrupt ({one_line(why)}); re-download or re-copy the checkpoint"
    return PackedFormatError(line) if declares_packed(path.parent) else BadInputError(line)


def _header(path: Path) -> dict[str, TensorInfo]:
    """{key: TensorInfo} from the header of the safetensors file `path` (no tensor data is read); a packed
    file's matrices as the dense tensors they decode to (`_dense_view`)."""
    if not path.is_file():
        raise InputNotFoundError(f"{path} is missing; copy every shard of the checkpoint into {path.parent}")
    found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            patterns = read_patterns(path, handle.metadata())
            names = handle.keys()
            for key in names:
                part = handle.get_slice(key)
                name = part.get_dtype()
                if name not in SAFETENSORS_DTYPES:
                    raise BadInputError(
                        f"{path}: tensor {key} has dtype {name}, which tsenor does not read; "
                        "pass a checkpoint in float32, bfloat16 or float16"
                    )
                found[key] = (tuple(int(s) for s in part.get_shape()), SAFETENSORS_DTYPES[name])
    except SafetensorError as exc:
        raise _corrupt(path, str(exc)) from exc
    except OSError as exc:
        raise _corrupt(path, exc.strerror or str(exc)) from exc
    return _dense_view(path, found, patterns or {})


def _dense_view(
    path: Path, found: dict[str, tuple[tuple[int, ...], torch.dtype]], patterns: dict[str, MatrixPattern]
) -> dict[str, TensorInfo]:
    """The tensors of one file by key, each packed matrix as the dense tensor it decodes to (its code
    tensor folded into it); PackedFormatError when a packed matrix's tensors do not fit its record."""
    infos = {key: TensorInfo(path.name, *spec) for key, spec in found.items()}
    for key, pattern in patterns.items():
        code = key + pattern.suffix
        if key not in found or code not in found:
            raise PackedFormatError(f"{path}: packed matrix {key} lacks its values or its code {code}; re-copy it")
        values_shape, dtype = found[key]
        expected = pattern.values_shape()
        if found[code] != (pattern.code_shape(), torch.uint8) or expected not in (None, values_shape):
            raise PackedFormatError(
                f"{path}: packed matrix {key}'s tensors do not have its record's shapes; re-copy it"
            )
        infos[key] = TensorInfo(path.name, pattern.stored_shape(), dtype, pattern, code)
        del infos[code]
    return infos


def read_weight_map(index: Path) -> dict[str, str]:
    """{key: shard file name} of a transformers index file; BadInputError when it is not one."""
    try:
        payload = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{index} is not valid JSON ({exc}); re-download or re-copy the checkpoint") from exc
    weight_map = payload.get("weight_map") if isinstance(payload, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInputError(
            f"{index} has no weight_map of tensor names to shard files; re-download or re-copy the checkpoint"
        )
    bad = [key for key, file in weight_map.items() if not isinstance(file, str) or Path(file).name != file]
    if bad:
        raise BadInputError(
            f"{index} maps {bad[0]} to {weight_map[bad[0]]!r}, not a file name in the checkpoint folder; "
            "re-download or re-copy the checkpoint"
        )
    return {str(key): str(file) for key, file in weight_map.items()}


class Checkpoint:
    """The safetensors tensors of one checkpoint folder, by key, in the order its files list them.

    tensors: {key: TensorInfo}, every tensor the checkpoint holds (a sharded checkpoint: those its index
    names). Build it with `Checkpoint.open`.
    """

    def __init__(self, folder: Path, tensors: Mapping[str, TensorInfo]) -> None:
        self.folder = folder
        self.tensors = dict(tensors)

    @classmethod
    def open(cls, folder: Path) -> Checkpoint:
        """Read the headers of the checkpoint in `folder` (see the module docstring for what is refused)."""
        folder = Path(folder)
        single, index = folder / WEIGHTS_NAME, folder / INDEX_NAME
        if single.is_file():
            return cls(folder, _header(single))
        if not index.is_file():
            pickles = sorted(p.name for p in folder.glob(PICKLE_PATTERN))
            held = f"it holds {', '.join(pickles[:2])}, pickle weights" if pickles else "it holds no weight files"
            raise InputNotFoundError(
                f"{folder} has no {WEIGHTS_NAME} nor {INDEX_NAME} ({held}); reading a checkpoint block by block "
                "needs safetensors weights: convert it with save_pretrained, or load it whole"
            )
        weight_map = read_weight_map(index)
        tensors: dict[str, TensorInfo] = {}
        codes: set[str] = set()
        for file in dict.fromkeys(weight_map.values()):
            path = folder / file
            if not path.is_file():
                raise InputNotFoundError(
                    f"{index.name} names the shard {file}, which is missing from {folder}; copy every shard of "
                    "the checkpoint into it"
                )
            header = _header(path)
            codes.update(info.code for info in header.values() if info.code is not None)
            for key in (k for k, f in weight_map.items() if f == file):
                if key in codes:
                    continue
                if key not in header:
                    raise BadInputError(
                        f"{index.name} places {key} in {file}, which does not hold it; the index and the shards "
                        "come from different checkpoints: re-download or re-copy the checkpoint"
                    )
                tensors[key] = header[key]
        return cls(folder, {key: tensors[key] for key in weight_map if key not in codes})

    def keys(self) -> list[str]:
        return list(self.tensors)

    def keys_under(self, prefix: str) -> list[str]:
        """The keys inside module `prefix` ("model.layers.3" → "model.layers.3.…", not "model.layers.30.…")."""
        start = f"{prefix}." if prefix else ""
        return [key for key in self.tensors if key.startswith(start)]

    def nbytes(self, keys: Iterable[str] | None = None) -> int:
        """Bytes the tensors `keys` (default: all) take in their stored dtypes."""
        chosen = self.tensors if keys is None else {key: self.tensors[key] for key in keys}
        return sum(info.nbytes for info in chosen.values())

    def read(
        self, keys: Iterable[str], *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """{key: tensor} of `keys`, cast to `dtype` (None: as stored) on `device`; each file is opened
        once and unmapped again before returning. KeyError names a key the checkpoint does not hold."""
        return dict(self.iter_read(keys, dtype=dtype, device=device))

    def iter_read(
        self, keys: Iterable[str], *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) of `keys` in the order given, one tensor at a time (see `read`)."""
        wanted = list(keys)
        missing = [key for key in wanted if key not in self.tensors]
        if missing:
            raise KeyError(f"{self.folder} holds no tensor {missing[0]}")
        with ExitStack() as stack:
            handles: dict[str, object] = {}
            for key in wanted:
                file = self.tensors[key].file
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(self.folder / file), framework="pt"))
                info = self.tensors[key]
                try:
                    tensor = handles[file].get_tensor(key)  # type: ignore[attr-defined]
                    if info.pattern is not None and info.code is not None:
                        code = handles[file].get_tensor(info.code)  # type: ignore[attr-defined]
                        tensor = decode_matrix(key, tensor, code, info.pattern, self.folder / file)
                except SafetensorError as exc:
                    raise _corrupt(self.folder / file, str(exc)) from exc
                # The tensor is backed by safetensors' mapping of the file, which it keeps alive past the
                # handle (measured: the resident set grows by its pages as they are touched); `.to` copies
                # it only where the device or the dtype changes.
                yield key, tensor.to(device=device, dtype=dtype or tensor.dtype)
