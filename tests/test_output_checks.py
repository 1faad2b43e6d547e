"""Every output checked before the work (issue 47, item 2; `tsenor_cli/outputs.py`).

`tsenor eval --output` on a read-only file system or `/dev/null/x` ran the whole evaluation, then exited
1 with "unexpected OSError" and the result was lost. eval, report, bench and `make gpu-check OUT=` now
run the check `tsenor prune --output` runs (not a file, creatable and writable, room for what is
written) before any work, exit 4. "Before any work" is shown as in tests/test_reliability.py: the model
or the runs passed do not exist, so a check made after them would fail with their error (exit 3).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from types import ModuleType

import pytest
from helpers_cli import invoke

ROOT = Path(__file__).resolve().parents[1]
MISSING_MODEL = "/nonexistent/tsenor-model"
Usage = namedtuple("Usage", "total used free")


def _unusable(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """{case: (an output path, the start of its line)} for each way an output cannot be used."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    return {
        "under a file": (Path("/dev/null/x"), "--output /dev/null/x cannot be created: /dev/null is a file"),
        "pseudo file system": (Path("/proc/tsenor-out"), "--output /proc/tsenor-out is not writable: cannot create"),
        "a file": (afile, f"--output {afile} is a file; choose a directory path for "),
    }


def _no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file system has 1000 bytes free."""
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: Usage(10**9, 10**9 - 1000, 1000))


@pytest.mark.parametrize("case", ["under a file", "pseudo file system", "a file", "no room"])
def test_eval_output_is_checked_before_the_model_is_read(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    if case == "no room":
        _no_room(monkeypatch)
        output, start = tmp_path / "evaluated", "not enough free space for --output "
    else:
        output, start = _unusable(tmp_path)[case]
    args = ["eval", MISSING_MODEL, "--ppl", "wikitext2", "--data-dir", str(data_dir), "--output", str(output)]
    result = invoke(args)
    assert result.exit_code == 4, result.output
    message = str(result.exception)
    assert message.startswith(start) and "\n" not in message, message
    if case == "no room":
        assert "1000.0 B are free; free some space or choose another --output" in message


@pytest.mark.parametrize("case", ["under a file", "pseudo file system", "a file", "no room"])
def test_report_output_is_checked_before_the_runs_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    if case == "no room":
        _no_room(monkeypatch)
        output, start = tmp_path / "report", "not enough free space for --output "
    else:
        output, start = _unusable(tmp_path)[case]
    result = invoke(["report", str(tmp_path / "no-such-run"), "--output", str(output), "--force"])
    assert result.exit_code == 4, result.output
    message = str(result.exception)
    assert message.startswith(start) and "\n" not in message, message


@pytest.mark.parametrize("case", ["under a file", "pseudo file system", "no room"])
def test_bench_output_is_checked_before_the_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """`tsenor bench moe --output F` (every bench command shares the check: `cli/bench._check_outputs`)."""
    if case == "no room":
        _no_room(monkeypatch)
        output, start = tmp_path / "bench.json", "not enough free space for --output "
    else:
        folder, start = _unusable(tmp_path)[case]
        output = folder / "bench.json"
        start = start.replace(str(folder), str(output), 1).split(":")[0]
    result = invoke(["bench", "moe", "--output", str(output)])
    assert result.exit_code == 4, result.output
    message = str(result.exception)
    assert message.startswith(start) and "\n" not in message, message


@pytest.fixture
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["under a file", "pseudo file system", "a file", "no room"])
def test_gpu_check_out_is_checked_first_in_one_line(
    gpu_check: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    case: str,
) -> None:
    """`make gpu-check OUT=...` (scripts/gpu_check.py run --out): one `error:` line and exit 4 before the
    carry folder is even looked at (here it is empty), where a traceback came after the first steps."""
    if case == "no room":
        _no_room(monkeypatch)
        out, start = tmp_path / "out", "error: not enough free space for OUT "
    else:
        out, start = _unusable(tmp_path)[case]
        start = "error: " + start.replace("--output", "OUT", 1)
    code = gpu_check.main(["run", "--device", "cpu", "--carry", str(tmp_path / "carry"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 4 and err.startswith(start) and err.count("\n") == 1, err


def test_gpu_check_with_a_python_without_torch_is_one_line(tmp_path: Path) -> None:
    """`make gpu-check DEVICE=cuda` runs the machine's python3, which may lack torch: one line naming the
    fix, exit 2 (was ModuleNotFoundError's traceback)."""
    carry = tmp_path / "carry"
    (carry / "tokenizer").mkdir(parents=True)
    (carry / "tokenizer" / "tokenizer.json").write_text("{}")
    (carry / "pool.safetensors").write_text("")
    script = (
        "import runpy, sys; sys.modules['torch'] = None; "  # `import torch` now raises ImportError
        f"sys.argv = ['gpu_check.py', 'run', '--device', 'cuda', '--carry', {str(carry)!r}, "
        f"'--out', {str(tmp_path / 'out')!r}]; runpy.run_path({str(ROOT / 'scripts' / 'gpu_check.py')!r}, "
        "run_name='__main__')"
    )
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and "has no torch" in done.stderr and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr


def test_prune_and_the_others_share_one_check() -> None:
    """One implementation: the run folder's names are the shared module's own objects, not copies."""
    from tsenor_cli import outputs
    from tsenor_cli.runfiles import output, write

    assert output.check_output_location is outputs.check_output_location
    assert write.free_bytes is outputs.free_bytes and output.human_bytes is outputs.human_bytes
