"""The runs committed in docs/results/zeroshot/runs: each folder reads as a run (`load_run`: its
tsenor_report.json and eval.json against their schemas, every document's score included), and the table
in docs/results/zeroshot/README.md prints what those files hold, so that the numbers docs/results.md quotes
from them are the files' and a later session can pair against them (`report.paired`)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tsenor_cli.evaluation.zeroshot import PAPER_TASKS
from tsenor_cli.runfiles.run import Run, load_run

ZEROSHOT = Path(__file__).resolve().parents[1] / "docs" / "results" / "zeroshot"
RUNS = ZEROSHOT / "runs"
FOLDERS = sorted(p for p in RUNS.iterdir() if p.is_dir())
# `| `folder` | `prune flags` | WT2 | PTB | C4 | mean ± stderr |`
ROW = re.compile(r"^\| `([^`]+)` \| .+ \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) ± ([\d.]+) \|$")


def readme_rows() -> dict[str, tuple[str, ...]]:
    rows = {}
    for line in (ZEROSHOT / "README.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = match.groups()[1:]
    return rows


def printed(run: Run) -> tuple[str, ...]:
    """The README's columns as the files give them: perplexities to 2 places, the zero-shot mean in
    points and its error √(Σ stderr²)/n (the tasks taken as independent)."""
    ppl = tuple(f"{run.eval.perplexity[name].ppl:.2f}" for name in ("wikitext2", "ptb", "c4"))
    zeroshot = run.eval.zeroshot
    assert zeroshot is not None
    errors = [t.acc_stderr for t in zeroshot.tasks]
    assert all(e is not None for e in errors)
    stderr = 100 * math.sqrt(sum(e * e for e in errors if e is not None)) / len(errors)
    return (*ppl, f"{100 * zeroshot.average:.2f}", f"{stderr:.2f}")


def test_every_folder_has_a_row_and_every_row_a_folder() -> None:
    assert FOLDERS, f"no runs under {RUNS}"
    assert sorted(readme_rows()) == [p.name for p in FOLDERS]


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_a_committed_run_reads_and_its_row_prints_its_files(folder: Path) -> None:
    run = load_run(folder)
    assert run.prune is not None, f"{folder.name} has no tsenor_report.json"
    zeroshot = run.eval.zeroshot
    assert zeroshot is not None
    # Paired comparisons need every document's score, on the protocol's 500 documents a task (RTE has 277).
    assert sorted(t.name for t in zeroshot.tasks) == sorted(PAPER_TASKS)
    for task in zeroshot.tasks:
        assert task.doc_acc is not None and task.docs_sha256 is not None
        assert task.n_samples == (277 if task.name == "rte" else 500)
        assert math.isclose(task.acc, sum(task.doc_acc) / task.n_samples, rel_tol=1e-9)
    assert readme_rows()[folder.name] == printed(run)
