"""Resume state of a pruning run, kept in OUTPUT/.tsenor-resume/ (safetensors + JSON only): `ResumeStore`.

After block i is pruned the store writes, each file atomically (tsenor_cli.atomic):

1. ``block_<i>.safetensors``: the block's pruned parameters;
2. ``hidden_<i>.safetensors``: the hidden states (S, T, H) leaving it, the input of block i+1 (not
   written after the last block, which nothing reads), and with `--refine block` under ``dense`` the
   dense model's hidden states there (the dense stream, pruning/block/refine.py);
3. ``state.json`` (its schema is `runfiles.ResumeState`): the commit point. It names the next block,
   the hidden-states file to read and the size and sha256 of every file it relies on, plus the layer
   records and the calibration source;
4. the previous ``hidden_<i-1>.safetensors`` is deleted.

The run's `hooks.ResumeHook` calls it on the background writer's thread (`background.py`), one
block at a time in block order, so this order and what a kill leaves are the same as when it ran in the block loop.

Files are named by block and never rewritten with other contents, so a kill at any point leaves the
state.json of step 3 before or after, and every file that one names complete: resuming never reads a
block's own output as its input. What a kill leaves unnamed (a new file before its state.json, the
previous hidden states before step 4, a temporary) is deleted when the state is next opened. A
state.json that cannot be read or names a missing file, or one of another size or sha256, is damaged:
one line (`ResumeStateError`), never a traceback.

The state belongs to one run's settings and one input: its key (`PruneConfig.result_hash`) takes the
input checkpoint's identity (`models/identity.checkpoint_identity`), so a checkpoint replaced at the same path between
a kill and the rerun is another run, never continued with blocks pruned from the old weights.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from tsenor_cli import atomic
from tsenor_cli.errors import OutputUnwritableError, ResumeStateError, SchemaError
from tsenor_cli.outputs import free_bytes, human_bytes
from tsenor_cli.runfiles.run import (
    PRUNE_STATE_VERSION,
    RESUME_DIR,
    RESUME_STATE_FILE,
    BlockRefinement,
    LayerRecord,
    ResumeState,
    block_file,
    block_range,
    hidden_file,
)
from tsenor_cli.runfiles.schema import DataSource

# What this store writes in its folder: its files and their atomic temporaries (.NAME.tmp-<pid>-…).
_OWN_FILE = re.compile(
    rf"\.?({re.escape(RESUME_STATE_FILE)}|(block|hidden)_[0-9]{{4}}\.safetensors)(\.tmp-[0-9]+-[A-Za-z0-9_]+)?"
)


def disk_full(exc: BaseException) -> str | None:
    """How a write failed for want of space (a full disk or quota: "No space left on device"), None when
    it failed otherwise. safetensors' writer reports the OS error inside its own SafetensorError's text."""
    if isinstance(exc, OSError):
        return (exc.strerror or str(exc)) if exc.errno in (errno.ENOSPC, errno.EDQUOT) else None
    text = str(exc)
    for sign, why in (
        ("No space left", "No space left on device"),
        ("os error 28", "No space left on device"),
        ("StorageFull", "No space left on device"),
        ("Disk quota", "Disk quota exceeded"),
        ("os error 122", "Disk quota exceeded"),
    ):
        if sign in text:
            return why
    return None


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 4 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while piece := handle.read(4 << 20):
            digest.update(piece)
    return digest.hexdigest()


@dataclass(frozen=True)
class StateKey:
    """What every committed state of one run repeats: the run's `result_hash` (the key a rerun must match),
    the calibration text's description and source, and the model's block count."""

    config_hash: str
    calibration: str
    calibration_source: DataSource
    blocks: int


@dataclass(frozen=True)
class BlockSave:
    """One block's commit (`ResumeStore.save_block`): block `index` pruned, as a module or its state dict
    (the background writer's snapshot, `hooks.ResumeHook`); `hidden` (S, T, H) the input of block
    index+1, None after the last block; the layer records of blocks 0..index; with `--refine block` the
    dense stream's (S, T, H) there (`dense`, saved beside `hidden`) and the records of the blocks refined
    so far (`refinement`)."""

    index: int
    block: nn.Module | Mapping[str, torch.Tensor]
    hidden: torch.Tensor | None
    records: list[LayerRecord]
    dense: torch.Tensor | None = None
    refinement: tuple[BlockRefinement, ...] = ()


def _damaged(root: Path, why: str) -> ResumeStateError:
    return ResumeStateError(
        f"the resume state in {root} is damaged ({why}); pass --force to start over, or delete {root}"
    )


def _parse_state(root: Path, raw: object, config_hash: str) -> ResumeState:
    """`raw` (state.json's JSON) as the state of the run keyed `config_hash`: ResumeStateError when it was
    written by another tsenor version, for other settings, or is not a state at all."""
    if not isinstance(raw, dict):
        raise _damaged(root, f"{RESUME_STATE_FILE} is not a JSON object")
    version = ResumeState.version_of(raw)
    if version != PRUNE_STATE_VERSION:
        raise ResumeStateError(
            f"the resume state in {root} was written by another tsenor version (state version "
            f"{version!r}, this one reads {PRUNE_STATE_VERSION}); pass --force to start over"
        )
    if raw.get("config_hash") != config_hash:
        raise ResumeStateError(
            f"the resume state in {root} was made with different settings or from another input "
            "checkpoint (its files changed since); rerun the same command on the same checkpoint to "
            "continue it, or pass --force to start over"
        )
    try:
        return ResumeState.from_json(raw, RESUME_STATE_FILE)
    except SchemaError as exc:
        raise _damaged(root, str(exc)) from exc


def _check_files(root: Path, state: ResumeState, blocks: int) -> None:
    """ResumeStateError unless `state` is of a model with `blocks` blocks and names exactly the files of its
    blocks, each in `root` with the size and sha256 it records."""
    if state.blocks != blocks:
        raise ResumeStateError(
            f"the resume state in {root} is for a model with {state.blocks} blocks, not {blocks}; "
            "pass --force to start over"
        )
    expected = {block_file(i) for i in range(state.next_block)}
    if state.hidden is not None:
        expected.add(state.hidden)
    if not 1 <= state.next_block <= blocks or (state.hidden is None) != (state.next_block == blocks):
        raise _damaged(root, f"next block {state.next_block} of {blocks} with hidden states {state.hidden}")
    if set(state.files) != expected:
        raise _damaged(root, f"{RESUME_STATE_FILE} lists {sorted(state.files)}, not the files of its blocks")
    for name, size in state.files.items():
        path = root / name
        if not path.is_file():
            raise _damaged(root, f"{name} is missing")
        if path.stat().st_size != size:
            raise _damaged(root, f"{name} has {path.stat().st_size} bytes, {RESUME_STATE_FILE} says {size}")
        if file_sha256(path) != state.digests.get(name):
            raise _damaged(root, f"{name} does not have the sha256 {RESUME_STATE_FILE} records")


@contextmanager
def _full_disk_is_one_line(root: Path, previous: ResumeState | None) -> Iterator[None]:
    """A full disk (or quota) while the resume state is written → OutputUnwritableError (exit 4), as the
    final write gives it: the block and hidden-state files are written by safetensors' own code, and a
    disk that filled up there was "unexpected SafetensorError". The state committed before
    (`previous`) stays whole, and the line says what it holds."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        why = disk_full(exc)
        if why is None:
            raise
        done = previous.next_block if previous is not None else 0
        held = f"the resume state holds {block_range(done)}" if done else ""
        output = root.parent
        raise OutputUnwritableError(
            f"the disk holding --output {output} filled up while the resume state was written ({why}); "
            + (f"{held}: free some space" if held else "no block is saved yet: free some space")
            + f" (about {human_bytes(free_bytes(output))} are free now) and rerun the same command to "
            "continue, or choose another --output"
        ) from exc


class ResumeStore:
    """The resume folder of one output directory; `save_block` after each block, `load` to continue."""

    def __init__(self, output: Path) -> None:
        self.root = Path(output) / RESUME_DIR

    @property
    def state_path(self) -> Path:
        return self.root / RESUME_STATE_FILE

    def exists(self) -> bool:
        return self.root.is_dir()

    def size(self) -> int:
        """Bytes the folder takes now (0 when it does not exist)."""
        if not self.root.is_dir():
            return 0
        return sum(entry.stat().st_size for entry in self.root.iterdir() if entry.is_file())

    def discard(self) -> None:
        """Delete the folder and everything in it."""
        if self.root.is_dir():
            shutil.rmtree(self.root)

    def load(self, config_hash: str, blocks: int) -> ResumeState | None:
        """The committed state, None when there is none; removes what a kill left unnamed.

        ResumeStateError when the state is damaged, belongs to other settings or another tsenor
        version, or when the folder holds files this store never writes (another command's state).
        `blocks`: the model's block count, which a state must match.
        """
        if not self.root.is_dir():
            return None
        foreign = sorted(entry.name for entry in self.root.iterdir() if not _OWN_FILE.fullmatch(entry.name))
        if foreign:
            raise ResumeStateError(
                f"{self.root} holds files tsenor prune does not write ({', '.join(foreign[:4])}), "
                "e.g. another command's resume state; pass --force to start over"
            )
        if not self.state_path.is_file():
            # Killed before the first block's state.json: nothing was committed.
            self.discard()
            return None
        try:
            raw = json.loads(self.state_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _damaged(self.root, f"{RESUME_STATE_FILE} is unreadable: {exc}") from exc
        state = _parse_state(self.root, raw, config_hash)
        _check_files(self.root, state, blocks)
        for entry in self.root.iterdir():
            if entry.name != RESUME_STATE_FILE and entry.name not in state.files:
                entry.unlink()
        return state

    def _save(self, name: str, tensors: Mapping[str, torch.Tensor]) -> tuple[int, str]:
        """Write `tensors` as `name` in the folder (atomically); its size and sha256."""
        path = self.root / name
        atomic.save_safetensors(tensors, path)
        return path.stat().st_size, file_sha256(path)

    def save_block(self, save: BlockSave, key: StateKey, previous: ResumeState | None) -> ResumeState:
        """Commit that blocks 0..save.index are done (the order of the module docstring); returns the new
        state. previous: the state committed after block index-1 (None for the first block of a fresh run)."""
        with _full_disk_is_one_line(self.root, previous):
            self.root.mkdir(parents=True, exist_ok=True)
            files = dict(previous.files) if previous is not None else {}
            digests = dict(previous.digests) if previous is not None else {}
            old_hidden = previous.hidden if previous is not None else None
            if old_hidden is not None:
                del files[old_hidden]
                digests.pop(old_hidden, None)
            name = block_file(save.index)
            block = save.block
            tensors = dict(block.state_dict()) if isinstance(block, nn.Module) else dict(block)
            files[name], digests[name] = self._save(name, tensors)
            new_hidden = None
            if save.hidden is not None:
                new_hidden = hidden_file(save.index)
                streams = {"hidden": save.hidden} | ({"dense": save.dense} if save.dense is not None else {})
                files[new_hidden], digests[new_hidden] = self._save(new_hidden, streams)
            state = ResumeState(
                key.config_hash, save.index + 1, key.blocks, new_hidden, files, list(save.records),
                key.calibration, key.calibration_source, tuple(save.refinement), digests,
            )  # fmt: skip
            atomic.write_json(self.state_path, state.to_json(), indent=1)
            if old_hidden is not None:
                (self.root / old_hidden).unlink(missing_ok=True)
            return state

    def restore_blocks(self, blocks: nn.ModuleList, state: ResumeState) -> None:
        """Load the saved pruned parameters of blocks 0..next_block-1 into `blocks` (on the CPU)."""
        for index in range(state.next_block):
            name = block_file(index)
            try:
                blocks[index].load_state_dict(load_file(str(self.root / name)), strict=True)
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise _damaged(self.root, f"{name} does not load into block {index}: {exc}") from exc

    def load_hidden(
        self, state: ResumeState, device: torch.device, rows: slice | None = None, *, stream: str = "hidden"
    ) -> torch.Tensor:
        """(S, T, H) hidden states entering block `state.next_block`, on `device`; rows: only these samples
        (a rank's shard in a distributed run), read without loading the others. stream: "hidden" (the
        pruned model's) or "dense" (the dense model's, saved by runs with `--refine block`)."""
        if state.hidden is None:
            raise ValueError("every block is done; there are no hidden states to continue from")
        try:
            if rows is None:
                hidden = load_file(str(self.root / state.hidden))[stream]
            else:
                with safe_open(str(self.root / state.hidden), framework="pt") as handle:
                    hidden = handle.get_slice(stream)[rows]
        except (SafetensorError, OSError, KeyError) as exc:
            raise _damaged(self.root, f"{state.hidden} does not load: {exc}") from exc
        if hidden.dim() != 3:
            raise _damaged(self.root, f"{state.hidden} holds a tensor of shape {tuple(hidden.shape)}, not (S, T, H)")
        return hidden.to(device)
