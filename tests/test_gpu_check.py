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
    assert [s["name"] for s in report["steps"]] == [s.name for s in gpu_check.DEFAULT_STEPS]
    assert "llama-8b" not in [s.name for s in gpu_check.DEFAULT_STEPS]  # runs when named (the 8 minutes)
    assert all(s["status"] == "skipped" and "budget of 5 s was spent" in s["note"] for s in report["steps"])


def test_path_steps_run_two_at_a_time_on_a_gpu_and_the_others_alone(gpu_check: ModuleType, tmp_path: Path) -> None:
    """Seven path steps in series took 143 s of the H200 run's 551 (2026-11-29): on CUDA they go two at a
    time, each with its own folder, and the records keep the steps' order. Both steps of a group wait on
    one barrier, so the test passes only if they really run at once."""
    import threading

    barrier = threading.Barrier(2, timeout=20)

    def together(r: object) -> dict:
        barrier.wait()
        return {"checks": [gpu_check.fact("ran", True, str(r.folder.name))]}  # type: ignore[attr-defined]

    def alone(r: object) -> dict:
        return {"checks": []}

    steps = [
        gpu_check.Step("big", "big", "whole", alone),
        gpu_check.Step("p1", "p1", "path", together),
        gpu_check.Step("p2", "p2", "path", together),
        gpu_check.Step("p3", "p3", "path", alone),
    ]
    groups = gpu_check.step_groups(steps, gpu_check.PATH_AT_ONCE["cuda"])
    assert [[s.name for s in g] for g in groups] == [["big"], ["p1", "p2"], ["p3"]]
    assert [len(g) for g in gpu_check.step_groups(steps, gpu_check.PATH_AT_ONCE["cpu"])] == [1, 1, 1, 1]
    sizes = gpu_check.Sizes(0, (), (), (), "1", (), caps={"whole": 30, "path": 30})
    run = gpu_check.Run(tmp_path / "out", "cuda", tmp_path / "carry", sizes)
    records = gpu_check.run_group(run, groups[1], None)
    shown = [(r["name"], r["status"], r["checks"][0]["shown"]) for r in records]
    assert shown == [("p1", "ok", "p1"), ("p2", "ok", "p2")]


def test_the_speedup_step_judges_transposable_and_shows_ordinary(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tsenor bench speedup`'s MLP rows, by hand: dense 10 ms, transposable 8 ms (1.25x, target 1.15) and
    ordinary 9.5 ms, shown without a target (its input gradient cannot run sparse)."""
    sizes = gpu_check.Sizes(0, (), (), (), "1", (), caps={"speedup": 30})
    run = gpu_check.Run(tmp_path / "out", "cuda", tmp_path / "carry", sizes, folder=tmp_path)
    rows = [
        ("dense", "cublas", 10.0),
        ("transposable", "cusparselt-direct", 8.0),
        ("ordinary", "cusparselt-direct", 9.5),
    ]
    timings = [{"op": "MLP fwd+bwd", "variant": v, "backend": b, "ms": ms} for v, b, ms in rows]

    def call(name: str, argv: list[str]) -> str:
        assert argv[argv.index("--backends") + 1] == "cusparselt-direct"
        (tmp_path / "speedup.json").write_text(json.dumps({"timings": timings}))
        return ""

    monkeypatch.setattr(run, "call", call)
    checks = gpu_check.step_speedup(run)["checks"]
    assert [(c["shown"], c["ok"]) for c in checks] == [("1.25", True), ("1.05", None)]
    assert checks[1]["target"] == "none"


def test_the_kernels_step_shows_each_shapes_fused_compression_or_why_not(gpu_check: ModuleType) -> None:
    """`tsenor bench kernels`' shape rows, by hand: 0.2 ms fused against 1.1 + 1.2 ms apart; another shape
    whose fused layout differed; an older result without the fused columns."""
    rows = [
        {"shape": [14336, 4096], "compress_ms": 1.1, "compress_t_ms": 1.2, "fused": "", "compress_fused_ms": 0.2},
        {"shape": [1024, 4096], "compress_ms": 0.3, "compress_t_ms": 0.3, "fused": "its layout differs",
         "compress_fused_ms": None},
        {"shape": [4096, 4096], "compress_ms": 0.5, "compress_t_ms": 0.6},
    ]  # fmt: skip
    assert gpu_check.fused_shown(rows) == (
        "14336×4096 0.200/2.300; 1024×4096 no: its layout differs; 4096×4096 no: not measured"
    )


def test_a_carry_folder_without_the_prepared_inputs_is_refused(gpu_check: ModuleType, tmp_path: Path) -> None:
    assert gpu_check.main(["run", "--device", "cpu", "--carry", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_an_unknown_step_is_refused(gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    assert gpu_check.main(["run", "--carry", str(tmp_path), "--out", str(out), "--steps", "llama-70b", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: no step nope; the steps: solver, ")
    assert not out.exists()


def _e2e_70b(projected: float, start: int, peak: int, estimate: int) -> dict:
    """What `tsenor bench prune --stream` writes for one 70B block (the fields the step reads)."""
    run = {"method": "alps", "kind": "transposable", "pattern": "16:32", "seconds": 110.0, "verified": True}
    run |= {"phases": {"save": 8.0, "statistics": 0.4}, "peak_over_estimate": 1.1}
    run |= {"projected_whole_seconds": projected - 900.0, "projected_whole_seconds_default_calibration": projected}
    run |= {"host_start_bytes": start, "host_peak_bytes": peak, "host_estimate_bytes": estimate}
    run |= {"host_added_over_estimate": (peak - start) / estimate}
    run |= {"host_phase_peak_bytes": {"load": start, "statistics": start + 1, "write": peak}}
    return {"runs": [run]}


@pytest.mark.parametrize(
    ("peak_gib", "host_ok", "status"),
    [(7, True, "ok"), (9, False, "miss")],  # 2 GiB at the start, 6 GiB estimated: 5 GiB more is within, 7 is not
)
def test_the_70b_step_judges_the_projection_and_the_host_peak_less_the_start(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peak_gib: int, host_ok: bool, status: str
) -> None:
    """On CUDA the step judges the 80-block projection at the default calibration (≤ 3 h) and what the run
    added to the process's resident set against the dry run's host estimate (≤ 1); it reports both
    projections and the host bytes."""
    gib = 1 << 30
    result = _e2e_70b(10_000.0, 2 * gib, peak_gib * gib, 6 * gib)
    calls: list[tuple] = []

    def bench(run: object, name: str, args: list[str], sizes: tuple | None = None) -> dict:
        calls.append((name, tuple(args), sizes))
        return result

    monkeypatch.setattr(gpu_check, "_bench_prune", bench)
    run = gpu_check.Run(tmp_path / "out", "cuda", tmp_path / "carry", gpu_check.GPU)
    step = next(s for s in gpu_check.STEPS if s.name == "llama-70b")
    record = gpu_check.run_step(run, step)
    assert calls == [
        ("e2e-70b", ("--methods", "alps", "--kinds", "transposable", "--stream"), gpu_check.GPU.huge_model)
    ]
    assert record["status"] == status
    checks = {c["what"]: c for c in record["checks"]}
    projected = checks["alps transposable 16:32: whole-model s (projected, at the default 128 × 2048 calibration)"]
    assert projected["ok"] and projected["shown"] == "1e+04" and projected["target"] == "≤ 1.08e+04"
    host = checks["alps transposable 16:32: host peak less the start / dry-run host estimate"]
    assert host["ok"] is host_ok and host["shown"] == f"{(peak_gib - 2) / 6:.2f}" and host["target"] == "≤ 1.00"
    assert checks["alps transposable 16:32: host peak in"]["shown"] == "write"
    assert record["projected_s"] == {"at the run's calibration": 9100.0, "at the default calibration": 10_000.0}
    assert record["host_bytes"] == {"start": 2 * gib, "peak": peak_gib * gib, "estimate": 6 * gib}


@pytest.mark.realmodel
@pytest.mark.realdata
def test_the_70b_step_runs_in_cpu_mode(
    gpu_check: ModuleType, tmp_path: Path, data_dir: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--steps llama-70b --device cpu`: the 70B shape's widths / 64 streamed from a random checkpoint, its
    checkpoint verified; its GPU targets (the projection, the peaks) shown but not judged."""
    carry, out = tmp_path / "carry", tmp_path / "out"
    (carry / "tokenizer").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (carry / "tokenizer" / name).write_bytes((smollm2_path / name).read_bytes())
    c4 = "c4/c4-en-sample-1000.olmo.json.gz"
    (carry / "data" / c4).parent.mkdir(parents=True)
    (carry / "data" / c4).write_bytes((data_dir / c4).read_bytes())
    (carry / "pool.safetensors").write_text("{}")  # present: the solver step, which reads it, is not run
    for model in gpu_check.TINY.values():
        (carry / "models" / model).mkdir(parents=True)
        (carry / "models" / model / "config.json").write_text("{}")  # present: not built
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert (
        gpu_check.main(["run", "--device", "cpu", "--carry", str(carry), "--out", str(out), "--steps", "llama-70b"])
        == 0
    )
    (step,) = json.loads((out / "gpu-check.json").read_text())["steps"]
    assert step["name"] == "llama-70b" and step["status"] == "ok", step
    judged = {c["what"]: c["ok"] for c in step["checks"]}
    assert judged.pop("alps transposable 16:32: checkpoint verified") is True
    # Projection, device peak, save share, host peak, and the phase of the host peak (not judged).
    assert set(judged.values()) == {None} and len(judged) == 5
    assert step["host_bytes"]["peak"] > step["host_bytes"]["start"] > 0 and step["host_bytes"]["estimate"] > 0
    where = next(c["shown"] for c in step["checks"] if c["what"] == "alps transposable 16:32: host peak in")
    assert max(step["host_phase_peak_bytes"].values()) <= step["host_bytes"]["peak"]
    assert where == "outside the phases" or set(where.split(", ")) <= set(step["host_phase_peak_bytes"]), where
    assert step["projected_s"]["at the default calibration"] > step["projected_s"]["at the run's calibration"] > 0
    assert "| llama-70b | alps transposable 16:32: host peak less the start" in (out / "gpu-check.md").read_text()


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
    assert list(steps) == [s.name for s in gpu_check.DEFAULT_STEPS]
    skipped = {"speedup", "device-map"}
    for name, step in steps.items():
        if name in skipped:
            assert step["status"] == "skipped" and ("CUDA" in step["note"] or "GPU" in step["note"]), step
        else:
            assert step["status"] == "ok", step
            assert step["checks"] and all(c["ok"] in (True, None) for c in step["checks"]), step
    page = (out / "gpu-check.md").read_text()
    assert all(f"| {s.title} |" in page for s in gpu_check.DEFAULT_STEPS)
    assert not (carry / "scratch").exists() or not any((carry / "scratch").rglob("*.safetensors"))
