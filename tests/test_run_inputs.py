"""Explicit run inputs: the RunContext and its environment defaults, no environment reads or network
probes outside settings.py, the recorded command line, and an offline run that opens no socket."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_tiny import make_tiny_llama

from tsenor_cli import settings
from tsenor_cli.cli import command_line
from tsenor_cli.settings import RunContext

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "tsenor_cli"


def test_explicit_values_win_over_the_environment(tmp_path: Path) -> None:
    env = {
        "TSENOR_DATA_DIR": str(tmp_path / "env-data"),
        "TSENOR_CACHE_DIR": str(tmp_path / "env-cache"),
        "HF_HUB_OFFLINE": "1",
        "TSENOR_DEBUG": "1",
    }
    from_env = RunContext.from_environment(environ=env)
    assert from_env == RunContext(tmp_path / "env-data", True, tmp_path / "env-cache", True)
    explicit = RunContext.from_environment(tmp_path / "flag-data", False, tmp_path / "flag-cache", False, environ=env)
    assert explicit == RunContext(tmp_path / "flag-data", False, tmp_path / "flag-cache", False)


@pytest.mark.parametrize(
    ("env", "offline"),
    [
        ({}, False),
        ({"HF_HUB_OFFLINE": "0"}, False),
        ({"HF_HUB_OFFLINE": "1"}, True),
        ({"HF_DATASETS_OFFLINE": "1"}, True),
        ({"TRANSFORMERS_OFFLINE": "true"}, True),
    ],
)
def test_offline_default_follows_the_hf_switches(env: dict[str, str], offline: bool) -> None:
    assert RunContext.from_environment(environ=env).offline is offline


def test_defaults_without_any_variable(tmp_path: Path) -> None:
    ctx = RunContext.from_environment(environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert ctx.data_dir is None and not ctx.offline and not ctx.debug
    assert ctx.cache_dir == tmp_path / "tsenor"
    assert RunContext.from_environment(environ={}).cache_dir == Path.home() / ".cache" / "tsenor"


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_environment_reads_outside_settings() -> None:
    """Every environment read of the package lives in tsenor_cli/settings.py."""
    pattern = re.compile(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(|\bfrom os import\b[^\n]*\b(environ|getenv)\b")
    hits = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for path in _python_files(PACKAGE)
        if path.name != "settings.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if pattern.search(line)
    ]
    assert hits == []
    # the grep itself finds what it looks for
    assert pattern.search((PACKAGE / "settings.py").read_text(encoding="utf-8"))


def test_no_network_probe_in_the_package() -> None:
    """No module opens connections itself (the hub libraries do, when the context allows the hub)."""
    pattern = re.compile(r"^\s*(import|from)\s+(socket|urllib|http\.client|requests|httpx)\b", re.MULTILINE)
    hits = [str(p.relative_to(REPO_ROOT)) for p in _python_files(PACKAGE) if pattern.search(p.read_text("utf-8"))]
    assert hits == []


def test_triton_interpret_is_read_through_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert settings.triton_interpret()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not settings.triton_interpret()


def test_command_line_for_both_entry_points() -> None:
    # the console script: sys.argv holds the script path and the arguments as typed
    script = command_line(
        ["/venv/bin/tsenor", "prune", "--model", "my model", "--nm", "16:32"],
        ["/venv/bin/python", "/venv/bin/tsenor", "prune", "--model", "my model", "--nm", "16:32"],
    )
    assert script == "/venv/bin/tsenor prune --model 'my model' --nm 16:32"
    # python -m: sys.argv[0] is __main__.py, so the interpreter's own command line is recorded
    module = command_line(
        ["/repo/tsenor_cli/__main__.py", "prune", "-m", "x"],
        ["python3", "-X", "dev", "-m", "tsenor_cli", "prune", "-m", "x"],
    )
    assert module == "python3 -X dev -m tsenor_cli prune -m x"


def test_debug_flag_shows_the_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --debug: one `error:` line and the exit code; with it, the exception itself."""
    from tsenor_cli.cli import main
    from tsenor_cli.errors import InputNotFoundError

    monkeypatch.delenv(settings.DEBUG_ENV, raising=False)
    missing = str(tmp_path / "missing-ckpt")
    monkeypatch.setattr(sys, "argv", ["tsenor", "eval", "--model", missing])
    with pytest.raises(SystemExit):
        main()
    monkeypatch.setattr(sys, "argv", ["tsenor", "--debug", "eval", "--model", missing])
    with pytest.raises(InputNotFoundError, match="does not exist"):
        main()


@pytest.mark.slow
@pytest.mark.realdata
def test_offline_prune_and_eval_open_no_socket(tmp_path: Path, data_dir: Path) -> None:
    """`python -m tsenor_cli prune --eval` with --data-dir and --offline, none of the HF offline variables
    set, in a process whose sockets refuse (and log) every internet connection and name lookup. The
    run files record the data sources, the context and the full `python -m` command line. (Two fresh
    processes, so the HF libraries see no offline variable: about 20 s.)"""
    model = make_tiny_llama(tmp_path / "tiny")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    log = tmp_path / "network.log"
    (hooks / "sitecustomize.py").write_text(
        "import os, socket\n"
        "_log = os.environ['TSENOR_TEST_NETWORK_LOG']\n"
        "_connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo\n"
        "def _refuse(what):\n"
        "    with open(_log, 'a') as handle:\n"
        "        handle.write(repr(what) + '\\n')\n"
        "    raise OSError('network access in an offline run: ' + repr(what))\n"
        "def connect(self, address):\n"
        "    if self.family in (socket.AF_INET, socket.AF_INET6):\n"
        "        _refuse(address)\n"
        "    return _connect(self, address)\n"
        "def connect_ex(self, address):\n"
        "    if self.family in (socket.AF_INET, socket.AF_INET6):\n"
        "        _refuse(address)\n"
        "    return _connect_ex(self, address)\n"
        "def getaddrinfo(host, *args, **kwargs):\n"
        "    _refuse(host)\n"
        "socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k not in (*settings.HUB_OFFLINE_ENVS, settings.DATA_DIR_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(hooks), str(REPO_ROOT)])
    env["TSENOR_TEST_NETWORK_LOG"] = str(log)
    # the hooks do catch a connection attempt
    probe = "import socket; socket.create_connection(('huggingface.co', 443), timeout=1)"
    refused = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "network access in an offline run" in refused.stderr
    assert log.read_text() == "'huggingface.co'\n"
    log.unlink()
    out, run = tmp_path / "pruned", tmp_path / "run"
    inputs = ["--data-dir", str(data_dir), "--offline"]
    prune = ["prune", "--model", str(model), "--nm", "2:4", "--method", "wanda", "--solver", "exhaustive"]
    prune += ["--calib-data", "c4", "--nsamples", "2", "--seqlen", "32", "--output", str(out), *inputs]
    evaluate = ["eval", "--model", str(out), "--ppl", "ptb", "--seqlen", "32", "--max-windows", "1"]
    evaluate += ["--tasks", "piqa", "--limit", "2", "--batch-size", "2", "--output", str(run), *inputs]
    commands = [[sys.executable, "-m", "tsenor_cli", *args] for args in (prune, evaluate)]
    for argv in commands:
        proc = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert not log.exists(), log.read_text()
    report = json.loads((out / "tsenor_report.json").read_text())
    evaluation = json.loads((run / "eval.json").read_text())
    assert [report["command"], evaluation["command"]] == [shlex.join(argv) for argv in commands]
    context = {"data_dir": str(data_dir.resolve()), "offline": True}
    assert report["context"] == evaluation["context"] == context
    c4 = report["calibration_source"]
    assert c4["kind"] == "offline" and [f["path"] for f in c4["files"]] == [
        str((data_dir / "c4" / "c4-en-sample-1000.olmo.json.gz").resolve())
    ]
    assert evaluation["perplexity"]["ptb"]["data_source"]["kind"] == "offline"
    piqa = evaluation["zeroshot"]["tasks"]["piqa"]["data_source"]
    assert piqa["kind"] == "offline" and len(piqa["files"]) == 2  # valid.jsonl and valid-labels.lst
