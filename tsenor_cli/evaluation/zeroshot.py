"""Zero-shot accuracy through lm-evaluation-harness on an in-memory model (paper Section 5.2, Table 2).

Scoring is lm-eval's own (`HFLM` + `simple_evaluate`); this module runs it on the task source the
run context picks (the rule of tsenor_cli/settings.py, `sources.data_folder`) and condenses the
results, recording for each task the files it read (with sha256) or the hub dataset:

- ``offline`` (a data folder is set): our twins in ``tsenor_cli/evaluation/tasks/`` (same names,
  same prompts and metrics, tag ``tsenor_offline``) that read that folder. They are loaded by a
  TaskManager that sees only that directory, so the names never clash with the built-in ones.
- ``hub`` (no data folder, hub allowed): lm-eval's built-in task configs, which download their
  datasets from the HF hub.

The average is the unweighted mean of ``acc`` over the tasks, as the paper's "Avg" column (pruning
papers report acc, not acc_norm); the result says so in ``average_metric``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tsenor_cli.data.sources import data_folder, file_source
from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.evaluation.tasks.converters import TASK_FILES, resolve_files
from tsenor_cli.progress import quiet_foreign_output, sink
from tsenor_cli.runfiles import DataSource, TaskScore, TaskSource, ZeroShotResult
from tsenor_cli.settings import RunContext

# The paper's eight tasks, in Table 2's column order.
PAPER_TASKS: tuple[str, ...] = (
    "piqa",
    "hellaswag",
    "arc_easy",
    "arc_challenge",
    "winogrande",
    "rte",
    "openbookqa",
    "boolq",
)
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
# lm-eval's batch-size probe runs 5 forward passes at batch 64 and the longest request: minutes on a
# CPU, which cannot signal out-of-memory the way CUDA does. CPU runs use this fixed size instead.
CPU_AUTO_BATCH_SIZE = 8


def average_acc(scores: Sequence[TaskScore]) -> float:
    """Unweighted mean of `acc` over tasks (Table 2's "Avg"): every task counts once, whatever its size."""
    if not scores:
        raise UsageError("no zero-shot tasks to average; pass at least one task")
    return math.fsum(s.acc for s in scores) / len(scores)


def validate_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    """Reject unknown or repeated task names with the list of valid ones."""
    if not tasks:
        raise UsageError(f"no zero-shot tasks given; choose from {', '.join(PAPER_TASKS)}")
    unknown = [t for t in tasks if t not in TASK_FILES]
    if unknown:
        raise UsageError(f"unknown zero-shot task(s) {', '.join(unknown)}; valid names: {', '.join(PAPER_TASKS)}")
    if len(set(tasks)) != len(tasks):
        raise UsageError(f"zero-shot task list {', '.join(tasks)} repeats a task; name each task once")
    return tuple(tasks)


def _validate_limit(limit: int | float | None) -> None:
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, int | float):
        raise UsageError(f"limit {limit!r} must be a number of documents or a fraction in (0, 1)")
    # lm-eval reads a limit below 1 as a fraction and anything else as a count (so 1.0 means 1 document).
    if isinstance(limit, float) and not (0.0 < limit < 1.0):
        raise UsageError(f"fractional limit {limit} must lie in (0, 1); pass an integer for a document count")
    if isinstance(limit, int) and limit < 1:
        raise UsageError(f"limit {limit} must be at least 1 document; omit it to score whole splits")


def task_source(ctx: RunContext, tasks: Sequence[str]) -> tuple[TaskSource, Path | None]:
    """("offline", the data folder) when the context names one, else ("hub", None); the files every
    offline task reads must exist (InputNotFoundError naming the first missing one)."""
    folder = data_folder(ctx, f"zero-shot task {tasks[0]}" if len(tasks) == 1 else "the zero-shot tasks")
    if folder is None:
        return "hub", None
    if not folder.is_dir():
        raise InputNotFoundError(
            f"data folder {folder} does not exist; pass --data-dir with a folder laid out as shared/data"
        )
    for task in tasks:
        resolve_files(task, folder)  # raises InputNotFoundError naming the missing file
    return "offline", folder


def _hub_task_source(config: Mapping[str, Any]) -> DataSource:
    """The hub dataset an lm-eval task config reads (its test split when it has one, else validation)."""
    name = str(config.get("dataset_path"))
    if config.get("dataset_name"):
        name += f"/{config['dataset_name']}"
    revision = (config.get("dataset_kwargs") or {}).get("revision")
    if revision:
        name += f"@{revision}"
    split = config.get("test_split") or config.get("validation_split")
    return DataSource(kind="hub", hub=f"{name} split={split}")


def _resolve_batch_size(model: Any, batch_size: int | str) -> int | str:
    if isinstance(batch_size, int) and not isinstance(batch_size, bool):
        if batch_size < 1:
            raise UsageError(f"batch size {batch_size} must be at least 1, or 'auto'")
        return batch_size
    if batch_size == "auto":
        return "auto" if model.device.type == "cuda" else CPU_AUTO_BATCH_SIZE
    raise UsageError(f"batch size {batch_size!r} must be a positive integer or 'auto'")


def _metric(values: dict[str, Any], key: str) -> float | None:
    value = values.get(f"{key},none")
    if value is None or isinstance(value, str):  # lm-eval writes "N/A" for stderrs it skipped
        return None
    return float(value)


def _task_manager(root: Path | None) -> tuple[Any, str]:
    """lm-eval's TaskManager for the task source (`task_source`'s folder, or None for the hub's tasks)
    and the words that name it in the progress line."""
    from lm_eval.tasks import TaskManager

    if root is not None:
        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_dir": str(root)})
        return manager, f"offline tasks from {root}"
    return TaskManager(), "lm-eval hub tasks"


def _score(name: str, results: Mapping[str, Any], root: Path | None) -> TaskScore:
    """Task `name`'s scores in lm-eval's `results`, with the data it read (the offline files under `root`,
    or the hub dataset of its config)."""
    values = results["results"][name]
    acc = _metric(values, "acc")
    if acc is None:
        raise RuntimeError(f"lm-eval reported no acc for {name}")
    return TaskScore(
        name=name,
        acc=acc,
        acc_stderr=_metric(values, "acc_stderr"),
        acc_norm=_metric(values, "acc_norm"),
        acc_norm_stderr=_metric(values, "acc_norm_stderr"),
        n_samples=int(results["n-samples"][name]["effective"]),
        data_source=(
            file_source("offline", resolve_files(name, root))
            if root is not None
            else _hub_task_source(results["configs"][name])
        ),
        version=str(results["versions"][name]),
        **_documents(results["samples"][name]),
    )


def _documents(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """TaskScore's doc_acc and docs_sha256 from lm-eval's logged samples of one task, in document order."""
    ordered = sorted(samples, key=lambda sample: int(sample["doc_id"]))
    digest = hashlib.sha256("\n".join(str(sample["doc_hash"]) for sample in ordered).encode())
    return {"doc_acc": tuple(float(sample["acc"]) for sample in ordered), "docs_sha256": digest.hexdigest()}


@dataclass(frozen=True)
class ZeroShotTasks:
    """What `run_zeroshot` scores: the task `names`; `limit` caps documents per task (an int count, or a
    fraction in (0, 1)), and lm-eval takes the first documents of each split; `seed` seeds only lm-eval's
    few-shot sampler (its own random.Random): loglikelihood scoring draws no random numbers, so no global
    RNG is touched. Checked by `run_zeroshot`, each bad value one UsageError."""

    names: Sequence[str]
    num_fewshot: int = 0
    limit: int | float | None = None
    batch_size: int | str = "auto"
    seed: int = 0


def run_zeroshot(
    model: Any, tokenizer: Any, tasks: ZeroShotTasks, ctx: RunContext, progress: Callable[[str], None] | None = None
) -> ZeroShotResult:
    """Score `model` (a transformers causal LM, on its device) on `tasks` with lm-eval.

    Each task's score keeps lm-eval's standard errors (`acc_stderr`, `acc_norm_stderr`; the report prints
    acc ± stderr).
    """
    names = validate_tasks(list(tasks.names))
    _validate_limit(tasks.limit)
    if tasks.num_fewshot < 0:
        raise UsageError(f"num_fewshot {tasks.num_fewshot} must be >= 0")
    size = _resolve_batch_size(model, tasks.batch_size)
    source, root = task_source(ctx, names)

    import lm_eval
    from lm_eval.models.huggingface import HFLM

    manager, where = _task_manager(root)
    sink(progress)(f"zero-shot: {', '.join(names)} ({where}, limit={tasks.limit}, batch size {size})")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=size)
    results = _evaluate(lm, names, tasks, manager, from_hub=root is None)
    scores = []
    for name in names:
        scores.append(_score(name, results, root))
        sink(progress)(f"zero-shot: {name} acc={scores[-1].acc:.4f} (n={scores[-1].n_samples})")
    return ZeroShotResult(
        tasks=tuple(scores),
        average=average_acc(scores),
        average_metric="acc",
        num_fewshot=tasks.num_fewshot,
        limit=tasks.limit,
        source=source,
        lm_eval_version=lm_eval.__version__,
    )


def _evaluate(lm: Any, names: Sequence[str], tasks: ZeroShotTasks, manager: Any, *, from_hub: bool) -> Any:
    """lm-eval's results of `lm` on the validated task `names`; with the task data from the hub
    (`from_hub`), a download failure is one InputNotFoundError naming --data-dir."""
    import lm_eval

    try:
        with quiet_foreign_output():
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(names),
                num_fewshot=tasks.num_fewshot,
                limit=tasks.limit,
                task_manager=manager,
                # Each document's score, for comparisons paired document by document (`report.paired`).
                log_samples=True,
                random_seed=None,
                numpy_random_seed=None,
                torch_random_seed=None,
                fewshot_random_seed=tasks.seed,
            )
    except OSError as exc:
        if not from_hub:
            raise
        # ConnectionError, the hub libraries' offline-mode errors and missing datasets are OSErrors.
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise InputNotFoundError(
            f"cannot download the zero-shot task data from the HF hub ({type(exc).__name__}: {first}); "
            "pass --data-dir with the offline data folder, or fix the connection"
        ) from exc
    if results is None:
        raise RuntimeError("lm-eval returned no results on rank 0")
    return results
