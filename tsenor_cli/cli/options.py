"""Options that several commands take, defined once as `Annotated` aliases (as the `hf` CLI does), and
the parsers of the evaluation options `eval`, `prune --eval` and `finetune` share.

A command declares ``device: DeviceOpt = DEVICE``: the flag, its help and its default come from here,
so `prune`, `eval`, `finetune` and `bench` cannot drift apart (tests/test_cli_options.py checks every
command that takes one of these has the same default and help).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, cast

import typer

from tsenor_cli.data.sources import DATASET_NAMES, DatasetName
from tsenor_cli.errors import UsageError
from tsenor_cli.pruning.recipe import DEFAULT_DEVICE, DEFAULT_DTYPE

DEVICE = DEFAULT_DEVICE
DTYPE = DEFAULT_DTYPE
# The paper's perplexity protocol evaluates all three datasets (SparseGPT's WikiText2, PTB, C4).
PPL = ",".join(DATASET_NAMES)

DeviceOpt = Annotated[
    str, typer.Option("--device", help="Compute device: cpu, cuda or cuda:N (prune: one block at a time on it).")
]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 or fp16.")]
OutputDirOpt = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="Output folder; what tsenor wrote there before is replaced only with --force."),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace existing output: prune, finetune: a tsenor run (never other files); eval: eval.json; "
        "report: the folder; bench: its result files; sweep: take over a folder made from another sweep file.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
PplOpt = Annotated[
    str, typer.Option("--ppl", help=f"Perplexity datasets, a comma list of {','.join(DATASET_NAMES)}, or none.")
]
MaxWindowsOpt = Annotated[
    int | None, typer.Option("--max-windows", min=1, help="Perplexity: only the first N windows of each dataset.")
]
TasksOpt = Annotated[str | None, typer.Option("--tasks", help="Zero-shot tasks (comma list), e.g. piqa,arc_easy.")]
LimitOpt = Annotated[str | None, typer.Option("--limit", help="Zero-shot documents per task (count or fraction).")]
TrustRemoteCodeOpt = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow the checkpoint's own model code (off by default).")
]
DataDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        help="Offline data folder (layout of shared/data); every dataset is read from it. Default: $TSENOR_DATA_DIR.",
    ),
]
OfflineOpt = Annotated[
    bool,
    typer.Option(
        "--offline",
        help="Never contact the HF hub (hub model ids from the local HF cache only). Default: HF_HUB_OFFLINE.",
    ),
]


# ---------------------------------------------------------------- parsing the evaluation options


def parse_list(text: str | None, option: str) -> tuple[str, ...]:
    """ "a,b , c" → ("a", "b", "c"); "" or "none" → (); empty items are refused."""
    if text is None or text.strip().lower() in ("", "none"):
        return ()
    items = tuple(item.strip() for item in text.split(","))
    if any(not item for item in items):
        raise UsageError(f"{option} {text!r} has an empty item; pass a comma-separated list like a,b")
    return items


def parse_ppl_datasets(text: str | None) -> tuple[DatasetName, ...]:
    items = parse_list(text, "--ppl")
    unknown = [item for item in items if item not in DATASET_NAMES]
    if unknown:
        raise UsageError(
            f"unknown --ppl dataset(s) {', '.join(unknown)}; use a subset of {','.join(DATASET_NAMES)} or none"
        )
    return cast(tuple[DatasetName, ...], items)


def parse_tasks(text: str | None) -> tuple[str, ...]:
    """--tasks "a,b" → ("a", "b"), refusing unknown or repeated names (before any model is loaded)."""
    tasks = parse_list(text, "--tasks")
    if not tasks:
        return ()
    _check_zeroshot_available()
    from tsenor_cli.evaluation.zeroshot import validate_tasks

    return validate_tasks(tasks)


def parse_batch_size(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError as exc:
        raise UsageError(f"--batch-size {text!r} must be a positive integer or 'auto'") from exc
    if value < 1:
        raise UsageError(f"--batch-size {value} must be a positive integer or 'auto'")
    return value


def parse_limit(text: str | None) -> int | float | None:
    """lm-eval's limit: an integer document count, or a fraction in (0, 1]."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError as exc:
        raise UsageError(f"--limit {text!r} must be a document count or a fraction in (0, 1]") from exc


def _check_zeroshot_available() -> None:
    try:
        import tsenor_cli.evaluation.zeroshot  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "tsenor_cli.evaluation.zeroshot":
            raise
        raise UsageError("zero-shot evaluation is not available in this build; omit --tasks") from exc
