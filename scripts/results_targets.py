"""Check the pruning-engine targets on the runs of `make results` (configs/sweeps/table2.yaml, docs/results.md).

Usage: .venv/bin/python scripts/results_targets.py [--results docs/results]
Reads RESULTS/runs/NAME/{eval.json,tsenor_report.json} and writes RESULTS/targets.md (also printed).
A target whose runs are missing is reported as "not run", never as met. RESULTS/claims.md gets the
numbers behind docs/results.md's paragraph on the paper's Section 5.2 claims, computed from the same
runs: transposable over ordinary perplexity per method and pattern, and how much of Wanda's and
SparseGPT's perplexity increase over the dense model ALPS removes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tsenor_cli import atomic


def _load(results: Path, name: str) -> dict[str, Any] | None:
    run = results / "runs" / name
    if not (run / "eval.json").exists():
        return None
    out: dict[str, Any] = {"eval": json.loads((run / "eval.json").read_text())}
    if (run / "tsenor_report.json").exists():
        out["prune"] = json.loads((run / "tsenor_report.json").read_text())
    return out


def _ppl(run: dict[str, Any]) -> float:
    return float(run["eval"]["perplexity"]["wikitext2"]["ppl"])


def _err(run: dict[str, Any]) -> float:
    return float(run["prune"]["totals"]["mean_recon_error"])


def _secs(run: dict[str, Any]) -> float:
    return float(run["prune"]["totals"]["total_seconds"])


def check(results: Path) -> list[tuple[str, str, str]]:
    """→ rows (target, measured, verdict)."""
    names = ["alps-16x32-t", "sparsegpt-16x32-t", "wanda-16x32-t", "alps-16x32-o", "sparsegpt-2x4-o"]
    runs = {n: _load(results, n) for n in names}
    rows: list[tuple[str, str, str]] = []

    def need(*keys: str) -> list[dict[str, Any]] | None:
        got = [runs[k] for k in keys]
        return None if any(r is None for r in got) else [r for r in got if r is not None]

    trio = need("alps-16x32-t", "sparsegpt-16x32-t", "wanda-16x32-t")
    if trio is None:
        rows += [("T16:32 ppl: ALPS < SparseGPT < Wanda", "—", "not run")] * 2
    else:
        a, s, w = (_ppl(r) for r in trio)
        rows.append(("T16:32 WikiText2 ppl: ALPS < SparseGPT < Wanda", f"{a:.2f} / {s:.2f} / {w:.2f}", _ok(a < s < w)))
        a, s, w = (_err(r) for r in trio)
        rows.append(
            ("T16:32 mean rel. recon. error: ALPS < SparseGPT < Wanda", f"{a:.4f} / {s:.4f} / {w:.4f}", _ok(a < s < w))
        )
    pair = need("alps-16x32-t", "alps-16x32-o")
    if pair is None:
        rows += [("ALPS T16:32 ppl ≤ 1.15 × ALPS O16:32", "—", "not run"), ("ALPS time T ≤ 2 × O", "—", "not run")]
    else:
        t, o = pair
        rows.append(
            (
                "ALPS T16:32 ppl ≤ 1.15 × ALPS O16:32",
                f"{_ppl(t):.2f} vs {_ppl(o):.2f} (× {_ppl(t) / _ppl(o):.3f})",
                _ok(_ppl(t) <= 1.15 * _ppl(o)),
            )
        )
        rows.append(
            (
                "ALPS T16:32 prune time ≤ 2 × ALPS O16:32",
                f"{_secs(t):.0f} s vs {_secs(o):.0f} s (× {_secs(t) / _secs(o):.2f})",
                _ok(_secs(t) <= 2 * _secs(o)),
            )
        )
    pair = need("alps-16x32-t", "sparsegpt-2x4-o")
    if pair is None:
        rows.append(("ALPS T16:32 ppl < SparseGPT O2:4", "—", "not run"))
    else:
        t, sg = pair
        rows.append(("ALPS T16:32 ppl < SparseGPT O2:4", f"{_ppl(t):.2f} vs {_ppl(sg):.2f}", _ok(_ppl(t) < _ppl(sg))))
    alone = runs["alps-16x32-t"]
    if alone is None:
        rows.append(("ALPS T16:32 whole run ≤ 20 min on the 2-core CPU", "—", "not run"))
    else:
        rows.append(
            (
                "ALPS T16:32 whole run ≤ 20 min on the 2-core CPU",
                f"{_secs(alone) / 60:.1f} min",
                _ok(_secs(alone) <= 20 * 60),
            )
        )
    return rows


# The grid's patterns at 50% sparsity in order of M (the paper's Figure 3 axis); 8:32 is 75% and stands apart.
HALF = ("2:4", "4:8", "8:16", "16:32")
METHODS = ("alps", "sparsegpt", "wanda", "magnitude")


def _name(method: str, nm: str, transposable: bool) -> str:
    return f"{method}-{nm.replace(':', 'x')}-{'t' if transposable else 'o'}"


def claims(results: Path, dataset: str = "wikitext2") -> list[str]:
    """→ Markdown lines: T/O perplexity ratios by method and pattern, then ALPS's share of the loss removed."""
    patterns = (*HALF, "8:32")
    names = [_name(m, nm, t) for m in METHODS for nm in patterns for t in (True, False)]
    runs = {name: _load(results, name) for name in names}
    dense = _load(results, "dense")

    def ppl(name: str) -> float | None:
        run = runs[name]
        return None if run is None else float(run["eval"]["perplexity"][dataset]["ppl"])

    lines = [
        f"Transposable over ordinary {dataset} perplexity (— where a run is missing):",
        "",
        "| method | " + " | ".join(patterns) + " |",
        "|---|" + "---:|" * len(patterns),
    ]
    for m in METHODS:
        cells = []
        for nm in patterns:
            t, o = ppl(_name(m, nm, True)), ppl(_name(m, nm, False))
            cells.append("—" if t is None or o is None else f"{t / o:.2f}×")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Share of the {dataset} perplexity increase over dense that ALPS removes, (other − ALPS) / (other − dense):",
        "",
        "| pattern | vs Wanda | vs SparseGPT |",
        "|---|---:|---:|",
    ]
    d = None if dense is None else float(dense["eval"]["perplexity"][dataset]["ppl"])
    for nm in patterns:
        for t in (True, False):
            a = ppl(_name("alps", nm, t))
            cells = []
            for other in ("wanda", "sparsegpt"):
                x = ppl(_name(other, nm, t))
                cells.append("—" if a is None or x is None or d is None else f"{(x - a) / (x - d):.0%}")
            lines.append(f"| {'T' if t else 'O'}{nm} | " + " | ".join(cells) + " |")
    return lines


def _ok(flag: bool) -> str:
    return "met" if flag else "NOT met"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in check(args.results)]
    text = "\n".join(lines) + "\n"
    atomic.write_text(args.results / "targets.md", text)
    print(text, end="")
    claim_text = "\n".join(claims(args.results)) + "\n"
    atomic.write_text(args.results / "claims.md", claim_text)
    print("\n" + claim_text, end="")


if __name__ == "__main__":
    main()
