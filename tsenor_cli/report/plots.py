"""PNG plots for `tsenor report`, drawn with matplotlib's object API on the Agg canvas (no pyplot state).

- `plot_perplexity_vs_m`: the paper's Figure 3 (upper): perplexity against M at equal sparsity, one
  line per (algorithm, transposable, sparsity); ordinary N:M solid, transposable dashed, one colour per
  algorithm (a refined run's "alps + refine" is one of its own), one marker per sparsity; dense runs as
  dotted horizontal references. One panel per perplexity dataset.
- `plot_reconstruction_error`: relative reconstruction error as recorded in tsenor_report.json
  (Appendix B.2.3 reports the same quantity), averaged over each decoder block's pruned linears, one
  panel per pattern and one line per run in it (same colours and line styles), so a grid of forty runs
  stays readable.
- `plot_training_loss` / `plot_perplexity_vs_steps`: `tsenor finetune`'s curves against optimizer
  steps, one line per run (scripts/finetune_study.py draws two runs on one plot).
- `plot_refinement`: `--refine block`'s per-block output error before (dashed) and after (solid)
  refinement, one colour per run (scripts/refine_table.py).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from tsenor_cli.report.table import PPL_COLUMNS, Table
from tsenor_cli.runfiles import PruneReport, Run

PERPLEXITY_PNG = "perplexity_vs_m.png"
RECONSTRUCTION_PNG = "reconstruction_error.png"


# Sparsity → marker, so 50% N:M lines and 75% ones (8:32) of one algorithm stay apart.
_MARKERS = ("o", "^", "s", "D", "v", "P")


def _colours(algorithms: Iterable[str]) -> dict[str, str]:
    """One colour of matplotlib's default cycle per algorithm, in sorted order, shared by both plots."""
    return {a: f"C{i % 10}" for i, a in enumerate(sorted(set(algorithms)))}


def tick_label(value: float, _position: object = None) -> str:
    """A log-axis tick as a plain number, with k/M/G for thousands/millions/billions: 20, 2k, 5M.
    (matplotlib's ScalarFormatter switches to an offset such as "1e6" on wide ranges and then
    labels 10-1000 as "0.000", which is what broken runs at 75% sparsity produced.)"""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _log_y(ax: Axes) -> None:
    """Log y axis labelled at 1, 2 and 5 × 10^k as plain numbers: perplexities are read as values, and
    labelling every minor tick (3, 4, 6, 7, ...) makes the labels overlap. Call after plotting: over
    more than three decades only the powers of ten are labelled, for the same reason."""
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    subs = (1.0,) if high > 1000 * low else (1.0, 2.0, 5.0)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(tick_label))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_perplexity_vs_m(table: Table, path: Path) -> bool:
    """Write the plot to `path`; False (nothing written) when no N:M run has a perplexity."""
    nm_rows = [r for r in table.rows if r.m is not None and r.perplexity]
    datasets = [d for d in table.ppl_datasets if any(d in r.perplexity for r in nm_rows)]
    if not datasets:
        return False
    names = dict(PPL_COLUMNS)
    colours = _colours(r.method for r in nm_rows)
    sparsities = sorted({r.sparsity for r in nm_rows})
    markers = {sp: _MARKERS[i % len(_MARKERS)] for i, sp in enumerate(sparsities)}
    fig = Figure(figsize=(4.6 * len(datasets), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(datasets), squeeze=False)[0]
    for ax, dataset in zip(axes, datasets, strict=True):
        lines: dict[tuple[str, bool, float], list[tuple[int, float]]] = defaultdict(list)
        for row in nm_rows:
            if dataset in row.perplexity and row.m is not None:
                lines[(row.method, row.transposable is True, row.sparsity)].append((row.m, row.perplexity[dataset]))
        for (algorithm, transposable, sparsity), points in sorted(lines.items()):
            points.sort()
            ax.plot(
                [m for m, _ in points],
                [p for _, p in points],
                color=colours[algorithm],
                marker=markers[sparsity],
                linestyle="--" if transposable else "-",
                label=f"{algorithm} {'transposable' if transposable else 'N:M'} ({100 * sparsity:g}%)",
            )
        for row in table.rows:
            if row.sparsity == 0.0 and dataset in row.perplexity:
                ax.axhline(row.perplexity[dataset], color="gray", linestyle=":", label=f"dense ({row.run})")
        ax.set_xscale("log", base=2)
        _log_y(ax)
        ms = sorted({m for pts in lines.values() for m, _ in pts})
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("M")
        ax.set_ylabel(f"{names.get(dataset, dataset)} perplexity")
        ax.set_title(names.get(dataset, dataset))
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    fig.suptitle("Perplexity vs M at equal sparsity: N:M (solid) and transposable N:M (dashed)")
    fig.savefig(path, format="png", dpi=120)
    return True


def _pattern_key(prune: PruneReport) -> tuple[float, int, str]:
    """Panel order and title: sparsity, then M (unstructured last within a sparsity)."""
    pattern = prune.pattern
    if pattern is None:
        return (prune.sparsity, 1 << 30, f"unstructured {100 * prune.sparsity:g}%")
    return (prune.sparsity, pattern.m, f"{pattern.n}:{pattern.m}")


def _transposable(prune: PruneReport) -> bool:
    return prune.pattern is not None and prune.pattern.transposable


def _block_means(prune: PruneReport) -> tuple[list[int], list[float]]:
    """→ (blocks, mean relative error of each block's recorded linears); skipped layers (None) do not
    count, and a block whose linears were all skipped is NaN, a gap in the line."""
    by_block: dict[int, list[float]] = defaultdict(list)
    for layer in prune.layers:
        if layer.block < 0:  # outside the language model (pruning/block/outside.py): not a decoder block
            continue
        recorded = by_block[layer.block]  # a block of skipped layers still gets its (empty) entry
        if layer.recon_error is not None:
            recorded.append(layer.recon_error)
    blocks = sorted(by_block)
    return blocks, [sum(v) / len(v) if v else math.nan for v in (by_block[b] for b in blocks)]


def plot_reconstruction_error(runs: Sequence[Run], path: Path) -> bool:
    """Write the plot to `path`; False (nothing written) when no run has per-layer records."""
    pruned = [(run, run.prune) for run in runs if run.prune is not None and run.prune.layers]
    if not pruned:
        return False
    panels: dict[tuple[float, int, str], list[tuple[Run, PruneReport]]] = defaultdict(list)
    for run, prune in pruned:
        panels[_pattern_key(prune)].append((run, prune))
    colours = _colours(prune.method for _, prune in pruned)
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(4.6 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(rows, cols, squeeze=False, sharey=True)
    axes = [ax for row in grid for ax in row]
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    positive = True
    legend: dict[str, Line2D] = {}
    for ax, (key, members) in zip(axes, sorted(panels.items()), strict=False):
        kinds = Counter((prune.method, _transposable(prune)) for _, prune in members)
        for run, prune in sorted(members, key=lambda rp: (rp[1].method, _transposable(rp[1]), rp[0].label)):
            blocks, errors = _block_means(prune)
            positive = positive and all(e > 0 for e in errors if not math.isnan(e))
            transposable = _transposable(prune)
            label = f"{prune.method}{' transposable' if transposable else ''}"
            if kinds[(prune.method, transposable)] > 1:  # two runs of one kind in a panel: name them
                label += f" ({run.label})"
            (line,) = ax.plot(
                blocks,
                errors,
                color=colours[prune.method],
                linestyle="--" if transposable else "-",
                marker=".",
                linewidth=1,
                label=label,
            )
            legend.setdefault(label, line)
        ax.set_title(f"{key[2]} ({100 * key[0]:g}% sparse)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("decoder block")
        ax.grid(True, which="both", alpha=0.3)
    if positive:
        for ax in axes[: len(panels)]:
            ax.set_yscale("log")
    for row in grid:
        row[0].set_ylabel("mean relative error")
    fig.legend(list(legend.values()), list(legend), loc="outside right upper", fontsize="small")
    fig.suptitle("Relative reconstruction error ‖X(Ŵ−W)ᵀ‖²/‖XWᵀ‖² per block, mean over its pruned linears")
    fig.savefig(path, format="png", dpi=120)
    return True


def _step_panels(
    curves: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
    out: Path | BinaryIO,
    ylabel: str,
    title: str,
    *,
    log_y: bool,
) -> bool:
    """One panel per key of the inner mappings (a dataset), one line per outer key (a run); False
    (nothing written) when no line has a point."""
    panels = sorted({key for run in curves.values() for key, points in run.items() if points})
    if not panels:
        return False
    colours = _colours(curves)
    fig = Figure(figsize=(4.6 * len(panels) + 1.6, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        for label, run in curves.items():
            points = sorted(run.get(panel, ()))
            if points:
                marker = "." if len(points) <= 60 else None
                ax.plot(
                    [s for s, _ in points], [v for _, v in points], color=colours[label], marker=marker, label=label
                )
        if log_y:
            _log_y(ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel.format(panel=panel))
        ax.set_title(panel)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    fig.suptitle(title)
    fig.savefig(out, format="png", dpi=120)
    return True


def plot_training_loss(curves: Mapping[str, Sequence[tuple[int, float]]], out: Path | BinaryIO) -> bool:
    """Training loss against optimizer step, one line per run: {run: [(step, loss), ...]}."""
    return _step_panels(
        {run: {"training loss": points} for run, points in curves.items()},
        out,
        "loss (nats/token)",
        "Fine-tuning loss with the sparsity mask fixed",
        log_y=False,  # a loss spans less than a decade: a linear axis keeps its labels
    )


def plot_perplexity_vs_steps(
    curves: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], out: Path | BinaryIO
) -> bool:
    """Perplexity against optimizer step: {run: {dataset: [(step, ppl), ...]}}, one panel per dataset
    (step 0 is the pruned checkpoint before fine-tuning)."""
    names = dict(PPL_COLUMNS)
    renamed = {run: {names.get(d, d): pts for d, pts in per.items()} for run, per in curves.items()}
    return _step_panels(
        renamed, out, "{panel} perplexity", "Perplexity during fine-tuning with the mask fixed", log_y=True
    )


def plot_refinement(reports: Mapping[str, PruneReport], out: Path | BinaryIO) -> bool:
    """Each refined run's block output error (relative, against the dense block on the dense stream)
    before and after refinement, by block, log scale; False (nothing written) when no run was refined."""
    refined = {label: report.refinement for label, report in reports.items() if report.refinement}
    if not refined:
        return False
    colours = _colours(refined)
    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for label, blocks in refined.items():
        ordered = sorted(blocks, key=lambda b: b.block)
        index = [b.block for b in ordered]
        ax.plot(index, [b.error_before for b in ordered], color=colours[label], linestyle="--", linewidth=1)
        ax.plot(index, [b.error_after for b in ordered], color=colours[label], marker=".", label=label)
    _log_y(ax)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("decoder block")
    ax.set_ylabel("block output error (relative)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", title="after (solid), before (dashed)", title_fontsize="small")
    ax.set_title("Block refinement with the mask fixed: each block's calibration error")
    fig.savefig(out, format="png", dpi=120)
    return True
