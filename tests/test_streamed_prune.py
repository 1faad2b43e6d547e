"""`tsenor prune --stream`: each block read from the checkpoint when the loop reaches it, the output assembled
from the pruned blocks' files; the files equal a whole load's bit for bit (with and without a resume
state, sharded, resumed after a kill), one block holds weights at a time, and a pickle checkpoint is
loaded whole with one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_faults import Killed
from helpers_tiny import LOCAL_CTX, sparsegpt_config

from tsenor_cli.models.checkpoint import INDEX_NAME
from tsenor_cli.models.loading import load_model
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.plan.plan import plan_model
from tsenor_cli.pruning.plan.render import plan_lines
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.run.writer import CheckpointSink
from tsenor_cli.replay import BlockSource
from tsenor_cli.runfiles import PRUNE_FILE, RESUME_DIR
from tsenor_cli.settings import RunContext

BLOCKS = 3
COUNTS = ("model_params", "model_nonzero", "linear_params", "linear_nonzero")


@pytest.fixture(scope="module")
def model(tiny_llama: Callable[..., Path]) -> Path:
    return tiny_llama(num_layers=BLOCKS)


def _weights(folder: Path) -> dict[str, str]:
    """{file: sha256} of the checkpoint's weight files and config (what must be the same bit for bit)."""
    names = [p for p in sorted(folder.iterdir()) if p.suffix == ".safetensors" or p.name in (INDEX_NAME, "config.json")]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in names}


def _report(folder: Path) -> dict[str, object]:
    return json.loads((folder / PRUNE_FILE).read_text())


@pytest.fixture(scope="module")
def whole(model: Path, calib: Path, data_ctx: RunContext, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "out"
    prune_model(sparsegpt_config(model, calib, out, resume=False, stream=False), data_ctx)
    return out


@pytest.mark.parametrize("resume", [True, False])
def test_streamed_prune_writes_the_whole_load_files_one_block_at_a_time(
    model: Path, calib: Path, whole: Path, data_ctx: RunContext, tmp_path: Path, resume: bool
) -> None:
    out = tmp_path / "out"
    holding: list[list[int]] = []
    original_load = BlockSource.load

    def load(self: BlockSource, index: int, to: torch.device | None = None) -> torch.nn.Module:
        block = original_load(self, index, to)
        blocks = self.structure.blocks
        holding.append([i for i, b in enumerate(blocks) if any(not p.is_meta for p in b.parameters())])
        return block

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockSource, "load", load)
        prune_model(sparsegpt_config(model, calib, out, resume=resume, stream=True), data_ctx)
    # capture (block 0), the watch pass (every block), the loop (every block): one block at a time
    assert holding == [[0], [0], [1], [2], [0], [1], [2]]
    assert _weights(out) == _weights(whole)
    streamed_report, whole_report = _report(out), _report(whole)
    assert [streamed_report["totals"][k] for k in COUNTS] == [whole_report["totals"][k] for k in COUNTS]
    timing = ("seconds", "solver_seconds")
    assert [{k: v for k, v in layer.items() if k not in timing} for layer in streamed_report["layers"]] == [
        {k: v for k, v in layer.items() if k not in timing} for layer in whole_report["layers"]
    ]
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no block folder, temporary or lock left


def test_streamed_prune_shards_as_asked_and_loads(
    model: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    whole_out, streamed_out = tmp_path / "whole", tmp_path / "streamed"
    prune_model(sparsegpt_config(model, calib, whole_out, resume=False, max_shard_size="100KB"), data_ctx)
    prune_model(sparsegpt_config(model, calib, streamed_out, stream=True, max_shard_size="100KB"), data_ctx)
    assert (streamed_out / INDEX_NAME).is_file()
    assert _weights(streamed_out) == _weights(whole_out)
    loaded = load_model(str(streamed_out), LOCAL_CTX)
    assert loaded.structure.blocks[0].self_attn.q_proj.weight.count_nonzero() * 2 == (
        loaded.structure.blocks[0].self_attn.q_proj.weight.numel()
    )


def test_streamed_prune_killed_after_a_block_resumes_to_the_same_files(
    model: Path, calib: Path, whole: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    for killed_at in range(BLOCKS):
        out = tmp_path / f"k{killed_at}" / "out"

        def kill(index: int, at: int = killed_at) -> None:
            if index == at:
                raise Killed

        with pytest.raises(Killed):
            prune_model(sparsegpt_config(model, calib, out, stream=True), data_ctx, after_block=kill)
        assert sorted(p.name for p in out.iterdir()) == [RESUME_DIR]
        report = prune_model(sparsegpt_config(model, calib, out, stream=True), data_ctx)
        assert report.resumed_from_block == killed_at + 1
        assert _weights(out) == _weights(whole)
        assert [getattr(report, k) for k in COUNTS] == [_report(whole)["totals"][k] for k in COUNTS]


def test_killed_streamed_run_without_resume_state_leaves_its_blocks_to_recover(
    model: Path, calib: Path, whole: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    out = tmp_path / "out"

    def kill(index: int) -> None:
        if index == 1:
            raise Killed

    # A SIGKILL runs no cleanup: the folder of pruned blocks stays beside the output.
    with pytest.MonkeyPatch.context() as patch, pytest.raises(Killed):
        patch.setattr(CheckpointSink, "close", lambda self: None)
        prune_model(sparsegpt_config(model, calib, out, stream=True, resume=False), data_ctx, after_block=kill)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(left) == 1 and sorted(p.name for p in left[0].iterdir()) == [
        "block_0000.safetensors",
        "block_0001.safetensors",
    ]
    messages: list[str] = []
    prune_model(sparsegpt_config(model, calib, out, stream=True, resume=False), data_ctx, progress=messages.append)
    assert any(m.startswith("removed .out.tmp-") for m in messages)
    assert _weights(out) == _weights(whole)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_pickle_checkpoint_is_loaded_whole_with_one_line(
    model: Path, calib: Path, whole: Path, data_ctx: RunContext, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(model, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(load_model(str(model), LOCAL_CTX).model.state_dict(), pickled / "pytorch_model.bin")
    out = tmp_path / "out"
    prune_model(sparsegpt_config(pickled, calib, out, stream=True, resume=False), data_ctx)
    warned = [r.getMessage() for r in caplog.records if "pickle weights" in r.getMessage()]
    assert len(warned) == 1 and "loaded whole" in warned[0]
    assert _weights(out)["model.safetensors"] == _weights(whole)["model.safetensors"]


def test_dry_run_host_memory_is_one_block_when_streamed(model: Path, calib: Path, data_ctx: RunContext) -> None:
    whole_plan = plan_model(sparsegpt_config(model, calib, None, stream=False), data_ctx)
    streamed_plan = plan_model(sparsegpt_config(model, calib, None, stream=True), data_ctx)
    per_block = whole_plan.blocks_bytes // BLOCKS
    assert streamed_plan.host_memory.model == whole_plan.host_memory.model - (BLOCKS - 1) * per_block
    assert streamed_plan.host_memory.streamed and "one block" in streamed_plan.host_memory.describe()
    lines = list(plan_lines(streamed_plan, sparsegpt_config(model, calib, None, stream=True)))
    assert any(line.startswith("disk: checkpoint ") for line in lines)


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_streamed_prune_of_smollm2_equals_the_whole_load(
    smollm2_path: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, method: str
) -> None:
    """The real SmolLM2 (30 blocks, tied head) pruned 2:4 on 4×64 tokens, whole and streamed: same files."""
    options = {
        "method": method,
        "seqlen": 64,
        "matrix": MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True), solver="flow"),
    }
    whole_out, streamed_out = tmp_path / "whole", tmp_path / "streamed"
    prune_model(sparsegpt_config(smollm2_path, calib, whole_out, resume=False, **options), data_ctx)
    prune_model(sparsegpt_config(smollm2_path, calib, streamed_out, resume=False, stream=True, **options), data_ctx)
    assert _weights(streamed_out) == _weights(whole_out)
    assert [_report(streamed_out)["totals"][k] for k in COUNTS] == [_report(whole_out)["totals"][k] for k in COUNTS]


def test_prune_eval_evaluates_the_pruned_checkpoint_block_by_block(
    model: Path, calib: Path, data_dir: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tsenor prune --stream --eval`: the evaluation reads the pruned checkpoint block by block too (its
    load keeps the blocks on the meta device, one block holds weights at a time, the whole-model
    perplexity never runs), and its perplexity is the whole load's evaluation of the same checkpoint."""
    from helpers_cli import invoke

    from tsenor_cli.evaluation import runner
    from tsenor_cli.evaluation.runner import EvalConfig, evaluate_model
    from tsenor_cli.models import loading
    from tsenor_cli.runfiles import EVAL_FILE

    out = tmp_path / "out"
    loads: list[tuple[str, bool]] = []
    holding: list[list[int]] = []
    original_load_model, original_block = loading.load_model, BlockSource.load

    def load_model_seen(name: str, *args: object, **kwargs: object) -> loading.LoadedModel:
        loaded = original_load_model(name, *args, **kwargs)
        loads.append((name, loaded.checkpoint is not None))
        return loaded

    def load_block_seen(self: BlockSource, index: int, to: torch.device | None = None) -> torch.nn.Module:
        block = original_block(self, index, to)
        if loads and loads[-1][0] == str(out):  # the evaluation's reads
            holding.append(
                [i for i, b in enumerate(self.structure.blocks) if any(not p.is_meta for p in b.parameters())]
            )
        return block

    def whole_perplexity(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the evaluation ran the whole model's perplexity")

    monkeypatch.setattr(loading, "load_model", load_model_seen)
    monkeypatch.setattr(BlockSource, "load", load_block_seen)
    with monkeypatch.context() as patch:
        patch.setattr(runner, "perplexity", whole_perplexity)
        args = ["prune", "--model", str(model), "--method", "sparsegpt", "--nm", "2:4", "--solver", "exhaustive"]
        args += ["--nsamples", "4", "--seqlen", "32", "--calib-data", str(calib), "--output", str(out)]
        args += ["--stream", "--eval", "--ppl", "wikitext2", "--max-windows", "2", "--data-dir", str(data_dir)]
        result = invoke([*args, "--offline"])
    assert result.exit_code == 0, result.output
    assert loads == [(str(model), True), (str(out), True)]
    assert holding == [[0], [1], [2]]  # block 0 for the capture (and its replay), then each block alone
    streamed = json.loads((out / EVAL_FILE).read_text())["perplexity"]["wikitext2"]["ppl"]
    whole = evaluate_model(original_load_model(str(out), data_ctx), EvalConfig(("wikitext2",), max_windows=2), data_ctx)
    assert streamed == pytest.approx(whole.perplexity["wikitext2"].ppl, rel=1e-5)
