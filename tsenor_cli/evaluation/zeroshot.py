"""Zero-shot accuracy through lm-evaluation-harness on an in-memory model (paper Section 5.2, Table 2).

Scoring is lm-eval's own (`HFLM` + `simple_evaluate`); this module picks the task source, runs it
and condenses the results. Two task sources:

- ``hub``: lm-eval's built-in task configs, which download their datasets from the HF hub.
- ``offline``: our twins in ``tsenor_cli/evaluation/tasks/`` (same names, same prompts and metrics,
  tag ``tsenor_offline``) that read the data folder ($TSENOR_DATA_DIR). They are loaded by a
  TaskManager that sees only that directory, so the names never clash with the built-in ones.

The average is the unweighted mean of ``acc`` over the tasks, as the paper's "Avg" column (pruning
papers report acc, not acc_norm); the result says so in ``average_metric``.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tsenor_cli import settings
from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.evaluation.tasks.converters import TASK_FILES, resolve_files

Source = Literal["hub", "offline"]

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
_HUB_PROBE_URL = "https://huggingface.co/api/datasets/allenai/ai2_arc"


@dataclass(frozen=True)
class TaskScore:
    """One task's lm-eval metrics; acc_norm is None for tasks that do not define it (WG, RTE, BoolQ)."""

    name: str
    acc: float
    acc_stderr: float | None
    acc_norm: float | None
    acc_norm_stderr: float | None
    n_samples: int
    source: Source
    version: str

    def to_json(self) -> dict[str, Any]:
        return {
            "acc": self.acc,
            "acc_stderr": self.acc_stderr,
            "acc_norm": self.acc_norm,
            "acc_norm_stderr": self.acc_norm_stderr,
            "n_samples": self.n_samples,
            "source": self.source,
            "version": self.version,
        }


@dataclass(frozen=True)
class ZeroShotResult:
    """Per-task scores plus the unweighted mean of `average_metric` over the tasks."""

    tasks: tuple[TaskScore, ...]
    average: float
    average_metric: Literal["acc"]
    num_fewshot: int
    limit: int | float | None
    source: Source
    lm_eval_version: str

    def to_json(self) -> dict[str, Any]:
        """The ``zeroshot`` section of eval.json (docs/report-format.md)."""
        return {
            "tasks": {t.name: t.to_json() for t in self.tasks},
            "average": self.average,
            "average_metric": self.average_metric,
            "num_fewshot": self.num_fewshot,
            "limit": self.limit,
            "source": self.source,
            "lm_eval_version": self.lm_eval_version,
        }


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


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """True when the HF hub answers an HTTPS request within `timeout_s`."""
    request = urllib.request.Request(_HUB_PROBE_URL, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return bool(response.status < 500)
    except OSError:  # URLError, refused connections and timeouts are all OSErrors
        return False


def choose_source(offline: bool | None) -> Source:
    """`offline` forces the source; None picks hub when the hub is allowed and reachable."""
    if offline is True:
        return "offline"
    if offline is False:
        return "hub"
    if offline is None:
        return "offline" if settings.hub_offline() or not hub_reachable() else "hub"
    raise UsageError(f"offline must be True, False or None, not {offline!r}")


def _offline_data_dir(data_dir: Path | None, tasks: Sequence[str]) -> Path:
    path = data_dir if data_dir is not None else settings.data_dir()
    if path is None:
        raise InputNotFoundError(
            f"offline zero-shot evaluation needs the data folder; set {settings.DATA_DIR_ENV} to a folder "
            "with the layout of shared/data"
        )
    if not path.is_dir():
        raise InputNotFoundError(
            f"data folder {path} does not exist; set {settings.DATA_DIR_ENV} to a folder with the layout of shared/data"
        )
    for task in tasks:
        resolve_files(task, path)  # raises InputNotFoundError naming the missing file
    return path.resolve()


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


def run_zeroshot(
    model: Any,
    tokenizer: Any,
    tasks: list[str],
    *,
    num_fewshot: int = 0,
    limit: int | float | None = None,
    batch_size: int | str = "auto",
    data_dir: Path | None = None,
    offline: bool | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> ZeroShotResult:
    """Score `model` (a transformers causal LM, on its device) on `tasks` with lm-eval.

    `limit` caps documents per task (an int count, or a fraction in (0, 1)); lm-eval takes the first
    documents of each split. `seed` seeds only lm-eval's few-shot sampler (its own random.Random):
    loglikelihood scoring draws no random numbers, so no global RNG is touched.
    """
    names = validate_tasks(tasks)
    _validate_limit(limit)
    if num_fewshot < 0:
        raise UsageError(f"num_fewshot {num_fewshot} must be >= 0")
    size = _resolve_batch_size(model, batch_size)
    source = choose_source(offline)
    root = _offline_data_dir(data_dir, names) if source == "offline" else None

    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if root is not None:
        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_dir": str(root)})
        where = f"offline tasks from {root}"
    else:
        manager = TaskManager()
        where = "lm-eval hub tasks"
    if progress is not None:
        progress(f"zero-shot: {', '.join(names)} ({where}, limit={limit}, batch size {size})")

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=size)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(names),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
        random_seed=None,
        numpy_random_seed=None,
        torch_random_seed=None,
        fewshot_random_seed=seed,
    )
    if results is None:
        raise RuntimeError("lm-eval returned no results on rank 0")

    scores = []
    for name in names:
        values = results["results"][name]
        acc = _metric(values, "acc")
        if acc is None:
            raise RuntimeError(f"lm-eval reported no acc for {name}")
        scores.append(
            TaskScore(
                name=name,
                acc=acc,
                acc_stderr=_metric(values, "acc_stderr"),
                acc_norm=_metric(values, "acc_norm"),
                acc_norm_stderr=_metric(values, "acc_norm_stderr"),
                n_samples=int(results["n-samples"][name]["effective"]),
                source=source,
                version=str(results["versions"][name]),
            )
        )
        if progress is not None:
            progress(f"zero-shot: {name} acc={acc:.4f} (n={scores[-1].n_samples})")
    return ZeroShotResult(
        tasks=tuple(scores),
        average=average_acc(scores),
        average_metric="acc",
        num_fewshot=num_fewshot,
        limit=limit,
        source=source,
        lm_eval_version=lm_eval.__version__,
    )
