"""Merge runs into the paper's Table 2 layout: N:M | algorithm | transposable | perplexity | zero-shot | Avg.

A column "Refine" follows "Transposable" in the Markdown when some run was pruned with `--refine block`
(`refine: block (2 epochs, lr 0.001)`), so that a refined run and its plain twin are told apart by more
than their folder names; CSV and JSON always carry it (empty / null for a run without refinement).

Perplexity columns are C4, WT2, PTB (then any other dataset found); zero-shot columns are the
paper's eight tasks in its order (then any other task found). Markdown shows accuracy in percent
with two decimals as the paper does; CSV and JSON keep the raw values (accuracy as a fraction).
"Avg" is recomputed from the row's per-task ``acc`` values, the same rule as
`tsenor_cli.evaluation.zeroshot.average_acc`: the unweighted mean over the tasks the run scored.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tsenor_cli.errors import UsageError
from tsenor_cli.runfiles import Run

PPL_COLUMNS: tuple[tuple[str, str], ...] = (("c4", "C4"), ("wikitext2", "WT2"), ("ptb", "PTB"))
TASK_COLUMNS: tuple[tuple[str, str], ...] = (
    ("piqa", "PIQA"),
    ("hellaswag", "HS"),
    ("arc_easy", "ARC-E"),
    ("arc_challenge", "ARC-C"),
    ("winogrande", "WG"),
    ("rte", "RTE"),
    ("openbookqa", "OQA"),
    ("boolq", "BoolQ"),
)
MISSING = "-"


@dataclass(frozen=True)
class Row:
    """One run as a table row; `n`/`m`/`transposable` are None for dense and unstructured runs; `refine`
    names the block refinement the prune ran (None: none)."""

    run: str
    model: str
    algorithm: str
    n: int | None
    m: int | None
    transposable: bool | None
    sparsity: float
    perplexity: dict[str, float]
    accuracy: dict[str, float]
    refine: str | None = None

    @property
    def method(self) -> str:
        """The algorithm, with "+ refine" for a refined run: what the plots draw one line per."""
        return self.algorithm if self.refine is None else f"{self.algorithm} + refine"

    @property
    def pattern(self) -> str:
        if self.n is not None and self.m is not None:
            return f"{self.n}:{self.m}"
        if self.sparsity == 0.0:
            return "dense"
        return f"unstructured {100 * self.sparsity:g}%"

    @property
    def average(self) -> float | None:
        if not self.accuracy:
            return None
        return math.fsum(self.accuracy.values()) / len(self.accuracy)

    def sort_key(self) -> tuple[Any, ...]:
        # Dense first, then as the paper's appendix tables: sparsity groups from the highest, M rising
        # inside a group, ordinary N:M before transposable.
        return (
            self.sparsity > 0.0,
            -self.sparsity,
            self.m if self.m is not None else 0,
            self.transposable is True,
            self.algorithm,
            self.refine is not None,
            self.run,
        )


@dataclass(frozen=True)
class Table:
    rows: tuple[Row, ...]
    ppl_datasets: tuple[str, ...]
    tasks: tuple[str, ...]

    @property
    def refined(self) -> bool:
        """Whether some row was refined (the Markdown then has a Refine column)."""
        return any(row.refine is not None for row in self.rows)

    def header(self) -> list[str]:
        """Markdown header labels."""
        ppl_names = dict(PPL_COLUMNS)
        task_names = dict(TASK_COLUMNS)
        return [
            "N:M",
            "Algorithm",
            "Transposable",
            *(["Refine"] if self.refined else []),
            *(ppl_names.get(d, d) for d in self.ppl_datasets),
            *(task_names.get(t, t) for t in self.tasks),
            "Avg",
            "Run",
        ]

    def record_keys(self) -> list[str]:
        """Column names of the CSV and of the JSON rows."""
        return [
            "run",
            "model",
            "nm",
            "n",
            "m",
            "sparsity",
            "algorithm",
            "transposable",
            "refine",
            *(f"ppl_{d}" for d in self.ppl_datasets),
            *(f"acc_{t}" for t in self.tasks),
            "average_acc",
        ]

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "run": row.run,
                "model": row.model,
                "nm": row.pattern,
                "n": row.n,
                "m": row.m,
                "sparsity": row.sparsity,
                "algorithm": row.algorithm,
                "transposable": row.transposable,
                "refine": row.refine,
                **{f"ppl_{d}": row.perplexity.get(d) for d in self.ppl_datasets},
                **{f"acc_{t}": row.accuracy.get(t) for t in self.tasks},
                "average_acc": row.average,
            }
            for row in self.rows
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": self.record_keys(),
            "average_metric": "acc",
            "models": sorted({row.model for row in self.rows}),
            "rows": self.records(),
        }

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.record_keys(), lineterminator="\n")
        writer.writeheader()
        for record in self.records():
            writer.writerow({k: "" if v is None else v for k, v in record.items()})
        return buf.getvalue()

    def to_markdown(self) -> str:
        header = self.header()
        n_ppl, n_acc = len(self.ppl_datasets), len(self.tasks) + 1
        align = ["---"] * (4 if self.refined else 3) + ["---:"] * (n_ppl + n_acc) + ["---"]
        lines = [
            f"Models: {', '.join(sorted({row.model for row in self.rows}))}",
            "",
            "Perplexity (lower is better); zero-shot accuracy in % (lm-eval `acc`, higher is better); "
            "Avg = unweighted mean of acc over the run's tasks.",
            "",
            "| " + " | ".join(header) + " |",
            "| " + " | ".join(align) + " |",
        ]
        for row in self.rows:
            cells = [
                row.pattern,
                row.algorithm,
                MISSING if row.transposable is None else ("yes" if row.transposable else "no"),
                *([row.refine or "none"] if self.refined else []),
                *(_fmt(row.perplexity.get(d)) for d in self.ppl_datasets),
                *(_fmt(_percent(row.accuracy.get(t))) for t in self.tasks),
                _fmt(_percent(row.average)),
                row.run,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"


def _percent(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def _fmt(value: float | None) -> str:
    return MISSING if value is None else f"{value:.2f}"


def _ordered(found: set[str], preferred: Sequence[str]) -> tuple[str, ...]:
    return tuple(k for k in preferred if k in found) + tuple(sorted(found - set(preferred)))


def row_of(run: Run) -> Row:
    prune = run.prune
    zeroshot = run.eval.zeroshot
    return Row(
        run=run.label,
        model=run.eval.model,
        algorithm=prune.method if prune is not None else "dense",
        n=prune.pattern.n if prune is not None and prune.pattern is not None else None,
        m=prune.pattern.m if prune is not None and prune.pattern is not None else None,
        transposable=prune.pattern.transposable if prune is not None and prune.pattern is not None else None,
        sparsity=prune.sparsity if prune is not None else 0.0,
        perplexity={name: p.ppl for name, p in run.eval.perplexity.items()},
        accuracy={t.name: t.acc for t in zeroshot.tasks} if zeroshot is not None else {},
        refine=_refine_label(prune.settings.get("refine")) if prune is not None else None,
    )


def _refine_label(settings: Any) -> str | None:
    """tsenor_report.json's settings.refine (`RefineConfig.result_fields`, absent without refinement)
    → "block (2 epochs, lr 0.001)"; None for a run without it."""
    if not isinstance(settings, dict) or settings.get("mode", "none") == "none":
        return None
    return f"{settings['mode']} ({settings['epochs']} epochs, lr {settings['lr']:g})"


def build_table(runs: Sequence[Run]) -> Table:
    """Rows sorted as the paper's tables; columns are the union over runs (blank where a run lacks one)."""
    if not runs:
        raise UsageError("no runs to report; pass at least one run directory")
    labels = [run.label for run in runs]
    if len(set(labels)) != len(labels):
        raise UsageError(f"run directory names repeat ({', '.join(labels)}); rows are labelled by name, rename one")
    rows = sorted((row_of(run) for run in runs), key=Row.sort_key)
    return Table(
        rows=tuple(rows),
        ppl_datasets=_ordered({d for r in rows for d in r.perplexity}, [k for k, _ in PPL_COLUMNS]),
        tasks=_ordered({t for r in rows for t in r.accuracy}, [k for k, _ in TASK_COLUMNS]),
    )
