"""A method declared outside tsenor_cli (tests/toy_method.py) prunes a tiny model from the CLI, a recipe
and the Python API, named as `package.module:NAME` or installed under the `tsenor.methods` entry point;
an unknown or broken one is one line, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.helpers_cli import invoke
from tsenor_cli.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
TOY = "tests.toy_method:TOY"


def _weights(out: Path) -> str:
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def _run_args(model: Path, calib: Path, out: Path) -> list[str]:
    return [str(model), "--nm", "2:4", "--data", str(calib), "--nsamples", "2", "--seqlen", "16", "-o", str(out)]


@pytest.fixture
def model(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=2)


def test_a_method_named_by_module_prunes_from_the_cli_a_recipe_and_the_api(
    model: Path, calibration_text: Path, tmp_path: Path
) -> None:
    from tsenor_cli import prune

    # Its defaults are magnitude pruning: the same checkpoint as --method magnitude, bit for bit.
    for method, name in ((TOY, "toy"), ("magnitude", "magnitude")):
        result = invoke(["prune", *_run_args(model, calibration_text, tmp_path / name), "--method", method])
        assert result.exit_code == 0, result.output
    assert _weights(tmp_path / "toy") == _weights(tmp_path / "magnitude")

    # Its typed options from a recipe (a float, a bool, a choice) and as keywords: the same run.
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump({"method": TOY, "toy_power": 2, "toy_smallest": True, "toy_scope": "row"}))
    result = invoke(["prune", *_run_args(model, calibration_text, tmp_path / "recipe"), "--config", str(recipe)])
    assert result.exit_code == 0, result.output
    report = prune(
        model, tmp_path / "api", method=TOY, nm="2:4", calib_data=str(calibration_text), nsamples=2, seqlen=16,
        toy_power=2.0, toy_smallest=True, toy_scope="row",
    )  # fmt: skip
    assert _weights(tmp_path / "recipe") == _weights(tmp_path / "api") != _weights(tmp_path / "toy")
    assert report.settings["method"] == TOY
    assert report.settings["layer"]["options"] == {"power": 2.0, "smallest": True, "scope": "row"}
    with pytest.raises(UsageError, match=r"unknown --toy-scope 'column'; choose one of: row, matrix"):
        prune(model, tmp_path / "bad", method=TOY, nm="2:4", toy_scope="column")
    with pytest.raises(UsageError, match=r"toy_smallest must be a bool"):
        prune(model, tmp_path / "bad", method=TOY, nm="2:4", toy_smallest="yes")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("nosuch", "unknown pruning method 'nosuch'; choose one of: magnitude, wanda, sparsegpt, alps"),
        ("tests.no_such_module:TOY", "--method tests.no_such_module:TOY: no module named 'tests.no_such_module'"),
        ("tests.toy_method:MISSING", "tests.toy_method.MISSING is nothing, not a PrunerSpec"),
        ("tests.toy_method:NOT_A_METHOD", "tests.toy_method.NOT_A_METHOD is a int, not a PrunerSpec"),
        ("tests.toy_method:", "name a method as package.module:NAME"),
    ],
)
def test_an_unknown_or_broken_method_is_one_line_and_exit_2(
    method: str, expected: str, model: Path, calibration_text: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = invoke(["prune", *_run_args(model, calibration_text, out), "--method", method])
    assert result.exit_code == 2, result.output
    assert expected in str(result.exception) and "\n" not in str(result.exception)
    assert not out.exists()


def _installed(tmp_path: Path, entries: str) -> dict[str, str]:
    """The environment of a process that sees a distribution declaring `entries` under tsenor.methods (a
    dist-info folder on its PYTHONPATH: nothing installed)."""
    dist = tmp_path / "site" / "toy_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[tsenor.methods]\n{entries}\n")
    path = os.pathsep.join([str(tmp_path / "site"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _tsenor(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tsenor_cli", *args], capture_output=True, text=True, env=env, timeout=600, check=False
    )


def test_an_installed_method_gets_its_flags_and_a_broken_one_fails_only_when_named(
    model: Path, calibration_text: Path, tmp_path: Path
) -> None:
    env = _installed(tmp_path, f"toy = {TOY}\nbroken = tests.no_such_module:METHOD")
    shown = _tsenor(["prune", "--help"], env)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "--method <magnitude|wanda|sparsegpt|alps|broken|toy|MODULE:NAME>" in text
    assert "--toy-smallest / --no-toy-smallest" in text and "--toy-scope <row|matrix>" in text

    done = _tsenor(
        ["prune", *_run_args(model, calibration_text, tmp_path / "out"), "--method", "toy", "--toy-smallest"], env
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "tsenor_report.json").read_text())
    assert report["settings"]["method"] == "toy" and report["settings"]["layer"]["options"]["smallest"] is True

    broken = _tsenor(["prune", *_run_args(model, calibration_text, tmp_path / "no"), "--method", "broken"], env)
    assert broken.returncode == 2
    assert broken.stderr.strip() == (
        "error: the tsenor.methods entry point broken = tests.no_such_module:METHOD: no module named "
        "'tests.no_such_module'; install it or add its folder to PYTHONPATH"
    )
    assert not (tmp_path / "no").exists()
