"""scripts/gpu_check.py (`make gpu-check`): the report's steps and checks, the time caps, the mask
comparison, and the whole check in CPU mode at toy sizes (so it cannot rot between GPU runs)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _checkpoint(folder: Path, masks: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True)
    save_file({k: torch.where(m, 0.0, 1.0) for k, m in masks.items()}, str(folder / "model.safetensors"))
    return folder


def test_agreement_is_the_smallest_share_of_entries_pruned_alike(gpu_check: ModuleType, tmp_path: Path) -> None:
    zeros = torch.zeros(4, 4, dtype=torch.bool)
    a = {"q.weight": zeros.clone(), "k.weight": zeros.clone()}
    a["q.weight"][0, :2] = True
    a["k.weight"][1, 1] = True
    b = {"q.weight": a["q.weight"].clone(), "k.weight": a["k.weight"].clone()}
    b["k.weight"][2, 2] = True  # one of k's 16 entries differs
    share, count = gpu_check.agreement(_checkpoint(tmp_path / "a", a), _checkpoint(tmp_path / "b", b))
    assert (share, count) == (15 / 16, 2)
    assert gpu_check.agreement(tmp_path / "a", tmp_path / "a") == (1.0, 2)
    other = _checkpoint(tmp_path / "c", {"q.weight": a["q.weight"]})  # prunes other matrices: no agreement
    assert gpu_check.agreement(tmp_path / "a", other) == (0.0, 0)


def test_transposable_two_four_on_hand_made_masks(gpu_check: ModuleType) -> None:
    kept = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert gpu_check.transposable_two_four(~kept)
    rows_only = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert not gpu_check.transposable_two_four(~rows_only)  # 2 of 4 per row, 4 or 0 per column
    assert not gpu_check.transposable_two_four(~kept[:, :3].contiguous())  # not a multiple of 4


def test_a_check_meets_or_misses_its_target(gpu_check: ModuleType) -> None:
    assert gpu_check.check("s", 0.04, 0.05)["ok"] and not gpu_check.check("s", 0.06, 0.05)["ok"]
    assert gpu_check.check("x", 1.2, 1.15, at_most=False)["ok"]
    missing = gpu_check.check("peak", None, 1.25)
    assert not missing["ok"] and missing["shown"] == "n/a"


def test_a_step_past_its_cap_is_cut_off_and_the_report_keeps_the_steps_before(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    sizes = gpu_check.Sizes(0, (), (), (), "1", (), caps={"fast": 30, "slow": 3})
    run = gpu_check.Run(tmp_path / "out", "cuda", tmp_path / "carry", sizes)

    def fast(r: object) -> dict:
        return {"checks": [gpu_check.fact("ran", True, "yes")]}

    def slow(r: object) -> dict:
        run.call("sleep", [sys.executable, "-c", "import time; time.sleep(30)"])
        return {"checks": []}

    env = {"date": "d", "device": "cuda", "python": "3", "torch": "t", "cpu_cores": 1, "commit": "c"}
    for step in (gpu_check.Step("a", "first", "fast", fast), gpu_check.Step("b", "second", "slow", slow)):
        run.steps.append(gpu_check.run_step(run, step))
        gpu_check.write_report(run, env, finished=step.name == "b")
    report = json.loads((run.out / "gpu-check.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [("a", "ok"), ("b", "cut off")]
    assert report["steps"][1]["seconds"] < 10
    assert "(cut off after" in (run.out / "steps" / "b" / "sleep.log").read_text()
    assert "| second | cut off |" in (run.out / "gpu-check.md").read_text()


def test_steps_past_the_run_budget_are_skipped_and_say_so(gpu_check: ModuleType, tmp_path: Path) -> None:
    carry, out = tmp_path / "carry", tmp_path / "out"
    for rel in (
        "tokenizer/tokenizer.json",
        "pool.safetensors",
        *(f"models/{m}/config.json" for m in gpu_check.TINY.values()),
    ):
        (carry / rel).parent.mkdir(parents=True, exist_ok=True)
        (carry / rel).write_text("{}")  # present: the run neither refuses the carry nor builds the models
    assert gpu_check.main(["run", "--device", "cpu", "--carry", str(carry), "--out", str(out), "--budget", "5"]) == 0
    report = json.loads((out / "gpu-check.json").read_text())
    assert [s["name"] for s in report["steps"]] == [s.name for s in gpu_check.STEPS]
    assert all(s["status"] == "skipped" and "budget of 5 s was spent" in s["note"] for s in report["steps"])


def test_a_carry_folder_without_the_prepared_inputs_is_refused(gpu_check: ModuleType, tmp_path: Path) -> None:
    assert gpu_check.main(["run", "--device", "cpu", "--carry", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.realdata
def test_the_gpu_check_runs_every_step_in_cpu_mode(data_dir: Path, tmp_path: Path, gpu_check: ModuleType) -> None:
    """`scripts/gpu_check.py prepare` then `run --device cpu` (what `make gpu-check DEVICE=cpu` runs):
    every step that can run on a CPU is ok, the two that need CUDA say so, the report lists them all."""
    carry, out = tmp_path / "carry", tmp_path / "report"
    env = os.environ | {"TSENOR_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}
    script = [sys.executable, str(ROOT / "scripts" / "gpu_check.py")]
    subprocess.run([*script, "prepare", "--carry", str(carry)], env=env, check=True, cwd=ROOT)
    carried = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    assert carried < 50 * 2**20  # the GPU machine's carry limit
    done = subprocess.run(
        [*script, "run", "--device", "cpu", "--carry", str(carry), "--out", str(out)], env=env, cwd=ROOT
    )
    assert done.returncode == 0
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["finished"] and report["environment"]["device"] == "cpu"
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == [s.name for s in gpu_check.STEPS]
    skipped = {"speedup", "device-map"}
    for name, step in steps.items():
        if name in skipped:
            assert step["status"] == "skipped" and ("CUDA" in step["note"] or "GPU" in step["note"]), step
        else:
            assert step["status"] == "ok", step
            assert step["checks"] and all(c["ok"] in (True, None) for c in step["checks"]), step
    page = (out / "gpu-check.md").read_text()
    assert all(f"| {s.title} |" in page for s in gpu_check.STEPS)
    assert not (carry / "scratch").exists() or not any((carry / "scratch").rglob("*.safetensors"))
