"""The identity of an input checkpoint: what tells it from another at the same path without reading its
weights. It keys a run's result (`PruneConfig.result_hash`), so a checkpoint replaced at the same path
is another input, whose run is neither continued nor taken for done."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_INPUT_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
    "config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def _safetensors_header(path: Path) -> bytes:
    """The header of a safetensors file (its 8-byte length and the JSON of names, dtypes, shapes, offsets);
    b"" when the file is too short to hold one (the loader reports the damage)."""
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return b""
        return head + handle.read(int.from_bytes(head, "little"))


def checkpoint_identity(model: str) -> dict[str, Any] | None:
    """What tells this input checkpoint from another at the same path, without reading its weights:

    - a local folder: for each file that decides the weights (`_INPUT_FILES`) its size and modification
      time (any rewrite, a `cp` of another checkpoint over it included, moves it) and for safetensors the
      sha256 of the header (shapes and dtypes, even under a preserved time);
    - a hub id in the local cache: the snapshot's commit, which names the files' contents;
    - None for an embedded model (made from the GGUF inside the package) and a hub id not cached yet.

    Reading the headers takes milliseconds even for a sharded 8B checkpoint; hashing its 16 GB of weights
    would take a minute on every run and rerun.
    """
    from tsenor_cli.models.embedded import is_embedded

    if is_embedded(model):
        return None
    folder = Path(model).expanduser()
    if folder.is_dir():
        files: dict[str, Any] = {}
        for path in sorted({p for pattern in _INPUT_FILES for p in folder.glob(pattern) if p.is_file()}):
            stat = path.stat()
            entry: dict[str, Any] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
            if path.name.endswith(".safetensors"):
                entry["header_sha256"] = hashlib.sha256(_safetensors_header(path)).hexdigest()
            files[path.name] = entry
        return {"files": files}
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "config.json")
    except ValueError:  # HFValidationError: no hub id either, e.g. a missing folder (the loader says so)
        return None
    return {"hub_commit": Path(cached).parent.name} if isinstance(cached, str) else None


def identity_digest(model: str) -> str | None:
    """sha256 of `checkpoint_identity(model)` (None where that is None): what eval.json records of the model
    it evaluated, so that the same `tsenor eval` again, and `tsenor finetune`'s reuse of that evaluation,
    know the model is still the one on disk (`runfiles.output.finished_evaluation`)."""
    identity = checkpoint_identity(model)
    if identity is None:
        return None
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
