"""The run reports rendered for people: ``tsenor_report.md`` (from `runfiles.PruneReport`) and the table
`tsenor eval` prints (from `runfiles.EvalReport`).

`prune_summary` is the report's head (model, method and pattern, calibration, times, totals), which
`tsenor prune` also prints when it finishes; `prune_markdown` adds one table row per layer. Kept free
of heavy imports: `tsenor prune` writes the file.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tsenor_cli.runfiles import EvalReport, PruneReport, block_range

MAX_LISTED_IGNORED = 12  # more ignored layers than this are counted by reason in the report summary


def prune_summary(report: PruneReport) -> list[str]:
    """The report's title and summary lines (no trailing blank line)."""
    s = report.settings
    t = report.totals()
    pattern = s["pattern"]
    label = f"{pattern['n']}:{pattern['m']}" if pattern["kind"] != "unstructured" else f"{pattern['sparsity']:.0%}"
    lines = [
        "# tsenor pruning report",
        "",
        f"- model: `{s['model']}`",
        f"- method: {s['method']}, pattern {label} ({pattern['kind']}), {_solver_label(s)}",
        f"- calibration: {report.calibration} ({s['nsamples']} × {s['seqlen']}), seed {s['seed']}"
        if report.calibration_source is None or report.calibration_source.kind != "none"
        else f"- calibration: {report.calibration}",  # a method that reads no data (stand_in_batches)
    ]
    if report.context is not None:
        folder = report.context.data_dir or "none (HF hub)"
        lines.append(f"- data folder: {folder}; offline: {'yes' if report.context.offline else 'no'}")
    return [
        *lines,
        f"- command: `{report.command or ''}`",
        f"- versions: {', '.join(f'{k} {v}' for k, v in report.versions.items())}",
        _time_line(report, t),
        f"- layers pruned: {t['layers_pruned']}, skipped: {t['layers_skipped']}, "
        f"idle: {t['layers_idle']}, ignored: {t['layers_ignored']}",
        *_density_lines(report, t),
        f"- mean relative reconstruction error: {_fmt(t['mean_recon_error'])}; max certified gap: {_fmt(t['max_gap'])}",
    ]


def _time_line(report: PruneReport, t: Mapping[str, Any]) -> str:
    """The wall time of this run, and the method's and solver's seconds summed over the layer records.

    A resumed run's records include the blocks earlier attempts pruned, its wall time does not, so the
    line says which of the two a reader is looking at (the sum is larger than the wall time otherwise).
    """
    totals = f"method {t['method_seconds']:.1f} s, solver {t['solver_seconds']:.1f} s"
    parts = totals
    if report.phases:
        # The run's phases, each timed once and none inside another; "other" is the rest (phases under
        # 0.05 s included), so the parts add up to the total.
        shown = [(name, s) for name, s in report.phases.items() if s >= 0.05]
        other = max(report.seconds - sum(s for _name, s in shown), 0.0)
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in (*shown, ("other", other)))
    if not report.resumed_from_block:
        return f"- total time: {report.seconds:.1f} s ({parts})"
    done = report.resumed_from_block
    attempt = f"{report.seconds:.1f} s in this attempt, which resumed with {block_range(done)} done"
    if not report.phases:
        return f"- total time: {attempt} ({parts}, over all attempts)"
    # The phases are this attempt's; the layer records' method and solver sums cover every attempt.
    return f"- total time: {attempt} ({parts}); {totals} over all attempts"


def prune_markdown(report: PruneReport) -> str:
    """The content of tsenor_report.md: the summary and one table row per layer."""
    lines = [
        *prune_summary(report),
        "",
        "| layer | shape | status | rel. error | certified gap | seconds | iterations |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report.layers:
        status = r.status if r.reason is None else f"{r.status}: {r.reason}"
        lines.append(
            f"| {r.name} | {r.out_features}×{r.in_features} | {status} | {_fmt(r.recon_error)} | "
            f"{_fmt(r.gap)} | {r.seconds:.2f} | {r.iterations} |"
        )
    return "\n".join(lines + _refinement_lines(report)) + "\n"


def _refinement_lines(report: PruneReport) -> list[str]:
    """The block refinement table (`--refine block`); none for a run without it."""
    blocks = report.refinement
    if not blocks:
        return []
    kept = sum(b.kept for b in blocks)
    return [
        "",
        f"## Block refinement ({kept} of {len(blocks)} blocks kept their refined weights, "
        f"{sum(b.seconds for b in blocks):.1f} s)",
        "",
        "| block | error before | error after | kept | steps | seconds |",
        "|---|---|---|---|---|---|",
        *(
            f"| {b.block} | {_fmt(b.error_before)} | {_fmt(b.error_after)} | {'yes' if b.kept else 'no'} | "
            f"{b.steps} | {b.seconds:.2f} |"
            for b in blocks
        ),
    ]


def _density_lines(report: PruneReport, t: Mapping[str, Any]) -> list[str]:
    """The report's density and ignored-layer lines."""
    lines = []
    if t["model_density"] is not None and t["linear_density"] is not None:
        lines.append(
            f"- density: model {t['model_density']:.4f} ({t['model_nonzero']:,} of {t['model_params']:,} "
            f"parameters nonzero), decoder weight matrices {t['linear_density']:.4f}"
        )
    ignored = [r for r in report.layers if r.status == "ignored"]
    if len(ignored) <= MAX_LISTED_IGNORED:
        named = ", ".join(r.name for r in ignored)
    else:  # every one is in the table below; the line counts them by reason
        reasons = Counter(r.reason for r in ignored)
        named = "; ".join(f"{count} {reason}" for reason, count in reasons.items()) + " (each in the table)"
    if ignored:
        lines.append(f"- ignored (left dense): {named}")
    return lines


def _solver_label(settings: Mapping[str, Any]) -> str:
    """The transposable solver that ran and, if different, the one asked for: "solver flow (asked for auto)".

    Reports written before the solver split (schema v1) carry only the solver asked for.
    """
    asked = settings["layer"]["solver"]
    ran = settings.get("solver", asked)
    if ran is None:
        return "no mask solver"
    return f"solver {ran}" if ran == asked else f"solver {ran} (asked for {asked})"


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def eval_table(report: EvalReport) -> str:
    """A human table: one row per perplexity dataset, then zero-shot accuracies when run."""
    lines = [f"model {report.model} ({report.model_type}, {report.dtype}, {report.device}), seqlen {report.seqlen}"]
    if report.perplexity:
        lines.append(f"{'dataset':<10} {'ppl':>12} {'windows':>8} {'tokens':>9}  data")
        for name, entry in report.perplexity.items():
            ppl = f"{entry.ppl:.3f}" if math.isfinite(entry.ppl) else str(entry.ppl)
            kind = entry.data_source.kind if entry.data_source is not None else "unrecorded"
            lines.append(f"{name:<10} {ppl:>12} {entry.windows:>8} {entry.tokens:>9}  {kind}")
    if report.zeroshot is not None:
        lines.append(f"{'task':<14} {'acc':>8} {'acc_norm':>9} {'± acc':>8}")
        for task in report.zeroshot.tasks:
            # WinoGrande, RTE, BoolQ define only acc; "± acc" is lm-eval's standard error of acc.
            norm_text = "-" if task.acc_norm is None else f"{task.acc_norm:.4f}"
            stderr_text = "-" if task.acc_stderr is None else f"{task.acc_stderr:.4f}"
            lines.append(f"{task.name:<14} {task.acc:>8.4f} {norm_text:>9} {stderr_text:>8}")
        lines.append(f"{'average (acc)':<14} {report.zeroshot.average:>8.4f}")
    lines.extend(f"data {name}: {entry.data}" for name, entry in report.perplexity.items())
    lines.append(f"took {report.seconds:.1f} s")
    return "\n".join(lines)
