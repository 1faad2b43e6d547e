"""The output folder: refused when it exists (unless --force / --resume), written atomically at the end."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tsenor_cli.errors import OutputExistsError, UsageError
from tsenor_cli.pruning.report import PruneReport
from tsenor_cli.pruning.resume import RESUME_DIRNAME, ResumeStore

SPARSITY_KEY = "tsenor_sparsity"
REPORT_JSON = "tsenor_report.json"
REPORT_MD = "tsenor_report.md"
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


def _replace_dir(tmp: Path, output: Path) -> None:
    """Move the finished `tmp` folder to `output`, replacing what is there (rename, so never half-written)."""
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
        tmp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(output)


def write_model_folder(
    model: Any, tokenizer: Any, output: Path, sparsity: dict[str, Any], files: Mapping[str, str | bytes]
) -> None:
    """save_pretrained (safetensors, sharded) + tokenizer + `files` ({name: content}) into a temp
    sibling of `output`, then rename it into place (so `output` is never half-written)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        tmp.chmod(0o755)
        setattr(model.config, SPARSITY_KEY, sparsity)
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD_SIZE)
        tokenizer.save_pretrained(tmp)
        for name, content in files.items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                (tmp / name).write_text(content)
        for path in tmp.rglob("*"):
            # save_pretrained writes the safetensors through a private temp file (mode 0600); a checkpoint
            # is meant to be shared, so every file gets the usual 0644.
            path.chmod(0o755 if path.is_dir() else 0o644)
        _replace_dir(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_checkpoint(model: Any, tokenizer: Any, output: Path, report: PruneReport, sparsity: dict[str, Any]) -> None:
    """The pruned checkpoint with its reports (tsenor_report.json / .md), written atomically."""
    files = {REPORT_JSON: json.dumps(report.to_dict(), indent=2), REPORT_MD: report.to_markdown()}
    write_model_folder(model, tokenizer, output, sparsity, files)
