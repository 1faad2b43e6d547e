"""One safetensors file, written tensor by tensor: the header from the tensors' names, shapes and dtypes
alone, then each tensor's bytes at its offset, straight from the tensor's memory.

safetensors' own ``save_file`` first builds the whole file's contents in memory: a second copy of every
tensor it writes, for as long as the write takes. Written this way the file holds the same bytes
(`tests/test_saving.py` compares them with safetensors' own) and the writer holds no copy beyond a
non-contiguous tensor's, one at a time. That copy was the largest transient of a pruning run: the resume
state's hidden states, (S, T, H) two streams, 0.3 GB at 128 × 512 on SmolLM2 (docs/results.md, "Where the
peak memory is").

The layout is safetensors' (an 8-byte little-endian header length, the JSON header padded with spaces to 8
bytes, the data); the order of the data is its own, read from the header it writes for one-element
stand-ins, so that the rule stays the library's.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# safetensors pads its JSON header with spaces to a multiple of this many bytes.
HEADER_ALIGN = 8

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: its key, shape and dtype (what the file's header says)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @staticmethod
    def of(key: str, tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(key, tuple(tensor.shape), tensor.dtype)


def file_order(specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    """`specs` in the order safetensors lays their data out in a file (it sorts by dtype, then name), read
    from the header it writes for one-element stand-ins: the rule stays safetensors' own."""
    from safetensors.torch import save

    blob = save({spec.key: torch.zeros(1, dtype=spec.dtype) for spec in specs})
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header.pop("__metadata__", None)
    by_key = {spec.key: spec for spec in specs}
    return [by_key[key] for key in sorted(header, key=lambda key: header[key]["data_offsets"][0])]


def file_header(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None) -> tuple[bytes, dict[str, int]]:
    """(the first bytes of the safetensors file holding `specs`: length and padded JSON header,
    {key: offset of its data from the file's start}); metadata None: the header has none, as safetensors
    writes it. TypeError for metadata that does not map strings to strings (safetensors refuses it too)."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError(f"safetensors metadata maps strings to strings, not {dict(metadata)!r}")
    entries: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offsets: dict[str, int] = {}
    position = 0
    for spec in file_order(specs):
        entries[spec.key] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [position, position + spec.nbytes],
        }
        offsets[spec.key] = position
        position += spec.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGN)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {key: start + offset for key, offset in offsets.items()}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of `tensor` (moved to the CPU and made contiguous only when it is not),
    as safetensors stores them: a view of the tensor's memory, not a copy."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def write_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` as the safetensors file `path` (created or truncated; the caller makes it atomic):
    the bytes safetensors' ``save_file`` writes, without holding a copy of them."""
    header, offsets = file_header([TensorSpec.of(key, t) for key, t in tensors.items()], metadata)
    with Path(path).open("wb") as handle:
        handle.write(header)
        for key in sorted(offsets, key=offsets.__getitem__):
            handle.seek(offsets[key])
            handle.write(tensor_bytes(tensors[key]))
