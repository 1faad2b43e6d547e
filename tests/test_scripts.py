"""The analysis scripts behind docs/results.md, on hand-written inputs.

scripts/paper_ratios.py: parsing the paper's result tables and the ratio report. scripts/pattern_cost.py:
the score a pattern leaves out, on a tile worked by hand. scripts/rotation_floor.py: a row's refit on its
mask against a direct least-squares solve.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def paper_ratios() -> ModuleType:
    return _load_script("paper_ratios")


@pytest.fixture(scope="module")
def pattern_cost() -> ModuleType:
    return _load_script("pattern_cost")


def _table(label: str, alps_o: tuple[float, float, float], alps_t: tuple[float, float, float]) -> str:
    """A table shaped like the paper's appendix tables, with one 16:32 group."""
    o, t = (" & ".join(f"{x:.2f}" for x in v) for v in (alps_o, alps_t))
    return "\n".join(
        [
            r"\begin{table}[h]",
            r"\multirow{5}{*}{16:32}",
            r"&\texttt{SparseGPT} & \ding{55} & 99.00 & 98.00 & 97.00 & 50.00 \\",
            rf"&\texttt{{ALPS}} & \ding{{55}} & {o} & 60.00 \\",
            r"% &\texttt{ALPS} & \ding{55} & 1.00 & 1.00 & 1.00 \\",
            rf"&\texttt{{\modelnamee+ALPS}} & \ding{{51}} & {t} & 58.00 \\",
            rf"\caption{{x}}\label{{{label}}}",
            r"\end{table}",
        ]
    )


def test_parse_table_reads_marks_groups_and_skips_comments(paper_ratios: ModuleType) -> None:
    tex = "preamble\n" + _table("tab:exp-all-1B", (22.97, 16.75, 27.61), (25.92, 19.12, 31.08))
    rows = paper_ratios.parse_table(tex, "tab:exp-all-1B")
    assert rows == {
        ("16:32", "SparseGPT", False): (99.0, 98.0, 97.0),
        ("16:32", "ALPS", False): (22.97, 16.75, 27.61),
        ("16:32", "ALPS", True): (25.92, 19.12, 31.08),
    }


def test_parse_table_missing_label_names_the_fix(paper_ratios: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"tsenor\.tex"):
        paper_ratios.parse_table("no tables here", "tab:exp-all-1B")


def test_report_puts_paper_and_our_ratios_side_by_side(paper_ratios: ModuleType, tmp_path: Path) -> None:
    tex = "\n".join(_table(label, (10.0, 20.0, 40.0), (11.0, 25.0, 60.0)) for _, label in paper_ratios.TABLES)
    for kind, scale in (("t", 1.5), ("o", 1.0)):
        run = tmp_path / "runs" / f"alps-16x32-{kind}"
        run.mkdir(parents=True)
        ppl = {"c4": 30.0 * scale, "wikitext2": 20.0 * scale, "ptb": 40.0 * scale}
        (run / "eval.json").write_text(json.dumps({"perplexity": {k: {"ppl": v} for k, v in ppl.items()}}))
    lines = paper_ratios.report(tex, tmp_path)
    wt2 = lines[lines.index("ALPS transposable / ordinary perplexity, wikitext2 (— where a row is missing):") :]
    # 16:32 is the fourth pattern column; 25/20 = 1.25 in the paper rows, 1.5 in ours; other patterns missing.
    assert wt2[4] == "| LLaMA-3.2-1B (paper) | — | — | — | 1.25× | — |"
    assert wt2[7] == "| SmolLM2-135M (ours) | — | — | — | 1.50× | — |"


def test_pattern_cost_outlier_column_hand_worked(pattern_cost: ModuleType) -> None:
    # 2:4 on one 4×4 tile; column 0 scores 10 in every row, column 1 scores 5, the rest 1 (total 68).
    # Ordinary keeps columns 0 and 1 in every row (60 kept). Transposable keeps exactly 2 per column,
    # so at best 2·10 + 2·5 + 2·1 + 2·1 = 34: the outlier columns lose half their rows whatever the solver.
    scores = torch.tensor([[10.0, 5.0, 1.0, 1.0]] * 4)
    assert pattern_cost.left_out(scores, 2, 4, transposable=False) == pytest.approx(8 / 68)
    assert pattern_cost.left_out(scores, 2, 4, transposable=True) == pytest.approx(34 / 68)
    assert pattern_cost.top_channel_share(scores, 0.25) == pytest.approx(40 / 68)


@pytest.fixture(scope="module")
def rotation_floor() -> ModuleType:
    return _load_script("rotation_floor")


def test_rotation_floor_refit_is_each_row_s_least_squares_on_its_mask(rotation_floor: ModuleType) -> None:
    """With uncorrelated inputs (G = I) the kept weights are already optimal: the refit keeps them and the
    error is the dropped weights' share (hand-worked); with correlated ones each row's refit equals a least
    squares fit of w·X by the kept columns of X, solved directly, and it never raises the error."""
    weight = torch.tensor([[4.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    kept = torch.tensor([[True, False, False, True], [False, True, True, False]])
    eye = torch.eye(4, dtype=torch.float64)
    assert torch.equal(rotation_floor.refit(weight, eye, kept, damp=0.0), weight * kept)
    assert rotation_floor.relative_error(weight, eye, weight * ~kept) == pytest.approx((1 + 4 + 1 + 1) / (30 + 4))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen, dtype=torch.float64) @ torch.randn(4, 4, generator=gen, dtype=torch.float64)
    gram = x.T @ x
    fitted = rotation_floor.refit(weight, gram, kept, damp=0.0)
    for row in range(2):
        columns = kept[row].nonzero().flatten()
        solution = torch.linalg.lstsq(x[:, columns], x @ weight[row]).solution
        assert torch.allclose(fitted[row, columns], solution) and not fitted[row, ~kept[row]].any()
    assert rotation_floor.relative_error(weight, gram, weight - fitted) <= rotation_floor.relative_error(
        weight, gram, weight * ~kept
    )
