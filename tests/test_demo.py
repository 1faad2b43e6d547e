"""`make demo`'s script end to end on a tiny model (the real run is too long for CI; README shows it),
and the bookkeeping of `make results`' target and claims checks."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers_tiny import make_tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.realdata
def test_demo_script_runs_every_step_on_a_tiny_model(tmp_path: Path, data_dir: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "demo"
    tsenor = shutil.which("tsenor", path=str(Path(sys.executable).parent))
    assert tsenor is not None, "the tsenor console script is installed next to the interpreter"
    env = {
        **os.environ,
        "TSENOR": tsenor,
        "TSENOR_DATA_DIR": str(data_dir),
        "DEMO_MODEL": str(model),
        "DEMO_OUT": str(out),
        "DEMO_NSAMPLES": "2",
        "DEMO_SEQLEN": "64",
        "DEMO_WINDOWS": "2",
        "DEMO_TASKS": "piqa",
        "DEMO_LIMIT": "4",
    }
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "demo.sh")], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in ("2/7", "3/7", "4/7", "5/7", "6/7", "7/7", "done"):
        assert step in proc.stdout
    assert (out / "alps-16x32" / "model.safetensors").is_file()
    packed, dense = ((out / name / "model.safetensors").stat().st_size for name in ("alps-16x32-packed", "alps-16x32"))
    assert packed < dense
    assert f"packed: {packed / 1e6:.1f} MB of weights against {dense / 1e6:.1f} MB dense" in proc.stdout
    report = json.loads((out / "alps-16x32" / "tsenor_report.json").read_text())
    assert report["pattern"] == {"n": 16, "m": 32, "transposable": True}
    dense = json.loads((out / "dense" / "eval.json").read_text())
    pruned = json.loads((out / "alps-16x32" / "eval.json").read_text())
    assert set(dense["perplexity"]) == set(pruned["perplexity"]) == {"wikitext2", "ptb"}
    table = (out / "report" / "table.md").read_text()
    assert "dense" in table and "alps" in table


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_results_targets_report_missing_runs_as_not_run(tmp_path: Path) -> None:
    targets = _load_script("results_targets")
    rows = targets.check(tmp_path)
    assert rows and all(verdict == "not run" for _, _, verdict in rows)


def _fake_run(results: Path, name: str, ppl: float) -> None:
    run = results / "runs" / name
    run.mkdir(parents=True)
    (run / "eval.json").write_text(json.dumps({"perplexity": {"wikitext2": {"ppl": ppl}}}))


def test_results_claims_ratios_and_share_from_runs(tmp_path: Path) -> None:
    targets = _load_script("results_targets")
    for name, ppl in [("dense", 20.0), ("alps-16x32-t", 45.0), ("alps-16x32-o", 36.0), ("wanda-16x32-t", 120.0)]:
        _fake_run(tmp_path, name, ppl)
    lines = targets.claims(tmp_path)
    alps = next(line for line in lines if line.startswith("| alps |"))
    assert alps == "| alps | — | — | — | 1.25× | — |"  # 45 / 36; the other patterns were not run
    t16 = next(line for line in lines if line.startswith("| T16:32 |"))
    assert t16 == "| T16:32 | 75% | — |"  # (120 − 45) / (120 − 20); no SparseGPT run
