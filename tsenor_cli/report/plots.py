"""PNG plots for `tsenor report`, drawn with matplotlib's object API on the Agg canvas (no pyplot state).

- `plot_perplexity_vs_m`: the paper's Figure 3 (upper): perplexity against M at equal sparsity, one
  line per (algorithm, transposable, sparsity); ordinary N:M solid, transposable dashed; dense runs as
  dotted horizontal references. One panel per perplexity dataset.
- `plot_reconstruction_error`: per-layer relative reconstruction error as recorded in
  tsenor_report.json (Appendix B.2.3 reports the same quantity), in pruning order, one line per run.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, ScalarFormatter

from tsenor_cli.report.schema import Run
from tsenor_cli.report.table import PPL_COLUMNS, Table

PERPLEXITY_PNG = "perplexity_vs_m.png"
RECONSTRUCTION_PNG = "reconstruction_error.png"


def plot_perplexity_vs_m(table: Table, path: Path) -> bool:
    """Write the plot to `path`; False (nothing written) when no N:M run has a perplexity."""
    nm_rows = [r for r in table.rows if r.m is not None and r.perplexity]
    datasets = [d for d in table.ppl_datasets if any(d in r.perplexity for r in nm_rows)]
    if not datasets:
        return False
    names = dict(PPL_COLUMNS)
    fig = Figure(figsize=(4.2 * len(datasets), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(datasets), squeeze=False)[0]
    for ax, dataset in zip(axes, datasets, strict=True):
        lines: dict[tuple[str, bool, float], list[tuple[int, float]]] = defaultdict(list)
        for row in nm_rows:
            if dataset in row.perplexity and row.m is not None:
                lines[(row.algorithm, row.transposable is True, row.sparsity)].append((row.m, row.perplexity[dataset]))
        for (algorithm, transposable, sparsity), points in sorted(lines.items()):
            points.sort()
            ax.plot(
                [m for m, _ in points],
                [p for _, p in points],
                marker="o",
                linestyle="--" if transposable else "-",
                label=f"{algorithm} {'transposable' if transposable else 'N:M'} ({100 * sparsity:g}%)",
            )
        for row in table.rows:
            if row.sparsity == 0.0 and dataset in row.perplexity:
                ax.axhline(row.perplexity[dataset], color="gray", linestyle=":", label=f"dense ({row.run})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ms = sorted({m for pts in lines.values() for m, _ in pts})
        ax.set_xticks(ms, [str(m) for m in ms])
        # Plain numbers on the log axis: perplexities are read as values, not powers of ten.
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.set_xlabel("M")
        ax.set_ylabel(f"{names.get(dataset, dataset)} perplexity")
        ax.set_title(names.get(dataset, dataset))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle("Perplexity vs M at equal sparsity: N:M (solid) and transposable N:M (dashed)")
    fig.savefig(path, format="png", dpi=120)
    return True


def plot_reconstruction_error(runs: Sequence[Run], path: Path) -> bool:
    """Write the plot to `path`; False (nothing written) when no run has per-layer records."""
    pruned = [run for run in runs if run.prune is not None and run.prune.layers]
    if not pruned:
        return False
    fig = Figure(figsize=(9.0, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    positive = True
    for run in sorted(pruned, key=lambda r: r.label):
        prune = run.prune
        assert prune is not None  # filtered above; narrows the type for mypy
        # Skipped layers (error null) leave a gap in the line.
        recorded = [layer.reconstruction_error for layer in prune.layers]
        errors = [math.nan if e is None else e for e in recorded]
        positive = positive and all(e > 0 for e in errors if not math.isnan(e))
        pattern = prune.pattern
        kind = (
            f"{pattern.n}:{pattern.m}{' transposable' if pattern.transposable else ''}"
            if pattern is not None
            else f"unstructured {100 * prune.sparsity:g}%"
        )
        ax.plot(range(len(errors)), errors, marker=".", linewidth=1, label=f"{run.label}: {prune.method} {kind}")
    if positive:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer (pruning order)")
    ax.set_ylabel("relative reconstruction error")
    ax.set_title("Per-layer relative reconstruction error (tsenor_report.json)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, format="png", dpi=120)
    return True
