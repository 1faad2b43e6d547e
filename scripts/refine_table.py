"""The Markdown tables of a `--refine block` study (docs/results.md, "Block refinement").

    python scripts/refine_table.py BASELINE_RUN RUN [RUN ...] [--output FILE] [--plot PNG]

Each RUN is a folder written by `tsenor prune` (tsenor_report.json) and `tsenor eval` (eval.json);
BASELINE_RUN is the same prune without refinement, made in the same session, which the time ratios
divide by. Prints (or writes) one row per run (settings, perplexities, prune seconds, ratio, blocks whose
refinement was kept; the zero-shot average where a run has one) and the per-block errors of every refined run;
--plot draws those errors (before dashed, after solid) by block. A resumed prune's seconds are its last
attempt's, so no ratio is drawn where the run or the baseline was resumed.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from tsenor_cli import atomic
from tsenor_cli.report.plots import plot_refinement
from tsenor_cli.runfiles import EVAL_FILE, PRUNE_FILE, EvalReport, PruneReport, read_json


def _load(folder: Path) -> tuple[PruneReport, EvalReport | None]:
    prune = PruneReport.from_json(read_json(folder / PRUNE_FILE), str(folder / PRUNE_FILE))
    path = folder / EVAL_FILE
    return prune, EvalReport.from_json(read_json(path), str(path)) if path.is_file() else None


def _setting(report: PruneReport) -> str:
    refine = report.settings.get("refine")
    return "none" if refine is None else f"{refine['epochs']} epoch(s), lr {refine['lr']:g}"


def _average(ev: EvalReport | None) -> str:
    """The zero-shot average in % with its task count and document limit, or "-"."""
    if ev is None or ev.zeroshot is None:
        return "-"
    zs = ev.zeroshot
    return f"{100 * zs.average:.2f} ({len(zs.tasks)} tasks, limit {zs.limit})"


def tables(baseline: Path, runs: list[Path]) -> str:
    """The summary table (baseline first) and the per-block table of the refined runs."""
    base, _ = _load(baseline)
    loaded = [(folder, *_load(folder)) for folder in [baseline, *runs]]
    datasets = sorted({name for _, _, ev in loaded if ev is not None for name in ev.perplexity})
    zeroshot = any(ev is not None and ev.zeroshot is not None for _, _, ev in loaded)
    head = ["run", "refine", *(f"{d} ppl" for d in datasets), *(["zero-shot avg"] if zeroshot else [])]
    head += ["prune s", "× baseline", "refine s", "kept"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for folder, report, ev in loaded:
        ppl = [f"{ev.perplexity[d].ppl:.2f}" if ev is not None and d in ev.perplexity else "-" for d in datasets]
        blocks = report.refinement
        kept = f"{sum(b.kept for b in blocks)}/{len(blocks)}" if blocks else "-"
        refine_s = f"{sum(b.seconds for b in blocks):.0f}" if blocks else "-"
        avg = [_average(ev)] if zeroshot else []
        # A resumed prune's seconds cover its last attempt only, so no ratio is drawn from it or against it.
        resumed = report.resumed_from_block is not None or base.resumed_from_block is not None
        ratio = "-" if resumed else f"{report.seconds / base.seconds:.2f}"
        seconds = f"{report.seconds:.0f}"
        if report.resumed_from_block is not None:
            seconds += f" (last attempt, resumed at block {report.resumed_from_block})"
        row = [folder.name, _setting(report), *ppl, *avg, seconds, ratio]
        lines.append("| " + " | ".join([*row, refine_s, kept]) + " |")
    refined = [(folder, report) for folder, report, _ in loaded if report.refinement]
    if refined:
        indices = sorted({b.block for _, report in refined for b in report.refinement})
        lines += ["", "Block output error (relative, against the dense block on the dense stream), before → after:", ""]
        lines.append("| block | " + " | ".join(folder.name for folder, _ in refined) + " |")
        lines.append("|---|" + "---|" * len(refined))
        for index in indices:
            cells = []
            for _, report in refined:
                found = [b for b in report.refinement if b.block == index]
                cells.append(
                    f"{found[0].error_before:.4f} → {found[0].error_after:.4f}{'' if found[0].kept else ' (not kept)'}"
                    if found
                    else "-"
                )
            lines.append(f"| {index} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("baseline", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--plot", type=Path, help="also draw the per-block errors of the refined runs here (PNG)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        reports = {folder.name: _load(folder)[0] for folder in [args.baseline, *args.runs]}
        out = io.BytesIO()
        if plot_refinement(reports, out):
            atomic.write_bytes(args.plot, out.getvalue())
    text = tables(args.baseline, args.runs)
    if args.output is not None:
        atomic.write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
