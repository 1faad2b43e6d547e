"""A model whose decoder blocks are read from its checkpoint one at a time: host memory of one block, not one model.

`skeleton` builds the model from its config with every parameter on the meta device (no memory) and
every buffer real (accelerate's ``init_empty_weights(include_buffers=False)``: rotary frequencies and
other buffers computed at construction, as from_pretrained has them). `load_resident` then reads what
lies outside the decoder blocks (token embedding, final norm, output head, a multimodal model's vision
tower) onto the device; `load_block` reads one block's tensors from the checkpoint (`Checkpoint`) onto
the device, and `release_block` puts its parameters back on the meta device once it has run.

Tensors are matched to parameters by their names in the model's state dict, which are the checkpoint's
keys for every family whose checkpoint transformers loads without renaming (the LLaMA-like ones). A
checkpoint stored under other names (legacy multimodal ``language_model.model.…``, per-expert MoE keys that
transformers fuses on load) lacks some of those keys: `models.loading.load_model` then loads it whole, with
one line naming the first, before any weight is read. Tied parameters (one object under several names,
e.g. a tied output head) are read once, from whichever of their names the checkpoint holds, and stay one
object. Each tensor takes the dtype its skeleton parameter has.

`release_block` also hands the heap's free memory back to the OS (`trim_heap`). glibc raises its mmap
threshold each time a large buffer allocated by mmap is freed, so the next buffers of that size come from
the heap, where freed space is kept. A streamed prune then grew by about half a block of retained heap
per block. At width 1024 it peaked at 1.70 GB in about one run in two, against 1.08 GB in the others. With
`trim_heap` after each block, four runs peaked at 1.08-1.37 GB, at the same speed (39 s). Fixing the threshold
instead (M_MMAP_THRESHOLD) held it at 1.07 GB but took 25% longer (48 s) (16 blocks;
docs/measurements/bench-memory.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tsenor_cli.errors import IncompatibleModelError
from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.models.structure import ModelStructure

META = torch.device("meta")


def skeleton(model_class: Any, config: Any, dtype: torch.dtype, *, trust_remote_code: bool = False) -> nn.Module:
    """`model_class.from_config(config)` in `dtype`, in eval mode, parameters on the meta device, buffers real."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    # init_empty_weights re-creates every parameter it registers, so the tie the model made at construction
    # (the output head assigned the embedding's parameter) came out as two objects: the model ties them again.
    model.tie_weights()
    return model.eval()


def _set(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put `value` (a Parameter or a buffer's tensor) in the place of `root`'s parameter or buffer `name`."""
    owner, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, leaf, value)


def _tied_groups(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[str]]:
    """The names of `named` grouped by tensor object (tied parameters share one), in first-seen order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _key_of(names: list[str], prefix: str, checkpoint: Checkpoint) -> str | None:
    """The checkpoint key holding the tensor known by `names` (relative to the module at `prefix`)."""
    return next((f"{prefix}{name}" for name in names if f"{prefix}{name}" in checkpoint.tensors), None)


def _missing(key: str, checkpoint: Checkpoint) -> IncompatibleModelError:
    return IncompatibleModelError(
        f"{checkpoint.folder} holds no tensor {key}: its tensors are stored under other names than the model's "
        "modules (transformers renames them on load), so it cannot be read block by block; evaluate it without "
        "--stream"
    )


def _load(root: nn.Module, prefix: str, names: list[list[str]], checkpoint: Checkpoint, device: torch.device) -> None:
    """Read the parameters `names` (tied groups, relative to `root`, whose full name is `prefix`) from
    `checkpoint` onto `device`, each in its skeleton dtype."""
    keys: list[str] = []
    for group in names:
        key = _key_of(group, prefix, checkpoint)
        if key is None:
            raise _missing(f"{prefix}{group[0]}", checkpoint)
        keys.append(key)
    for group, key in zip(names, keys, strict=True):
        like = root.get_parameter(group[0])
        tensor = checkpoint.read([key], dtype=like.dtype, device=device)[key]
        value = nn.Parameter(tensor, requires_grad=False)
        for name in group:
            _set(root, name, value)


def first_missing(model: nn.Module, checkpoint: Checkpoint) -> str | None:
    """The first parameter of `model` (one name of each tied group) that `checkpoint` does not hold under its
    state-dict name, None when it holds them all: checked before any weight is read."""
    for group in _tied_groups(model.named_parameters(remove_duplicate=False)):
        if _key_of(group, "", checkpoint) is None:
            return group[0]
    return None


def _block_prefixes(structure: ModelStructure) -> tuple[str, ...]:
    return tuple(f"{structure.blocks_name}.{index}." for index in range(len(structure.blocks)))


def load_resident(model: nn.Module, structure: ModelStructure, checkpoint: Checkpoint, device: torch.device) -> None:
    """Read every parameter outside the decoder blocks onto `device` and move every buffer outside them
    there (persistent ones the checkpoint holds are read from it, as from_pretrained reads them)."""
    prefixes = _block_prefixes(structure)

    def outside(name: str) -> bool:
        return not name.startswith(prefixes)

    params = [group for group in _tied_groups(model.named_parameters(remove_duplicate=False)) if outside(group[0])]
    _load(model, "", params, checkpoint, device)
    for name, buffer in model.named_buffers():
        if outside(name):
            stored = checkpoint.read([name], dtype=buffer.dtype)[name] if name in checkpoint.tensors else buffer
            _set(model, name, stored.to(device))


def load_block(structure: ModelStructure, index: int, checkpoint: Checkpoint, device: torch.device) -> nn.Module:
    """Block `index` with its parameters read from `checkpoint` onto `device` (its buffers moved there)."""
    block = structure.blocks[index]
    prefix = f"{structure.blocks_name}.{index}."
    _load(block, prefix, _tied_groups(block.named_parameters(remove_duplicate=False)), checkpoint, device)
    for name, buffer in block.named_buffers():
        key = f"{prefix}{name}"
        stored = checkpoint.read([key], dtype=buffer.dtype)[key] if key in checkpoint.tensors else buffer
        _set(block, name, stored.to(device))
    return block


def release_block(structure: ModelStructure, index: int) -> None:
    """Put block `index`'s parameters back on the meta device, freeing their memory (its buffers stay)."""
    block = structure.blocks[index]
    for group in _tied_groups(block.named_parameters(remove_duplicate=False)):
        param = block.get_parameter(group[0])
        empty = nn.Parameter(torch.empty_like(param, device=META), requires_grad=False)
        for name in group:
            _set(block, name, empty)
    trim_heap()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, None under another C library (whose allocator returns freed memory itself or
    offers no such call: nothing to do there)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    trim: Callable[[int], int] = libc.malloc_trim
    return trim


def trim_heap() -> None:
    """Return the free memory of the C heap to the OS (the module docstring says why)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
