"""Writing into a run folder: the only code that puts a file into one, each through `tsenor_cli.atomic`.

The checkpoint folder (`write_model_folder`: the weights written by the caller's `weights` into a temporary
folder, then the sparsity record and the other files, renamed into place), a folder converted by `tsenor
pack`/`unpack` (`converted_folder`, `copy_run_files`), `eval.json` (`write_eval`), the model card
(`write_card`) and the pruned blocks a streamed run keeps beside its output (`kept_blocks_folder`,
`save_block_file`). The resume states are written by their own records (`resume.ResumeStore`,
`FinetuneState.write`), the sweep folder's files by `sweep.py`. Format writers (`models.saving`,
`packed.files`) fill the temporary folder these functions open; nothing else places a file in a run folder
(tests/test_layering.py).
"""

from __future__ import annotations

import errno
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tsenor_cli import atomic
from tsenor_cli.errors import OutputUnwritableError
from tsenor_cli.outputs import free_bytes, human_bytes, replacing
from tsenor_cli.progress import logger
from tsenor_cli.runfiles.run import (
    CONFIG_FILE,
    INDEX_NAME,
    MODEL_CARD,
    RESUME_DIR,
    SPARSITY_FILE,
    EvalReport,
    SparsityRecord,
    block_file,
)

if TYPE_CHECKING:
    import torch

# {file name: its content}, or a function giving them once the weights are written (a streamed run's
# report counts the nonzeros of the tensors as they pass).
Files = Mapping[str, str | bytes] | Callable[[], Mapping[str, str | bytes]]


@contextmanager
def _disk_full_is_one_line(output: Path) -> Iterator[None]:
    """A full disk (or quota) while the checkpoint is written → OutputUnwritableError; `atomic.atomic_dir`
    has removed the partial copy by then, so `output` is as it was (and a resume state in it stays)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OutputUnwritableError(
            f"the disk holding --output {output} filled up while the checkpoint was written "
            f"({exc.strerror or exc}); nothing was changed in {output}: free some space (about "
            f"{human_bytes(free_bytes(output))} are free now) and rerun, or choose another --output"
        ) from exc


def write_model_folder(output: Path, sparsity: SparsityRecord, files: Files, weights: Callable[[Path], None]) -> None:
    """A checkpoint folder: `weights(folder)` writes the model's files (`models.saving.save_model`: the
    safetensors, config.json, the tokenizer), then `SPARSITY_FILE` and `files`, all in a temporary sibling
    renamed into place (replacing an existing `output`: `output.prepare_output` allowed it).

    `atomic.atomic_dir` gives every file 0644 and every folder 0755 (the temporary folder is made
    private; a checkpoint is meant to be shared). A full disk is one line, `output` left as it was."""
    with _disk_full_is_one_line(output), atomic.atomic_dir(output, replace=True) as tmp:
        weights(tmp)
        (tmp / SPARSITY_FILE).write_text(json.dumps(sparsity.to_json(), indent=1) + "\n", encoding="utf-8")
        for name, content in (files() if callable(files) else files).items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                (tmp / name).write_text(content, encoding="utf-8")


@contextmanager
def converted_folder(output: Path, check: Callable[[], None]) -> Iterator[Path]:
    """The temporary folder of a checkpoint converted into `output` (`tsenor pack`/`unpack`), renamed into
    place (replacing an existing one) when the block ends without error; nothing is written otherwise.
    Under the output's lock, a killed conversion's leftovers put back or cleared first, then `check`
    (`outputs.replacing`)."""
    with replacing(output, logger.warning, check) as tmp:
        yield tmp


def copy_run_files(source: Path, folder: Path, quantization: dict[str, Any] | None) -> None:
    """Every file of the checkpoint `source` but its weights and resume state into `folder`, and its
    config.json with `quantization` as its ``quantization_config`` (None: without one)."""
    for entry in source.iterdir():
        weights = entry.suffix == ".safetensors" or entry.name == INDEX_NAME
        if entry.is_file() and not weights and entry.name != CONFIG_FILE and entry.name != RESUME_DIR:
            shutil.copy2(entry, folder / entry.name)
    config = json.loads((source / CONFIG_FILE).read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_eval(path: Path, report: EvalReport) -> None:
    """`report` as the eval.json at `path` (a run folder's `EVAL_FILE`, or where `tsenor eval --output` says)."""
    atomic.write_json(path, report.to_json())


def write_card(folder: Path, text: str) -> None:
    """The model card (`MODEL_CARD`) of the run folder `folder`."""
    atomic.write_text(folder / MODEL_CARD, text)


def kept_blocks_folder(output: Path) -> Path:
    """A new temporary folder beside `output` for the pruned blocks a streamed run without a resume state
    keeps until the write (named as `atomic.recover` cleans up after a kill); `remove_kept_blocks` ends it."""
    return Path(tempfile.mkdtemp(prefix=atomic.temp_prefix(output), dir=output.parent))


def save_block_file(folder: Path, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Block `index`'s tensors as its `block_file` in `folder` (atomically)."""
    atomic.save_safetensors(tensors, folder / block_file(index))


def remove_kept_blocks(folder: Path) -> None:
    """Remove a `kept_blocks_folder` and what it holds."""
    shutil.rmtree(folder, ignore_errors=True)
