"""The output folder: refused when it exists (unless --force / --resume), written atomically at the end."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tsenor_cli import atomic
from tsenor_cli.errors import OutputExistsError, UsageError
from tsenor_cli.pruning.resume import RESUME_DIRNAME, ResumeStore
from tsenor_cli.runfiles import PRUNE_FILE, PRUNE_MARKDOWN, PruneReport

SPARSITY_KEY = "tsenor_sparsity"
MAX_SHARD_SIZE = "2GB"


def prepare_output(output: Path, *, force: bool, resume: bool) -> ResumeStore | None:
    """Check `output` before any work; returns the resume store when --resume is set.

    Allowed: a missing or empty folder; with --resume, a folder holding only a resume state; with
    --force, anything (replaced at the very end, never earlier).
    """
    if output.exists():
        if not output.is_dir():
            raise OutputExistsError(f"--output {output} is a file; choose a directory path for the checkpoint")
        entries = {p.name for p in output.iterdir()}
        if entries == {RESUME_DIRNAME}:
            if not resume and not force:
                raise OutputExistsError(
                    f"{output} holds an interrupted run; pass --resume to continue it or --force to start over"
                )
            if not resume:
                shutil.rmtree(output / RESUME_DIRNAME)
        elif entries and not force:
            raise OutputExistsError(
                f"output directory {output} already exists and is not empty; pass --force to replace it "
                "or choose another --output"
            )
    return ResumeStore(output) if resume else None


def check_not_input(output: Path, source: str) -> None:
    """The input checkpoint is never touched: refuse an output that is (or contains) it."""
    src = Path(source)
    if not src.exists():
        return
    out, src = output.resolve(), src.resolve()
    if out == src or out in src.parents:
        raise UsageError(f"--output {output} would overwrite the input checkpoint {src}; choose another directory")


def write_model_folder(
    model: Any, tokenizer: Any, output: Path, sparsity: dict[str, Any], files: Mapping[str, str | bytes]
) -> None:
    """save_pretrained (safetensors, sharded) + tokenizer + `files` ({name: content}), built in a temp
    sibling and renamed into place (replacing an existing `output`: prepare_output allowed it).

    `atomic.atomic_dir` gives every file 0644 and every folder 0755 (save_pretrained writes its
    safetensors through a private 0600 temp file; a checkpoint is meant to be shared)."""
    with atomic.atomic_dir(output, replace=True) as tmp:
        setattr(model.config, SPARSITY_KEY, sparsity)
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD_SIZE)
        tokenizer.save_pretrained(tmp)
        for name, content in files.items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                (tmp / name).write_text(content, encoding="utf-8")


def write_checkpoint(model: Any, tokenizer: Any, output: Path, report: PruneReport, sparsity: dict[str, Any]) -> None:
    """The pruned checkpoint with its reports (tsenor_report.json / .md), written atomically."""
    files = {PRUNE_FILE: json.dumps(report.to_json(), indent=2) + "\n", PRUNE_MARKDOWN: report.to_markdown()}
    write_model_folder(model, tokenizer, output, sparsity, files)
