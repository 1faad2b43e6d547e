"""ALPS transposable over ordinary perplexity: the paper's LLaMA-3.2 1B/3B/8B tables next to our runs.

Usage: .venv/bin/python scripts/paper_ratios.py [--paper ../shared/paper/tsenor.tex] [--results docs/results]
Reads the appendix tables `tab:exp-all-1B`, `tab:exp-all-3B`, `tab:exp-all-8B` of the paper's LaTeX
source (columns C4, WT2, PTB perplexity, then zero-shot) and RESULTS/runs/alps-NxM-{t,o}/eval.json,
and writes RESULTS/paper_ratios.md (also printed). It is the evidence behind docs/results.md's
paragraph on why the ≤ 1.15× target of issue 4 is not met on SmolLM2-135M: the ratio depends on the
model's size, and 1.15× is the paper's 1B value.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tsenor_cli import atomic

# (model, table label) in the paper's appendix; perplexity columns in this order. The 8B table's caption
# says "LLaMA3.2-8B", a name no Meta release has (Table `tab:exp-layer-ablation` says LLaMA3-8B), so the
# label quotes it rather than guess the checkpoint.
TABLES = (
    ("LLaMA-3.2-1B", "tab:exp-all-1B"),
    ("LLaMA-3.2-3B", "tab:exp-all-3B"),
    ('"LLaMA3.2-8B"', "tab:exp-all-8B"),
)
DATASETS = ("c4", "wikitext2", "ptb")
PATTERNS = ("2:4", "4:8", "8:16", "16:32", "8:32")

_GROUP = re.compile(r"\\multirow\{\d+\}\{\*\}\{(\d+:\d+)\}")
# "&\texttt{ALPS} & \ding{55} & 22.97 & 16.75 & 27.61 & ..." (51 = check mark = transposable)
_ROW = re.compile(r"&\s*\\texttt\{([^}]*)\}\s*&\s*\\ding\{(\d+)\}\s*&\s*([\d.]+)\s*&\s*([\d.]+)\s*&\s*([\d.]+)")

Rows = dict[tuple[str, str, bool], tuple[float, float, float]]


def parse_table(tex: str, label: str) -> Rows:
    """The rows of the table environment holding `\\label{label}`: (N:M, algorithm, transposable) → (C4, WT2, PTB).

    Algorithm names are as typeset, with the paper's macro prefix dropped ("\\modelnamee+ALPS" → "ALPS");
    the transposable flag comes from the check mark (\\ding{51}) against the cross (\\ding{55}).
    """
    at = tex.find(f"\\label{{{label}}}")
    if at < 0:
        raise ValueError(f"no table labelled {label!r} in the paper source; pass the TSENOR paper's tsenor.tex")
    start = tex.rfind("\\begin{table", 0, at)
    end = tex.find("\\end{table", at)
    if start < 0 or end < 0:
        raise ValueError(f"label {label!r} is not inside a table environment")
    rows: Rows = {}
    group = None
    for line in tex[start:end].splitlines():
        if line.lstrip().startswith("%"):
            continue
        found = _GROUP.search(line)
        if found:
            group = found.group(1)
        row = _ROW.search(line)
        if row and group is not None:
            name = row.group(1).split("+")[-1]
            if row.group(2) not in ("51", "55"):
                raise ValueError(f"unexpected mark \\ding{{{row.group(2)}}} in {label!r}: {line.strip()[:80]}")
            rows[(group, name, row.group(2) == "51")] = (
                float(row.group(3)),
                float(row.group(4)),
                float(row.group(5)),
            )
    if not rows:
        raise ValueError(f"no result rows found in table {label!r}")
    return rows


def _ours(results: Path, nm: str) -> tuple[float, float, float] | None:
    """T/O perplexity ratios (C4, WT2, PTB) of alps-NxM-t over alps-NxM-o, or None where a run is missing."""
    runs = [results / "runs" / f"alps-{nm.replace(':', 'x')}-{k}" / "eval.json" for k in ("t", "o")]
    if not all(r.exists() for r in runs):
        return None
    t, o = (json.loads(r.read_text())["perplexity"] for r in runs)
    c4, wt2, ptb = (float(t[d]["ppl"]) / float(o[d]["ppl"]) for d in DATASETS)
    return c4, wt2, ptb


def report(tex: str, results: Path) -> list[str]:
    """→ Markdown lines: one table per dataset, a row per model, a column per pattern."""
    paper = {model: parse_table(tex, label) for model, label in TABLES}
    lines: list[str] = []
    for i, dataset in enumerate(DATASETS):
        lines += [
            f"ALPS transposable / ordinary perplexity, {dataset} (— where a row is missing):",
            "",
            "| model | " + " | ".join(PATTERNS) + " |",
            "|---|" + "---:|" * len(PATTERNS),
        ]
        for model, rows in paper.items():
            cells = []
            for nm in PATTERNS:
                t, o = rows.get((nm, "ALPS", True)), rows.get((nm, "ALPS", False))
                cells.append("—" if t is None or o is None else f"{t[i] / o[i]:.2f}×")
            lines.append(f"| {model} (paper) | " + " | ".join(cells) + " |")
        ours = [_ours(results, nm) for nm in PATTERNS]
        lines.append("| SmolLM2-135M (ours) | " + " | ".join("—" if r is None else f"{r[i]:.2f}×" for r in ours) + " |")
        lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", type=Path, default=Path("../shared/paper/tsenor.tex"))
    parser.add_argument("--results", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    if not args.paper.is_file():
        parser.error(f"paper source not found: {args.paper}; pass --paper PATH/tsenor.tex")
    text = "\n".join(report(args.paper.read_text(), args.results)).rstrip() + "\n"
    atomic.write_text(args.results / "paper_ratios.md", text)
    print(text, end="")


if __name__ == "__main__":
    main()
