"""A checkpoint is what its config.json says: its tensors against the model the config describes.

transformers builds a model from config.json and then fills it from the weight files: a parameter the
files lack is initialised at random (a warning), a tensor the model has no place for is dropped (a
warning), and a tensor of another shape stops the load (or, read block by block, a block of another
width). A config.json that disagrees with its weights (5 blocks said, 4 stored; 3 said, 4 stored; an
`intermediate_size` of 256 over weights of 128) so became a wrong model written with exit 0, or an
"unexpected" error after minutes of work.

`check_checkpoint` compares, before any weight is read and before any output exists, the tensors of a
local checkpoint folder (their names and shapes from the safetensors headers, `models/checkpoint.py`;
for pickle weights from ``torch.load(mmap=True)``, which maps the file and reads no tensor data) with
the model of its config built on the meta device (no memory), the way transformers matches them:

- each stored key is renamed as ``from_pretrained`` renames it (the model class's conversion mapping,
  e.g. Mllama's and LLaVA's legacy ``language_model.model.layers…``; the base-model prefix added or
  dropped). A key that transformers converts rather than renames (Mixtral's per-expert ``w1/w2/w3``
  fused into stacks) stands for its fused target: present, its shape not compared;
- tied parameters (one tensor under several names, e.g. a tied output head) need one of their names;
- the model's own exception rules hold (``_keys_to_ignore_on_load_missing`` and
  ``_keys_to_ignore_on_load_unexpected``, and the old checkpoints' ``rotary_emb.inv_freq`` and
  ``position_ids`` buffers that transformers ignores);
- refused: a parameter no stored key gives (missing), a stored tensor of another shape than the
  model's (mismatched), and a stored tensor inside a stack of repeated blocks (the decoder's, a vision
  encoder's) that the model has no place for (extra: a block beyond the config's count, a renamed
  tensor). Extra tensors elsewhere are left to transformers, which drops them as it always has.

One line names the first of each kind and their counts, and the block counts of the config and of the
weights when they differ (`CheckpointMismatchError`, exit 7). The plan (prune, its dry run), the load
(prune, eval, finetune, streamed or whole) and `tsenor verify` call it, so every command gives the
same verdict on the same folder, whichever way it reads the weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tsenor_cli.errors import CheckpointMismatchError

# How many names of each kind the line shows.
SHOWN = 3
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_WEIGHTS = "pytorch_model.bin"


@dataclass(frozen=True)
class Conformance:
    """What the stored tensors say against the model of the config: missing (the model's parameters no
    stored key gives), extra (stored tensors inside a stack of blocks the model has no place for),
    mismatched ({key: (the model's shape, the stored shape)}), and the decoder blocks of the config and
    of the weights (`stored_blocks`: how many distinct block indices the stored keys name)."""

    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    mismatched: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    config_blocks: int = 0
    stored_blocks: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.mismatched)

    def problem(self) -> str:
        """The line's problem part: the block counts (when they differ), then each kind with its count."""
        parts: list[str] = []
        if self.stored_blocks != self.config_blocks:
            parts.append(
                f"config.json describes {self.config_blocks} decoder block(s), the weights hold {self.stored_blocks}"
            )
        if self.missing:
            missing = _first(self.missing)
            parts.append(f"{len(self.missing)} tensor(s) of the model missing from the weights ({missing})")
        if self.extra:
            parts.append(f"{len(self.extra)} stored tensor(s) the model has no place for ({_first(self.extra)})")
        if self.mismatched:
            shown = "; ".join(
                f"{key}: config {_shape(want)}, stored {_shape(have)}"
                for key, (want, have) in list(self.mismatched.items())[:SHOWN]
            )
            more = f"; and {len(self.mismatched) - SHOWN} more" if len(self.mismatched) > SHOWN else ""
            parts.append(f"{len(self.mismatched)} tensor(s) of another shape ({shown}{more})")
        return "; ".join(parts)


def _first(names: Iterable[str]) -> str:
    listed = list(names)
    shown = ", ".join(listed[:SHOWN])
    return shown + (f" and {len(listed) - SHOWN} more" if len(listed) > SHOWN else "")


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(str(s) for s in shape) or "scalar"


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """{key: shape} of the weights in `folder`, read without their data: the safetensors headers
    (`Checkpoint.open`, which refuses a missing shard or a corrupt file in one line), else the pickle
    files mapped (``torch.load(mmap=True)``); None when the folder holds neither (a hub id's snapshot
    is not looked at, nor a pickle file torch cannot map: an old format, loaded whole as before)."""
    from tsenor_cli.models.checkpoint import INDEX_NAME, WEIGHTS_NAME, Checkpoint

    folder = Path(folder)
    if (folder / WEIGHTS_NAME).is_file() or (folder / INDEX_NAME).is_file():
        return {key: info.shape for key, info in Checkpoint.open(folder).tensors.items()}
    return _pickle_shapes(folder)


def _pickle_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    import torch

    index = folder / PICKLE_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            return None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    elif (folder / PICKLE_WEIGHTS).is_file():
        files = [folder / PICKLE_WEIGHTS]
    else:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            state = torch.load(str(file), map_location="cpu", mmap=True, weights_only=True)
        except Exception:  # noqa: BLE001  (not mappable: an old pickle format; transformers' own load judges it)
            return None
        if not isinstance(state, Mapping):
            return None
        shapes |= {str(key): tuple(value.shape) for key, value in state.items() if hasattr(value, "shape")}
        del state
    return shapes


def _stacks(model: Any) -> list[tuple[str, int]]:
    """(dotted name, length) of every module list of `model` that holds repeated blocks (outermost ones
    and those inside them alike: a decoder's layers, a vision encoder's layers, a block's experts)."""
    from torch import nn

    return [(name, len(module)) for name, module in model.named_modules() if isinstance(module, nn.ModuleList) and name]


def _ignored(patterns: Iterable[str]) -> re.Pattern[str] | None:
    listed = [p for p in patterns if p]
    return re.compile("|".join(f"({p})" for p in listed)) if listed else None


def conformance(model: Any, shapes: Mapping[str, tuple[int, ...]]) -> Conformance:
    """The stored tensors `shapes` ({key: shape}) against `model` (the config's model, on the meta
    device): see the module docstring for the rules."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from tsenor_cli.models.structure import discover_structure

    own = model.state_dict()
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    buffers = {name for name, _ in model.named_buffers()}
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        unexpected.add(r"(^|\.)position_ids$")
    skip_unexpected = _ignored(unexpected)
    skip_missing = _ignored(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())

    present: set[str] = set()
    extra: list[str] = []
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    renamed_keys: list[str] = []
    stacks = _stacks(model)
    for key, shape in shapes.items():
        renamed, converted = rename_source_key(key, renamings, converters, prefix, own)
        renamed_keys.append(renamed)
        if renamed in own:
            present.add(renamed)
            want = tuple(own[renamed].shape)
            if converted is None and want != tuple(shape):
                mismatched[renamed] = (want, tuple(shape))
            continue
        if skip_unexpected is not None and skip_unexpected.search(renamed):
            continue
        if any(renamed.startswith(f"{name}.") for name, _ in stacks):
            extra.append(key)

    missing: list[str] = []
    for group in _tied_groups(model):
        if any(name in present for name in group):
            continue
        if skip_missing is not None and all(skip_missing.search(name) for name in group):
            continue
        missing.append(group[0])

    structure = discover_structure(model)
    block = re.compile(rf"^{re.escape(structure.blocks_name)}\.(\d+)\.")
    indices = {int(m.group(1)) for m in map(block.match, renamed_keys) if m is not None}
    return Conformance(tuple(missing), tuple(extra), mismatched, len(structure.blocks), len(indices))


def _tied_groups(model: Any) -> list[list[str]]:
    """The parameter names of `model` grouped by tensor (tied parameters share one), and by
    transformers' own record of its ties (`all_tied_weights_keys`: {tied name: source name}), so a
    tie that a meta-device build left as two objects still counts as one."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    found = list(groups.values())
    ties = getattr(model, "all_tied_weights_keys", None) or {}
    if ties:
        where = {name: index for index, group in enumerate(found) for name in group}
        for tied, source in ties.items():
            a, b = where.get(tied), where.get(source)
            if a is None or b is None or a == b:
                continue
            found[a] += found[b]
            for name in found[b]:
                where[name] = a
            found[b] = []
        found = [group for group in found if group]
    return found


def check_checkpoint(folder: Path, model: Any, *, name: str | None = None) -> None:
    """CheckpointMismatchError (exit 7) when the weights in `folder` disagree with `model`, the model its
    config.json describes on the meta device (`conformance`); nothing when they agree, or when the
    folder holds no weights it can read without loading them (`stored_shapes` None: another check
    names what is wrong). name: how the user named the checkpoint (default: the folder)."""
    shapes = stored_shapes(Path(folder))
    if shapes is None:
        return
    found = conformance(model, shapes)
    if found.ok:
        return
    raise CheckpointMismatchError(
        f"the weights of {name or folder} do not match its config.json: {found.problem()}; pass a checkpoint whose "
        "config.json was saved with these weights (re-download or re-copy it), or fix config.json (nothing was written)"
    )
