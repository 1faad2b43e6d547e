"""`tsenor eval`: eval.json content, --force protection, option validation and error exits."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import LOCAL_CTX
from typer.testing import Result

from tsenor_cli.data.eval_text import eval_token_stream
from tsenor_cli.errors import InputNotFoundError, OutputExistsError, UsageError
from tsenor_cli.evaluation.perplexity import Windows, perplexity
from tsenor_cli.models.loading import load_model
from tsenor_cli.runfiles import SCHEMA_VERSION, EvalReport
from tsenor_cli.settings import RunContext

pytestmark = [pytest.mark.realdata, pytest.mark.usefixtures("hub_off")]


@pytest.fixture
def hub_off(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TSENOR_DATA_DIR", str(data_dir))


@pytest.fixture(scope="module")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(max_position_embeddings=256)


def eval_cli(args: list[str]) -> Result:
    return invoke(["eval", *args])


def test_eval_writes_eval_json(
    tiny: Path, tmp_path: Path, data_dir: Path, data_ctx: RunContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The flags decide, not the environment: no TSENOR_DATA_DIR, no HF_*_OFFLINE.
    for name in ("TSENOR_DATA_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    args = [
        "--data-dir",
        str(data_dir),
        "--offline",
        "--model",
        str(tiny),
        "--ppl",
        "wikitext2,ptb",
        "--seqlen",
        "64",
        "--max-windows",
        "2",
        "--output",
        str(out),
    ]
    result = eval_cli([*args, "--json"])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "eval.json").read_text())
    assert json.loads(result.stdout) == written
    assert written["model"] == str(tiny) and written["seqlen"] == 64 and written["zeroshot"] is None
    assert written["schema_version"] == SCHEMA_VERSION
    assert written["context"] == {"data_dir": str(data_dir.resolve()), "offline": True}
    # tsenor_source (the git commit) only when the package runs from a git checkout
    assert set(written["versions"]) - {"tsenor_source"} == {
        *("tsenor", "torch", "transformers", "datasets", "lm-eval"),
        *("cpu", "cpu_capability"),  # the CPU's kind: the last bits depend on it (precision.machine_versions)
    }
    assert set(written["perplexity"]) == {"wikitext2", "ptb"}
    wt2 = written["perplexity"]["wikitext2"]
    assert wt2["windows"] == 2 and "wiki.test.raw" in wt2["data"]
    wiki = data_dir / "wikitext-2-raw" / "wiki.test.raw"
    assert wt2["data_source"] == {
        "kind": "offline",
        "files": [{"path": str(wiki.resolve()), "sha256": hashlib.sha256(wiki.read_bytes()).hexdigest()}],
        "hub": None,
    }
    # the number is the library's perplexity on the same stream
    loaded = load_model(str(tiny), LOCAL_CTX)
    text = eval_token_stream("ptb", loaded.tokenizer, data_ctx, seqlen=64)
    direct = perplexity(loaded.model, text.input_ids, Windows(64, max_windows=2), device="cpu")
    assert written["perplexity"]["ptb"]["ppl"] == pytest.approx(direct.ppl, rel=1e-6)
    # `tsenor report` reads it
    record = EvalReport.from_json(written)
    assert record.perplexity["ptb"].ppl == pytest.approx(written["perplexity"]["ptb"]["ppl"])
    assert record.to_json() == written  # one schema: what is read writes back the same
    assert not list(out.glob(".eval.json.*"))  # no temp file left behind

    before = (out / "eval.json").read_bytes()
    again = eval_cli(args)
    assert isinstance(again.exception, OutputExistsError) and again.exception.exit_code == 4
    assert "--force" in str(again.exception)
    assert (out / "eval.json").read_bytes() == before  # untouched

    forced = eval_cli([*args, "--ppl", "c4", "--force"])
    assert forced.exit_code == 0, forced.output
    assert set(json.loads((out / "eval.json").read_text())["perplexity"]) == {"c4"}
    assert "c4" in forced.stdout and "ppl" in forced.stdout  # the human table


def test_eval_writes_beside_a_checkpoint_and_replaces_only_its_eval_json_with_force(tiny: Path, tmp_path: Path) -> None:
    """--output may be a folder with other files (`tsenor eval --model OUT --output OUT` after a prune):
    eval.json is added and nothing else touched; what --force guards is eval.json (its help says so)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "notes.txt").write_text("kept")
    args = ["--model", str(tiny), "--ppl", "wikitext2", "--seqlen", "32", "--max-windows", "1", "--output", str(folder)]
    assert eval_cli(args).exit_code == 0
    assert sorted(p.name for p in folder.iterdir()) == ["eval.json", "notes.txt"]
    again = eval_cli([*args, "--seqlen", "16"])  # another evaluation (the same command is a no-op: below)
    assert isinstance(again.exception, OutputExistsError)
    assert (
        str(again.exception)
        == f"{folder / 'eval.json'} already exists; pass --force to overwrite it or choose another --output"
    )
    assert eval_cli([*args, "--force"]).exit_code == 0 and (folder / "notes.txt").read_text() == "kept"


def test_the_same_eval_again_of_the_unchanged_model_writes_nothing_and_says_so(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tsenor eval DIR --output DIR` again (a requeued batch job; a script run again after its prune found its
    run finished): the eval.json this command line wrote of the folder as it is on disk is printed again, and
    nothing is loaded, evaluated or written (it was refused, exit 4, though the prune before it succeeded).
    Writing into the folder (eval.json, the model card) keeps the model's identity; a weight file written
    again since does not, and the eval.json is then refused as before."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    args = ["--model", str(folder), "--ppl", "wikitext2", "--seqlen", "32", "--max-windows", "1"]
    args += ["--output", str(folder)]
    first = eval_cli(args)
    assert first.exit_code == 0, first.output
    (folder / "README.md").write_text("a model card refreshed after the evaluation")
    written = (folder / "eval.json").read_bytes(), (folder / "eval.json").stat().st_mtime_ns

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model was loaded again")

    monkeypatch.setattr("tsenor_cli.evaluation.runner.load_for_evaluation", never)
    again = eval_cli(args)
    assert again.exit_code == 0, again.output
    assert again.stdout == first.stdout  # the same table
    held = f"{folder} already held this command's evaluation of {folder} as it is now; nothing written"
    assert held in again.stderr.splitlines()
    assert ((folder / "eval.json").read_bytes(), (folder / "eval.json").stat().st_mtime_ns) == written

    weights = folder / "model.safetensors"
    later = weights.stat().st_mtime_ns + 10**9
    os.utime(weights, ns=(later, later))  # the same bytes written again: another model as far as a stat tells
    changed = eval_cli(args)
    assert isinstance(changed.exception, OutputExistsError) and changed.exit_code == 4
    assert ((folder / "eval.json").read_bytes(), (folder / "eval.json").stat().st_mtime_ns) == written


def test_seqlen_default_capped_by_model(tiny: Path) -> None:
    result = eval_cli(["--model", str(tiny), "--ppl", "ptb", "--max-windows", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["seqlen"] == 256  # min(2048, max_position_embeddings)
    too_long = eval_cli(["--model", str(tiny), "--ppl", "ptb", "--seqlen", "512"])
    assert isinstance(too_long.exception, UsageError) and "max_position_embeddings 256" in str(too_long.exception)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ppl", "wikitext3"], "unknown --ppl dataset(s) wikitext3"),
        (["--ppl", "none"], "nothing to evaluate"),
        (["--batch-size", "0"], "--batch-size 0"),
        (["--dtype", "int4"], "unknown dtype"),
    ],
)
def test_bad_options(tiny: Path, args: list[str], message: str) -> None:
    result = eval_cli(["--model", str(tiny), *args])
    assert isinstance(result.exception, UsageError), result.output
    assert message in str(result.exception)


def test_max_windows_is_range_checked_before_any_model_is_read(tmp_path: Path) -> None:
    """--max-windows is the shared option of cli/options.py (min 1), checked by the parser."""
    result = eval_cli(["--model", str(tmp_path / "missing"), "--max-windows", "0"])
    assert result.exit_code == 2 and "--max-windows" in result.output


def test_missing_model_and_hub_id(tmp_path: Path) -> None:
    missing = eval_cli(["--model", str(tmp_path / "nope")])
    assert isinstance(missing.exception, InputNotFoundError) and "does not exist" in str(missing.exception)
    hub = eval_cli(["--model", "tsenor-nonexistent-org/model"])
    assert isinstance(hub.exception, InputNotFoundError)
    # HF_HUB_OFFLINE (the hub_off fixture) is the default of --offline: the local HF cache only
    assert "tsenor-nonexistent-org/model is not in the local HF cache" in str(hub.exception)


def test_tasks_without_zeroshot_module(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tsenor_cli.evaluation.zeroshot", None)  # import now fails
    result = eval_cli(["--model", str(tiny), "--tasks", "piqa"])
    assert isinstance(result.exception, UsageError)
    assert "zero-shot evaluation is not available in this build" in str(result.exception)


def test_main_exit_code_and_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the console-script entry: one `error:` line on stderr and exit code 3, no traceback."""
    from tsenor_cli.cli import main

    monkeypatch.delenv("TSENOR_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["tsenor", "eval", "--model", str(tmp_path / "missing-ckpt")])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 3
    err = capsys.readouterr().err
    assert err.startswith("error: model directory") and "Traceback" not in err
    assert not (tmp_path / "missing-ckpt").exists()


def test_eval_bf16_model_runs(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It runs, and on a CPU without bf16 instructions (an AVX2 one, whose bf16 products are tens of times
    slower than fp32: `tsenor_cli/precision.py`) it says so once, with the flag that avoids them."""
    from tsenor_cli import precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(precision, "_warned", set())
    result = eval_cli(
        [
            "--model",
            str(tiny),
            "--ppl",
            "ptb",
            "--seqlen",
            "32",
            "--max-windows",
            "1",
            "--dtype",
            "bf16",
            "--json",
        ]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["dtype"] == "bfloat16" and torch.isfinite(torch.tensor(payload["perplexity"]["ptb"]["ppl"]))
    assert result.stderr.count("evaluating in bf16: this CPU has no bf16 matrix instructions") == 1
    assert "; pass --dtype fp32" in result.stderr


def test_eval_table_with_zero_shot_tasks(tiny: Path, tmp_path: Path, data_dir: Path) -> None:
    """The human table prints tasks with and without acc_norm (RTE defines only acc)."""
    result = eval_cli(
        ["--model", str(tiny), "--ppl", "none", "--tasks", "rte,piqa", "--limit", "2", "--output", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.strip()}
    assert rows["rte"][1] == "-"  # no acc_norm
    assert 0.0 <= float(rows["piqa"][1]) <= 1.0
    assert "average" in rows
