"""Commands on packed folders: `tsenor verify` checks the tiles from the stored code (no dense weights
built), `tsenor finetune` of a packed prune writes a packed checkpoint (and says so on its card), `tsenor
report` names the format, of a run folder and of a sweep's run, its checkpoint kept or not."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_tiny import LOCAL_CTX, sparsegpt_config
from safetensors import safe_open

from tsenor_cli.finetune.run import FinetuneConfig, finetune
from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.packed.files import declares_packed
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.verify import verify_checkpoint
from tsenor_cli.report import build_table, load_run
from tsenor_cli.runfiles import EVAL_FILE, MODEL_DIR
from tsenor_cli.runfiles.sweep import keep_reports
from tsenor_cli.settings import RunContext

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "


@pytest.fixture(scope="module")
def pruned(
    tiny_llama: Callable[..., Path], calib: Path, data_ctx: RunContext, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The same 2:4 transposable prune written dense and packed."""
    model = tiny_llama(num_layers=2)
    root = tmp_path_factory.mktemp("packed-commands")
    outs = {fmt: root / fmt for fmt in ("dense", "packed")}
    for fmt, out in outs.items():
        prune_model(sparsegpt_config(model, calib, out, resume=False, save_format=fmt), data_ctx)
    return outs


def _tsenor(*args: str | Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tsenor_cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def test_verify_checks_a_packed_folder_from_its_code_without_decoding(
    pruned: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_decoding(*args: object, **kwargs: object) -> None:
        raise AssertionError("verify decoded a packed matrix")

    monkeypatch.setattr("tsenor_cli.models.checkpoint.decode_matrix", no_decoding)
    report = verify_checkpoint(pruned["packed"])
    dense = verify_checkpoint(pruned["dense"])
    assert report.ok and len(report.layers) == len(dense.layers) == 14
    assert [(c.name, c.groups, c.over) for c in report.layers] == [(c.name, c.groups, c.over) for c in dense.layers]


def _set_code(path: Path, key: str, byte: int) -> None:
    """Overwrite every byte of the tensor `key` of the safetensors file `path` with `byte`."""
    blob = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", blob[:8])
    start, end = json.loads(blob[8 : 8 + length])[key]["data_offsets"]
    blob[8 + length + start : 8 + length + end] = bytes([byte]) * (end - start)
    path.write_bytes(bytes(blob))


def test_verify_reports_a_packed_code_that_breaks_the_pattern(pruned: dict[str, Path], tmp_path: Path) -> None:
    """Every group keeping positions 0 and 1 (bits 00 10 per group, 0x44 per byte) is a valid 2:4 code but
    keeps 4 per column in columns 0 and 1 of every 4×4 tile: not transposable."""
    folder = tmp_path / "broken"
    shutil.copytree(pruned["packed"], folder)
    weights = folder / "model.safetensors"
    key = "model.layers.0.mlp.up_proj.weight"
    with safe_open(str(weights), framework="pt") as handle:
        assert key + "_tsenor_index" in handle.keys()  # noqa: SIM118
    _set_code(weights, key + "_tsenor_index", 0x44)
    report = verify_checkpoint(folder)
    broken = [c for c in report.layers if not c.ok]
    assert [c.name for c in broken] == ["model.layers.0.mlp.up_proj"] and broken[0].over > 0
    done = _tsenor("verify", folder)
    assert done.returncode == 6, done.stderr  # a verification failure, as for a dense matrix that breaks it
    assert len(done.stderr.strip().splitlines()) == 1 and "model.layers.0.mlp.up_proj" in done.stderr


def _finetune(run_dir: Path, output: Path, text: Path) -> None:
    cfg = FinetuneConfig(
        run_dir=run_dir, output=output, data=str(text), seqlen=32, max_steps=2, lr=1e-2, batch_size=2,
        ppl_datasets=(), save_every=0,
    )  # fmt: skip
    finetune(cfg, LOCAL_CTX)


def test_finetune_of_a_packed_prune_writes_a_packed_checkpoint(pruned: dict[str, Path], tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 60)
    outs = {fmt: tmp_path / f"ft-{fmt}" for fmt in pruned}
    for fmt, out in outs.items():
        _finetune(pruned[fmt], out, text)
    assert declares_packed(outs["packed"]) and not declares_packed(outs["dense"])
    # The card says how each loads (it said "the ordinary dense safetensors layout" of a packed output).
    assert "**packed**" in (outs["packed"] / "README.md").read_text()
    assert "**packed**" not in (outs["dense"] / "README.md").read_text()
    with safe_open(str(outs["packed"] / "model.safetensors"), framework="pt") as handle:
        assert any(key.endswith("_tsenor_index") for key in handle.keys())  # noqa: SIM118
    packed, dense = Checkpoint.open(outs["packed"]), Checkpoint.open(outs["dense"])
    trained = dense.read(dense.keys())
    assert set(packed.keys()) == set(trained)
    for key, tensor in packed.iter_read(packed.keys()):
        assert torch.equal(tensor, trained[key]), key  # the same training, stored packed
    assert not torch.equal(
        trained["model.layers.0.mlp.up_proj.weight"], _read(pruned["dense"], "model.layers.0.mlp.up_proj.weight")
    )
    assert verify_checkpoint(outs["packed"]).ok


def _read(folder: Path, key: str) -> torch.Tensor:
    checkpoint = Checkpoint.open(folder)
    return checkpoint.read([key])[key]


def test_report_names_the_packed_format(pruned: dict[str, Path], data_dir: Path, tmp_path: Path) -> None:
    runs = {}
    for fmt, folder in pruned.items():
        runs[fmt] = tmp_path / fmt
        shutil.copytree(folder, runs[fmt])
        done = _tsenor("eval", runs[fmt], "--ppl", "wikitext2", "--max-windows", "1", "--seqlen", "64",
                       "--output", runs[fmt], "--data-dir", data_dir)  # fmt: skip
        assert done.returncode == 0, done.stderr
    report = tmp_path / "report"
    done = _tsenor("report", runs["dense"], runs["packed"], "--output", report)
    assert done.returncode == 0, done.stderr
    rows = {Path(row["run"]).name: row for row in json.loads((report / "table.json").read_text())["rows"]}
    assert rows["packed"]["format"] == "packed" and rows["dense"]["format"] == "dense"
    assert rows["packed"]["ppl_wikitext2"] == rows["dense"]["ppl_wikitext2"]
    header = next(line for line in (report / "table.md").read_text().splitlines() if line.startswith("| N:M"))
    assert header.endswith("| Format | Run |")
    # A sweep's run folder: eval.json and the prune's reports beside the checkpoint's folder `model/`,
    # which goes when the sweep does not keep it. The run folder holds no config.json, so the format was
    # read as dense there, and the table lost its Format column.
    for kept in (True, False):
        sweep_runs = {}
        for fmt, run in runs.items():
            sweep_runs[fmt] = tmp_path / f"sweep-{kept}" / fmt
            shutil.copytree(run, sweep_runs[fmt] / MODEL_DIR)
            shutil.copy2(run / EVAL_FILE, sweep_runs[fmt] / EVAL_FILE)
            keep_reports(sweep_runs[fmt] / MODEL_DIR, sweep_runs[fmt])
            if not kept:
                shutil.rmtree(sweep_runs[fmt] / MODEL_DIR)
        table = build_table([load_run(sweep_runs[fmt]) for fmt in ("dense", "packed")])
        assert [row.checkpoint_format for row in table.rows] == ["dense", "packed"], kept
        assert "| Format | Run |" in table.to_markdown()
