"""The run's seams (`pruning/run/seams.py`): a sink and a block hook written here, outside the package, see
every block of a streamed run, of a run killed and resumed (the blocks the resume state restored reach the
sink first, marked `restored`, their tensors read from the resume state's files), and of a two-process
run killed and resumed (sinks on rank 0, hooks on every rank); what the sink receives is what the
checkpoint holds."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_tiny import sparsegpt_config
from safetensors.torch import load_file

import tsenor_cli
from tsenor_cli.pruning.run import api
from tsenor_cli.pruning.run.seams import BlockContext, BlockHook, RunEnd, RunStart, Sink, SinkBlock
from tsenor_cli.settings import DistributedContext, RunContext

BLOCKS = 3
WORLD = 2


class Killed(BaseException):
    """A kill the run cannot catch as an error (as SIGKILL would end it)."""


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """One sha256 over the tensors' names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RecordingSink(Sink):
    """Notes every call and each block's digest (holding no tensor past the call)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.digests: dict[int, str] = {}

    def begin(self, run: RunStart) -> None:
        self.calls.append(("begin", run.first, run.blocks, run.streamed))

    def add_block(self, block: SinkBlock) -> None:
        assert all(name.startswith(block.prefix) for name in block.tensors), block.prefix
        assert block.records and all(r.block == block.index for r in block.records)
        self.calls.append(("add_block", block.index, block.restored))
        self.digests[block.index] = _digest(dict(block.tensors))

    def finish(self, end: RunEnd) -> None:
        assert "model.embed_tokens.weight" in end.outside and not any(".layers." in n for n in end.outside)
        self.calls.append(("finish", len(end.report.layers), end.sparsity.pattern.label))

    def close(self) -> None:
        self.calls.append(("close",))


class RecordingHook(BlockHook):
    """Notes each call; checks what the context holds at each."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before(self, block: BlockContext) -> None:
        assert not block.records and block.inputs.shape == block.outputs.shape
        self.calls.append(("before", block.index))

    def after(self, block: BlockContext) -> None:
        assert any(r.status == "pruned" for r in block.records)
        self.calls.append(("after", block.index))

    def done(self, block: BlockContext) -> None:
        assert next(block.module.parameters()).device.type == "cpu"
        self.calls.append(("done", block.index))


def _checkpoint_digests(output: Path) -> dict[int, str]:
    """The digest of each block's tensors as the written checkpoint holds them."""
    weights = load_file(str(output / "model.safetensors"))
    return {
        index: _digest({k: v for k, v in weights.items() if k.startswith(f"model.layers.{index}.")})
        for index in range(BLOCKS)
    }


def _hooked(indices: range) -> list[tuple[str, int]]:
    return [(call, i) for i in indices for call in ("before", "after", "done")]


@pytest.fixture(scope="module")
def model(tiny_llama: Any) -> Path:
    return tiny_llama(num_layers=BLOCKS)


def test_a_sink_and_a_hook_see_every_block_of_a_streamed_run(
    model: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    sink, hook = RecordingSink(), RecordingHook()
    cfg = sparsegpt_config(model, calib, tmp_path / "out", stream=True)
    report = api.prune(model, cfg, ctx=data_ctx, sinks=[sink], hooks=[hook])
    assert hook.calls == _hooked(range(BLOCKS))
    adds = [("add_block", i, False) for i in range(BLOCKS)]
    pattern = cfg.pattern.label
    assert sink.calls == [("begin", 0, BLOCKS, True), *adds, ("finish", len(report.layers), pattern), ("close",)]
    assert sink.digests == _checkpoint_digests(tmp_path / "out")


def test_a_resumed_run_hands_the_restored_blocks_to_the_sink_first(
    model: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    cfg = sparsegpt_config(model, calib, out, stream=True)

    def kill(index: int) -> None:
        if index == 1:
            raise Killed

    first_sink, first_hook = RecordingSink(), RecordingHook()
    with pytest.raises(Killed):
        api.prune_model(cfg, data_ctx, after_block=kill, sinks=[first_sink], hooks=[first_hook])
    assert first_hook.calls == _hooked(range(2))
    assert first_sink.calls[-1] == ("close",) and not any(c[0] == "finish" for c in first_sink.calls)

    sink, hook = RecordingSink(), RecordingHook()
    report = api.prune_model(cfg, data_ctx, sinks=[sink], hooks=[hook])
    assert report.resumed_from_block == 2
    assert hook.calls == _hooked(range(2, BLOCKS))  # the restored blocks were hooked by the killed attempt
    adds = [("add_block", 0, True), ("add_block", 1, True), ("add_block", 2, False)]
    assert sink.calls[:4] == [("begin", 2, BLOCKS, True), *adds]
    assert [c[0] for c in sink.calls[4:]] == ["finish", "close"]
    assert sink.digests == _checkpoint_digests(out)


def _worker(rank: int, init: str, cfg: Any, ctx: RunContext, results: str) -> None:
    """One rank of a gloo run, killed after block 1 and run again, with a sink and a hook per attempt;
    what they saw goes to results/rank<r>.json."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    place = dataclasses.replace(ctx, distributed=DistributedContext(rank=rank, world_size=WORLD, local_rank=rank))
    seen = []

    def kill(index: int) -> None:
        if index == 1:
            raise Killed

    try:
        for after_block in (kill, None):
            sink, hook = RecordingSink(), RecordingHook()
            with contextlib.suppress(Killed):
                api.prune_model(cfg, place, after_block=after_block, sinks=[sink], hooks=[hook])
            seen.append({"sink": sink.calls, "digests": sink.digests, "hook": hook.calls})
    finally:
        dist.destroy_process_group()
    Path(results, f"rank{rank}.json").write_text(json.dumps(seen))


def test_with_two_processes_the_sink_runs_on_rank_0_and_the_hook_on_every_rank(
    model: Path, calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """Killed after block 1 and resumed: each attempt's hook saw its blocks on both ranks, rank 0's sink of
    the resumed attempt every block (blocks 0-1 restored), rank 1's none."""
    out = tmp_path / "out"
    cfg = sparsegpt_config(model, calib, out, stream=True, nsamples=5)
    init = f"file://{tmp_path / 'rendezvous'}"
    torch.multiprocessing.spawn(_worker, args=(init, cfg, data_ctx, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for attempt, blocks in enumerate((range(2), range(2, BLOCKS))):
        hooked = [list(call) for call in _hooked(blocks)]
        assert [seen[attempt]["hook"] for seen in ranks] == [hooked, hooked]
        assert ranks[1][attempt]["sink"] == [] and ranks[1][attempt]["digests"] == {}
    resumed = ranks[0][1]["sink"]
    adds = [["add_block", 0, True], ["add_block", 1, True], ["add_block", 2, False]]
    assert resumed[:4] == [["begin", 2, BLOCKS, True], *adds] and [c[0] for c in resumed[4:]] == ["finish", "close"]
    assert {int(i): d for i, d in ranks[0][1]["digests"].items()} == _checkpoint_digests(out)


def test_the_guides_sink_and_hook_run_as_written(
    model: Path, calib: Path, data_ctx: RunContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/guide/python-api.md's sink and hook (its ``py`` blocks) on a tiny model: a mask digest per
    pruned nn.Linear beside the checkpoint, an output norm per block."""
    import re

    guide = Path(__file__).parents[1] / "docs" / "guide" / "python-api.md"
    code = "\n".join(re.findall(r"```py\n(.*?)```", guide.read_text(), flags=re.S))
    assert "sinks=[MaskDigests()], hooks=[norms])" in code
    monkeypatch.setenv("TSENOR_DATA_DIR", str(data_ctx.data_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The guide's call as written, with the tiny test's calibration and solver set underneath it.
    small = functools.partial(tsenor_cli.prune, calib_data=str(calib), nsamples=4, seqlen=32, solver="exhaustive")
    namespace: dict[str, Any] = {"prune": small}
    code = code.replace("models/llama", str(model)).replace("pruned/llama-2of4", str(tmp_path / "out"))
    exec(compile(code, str(guide), "exec"), namespace)
    lines = (tmp_path / "out" / "masks.sha256").read_text().splitlines()
    pruned = [r.name for r in namespace["report"].layers if r.status == "pruned"]
    assert [line.split()[0] for line in lines] == pruned and all(len(line.split()[1]) == 64 for line in lines)
    assert sorted(namespace["norms"].norms) == list(range(BLOCKS))
