"""Zero-shot differences between two runs, paired document by document.

Two models scored on the same documents make correlated errors: a hard question is missed by both. The
standard error of the difference of their means computed as if they were independent,
√(se_a² + se_b²), then overstates the difference's uncertainty, often by half or more. With each
document's score kept (`runfiles.TaskScore.doc_acc`), the difference of two runs on task t is the mean of
the per-document differences d_i = acc_run,i − acc_baseline,i, with the standard error
sd(d)/√n (sample standard deviation, as lm-eval's `acc_stderr`). Over T tasks, as the table's "Avg"
(the unweighted mean over tasks): Δ = Σ_t mean(d_t) / T, with the error √(Σ_t se_t²) / T.

The pairing holds only on the same documents: each task's `docs_sha256` (lm-eval's per-document hashes)
must agree, else the run is not paired and the reason says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tsenor_cli.runfiles import TaskScore, ZeroShotResult


@dataclass(frozen=True)
class Paired:
    """`run` against `baseline` over `tasks`: difference and its standard errors as fractions (paired;
    unpaired, from lm-eval's per-task errors, None when one is missing); documents: the documents
    compared over all tasks. reason: why the run is not paired (the numbers are then None)."""

    run: str
    baseline: str
    tasks: tuple[str, ...] = ()
    documents: int = 0
    difference: float | None = None
    stderr: float | None = None
    unpaired_stderr: float | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "baseline": self.baseline,
            "tasks": list(self.tasks),
            "documents": self.documents,
            "difference": self.difference,
            "stderr": self.stderr,
            "unpaired_stderr": self.unpaired_stderr,
            "reason": self.reason,
        }


def _task_difference(base: TaskScore, other: TaskScore) -> tuple[float, float] | str:
    """(mean of the per-document differences, its standard error) on one task, or why not."""
    if base.doc_acc is None or other.doc_acc is None:
        return f"{base.name}: no per-document scores (evaluated before tsenor kept them; run tsenor eval again)"
    if base.docs_sha256 != other.docs_sha256 or len(base.doc_acc) != len(other.doc_acc):
        return f"{base.name}: scored on other documents (another --limit, task version or data)"
    n = len(base.doc_acc)
    if n < 2:
        return f"{base.name}: {n} document, too few for a standard error"
    diffs = [b - a for a, b in zip(base.doc_acc, other.doc_acc, strict=True)]
    mean = math.fsum(diffs) / n
    variance = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, math.sqrt(variance / n)


def paired_difference(run: str, result: ZeroShotResult, baseline: str, base: ZeroShotResult) -> Paired:
    """`result` (run `run`) against `base` (run `baseline`) over the tasks both scored."""
    scores = {task.name: task for task in base.tasks}
    shared = [(scores[task.name], task) for task in result.tasks if task.name in scores]
    if not shared:
        return Paired(run, baseline, reason="no zero-shot task in common")
    found = [_task_difference(a, b) for a, b in shared]
    reasons = [item for item in found if isinstance(item, str)]
    if reasons:
        return Paired(run, baseline, reason=reasons[0])
    pairs = [item for item in found if not isinstance(item, str)]
    count = len(pairs)
    # The unpaired error needs lm-eval's error on every task of both runs; one missing leaves it None.
    squares = [
        a.acc_stderr**2 + b.acc_stderr**2 for a, b in shared if a.acc_stderr is not None and b.acc_stderr is not None
    ]
    unpaired = math.sqrt(math.fsum(squares)) / count if len(squares) == count else None
    return Paired(
        run,
        baseline,
        tasks=tuple(a.name for a, _ in shared),
        documents=sum(len(a.doc_acc or ()) for a, _ in shared),
        difference=math.fsum(mean for mean, _ in pairs) / count,
        stderr=math.sqrt(math.fsum(se * se for _, se in pairs)) / count,
        unpaired_stderr=unpaired,
    )
