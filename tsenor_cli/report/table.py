"""Merge runs into the paper's Table 2 layout: N:M | algorithm | transposable | perplexity | zero-shot | Avg.

A column "Refine" follows "Transposable" in the Markdown when some run was pruned with `--refine block`
(`refine: block (2 epochs, lr 0.001)`), so that a refined run and its plain twin are told apart by more
than their folder names; CSV and JSON always carry it (empty / null for a run without refinement).

Perplexity columns are C4, WT2, PTB (then any other dataset found); zero-shot columns are the
paper's eight tasks in its order (then any other task found). Markdown shows accuracy in percent
with two decimals as the paper does; CSV and JSON keep the raw values (accuracy as a fraction).
"Avg" is recomputed from the row's per-task ``acc`` values, the same rule as
`tsenor_cli.evaluation.zeroshot.average_acc`: the unweighted mean over the tasks the run scored.
A zero-shot cell shows lm-eval's standard error beside the accuracy (``52.00 ± 1.57``) when eval.json
records one; CSV and JSON carry it as ``acc_stderr_<task>``. Under the table, each run's zero-shot "Avg"
against a baseline run, paired document by document where both kept each document's score
(`report/paired.py`): the error that says whether two models on the same documents differ.

Numbers evaluated under different protocols (perplexity window length and window cap, zero-shot
document limit and shots, where the data came from) do not compare: 21.98 at 512 tokens beside 222.40
at 128 tokens reads as a 10x loss that is mostly the window. `build_table` refuses such runs in one
table unless `allow_mixed`; the shared protocol is a line above the Markdown table, a mixed one a
"Protocol" column, and CSV/JSON carry each row's protocol fields either way.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tsenor_cli.errors import UsageError
from tsenor_cli.report.paired import Paired, paired_difference
from tsenor_cli.runfiles import CONFIG_FILE, MODEL_DIR, EvalReport, Run

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
class Protocol:
    """How one run was evaluated: the part of eval.json that decides what its numbers mean.

    seqlen / max_windows / ppl_data: the perplexity windows' length, their cap per dataset (None: every
    window of the split) and where the text came from (the data sources' kinds, e.g. "offline"); all
    None when the run has no perplexity. limit / num_fewshot / zeroshot_data: lm-eval's documents per
    task (None: whole splits), its shots and its task source; all None without zero-shot results.
    """

    seqlen: int | None
    max_windows: int | None
    ppl_data: str | None
    limit: int | float | None
    num_fewshot: int | None
    zeroshot_data: str | None

    @classmethod
    def of(cls, report: EvalReport) -> Protocol:
        kinds = sorted({p.data_source.kind if p.data_source else "unrecorded" for p in report.perplexity.values()})
        zs = report.zeroshot
        return cls(
            seqlen=report.seqlen if report.perplexity else None,
            max_windows=report.max_windows if report.perplexity else None,
            ppl_data="+".join(kinds) if kinds else None,
            limit=zs.limit if zs is not None else None,
            num_fewshot=zs.num_fewshot if zs is not None else None,
            zeroshot_data=zs.source if zs is not None else None,
        )

    @property
    def perplexity_part(self) -> str | None:
        if self.seqlen is None:
            return None
        cap = self.max_windows
        windows = "every window" if cap is None else f"at most {cap} window{'' if cap == 1 else 's'}"
        return f"perplexity on {windows} of {self.seqlen} tokens ({self.ppl_data} data)"

    @property
    def zeroshot_part(self) -> str | None:
        if self.zeroshot_data is None:
            return None
        docs = "whole splits" if self.limit is None else f"limit {self.limit:g} documents per task"
        return f"zero-shot {self.num_fewshot}-shot on {docs} ({self.zeroshot_data} tasks)"

    def describe(self) -> str:
        parts = [p for p in (self.perplexity_part, self.zeroshot_part) if p is not None]
        return "; ".join(parts) if parts else "nothing evaluated"

    def record(self) -> dict[str, Any]:
        """The CSV/JSON columns of the protocol."""
        return {
            "eval_seqlen": self.seqlen,
            "eval_max_windows": self.max_windows,
            "eval_ppl_data": self.ppl_data,
            "eval_limit": self.limit,
            "eval_num_fewshot": self.num_fewshot,
            "eval_zeroshot_data": self.zeroshot_data,
        }


PROTOCOL_KEYS: tuple[str, ...] = tuple(Protocol(None, None, None, None, None, None).record())


@dataclass(frozen=True)
class Row:
    """One run as a table row; `n`/`m`/`transposable` are None for dense and unstructured runs; `refine`
    names the block refinement the prune ran (None: none); `checkpoint_format`: how the run's folder stores
    its weights (dense, or packed: docs/reference/packed-format.md)."""

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
    stderr: dict[str, float | None] = field(default_factory=dict)
    protocol: Protocol = Protocol(None, None, None, None, None, None)
    checkpoint_format: str = "dense"

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
    """The merged rows; `mixed`: the rows were evaluated under different protocols (`allow_mixed`), so the
    Markdown has a Protocol column instead of one protocol line; `paired`: each other run's zero-shot
    difference from the baseline run, document by document (`report.paired`)."""

    rows: tuple[Row, ...]
    ppl_datasets: tuple[str, ...]
    tasks: tuple[str, ...]
    mixed: bool = False
    paired: tuple[Paired, ...] = ()

    @property
    def refined(self) -> bool:
        """Whether some row was refined (the Markdown then has a Refine column)."""
        return any(row.refine is not None for row in self.rows)

    @property
    def packed(self) -> bool:
        """Whether some row's checkpoint is packed (the Markdown then has a Format column)."""
        return any(row.checkpoint_format == "packed" for row in self.rows)

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
            *(["Protocol"] if self.mixed else []),
            *(["Format"] if self.packed else []),
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
            "format",
            *(f"ppl_{d}" for d in self.ppl_datasets),
            *(f"acc_{t}" for t in self.tasks),
            *(f"acc_stderr_{t}" for t in self.tasks),
            "average_acc",
            *PROTOCOL_KEYS,
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
                "format": row.checkpoint_format,
                **{f"ppl_{d}": row.perplexity.get(d) for d in self.ppl_datasets},
                **{f"acc_{t}": row.accuracy.get(t) for t in self.tasks},
                **{f"acc_stderr_{t}": row.stderr.get(t) for t in self.tasks},
                "average_acc": row.average,
                **row.protocol.record(),
            }
            for row in self.rows
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": self.record_keys(),
            "average_metric": "acc",
            "models": sorted({row.model for row in self.rows}),
            "protocol": None if self.mixed or not self.rows else self.rows[0].protocol.describe(),
            "rows": self.records(),
            "paired": [item.to_json() for item in self.paired],
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
        trailing = 1 + int(self.mixed) + int(self.packed)
        align = ["---"] * (4 if self.refined else 3) + ["---:"] * (n_ppl + n_acc) + ["---"] * trailing
        protocol = "mixed, see the Protocol column" if self.mixed else self.rows[0].protocol.describe()
        lines = [
            f"Models: {', '.join(sorted({row.model for row in self.rows}))}",
            f"Protocol: {protocol}",
            "",
            "Perplexity (lower is better); zero-shot accuracy in % ± lm-eval's standard error (`acc`, higher "
            "is better); Avg = unweighted mean of acc over the run's tasks.",
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
                *(_accuracy_cell(row.accuracy.get(t), row.stderr.get(t)) for t in self.tasks),
                _fmt(_percent(row.average)),
                *([row.protocol.describe()] if self.mixed else []),
                *([row.checkpoint_format] if self.packed else []),
                row.run,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join([*lines, *_paired_lines(self.paired)]) + "\n"


def _paired_lines(paired: Sequence[Paired]) -> list[str]:
    """The Markdown of the paired differences: a table of the runs paired, a line for each run not."""
    if not paired:
        return []
    lines = [""]
    done = [item for item in paired if item.reason is None]
    if done:
        lines += [
            f"Zero-shot Avg against {paired[0].baseline}, paired document by document (points; ± the paired "
            "standard error, beside the unpaired one from lm-eval's per-task errors):",
            "",
            "| Run | Δ Avg | ± paired | ± unpaired | tasks | documents |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
    for item in done:
        cells = [_points(item.difference, "+.2f"), _points(item.stderr, ".2f"), _points(item.unpaired_stderr, ".2f")]
        lines.append(f"| {item.run} | {' | '.join(cells)} | {len(item.tasks)} | {item.documents} |")
    return lines + [
        f"- {item.run} against {item.baseline}: zero-shot not paired, {item.reason}" for item in paired if item.reason
    ]


def _points(value: float | None, spec: str) -> str:
    """A fraction in points with the format `spec`, or MISSING."""
    return MISSING if value is None else format(100.0 * value, spec)


def _percent(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def _fmt(value: float | None) -> str:
    return MISSING if value is None else f"{value:.2f}"


def _accuracy_cell(acc: float | None, stderr: float | None) -> str:
    """Accuracy in percent, with lm-eval's standard error when recorded: "52.00 ± 1.57"."""
    if acc is None or stderr is None:
        return _fmt(_percent(acc))
    return f"{100.0 * acc:.2f} ± {100.0 * stderr:.2f}"


def _ordered(found: set[str], preferred: Sequence[str]) -> tuple[str, ...]:
    return tuple(k for k in preferred if k in found) + tuple(sorted(found - set(preferred)))


def _checkpoint_format(run: Run) -> str:
    """How the run's weights are stored. A folder holding the checkpoint says so in its config.json, which
    `tsenor pack`/`unpack` rewrite: the run folder, or a sweep run's `model/`. Once a sweep removed that
    checkpoint, the prune's report kept beside it records the format the prune wrote (none in a report of
    a tsenor before packing: dense, the only format it wrote)."""
    # Imported here: tsenor_cli.packed imports torch, which `tsenor --help` must not load.
    from tsenor_cli.packed.files import declares_packed

    for folder in (run.path, run.path / MODEL_DIR):
        if (folder / CONFIG_FILE).is_file():
            return "packed" if declares_packed(folder) else "dense"
    recorded = run.prune.settings.get("save_format") if run.prune is not None else None
    return recorded if isinstance(recorded, str) else "dense"


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
        stderr={t.name: t.acc_stderr for t in zeroshot.tasks} if zeroshot is not None else {},
        protocol=Protocol.of(run.eval),
        checkpoint_format=_checkpoint_format(run),
    )


def _refine_label(settings: Any) -> str | None:
    """tsenor_report.json's settings.refine (`RefineConfig.result_fields`, absent without refinement)
    → "block (2 epochs, lr 0.001)"; None for a run without it."""
    if not isinstance(settings, dict) or settings.get("mode", "none") == "none":
        return None
    return f"{settings['mode']} ({settings['epochs']} epochs, lr {settings['lr']:g})"


def _mixed(rows: Sequence[Row]) -> bool:
    """Whether the rows' protocols disagree: the perplexity settings of the rows with perplexity, or the
    zero-shot settings of the rows with zero-shot results (a run lacking one kind conflicts with none)."""
    protocols = [row.protocol for row in rows]
    ppl = {(p.seqlen, p.max_windows, p.ppl_data) for p in protocols if p.seqlen is not None}
    zs = {(p.limit, p.num_fewshot, p.zeroshot_data) for p in protocols if p.zeroshot_data is not None}
    return len(ppl) > 1 or len(zs) > 1


def _mixed_error(rows: Sequence[Row]) -> UsageError:
    groups: dict[str, list[str]] = {}
    for row in rows:
        groups.setdefault(row.protocol.describe(), []).append(row.run)
    listed = "; ".join(f"{', '.join(names)}: {protocol}" for protocol, names in groups.items())
    return UsageError(
        f"the runs were evaluated under different protocols ({listed}), so their numbers do not compare; "
        "re-evaluate them with the same tsenor eval options, or pass --allow-mixed to show each run's protocol"
    )


def distinct_labels(runs: Sequence[Run]) -> list[Run]:
    """`runs`, each labelled by its folder's name, or where names repeat (two sweeps each have their `dense`
    run) by its path below the folder the repeating ones share ("sweep-a/runs/dense"). UsageError for one
    folder given twice."""
    paths = [run.path.resolve() for run in runs]
    twice = sorted({str(path) for path in paths if paths.count(path) > 1})
    if twice:
        raise UsageError(f"run directory {twice[0]} is given twice; pass each run once")
    names = [run.label for run in runs]
    repeated = {name for name in names if names.count(name) > 1}
    if not repeated:
        return list(runs)
    labelled = []
    for run, path, name in zip(runs, paths, names, strict=True):
        if name in repeated:
            same = [other for other, other_name in zip(paths, names, strict=True) if other_name == name]
            shared = Path(os.path.commonpath(same))
            run = replace(run, name=path.relative_to(shared.parent if shared in same else shared).as_posix())
        labelled.append(run)
    return labelled


def build_table(runs: Sequence[Run], *, allow_mixed: bool = False, baseline: str | None = None) -> Table:
    """Rows sorted as the paper's tables; columns are the union over runs (blank where a run lacks one).
    The zero-shot differences are paired against `baseline` (a run's name; None: the first row with
    zero-shot scores, the dense model when one is given).

    UsageError when the runs were evaluated under different protocols, unless `allow_mixed`, or when
    `baseline` names no run with zero-shot scores.
    """
    if not runs:
        raise UsageError("no runs to report; pass at least one run directory")
    runs = distinct_labels(runs)
    rows = sorted((row_of(run) for run in runs), key=Row.sort_key)
    mixed = _mixed(rows)
    if mixed and not allow_mixed:
        raise _mixed_error(rows)
    return Table(
        rows=tuple(rows),
        ppl_datasets=_ordered({d for r in rows for d in r.perplexity}, [k for k, _ in PPL_COLUMNS]),
        tasks=_ordered({t for r in rows for t in r.accuracy}, [k for k, _ in TASK_COLUMNS]),
        mixed=mixed,
        paired=_pair(runs, [row.run for row in rows], baseline),
    )


def _pair(runs: Sequence[Run], order: Sequence[str], baseline: str | None) -> tuple[Paired, ...]:
    """Each run with zero-shot scores against the baseline, in the table's row order."""
    scored = {run.label: run.eval.zeroshot for run in runs if run.eval.zeroshot is not None}
    if baseline is not None and baseline not in scored:
        names = ", ".join(scored) or "none"
        raise UsageError(f"--baseline {baseline} is not a run with zero-shot scores (those: {names}); pass one of them")
    ordered = [label for label in order if label in scored]
    if len(ordered) < 2:
        return ()
    base = baseline if baseline is not None else ordered[0]
    return tuple(paired_difference(label, scored[label], base, scored[base]) for label in ordered if label != base)
