"""The paper's Table 2 analog on the embedded SmolLM2-135M, offline, resumable (docs/results.md).

Each run prunes with `tsenor prune` (its own process, with --resume), evaluates with `tsenor eval`,
copies the small JSON/Markdown reports to RESULTS/runs/NAME/ and, unless --keep-checkpoints, deletes
the pruned weights. A run whose RESULTS/runs/NAME/eval.json exists (and, with --tasks, holds every
requested task at the requested --limit) is skipped, so the script can be killed and restarted at any
time; a finished run that lacks the zero-shot tasks is pruned again (same seed, same masks) and
evaluated. After every run it rebuilds RESULTS/table.{md,csv,json} and the plots with `tsenor report`.

Usage (make results runs it with the defaults):
    .venv/bin/python scripts/results_grid.py [--only alps-16x32-t,alps-16x32-o] [--tasks piqa,...]
Run names are METHOD-NxM-t (transposable) or -o (ordinary), e.g. sparsegpt-2x4-o; "dense" is the
unpruned model. Default order: the 16:32 rows, then 2:4, 8:16, 4:8, 8:32.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tsenor_cli import atomic

METHODS = ("alps", "sparsegpt", "wanda", "magnitude")
PATTERNS = ("16:32", "2:4", "8:16", "4:8", "8:32")
KINDS = ("t", "o")
KEEP_FILES = ("eval.json", "tsenor_report.json", "tsenor_report.md")


@dataclass(frozen=True)
class Run:
    """One grid cell; method None is the dense model."""

    method: str | None
    nm: str
    transposable: bool

    @property
    def name(self) -> str:
        if self.method is None:
            return "dense"
        return f"{self.method}-{self.nm.replace(':', 'x')}-{'t' if self.transposable else 'o'}"

    @classmethod
    def parse(cls, name: str) -> Run:
        if name == "dense":
            return cls(None, "", False)
        parts = name.split("-")
        if len(parts) != 3 or parts[0] not in METHODS or parts[2] not in KINDS or "x" not in parts[1]:
            raise SystemExit(f"bad run name {name!r}; use METHOD-NxM-t|o (e.g. alps-16x32-t) or dense")
        return cls(parts[0], parts[1].replace("x", ":"), parts[2] == "t")


def default_runs(methods: list[str], patterns: list[str], kinds: list[str]) -> list[Run]:
    runs = [Run(None, "", False)]
    for nm in patterns:
        for kind in kinds:
            runs += [Run(method, nm, kind == "t") for method in methods]
    return runs


def tsenor(*args: str) -> None:
    """Run the CLI of this interpreter's environment; stop the grid on failure."""
    cmd = [sys.executable, "-m", "tsenor_cli", *args]
    print("$ tsenor " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def run_one(run: Run, args: argparse.Namespace, work: Path, results: Path) -> None:
    dest = results / "runs" / run.name
    out = work / run.name
    eval_args = ["--ppl", args.ppl, "--seqlen", str(args.eval_seqlen), "--max-windows", str(args.max_windows)]
    if args.tasks:
        eval_args += ["--tasks", args.tasks, "--limit", str(args.limit)]
    start = time.perf_counter()
    if run.method is None:
        tsenor("eval", "--model", args.model, *eval_args, "--output", str(out), "--force")
    elif (out / "tsenor_report.json").exists():
        # Pruned before the last interruption, not yet evaluated.
        tsenor("eval", "--model", str(out), *eval_args, "--output", str(out), "--force")
    else:
        pattern = ["--nm", run.nm, "--transposable" if run.transposable else "--no-transposable"]
        tsenor(
            "prune",
            "--model",
            args.model,
            *pattern,
            "--method",
            run.method,
            "--calib-data",
            "c4",
            "--nsamples",
            str(args.nsamples),
            "--seqlen",
            str(args.seqlen),
            "--seed",
            str(args.seed),
            "--output",
            str(out),
            "--resume",
        )
        tsenor("verify", str(out))
        tsenor("eval", "--model", str(out), *eval_args, "--output", str(out), "--force")
    dest.mkdir(parents=True, exist_ok=True)
    for name in KEEP_FILES:
        if (out / name).exists():
            shutil.copy2(out / name, dest / name)
    atomic.write_json(dest / "wall_seconds.json", {"seconds": time.perf_counter() - start}, indent=None)
    if not args.keep_checkpoints:
        shutil.rmtree(out)


def is_done(run: Run, args: argparse.Namespace) -> bool:
    """eval.json exists and covers what this invocation asks for (perplexity always; tasks if given)."""
    path = args.results / "runs" / run.name / "eval.json"
    if not path.exists():
        return False
    if not args.tasks:
        return True
    zeroshot = json.loads(path.read_text()).get("zeroshot") or {}
    have = set(zeroshot.get("tasks", {}))
    return set(args.tasks.split(",")) <= have and zeroshot.get("limit") == args.limit


def rebuild_report(results: Path) -> None:
    done = sorted(p for p in (results / "runs").glob("*") if (p / "eval.json").exists())
    if done:
        tsenor("report", *map(str, done), "--output", str(results / "report"), "--force")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--kinds", default="t,o", help="t (transposable), o (ordinary) or both")
    parser.add_argument("--only", default="", help="comma list of run names instead of the grid")
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ppl", default="wikitext2,ptb,c4")
    parser.add_argument("--eval-seqlen", type=int, default=2048)
    parser.add_argument("--max-windows", type=int, default=16)
    parser.add_argument("--tasks", default="", help="zero-shot tasks (comma list); none by default")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--work", type=Path, default=Path("runs/grid"), help="checkpoints while a run is going")
    parser.add_argument("--results", type=Path, default=Path("docs/results"))
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="list the runs still to do and exit")
    args = parser.parse_args()

    if args.only:
        runs = [Run.parse(name) for name in args.only.split(",")]
    else:
        runs = default_runs(args.methods.split(","), args.patterns.split(","), args.kinds.split(","))
    todo = [r for r in runs if not is_done(r, args)]
    print(f"{len(runs) - len(todo)} of {len(runs)} runs done; to do: {', '.join(r.name for r in todo) or 'none'}")
    if args.dry_run:
        return
    for i, run in enumerate(todo, 1):
        print(f"\n=== run {i}/{len(todo)}: {run.name}", flush=True)
        run_one(run, args, args.work, args.results)
        rebuild_report(args.results)


if __name__ == "__main__":
    main()
