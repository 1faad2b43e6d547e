"""The packed sink under the prune's run modes: a streamed, a resumed-after-kill and a `--nproc 2` packed
prune each write the one-process (whole-model) packed prune's weight files byte for byte, a packed
`--refine block` prune decodes to its dense twin, and a finished run is not taken for done in the other format."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers_faults import Killed
from helpers_tiny import sparsegpt_config

from tsenor_cli.errors import OutputExistsError
from tsenor_cli.models.checkpoint import Checkpoint
from tsenor_cli.packed.files import declares_packed
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.settings.config import RefineConfig
from tsenor_cli.settings import RunContext

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=3)


@pytest.fixture(scope="module")
def one(tiny: Path, calib: Path, data_ctx: RunContext, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-process packed prune, the whole model in memory: what every other run must write."""
    out = tmp_path_factory.mktemp("one") / "out"
    prune_model(sparsegpt_config(tiny, calib, out, resume=False, stream=False, save_format="packed"), data_ctx)
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_streamed_packed_prune_writes_the_same_files(
    tiny: Path, calib: Path, one: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    out = tmp_path / "streamed"
    prune_model(sparsegpt_config(tiny, calib, out, resume=False, stream=True, save_format="packed"), data_ctx)
    assert _sha(out / WEIGHTS) == _sha(one / WEIGHTS)


def test_a_packed_prune_killed_after_a_block_resumes_to_the_same_files(
    tiny: Path, calib: Path, one: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    out = tmp_path / "resumed"
    cfg = sparsegpt_config(tiny, calib, out, resume=True, save_format="packed")

    def kill_after_first(index: int) -> None:
        if index == 0:
            raise Killed

    with pytest.raises(Killed):
        prune_model(cfg, data_ctx, after_block=kill_after_first)
    assert not (out / WEIGHTS).exists()
    prune_model(cfg, data_ctx)
    assert _sha(out / WEIGHTS) == _sha(one / WEIGHTS)


def test_a_packed_prune_on_two_processes_writes_the_same_files(
    tiny: Path, calib: Path, one: Path, data_dir: Path, tmp_path: Path
) -> None:
    """`tsenor prune --nproc 2` itself (pruning/run/launch.py: two gloo processes on the CPU)."""
    out = tmp_path / "nproc"
    args = ["prune", "--model", tiny, "--method", "sparsegpt", "--nm", "2:4", "--solver", "exhaustive"]
    args += ["--nsamples", "4", "--seqlen", "32", "--calib-data", calib, "--output", out, "--data-dir", data_dir]
    args += ["--save-format", "packed", "--nproc", "2", "--no-resume-state"]
    done = subprocess.run(
        [sys.executable, "-m", "tsenor_cli", "-q", *map(str, args)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert _sha(out / WEIGHTS) == _sha(one / WEIGHTS)


def test_a_packed_refine_block_prune_decodes_to_its_dense_twin(
    tiny: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    outs = {fmt: tmp_path / fmt for fmt in ("dense", "packed")}
    for fmt, out in outs.items():
        refine = RefineConfig(mode="block", epochs=1)
        prune_model(sparsegpt_config(tiny, calib, out, resume=False, save_format=fmt, refine=refine), data_ctx)
    dense, packed = (Checkpoint.open(outs[fmt]) for fmt in ("dense", "packed"))
    assert any(info.pattern is not None for info in packed.tensors.values())  # it is packed
    assert set(dense.keys()) == set(packed.keys())
    for key, tensor in dense.iter_read(dense.keys()):
        decoded = packed.read([key])[key]
        assert decoded.dtype == tensor.dtype
        assert torch.equal(decoded.view(torch.uint8), tensor.view(torch.uint8)), key


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_packed_source_pruned_again_to_dense_writes_a_config_that_does_not_declare_packed(
    one: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, stream: bool
) -> None:
    """A packed folder as the source of another prune, written dense: its config.json has no packed entry
    (the streamed run once copied the source's, so a dense file claimed to be packed: `tsenor pack` refused
    it as packed already and transformers without tsenor warned of an unknown quantization), and both
    run modes write the same files."""
    import json

    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    prune_model(sparsegpt_config(one, calib, out, resume=False, stream=stream), data_ctx)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert "quantization_config" in json.loads((one / "config.json").read_text())  # the source's is packed
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert getattr(model.config, "quantization_config", None) is None
    if stream:
        whole = tmp_path / "whole"
        prune_model(sparsegpt_config(one, calib, whole, resume=False, stream=False), data_ctx)
        assert _sha(out / WEIGHTS) == _sha(whole / WEIGHTS)
        assert (out / "config.json").read_text() == (whole / "config.json").read_text()


def test_a_finished_run_rerun_in_the_other_format_is_refused_and_rewritten_with_force(
    tiny: Path, calib: Path, one: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """A rerun of a finished prune is a no-op, but the format is not in the settings' hash: the packed run
    rerun to be written dense said "nothing to do" and left it packed (and the other way round)."""
    out = tmp_path / "out"
    shutil.copytree(one, out)
    before = _sha(out / WEIGHTS)
    dense = sparsegpt_config(tiny, calib, out, resume=False, stream=False)
    with pytest.raises(OutputExistsError) as refused:
        prune_model(dense, data_ctx)
    assert str(refused.value) == (
        f"{out} holds this run finished, stored packed, not dense as --save-format asks; tsenor unpack {out} "
        "-o NEW converts it without pruning again, or pass --force to prune again"
    )
    assert refused.value.exit_code == 4 and _sha(out / WEIGHTS) == before
    prune_model(replace(dense, save_format="packed"), data_ctx)  # the same format: a no-op
    assert _sha(out / WEIGHTS) == before
    prune_model(replace(dense, force=True), data_ctx)
    assert not declares_packed(out)
    with pytest.raises(OutputExistsError, match="stored dense, not packed as --save-format asks; tsenor pack"):
        prune_model(replace(dense, save_format="packed"), data_ctx)
