"""The fourth audit's minor items (issue 47), one test each where a test can hold it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers_cli import invoke
from helpers_tiny import sparsegpt_config

from tsenor_cli.errors import OutputUnwritableError
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.runfiles import RESUME_DIR, RESUME_STATE_FILE
from tsenor_cli.settings import RunContext

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- a full disk while the resume state is written


def test_a_full_disk_in_safetensors_writer_of_the_resume_state_is_the_exit_4_line(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block and hidden-state files are written tensor by tensor (`tensorfile.write_file`); a disk that
    fills up in the middle of one (its header and part of its data written, then ENOSPC, as the kernel
    reports it) is the line the final write gives, exit 4, saying what the state holds; the rerun resumes
    to the checkpoint of an uninterrupted run. (With safetensors' own writer a full disk was "unexpected
    SafetensorError … run with TSENOR_DEBUG=1", exit 1.)"""
    import errno
    import os

    from tsenor_cli import tensorfile

    reference = tmp_path / "reference"
    prune_model(sparsegpt_config(tiny, calib, reference, resume=False), data_ctx)
    out = tmp_path / "out"
    real = tensorfile.write_file
    calls: list[str] = []

    def full(path: Path, tensors: Any, metadata: Any = None) -> None:
        calls.append(str(path))
        if len(calls) == 3:  # block 2's file, after block 1's file and hidden states
            Path(path).write_bytes(b"\x10\x00")  # what got onto the disk before it filled up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, tensors, metadata)

    monkeypatch.setattr(tensorfile, "write_file", full)
    with pytest.raises(OutputUnwritableError) as caught:
        prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
    message = str(caught.value)
    assert caught.value.exit_code == 4 and "\n" not in message
    assert message.startswith(
        f"the disk holding --output {out} filled up while the resume state was written (No space left on device); "
        "the resume state holds block 1: free some space (about "
    )
    assert message.endswith("are free now) and rerun the same command to continue, or choose another --output")
    assert json.loads((out / RESUME_DIR / RESUME_STATE_FILE).read_text())["next_block"] == 1
    assert all(RESUME_DIR in call for call in calls)
    monkeypatch.setattr(tensorfile, "write_file", real)
    report = prune_model(sparsegpt_config(tiny, calib, out), data_ctx)
    assert report.resumed_from_block == 1
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


# ---------------------------------------------------------------- make gpu-check-prepare VENV=other


def _make_dry(folder: Path, *args: str) -> str:
    done = subprocess.run(["make", "-n", *args], cwd=folder, capture_output=True, text=True, check=True)
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_a_venv_from_elsewhere_is_not_reinstalled_from_a_fresh_clone(tmp_path: Path) -> None:
    """A fresh clone's pyproject.toml is newer than any venv's .installed: `make gpu-check-prepare
    VENV=other` reinstalled the clone into the other venv (moving its editable install). A venv from
    elsewhere is used as it is once installed; the clone's own .venv still follows pyproject.toml."""
    clone = tmp_path / "clone"
    clone.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / ".installed").touch()
    (clone / ".venv").mkdir()
    (clone / ".venv" / ".installed").touch()
    time.sleep(1.1)  # make compares modification times
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, clone / name)
    (clone / "pyproject.toml").touch()
    elsewhere = _make_dry(clone, "gpu-check-prepare", f"VENV={other}")
    assert "pip install" not in elsewhere and "scripts/gpu_check.py prepare" in elsewhere
    own = _make_dry(clone, "gpu-check-prepare")
    assert "pip install -q -e '.[dev]'" in own  # the clone's own venv: pyproject.toml changed, reinstalled
    for spelling in (".venv", "./.venv", str(clone / ".venv")):
        assert "pip install" in _make_dry(clone, "install", f"VENV={spelling}"), spelling


# ---------------------------------------------------------------- tsenor prune --help without torch


def test_prune_help_imports_no_torch() -> None:
    """`tsenor prune --help` took 2.5 s (torch and every solver imported to list --solver's choices),
    where `tsenor --help` and `eval --help` take 0.2-0.4 s."""
    script = (
        "import sys\n"
        "from tsenor_cli.cli import main\n"
        "sys.argv = ['tsenor', 'prune', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip().endswith("NO TORCH"), done.stdout[-300:]
    assert "--solver <auto|two_approx|" in done.stdout


def test_the_solver_names_written_out_are_the_registrys() -> None:
    from tsenor_cli.pruning.settings.table import SOLVER_NAMES
    from tsenor_cli.solver import METHODS

    assert tuple(METHODS) == SOLVER_NAMES


# ---------------------------------------------------------------- hints name what --help shows


def test_hints_name_model_as_the_help_shows_it_not_the_hidden_flag() -> None:
    """MODEL is an argument; --model is hidden (an old spelling): no hint tells a user to type it."""
    from tsenor_cli.models.loading import hub_error

    ctx = RunContext(data_dir=None, offline=True, cache_dir=Path("/tmp"))
    for offline in (True, False):
        message = str(hub_error("org/name", RunContext(ctx.data_dir, offline, ctx.cache_dir)))
        assert "--model" not in message and "as MODEL" in message
        # Without network, the fix on a cluster: download where there is one, then run from the cache.
        assert offline or "(hf download org/name) and pass --offline" in message
    help_text = invoke(["prune", "--help"]).output
    assert "--model" not in help_text and "[MODEL]" in help_text
    for path in (ROOT / "tsenor_cli").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        hints = re.findall(r"""f?["'][^"'\n]*(?:use|with|run `tsenor \w+|then) --model [^"'\n]*["']""", text)
        assert not hints, (path, hints)


# ---------------------------------------------------------------- "blocks 1-1"


def test_the_interruption_line_says_block_1_not_blocks_1_1() -> None:
    from tsenor_cli.pruning.run.run import RunPoint

    out = Path("/out")
    one = str(RunPoint(blocks=4, done=1, current=1).interrupted(out, saving=True, signal_name=None))
    three = str(RunPoint(blocks=4, done=3, current=3).interrupted(out, saving=True, signal_name="SIGTERM"))
    assert "the resume state holds block 1: rerun" in one and "1-1" not in one
    assert "the resume state holds blocks 1-3: rerun" in three


# ---------------------------------------------------------------- docs/guide/python-api.md


def test_the_python_api_guide_says_where_evalconfig_comes_from() -> None:
    """The guide named `EvalConfig` without its module: its evaluation snippet's imports run as written."""
    guide = (ROOT / "docs" / "guide" / "python-api.md").read_text(encoding="utf-8")
    imports = [line.strip() for line in guide.splitlines() if line.strip().startswith("from tsenor_cli")]
    assert "from tsenor_cli.evaluation.runner import EvalConfig" in imports
    namespace: dict[str, Any] = {}
    exec("\n".join(imports), namespace)
    config = namespace["EvalConfig"](ppl_datasets=("wikitext2",), max_windows=8)
    assert config.max_windows == 8 and callable(namespace["prune_and_evaluate"])


# ---------------------------------------------------------------- bench memory takes the run context


def test_bench_memory_takes_the_run_context_and_reads_no_environment_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench/memory.py` read `cache_dir_default()` itself: the cache folder now comes from the command's
    run context, to the model it builds and to each measured child."""
    from helpers_tiny import smollm2_dir

    import tsenor_cli.bench.memory as memory
    import tsenor_cli.models.embedded as embedded
    import tsenor_cli.settings as settings

    tokenizer = smollm2_dir()
    asked: list[Path] = []

    def materialize(name: str, cache: Path, **_kwargs: Any) -> Path:
        asked.append(Path(cache))
        return tokenizer

    monkeypatch.setattr(embedded, "materialize", materialize)
    monkeypatch.setattr(settings, "cache_dir_default", lambda *a, **k: pytest.fail("read the environment's default"))
    ctx = RunContext(data_dir=None, offline=True, cache_dir=tmp_path / "cache")
    cfg = memory.MemoryConfig(blocks=(1,), width=64, intermediate=256, heads=1)
    memory.build_model(tmp_path / "m", cfg, 1, ctx)
    assert asked == [tmp_path / "cache"]
    assert memory.child_context(ctx) == RunContext(data_dir=None, offline=True, cache_dir=tmp_path / "cache")
    source = Path(memory.__file__).read_text(encoding="utf-8")
    assert "cache_dir_default" not in source and "from_environment" not in source
