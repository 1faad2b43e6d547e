"""Distributed pruning (docs/design/distributed.md): 2 gloo processes on the CPU against one process.

The distributed runs start through `torch.multiprocessing.spawn`, each worker joining a gloo group and
calling `prune_model` with its rank in the run context, so one spawn serves many runs; one test goes
through `tsenor prune --nproc 2` (`pruning/run/launch.py`) end to end, and one stops, kills and resumes it with
real signals. Tiny random models of two families, 2 blocks (8 for the signals).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import os
import pty
import re
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import make_tiny_llama
from safetensors.torch import load_file

from tsenor_cli import replay
from tsenor_cli.errors import (
    DEBUG_HINT,
    EXIT_RESUMABLE,
    BadInputError,
    OutputExistsError,
    PeerError,
    TsenorError,
)
from tsenor_cli.interrupt import StopRequest
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.block import engine, gather
from tsenor_cli.pruning.block.distributed import assign_owners, shard_bounds, shared_input_classes
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.plan.plan import plan_model
from tsenor_cli.pruning.run import api
from tsenor_cli.pruning.run.launch import KILLED_PEER_S, run_status, wait_ranks, without_option
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.pruning.settings.recipe import build_config, read_recipe
from tsenor_cli.runfiles import PRUNE_FILE, RESUME_DIR, RESUME_STATE_FILE, read_sparsity
from tsenor_cli.settings import DistributedContext, RunContext

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
METHODS = ("magnitude", "wanda", "sparsegpt", "alps")
FAMILIES = ("llama", "qwen2")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: make_tiny_llama(root / family, model_type=family, num_layers=2) for family in FAMILIES}


def _cfg(model: Path, calib: Path, output: Path, method: str, transposable: bool, **changes: Any) -> PruneConfig:
    fields: dict[str, Any] = {
        "model": str(model),
        "matrix": MatrixPruneConfig(SparsityPattern.from_nm(8, 16, transposable=transposable)),
        "method": method,
        "calib_data": str(calib),
        "nsamples": 5,  # odd: the shards are 3 and 2 samples
        "seqlen": 32,
        "output": output,
        "resume": False,
        **changes,
    }
    return PruneConfig(**fields)


# ---------------------------------------------------------------- workers


def _worker(rank: int, init: str, jobs: list[dict[str, Any]], ctx: RunContext, results: str) -> None:
    """One rank: join the gloo group, run every job, write {job: outcome} to results/rank<r>.json."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    place = dataclasses.replace(ctx, distributed=DistributedContext(rank=rank, world_size=WORLD, local_rank=rank))
    outcomes: dict[str, Any] = {}
    try:
        for job in jobs:
            outcomes[job["name"]] = _run_job(job, rank, place)
    finally:
        dist.destroy_process_group()
        Path(results, f"rank{rank}.json").write_text(json.dumps(outcomes))


def _run_job(job: dict[str, Any], rank: int, ctx: RunContext) -> Any:
    fail_on = job.get("fail_on")
    original = engine._prune_stacked  # every linear goes through it, alone or stacked with others

    def failing(*args: Any, **kwargs: Any) -> Any:
        if job.get("unexpected"):
            raise RuntimeError(f"injected bug on rank {rank}")
        raise BadInputError(f"injected failure on rank {rank}; nothing to fix")

    def stop_after_first(index: int) -> None:
        if index == 0:
            raise KeyboardInterrupt

    stop = StopRequest()

    def signal_rank_1_after_first(index: int) -> None:
        if index == 0 and rank == 1:
            stop.request("SIGTERM")

    after = stop_after_first if job.get("stop_after_first") else None
    if job.get("signal_rank_1"):
        after = signal_rank_1_after_first
    if fail_on == rank:
        engine._prune_stacked = failing
    try:
        api.prune_model(job["cfg"], ctx, after_block=after, stop=stop)
    except TsenorError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "exit_code": exc.exit_code}
    finally:
        engine._prune_stacked = original
    return "ok"


def _spawn(tmp: Path, jobs: list[dict[str, Any]], ctx: RunContext) -> list[dict[str, Any]]:
    results = tmp / "results"
    results.mkdir(parents=True, exist_ok=True)
    init = f"file://{tmp / 'rendezvous'}"
    torch.multiprocessing.spawn(_worker, args=(init, jobs, ctx, str(results)), nprocs=WORLD, join=True)
    return [json.loads((results / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _pruned_weights(output: Path) -> dict[str, torch.Tensor]:
    record = read_sparsity(output)
    assert record is not None
    pruned = record.pruned_modules
    tensors = load_file(str(output / "model.safetensors"))
    return {name: tensors[f"{name}.weight"] for name in pruned}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- pure parts


def test_shards_are_contiguous_balanced_and_cover_every_sample() -> None:
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for n in range(1, 20):
        for world in range(1, n + 1):
            bounds = shard_bounds(n, world)
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_linears_that_keep_the_same_tensors_share_one_chain_of_sums() -> None:
    x0, x1, y0, y1 = (torch.zeros(1) for _ in range(4))
    z0 = torch.zeros(1)  # equal values, another tensor: kept apart
    kept = {"q": [x0, x1], "k": [x0, x1], "o": [y0, y1], "v": [x0, x1], "up": [z0, x1], "empty": [], "none": []}
    assert shared_input_classes(kept) == [["q", "k", "v"], ["o"], ["up"], ["empty"], ["none"]]


def test_owners_balance_each_group_by_cost_largest_first() -> None:
    # LLaMA-like block, hidden 64, intermediate 256: cost = in³ + out·in.
    groups = [
        [("q", 64, 64), ("k", 32, 64), ("v", 32, 64)],
        [("o", 64, 64)],
        [("gate", 256, 64), ("up", 256, 64)],
        [("down", 64, 256)],
    ]
    loads = [0, 0]
    owners = assign_owners(groups, 2, loads)
    # Costs: q, o 266240; k, v 264192; gate, up 278528; down 16793600.
    # [q,k,v]: q (largest) → 0; k → 1 (empty in this group); v → 1 (264192 < 266240). Totals 266240 | 528384.
    # [o]: both groups empty, rank 0 has less in total → 0. Totals 532480 | 528384.
    # [gate,up]: gate → 1 (less in total), up → 0 (empty in this group). Totals 811008 | 806912.
    # [down] → 1 (less in total).
    assert owners == {"q": 0, "k": 1, "v": 1, "o": 0, "gate": 1, "up": 0, "down": 1}
    cost = {name: i**3 + o * i for group in groups for name, o, i in group}
    assert loads == [
        sum(cost[n] for n, r in owners.items() if r == 0),
        sum(cost[n] for n, r in owners.items() if r == 1),
    ]
    assert assign_owners(groups, 2) == owners  # deterministic
    assert set(assign_owners(groups, 1).values()) == {0}


def test_the_rank_comes_from_torchruns_environment_only_through_settings() -> None:
    from tsenor_cli.errors import UsageError
    from tsenor_cli.settings import distributed_default

    assert distributed_default({}) == DistributedContext(0, 1, 0)
    assert distributed_default({"RANK": "1", "WORLD_SIZE": "2"}) == DistributedContext(1, 2, 1)
    assert distributed_default({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == DistributedContext(3, 4, 1)
    assert RunContext.from_environment(environ={"RANK": "1", "WORLD_SIZE": "2"}).distributed.rank == 1
    for bad in ({"RANK": "2", "WORLD_SIZE": "2"}, {"RANK": "x", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "0"}):
        with pytest.raises(UsageError):
            distributed_default(bad)


def test_launched_processes_get_the_same_arguments_less_nproc() -> None:
    args = ["prune", "--model", "m", "--nproc", "2", "--nm", "2:4", "--nproc=3", "--output", "o"]
    assert without_option(args, "--nproc") == ["prune", "--model", "m", "--nm", "2:4", "--output", "o"]


def test_cli_nproc_checks_and_the_per_rank_dry_run(
    models: dict[str, Path], data_ctx: RunContext, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from tsenor_cli.cli import app

    base = ["prune", "--model", str(models["llama"]), "--nm", "8:16", "--seqlen", "32", "--calib-data", "wikitext2"]
    base += ["--data-dir", str(data_ctx.data_dir), "--offline"]
    runner = CliRunner()
    plan = runner.invoke(app, [*base, "--nsamples", "5", "--dry-run", "--nproc", "2"])
    assert plan.exit_code == 0, plan.output
    ranks = [line.split(":")[0].strip() for line in plan.output.splitlines() if line.startswith("  rank ")]
    assert ranks == ["rank 0", "rank 1"] and "peak per process" in plan.output
    few = runner.invoke(app, [*base, "--nsamples", "1", "--nproc", "2", "--output", str(tmp_path / "o")])
    assert isinstance(few.exception, TsenorError) and "--nsamples 1 is fewer than --nproc 2" in str(few.exception)
    pass_args = ["--nsamples", "4", "--loss-aware", "1", "--loss-aware-fraction", "0.25", "--nproc", "2"]
    short = runner.invoke(app, [*base, *pass_args, "--output", str(tmp_path / "o")])
    assert isinstance(short.exception, TsenorError)
    assert "--loss-aware-fraction 0.25 leaves the loss pass 1 samples, fewer than --nproc 2" in str(short.exception)
    torchrun_env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    nested = runner.invoke(app, [*base, "--nsamples", "4", "--nproc", "2", "--output", "o"], env=torchrun_env)
    assert isinstance(nested.exception, TsenorError) and "inside a torchrun process (rank 1 of 2)" in str(
        nested.exception
    )
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- against one process


def test_two_processes_give_the_checkpoint_of_one_bit_for_bit(
    models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """Both families × all four methods × transposable and ordinary 8:16."""
    cases = [(family, method, t) for family in FAMILIES for method in METHODS for t in (True, False)]
    jobs: list[dict[str, Any]] = []
    for family, method, transposable in cases:
        label = f"{family}-{method}-{'t' if transposable else 'o'}"
        api.prune_model(_cfg(models[family], calib, tmp_path / "single" / label, method, transposable), data_ctx)
        jobs.append(
            {"name": label, "cfg": _cfg(models[family], calib, tmp_path / "dist" / label, method, transposable)}
        )
    outcomes = _spawn(tmp_path, jobs, data_ctx)
    for job in jobs:
        name = str(job["name"])
        assert all(outcome[name] == "ok" for outcome in outcomes), (name, outcomes)
        # The statistics are summed in the single process's order: every weight is bit-identical.
        assert _sha(tmp_path / "single" / name / "model.safetensors") == _sha(
            tmp_path / "dist" / name / "model.safetensors"
        ), name
        pruned = _pruned_weights(tmp_path / "dist" / name)
        assert pruned.keys() == _pruned_weights(tmp_path / "single" / name).keys() and len(pruned) == 14
        report = json.loads((tmp_path / "dist" / name / PRUNE_FILE).read_text())
        # The workers run 1 thread each (_worker): recorded in the settings.
        assert report["settings"]["processes"] == WORLD and report["settings"]["threads"] == 1


def test_two_streamed_processes_give_the_checkpoint_of_one_bit_for_bit(
    models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """--stream with --nproc: each rank reads every block it runs from the checkpoint (each runs every block
    on its samples) and rank 0 assembles the output from the block files; with and without a resume state."""
    single = tmp_path / "single"
    api.prune_model(_cfg(models["llama"], calib, single, "sparsegpt", True), data_ctx)
    jobs = [
        {"name": f"resume-{resume}", "cfg": _cfg(models["llama"], calib, tmp_path / f"dist-{resume}", "sparsegpt", True,
                                                   stream=True, resume=resume)}
        for resume in (True, False)
    ]  # fmt: skip
    outcomes = _spawn(tmp_path, jobs, data_ctx)
    for job in jobs:
        assert all(outcome[job["name"]] == "ok" for outcome in outcomes), outcomes
        folder = job["cfg"].output
        assert _sha(folder / "model.safetensors") == _sha(single / "model.safetensors")
        counts = ("model_params", "model_nonzero", "linear_params", "linear_nonzero")
        totals = [json.loads((f / PRUNE_FILE).read_text())["totals"] for f in (folder, single)]
        assert [totals[0][k] for k in counts] == [totals[1][k] for k in counts]


def test_two_loss_aware_processes_give_the_checkpoint_of_one_and_resume_to_it(
    models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """--loss-aware with --nproc: each rank runs the curvature pass on its shard and the per-sample sums are
    added in sample order, so the row weights and the checkpoint are one process's, bit for bit; streamed
    and whole, and a run stopped after block 1 resumes to the same bytes (odd shards: 3 and 2 samples)."""
    model = models["llama"]
    jobs: list[dict[str, Any]] = []
    for stream in (True, False):
        single = tmp_path / f"single-{stream}"
        api.prune_model(_cfg(model, calib, single, "alps", True, loss_aware=4.0, stream=stream), data_ctx)
        resumed = _cfg(model, calib, tmp_path / f"resumed-{stream}", "alps", True, loss_aware=4.0, stream=stream,
                       resume=True)  # fmt: skip
        jobs += [
            {"name": f"dist-{stream}", "cfg": _cfg(model, calib, tmp_path / f"dist-{stream}", "alps", True,
                                                    loss_aware=4.0, stream=stream)},
            {"name": f"stopped-{stream}", "cfg": resumed, "stop_after_first": True},
            {"name": f"resumed-{stream}", "cfg": resumed},
        ]  # fmt: skip
    plain = tmp_path / "plain"
    api.prune_model(_cfg(model, calib, plain, "alps", True), data_ctx)
    outcomes = _spawn(tmp_path, jobs, data_ctx)
    for stream in (True, False):
        assert [o[f"dist-{stream}"] for o in outcomes] == ["ok"] * WORLD, outcomes
        assert all(o[f"stopped-{stream}"]["type"] == "Interrupted" for o in outcomes), outcomes
        assert [o[f"resumed-{stream}"] for o in outcomes] == ["ok"] * WORLD, outcomes
        single = _sha(tmp_path / f"single-{stream}" / "model.safetensors")
        assert single != _sha(plain / "model.safetensors")  # the row weights moved some masks
        assert _sha(tmp_path / f"dist-{stream}" / "model.safetensors") == single
        assert _sha(tmp_path / f"resumed-{stream}" / "model.safetensors") == single


def _folder_sha(folder: Path) -> str:
    """One hash of every safetensors file of an output folder (a dense or a packed checkpoint)."""
    files = sorted(folder.glob("*.safetensors"))
    assert files, folder
    return hashlib.sha256(b"".join(_sha(f).encode() for f in files)).hexdigest()


@pytest.mark.parametrize("name", ["quality-16x32.yaml", "quality-2x4.yaml"])
def test_the_quality_recipes_give_one_process_bytes_streamed_in_two_processes_and_resumed(
    name: str, models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """Each recipe as shipped (calibration made small): the whole-model run, the streamed one, two processes
    and a two-process run stopped after block 1 and resumed write the same bytes, dense and packed."""
    recipe = read_recipe(REPO / "configs" / name)
    assert "model" not in recipe

    def cfg(folder: str, resume: bool = False, **changes: Any) -> PruneConfig:
        small = {"model": str(models["llama"]), "calib_data": str(calib), "nsamples": 5, "seqlen": 32}
        values = {**recipe, **small, "output": str(tmp_path / folder), **changes}
        return build_config(values, force=False, resume=resume, command=None)

    jobs: list[dict[str, Any]] = []
    for save_format in ("dense", "packed"):
        api.prune_model(cfg(f"whole-{save_format}", stream=False, save_format=save_format), data_ctx)
        api.prune_model(cfg(f"streamed-{save_format}", save_format=save_format), data_ctx)
        resumed = cfg(f"resumed-{save_format}", resume=True, save_format=save_format)
        jobs += [
            {"name": f"two-{save_format}", "cfg": cfg(f"two-{save_format}", save_format=save_format)},
            {"name": f"stopped-{save_format}", "cfg": resumed, "stop_after_first": True},
            {"name": f"resumed-{save_format}", "cfg": resumed},
        ]
    outcomes = _spawn(tmp_path, jobs, data_ctx)
    for save_format in ("dense", "packed"):
        assert all(o[f"stopped-{save_format}"]["type"] == "Interrupted" for o in outcomes), outcomes
        for run in ("two", "resumed"):
            assert [o[f"{run}-{save_format}"] for o in outcomes] == ["ok"] * WORLD, outcomes
        one = _folder_sha(tmp_path / f"whole-{save_format}")
        for run in ("streamed", "two", "resumed"):
            assert _folder_sha(tmp_path / f"{run}-{save_format}") == one, (run, save_format)
    report = json.loads((tmp_path / "two-dense" / PRUNE_FILE).read_text())
    assert len(report["refinement"]) == 2 and report["settings"]["processes"] == WORLD


def test_resumed_distributed_run_equals_an_uninterrupted_one_and_failures_stop_every_rank(
    models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    model = models["llama"]
    full = _cfg(model, calib, tmp_path / "full", "sparsegpt", True)
    resumed = _cfg(model, calib, tmp_path / "resumed", "sparsegpt", True, resume=True)
    failed = [_cfg(model, calib, tmp_path / f"failed{rank}", "sparsegpt", True) for rank in range(WORLD)]
    jobs = [
        {"name": "full", "cfg": full},
        {"name": "stopped", "cfg": resumed, "stop_after_first": True},
        {"name": "resumed", "cfg": resumed},
        *({"name": f"fail{rank}", "cfg": failed[rank], "fail_on": rank} for rank in range(WORLD)),
        {"name": "bug", "cfg": failed[1], "fail_on": 1, "unexpected": True},
        {
            "name": "signal",
            "cfg": _cfg(model, calib, tmp_path / "signalled", "sparsegpt", True, resume=True),
            "signal_rank_1": True,
        },
    ]
    outcomes = _spawn(tmp_path, jobs, data_ctx)
    assert [o["full"] for o in outcomes] == ["ok"] * WORLD
    # The stop came after block 1's state was saved by rank 0; the rerun continues from it.
    assert all(o["stopped"]["type"] == "Interrupted" for o in outcomes), outcomes
    assert [o["resumed"] for o in outcomes] == ["ok"] * WORLD
    report = json.loads((tmp_path / "resumed" / PRUNE_FILE).read_text())
    assert report["resumed_from_block"] == 1
    assert _sha(tmp_path / "resumed" / "model.safetensors") == _sha(tmp_path / "full" / "model.safetensors")
    for rank in range(WORLD):
        seen = [o[f"fail{rank}"] for o in outcomes]
        line = f"injected failure on rank {rank}; nothing to fix"
        # Every rank stops with the failing rank's exit code and line; rank 0 raises it (and prints it).
        assert all(s["exit_code"] == BadInputError.exit_code for s in seen), seen
        assert seen[0]["message"] == (line if rank == 0 else f"rank {rank}: {line}")
        assert seen[1]["type"] == PeerError.__name__
        assert seen[0]["type"] == (BadInputError.__name__ if rank == 0 else PeerError.__name__)
        assert not (tmp_path / f"failed{rank}").exists()  # nothing written
    # SIGTERM reached rank 1 only, after block 1: both ranks stop before block 2, exit 75, state saved.
    signalled = [o["signal"] for o in outcomes]
    assert [s["exit_code"] for s in signalled] == [EXIT_RESUMABLE] * WORLD, signalled
    assert signalled[0]["message"].startswith("stopped by SIGTERM after block 1/2")
    assert (tmp_path / "signalled" / RESUME_DIR / RESUME_STATE_FILE).is_file()
    # Any other exception: the CLI's "unexpected" line, exit 1, on every rank.
    bug = [o["bug"] for o in outcomes]
    assert [b["exit_code"] for b in bug] == [1, 1] and [b["type"] for b in bug] == ["PeerError"] * 2
    assert bug[0]["message"] == f"rank 1: unexpected RuntimeError: injected bug on rank 1; {DEBUG_HINT}"


def test_offloaded_activations_give_the_same_checkpoint(
    models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    for method in ("sparsegpt", "alps"):
        plain, offloaded = tmp_path / f"{method}-plain", tmp_path / f"{method}-offloaded"
        api.prune_model(_cfg(models["qwen2"], calib, plain, method, True), data_ctx)
        api.prune_model(_cfg(models["qwen2"], calib, offloaded, method, True, offload_activations=True), data_ctx)
        assert _sha(plain / "model.safetensors") == _sha(offloaded / "model.safetensors")


def test_prune_nproc_runs_torchrun_with_the_same_command(
    models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """`tsenor prune --nproc 2` end to end: torchrun's environment, env:// rendezvous, rank 0's files."""
    single = tmp_path / "single"
    api.prune_model(_cfg(models["llama"], calib, single, "wanda", True), data_ctx)
    args = [
        "prune", "--model", str(models["llama"]), "--method", "wanda", "--nm", "8:16", "--nsamples", "5",
        "--seqlen", "32", "--calib-data", str(calib), "--no-resume-state", "--nproc", "2",
        "--data-dir", str(data_ctx.data_dir), "--offline",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "tsenor_cli", *args, "--output", str(tmp_path / "dist")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 alone reports
    single_w, dist_w = _pruned_weights(single), _pruned_weights(tmp_path / "dist")
    for layer, weight in single_w.items():
        assert torch.equal(weight != 0, dist_w[layer] != 0), layer
    bad = subprocess.run(
        [sys.executable, "-m", "tsenor_cli", *args, "--output", str(calib)],  # a file: refused by rank 0
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == OutputExistsError.exit_code  # the rank's code, through the launcher
    lines = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: --output {calib} is a file; choose a directory path for the checkpoint"], bad.stderr


def test_dry_run_memory_components_match_the_tensors_of_a_run(
    models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """The estimate's parts against the tensors a run allocates (CPU: sizes, not allocator peaks; the GPU
    peak is measured by the benchmark): the block's parameters, a rank's hidden states in and out, the
    statistics of a block's linears as one group."""
    from tsenor_cli.data.calibration import calibration_batches
    from tsenor_cli.models.loading import load_model

    cfg = _cfg(models["llama"], calib, tmp_path / "out", "sparsegpt", True, sequential=False)
    plan = plan_model(cfg, data_ctx, world_size=WORLD)
    assert [e.rank for e in plan.device_memory] == [0, 1]
    loaded = load_model(str(models["llama"]), data_ctx, dtype=torch.float32, device="cpu")
    structure = loaded.structure
    block = structure.blocks[0]
    assert plan.device_memory[0].block == sum(p.nbytes for p in block.parameters())
    ids = calibration_batches(str(calib), loaded.tokenizer, data_ctx, nsamples=5, seqlen=32, seed=0).input_ids
    linears = dict(structure.block_linears(0, block))
    cpu = torch.device("cpu")
    for estimate, (start, stop) in zip(plan.device_memory, shard_bounds(5, WORLD), strict=True):
        inputs = replay.capture_block_inputs(structure, ids[start:stop], cpu)
        kept = gather.group_inputs(block, linears, inputs.hidden, inputs.calls[0], cpu, keep=cpu)
        # Inputs, the output buffer and the kept linear inputs; --no-sequential counts every linear's
        # input, an upper bound of what is kept (q/k/v and gate/up share one tensor).
        every_linear = sum(x.nbytes for xs in kept.values() for x in xs)
        assert estimate.activations == 2 * inputs.hidden.nbytes + every_linear
        shared_once = sum({id(x): x.nbytes for xs in kept.values() for x in xs}.values())
        assert shared_once < every_linear
    inputs = replay.capture_block_inputs(structure, ids, cpu)
    stats = gather.group_input_stats(block, linears, inputs.hidden, inputs.calls[0], cpu)
    # The estimate counts one Gram per linear; q/k/v and gate/up share one (an upper bound).
    one_rank = sum(s.sq_norms.nbytes + s.require_gram().nbytes for s in stats.values())
    largest = max(s.sq_norms.nbytes + s.require_gram().nbytes for s in stats.values())
    assert plan.device_memory[0].statistics == 2 * one_rank + largest
    alone = plan_model(cfg, data_ctx, world_size=1).device_memory
    assert len(alone) == 1 and alone[0].statistics == one_rank
    shared = sum({id(s): s.sq_norms.nbytes + s.require_gram().nbytes for s in stats.values()}.values())
    assert len({id(s) for s in stats.values()}) == 4 and shared < one_rank  # [q,k,v] [o] [gate,up] [down]
    assert alone[0].activations == 2 * inputs.hidden.nbytes
    offloaded = plan_model(dataclasses.replace(cfg, offload_activations=True), data_ctx).device_memory[0]
    assert offloaded.activations == 2 * inputs.hidden[:1].nbytes


def test_scaling_script_times_both_runs_and_compares_their_checkpoints(
    models: dict[str, Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """scripts/distributed_scaling.py on a tiny model (the SmolLM2 measurement is in docs/design/distributed.md)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("distributed_scaling", REPO / "scripts" / "distributed_scaling.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prune = ["--model", str(models["qwen2"]), "--method", "sparsegpt", "--nm", "8:16", "--nsamples", "4"]
    prune += ["--seqlen", "32", "--calib-data", str(calib), "--data-dir", str(data_ctx.data_dir), "--offline"]
    result = script.main(["--out", str(tmp_path), "--nproc", "2", "--threads", "2", "--", *prune])
    # 2 threads against 1 per process: the same bytes, since the factorizations that rounded by the
    # thread count run on one thread (pruning/methods/linalg.py; the weights differed here before).
    assert result["same_masks"] and result["same_weights"]
    assert result["single_seconds"] > 0 and result["distributed_seconds"] > 0 and result["speedup"] > 0
    assert (result["nproc"], result["threads"]) == (2, 2)
    assert json.loads((tmp_path / "scaling.json").read_text()) == result


@pytest.mark.slow
@pytest.mark.realmodel
def test_real_smollm2_block_with_two_processes_equals_one(
    smollm2_path: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """The real SmolLM2-135M, ALPS transposable 16:32 on block 0 (every block still runs): 2 ranks, bit-identical."""
    cfg = PruneConfig(
        model=str(smollm2_path),
        matrix=MatrixPruneConfig(SparsityPattern.from_nm(16, 32, transposable=True)),
        method="alps",
        calib_data="wikitext2",
        nsamples=4,
        seqlen=64,
        targets=("re:model\\.layers\\.0\\.",),
        output=tmp_path / "single",
        resume=False,
    )
    api.prune_model(cfg, data_ctx)
    (outcome,) = {
        json.dumps(o)
        for o in _spawn(tmp_path, [{"name": "d", "cfg": dataclasses.replace(cfg, output=tmp_path / "dist")}], data_ctx)
    }
    assert json.loads(outcome) == {"d": "ok"}
    assert _sha(tmp_path / "single" / "model.safetensors") == _sha(tmp_path / "dist" / "model.safetensors")
    assert len(_pruned_weights(tmp_path / "dist")) == 7


@pytest.mark.parametrize(
    ("exits", "expected"),
    [
        ({0: -15, 1: 4}, 4),  # rank 1 exited first; a SIGTERM reached rank 0 while it shut down
        ({0: 4, 1: -15}, 4),
        ({0: 4, 1: 4}, 4),
        ({0: 130, 1: 130}, 130),  # Ctrl-C: the ranks' own code, not the launcher's
        ({0: 75, 1: -9}, 75),
        ({0: 0, 1: 0}, 0),
        ({0: 0, 1: -9}, 128 + 9),  # only signals: the run was killed (out of memory, preemption)
    ],
    ids=["signal-on-rank-0", "signal-on-rank-1", "both-exited", "ctrl-c", "stopped-then-killed", "done", "killed"],
)
def test_the_run_status_is_the_agreed_exit_code_whatever_order_the_ranks_exit_in(
    exits: dict[int, int], expected: int
) -> None:
    """The code a rank exited with beats a signal it got while it shut down (seen in CI as 143)."""
    if expected == 128 + 9:
        with pytest.raises(PeerError, match="killed by signal 9") as raised:
            run_status(exits, 2)
        assert raised.value.exit_code == expected
    else:
        assert run_status(exits, 2) == expected


def test_the_run_status_names_the_rank_killed_from_outside_not_the_peers_the_launcher_killed() -> None:
    """Rank 1 died by SIGABRT; the launcher then killed rank 0: the line names rank 1 and its signal."""
    with pytest.raises(PeerError, match="process 1 of 2 was killed by signal 6") as raised:
        run_status({0: -9, 1: -6}, 2, killed={0})
    assert raised.value.exit_code == 128 + 6


def _python(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_rank_ending_with_its_code_is_not_killed_because_a_peer_died_by_a_signal() -> None:
    """The CI failure (`assert 137 == 4`): both ranks were ending on rank 0's refusal, rank 1 died by a
    signal, and the launcher killed rank 0 before it exited with 4. Rank 0 now gets `KILLED_PEER_S`."""
    ranks = [
        _python("import time; time.sleep(1.5); raise SystemExit(4)"),
        _python("import os, signal; os.kill(os.getpid(), signal.SIGABRT)"),
    ]
    codes, killed = wait_ranks(ranks)
    assert (codes, killed) == ({0: 4, 1: -signal.SIGABRT}, set())
    assert run_status(codes, 2, killed) == 4


def test_a_rank_stuck_after_its_peer_died_is_killed_and_the_peer_is_named() -> None:
    """A rank waiting for a dead peer (here: sleeping) is killed after `KILLED_PEER_S`; the peer is the cause."""
    ranks = [
        _python("import time; time.sleep(120)"),
        _python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
    ]
    start = time.monotonic()
    codes, killed = wait_ranks(ranks)
    assert time.monotonic() - start < KILLED_PEER_S + 30
    assert (codes, killed) == ({0: -signal.SIGKILL, 1: -signal.SIGKILL}, {0})
    with pytest.raises(PeerError, match="process 1 of 2 was killed by signal 9"):
        run_status(codes, 2, killed)


def _run_pids(marker: str) -> list[int]:
    """The pids of live processes whose command line holds `marker` (a run's unique output path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                zombie = ") Z " in (entry / "stat").read_text(errors="replace")
            except OSError:
                continue
            if marker.encode() in cmdline and not zombie:
                pids.append(int(entry.name))
    return pids


def _on_a_terminal(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    """`python -m tsenor_cli ARGS` as the foreground job of a new pseudo-terminal (its ranks too) → (the
    process, the terminal's master end: b"\x03" written there is a user's Ctrl-C, sent by the kernel)."""
    master, slave = pty.openpty()

    def take_the_terminal() -> None:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background test run starts with SIGINT ignored

    proc = subprocess.Popen(
        [sys.executable, "-m", "tsenor_cli", *args],
        cwd=REPO,
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=take_the_terminal,
        pass_fds=(slave,),
    )
    os.close(slave)
    return proc, master


def _wait_for_state(out: Path, done: int, proc: subprocess.Popen[str]) -> None:
    """Poll the resume state until it holds at least `done` blocks."""
    state = out / RESUME_DIR / RESUME_STATE_FILE
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads(state.read_text())["next_block"] >= done:
                return
        time.sleep(0.05)
    raise AssertionError(f"no resume state with {done} blocks in {out}")


def _said_once(stderr: str, line: str) -> bool:
    """Whether `stderr` holds `line`'s start once and no error, unexpected exception or launcher signal line
    (a Ctrl-C can land inside a progress line, so the stop line may follow it on the same line)."""
    noise = ("error:", "SignalException", "death signal", "Traceback")
    return stderr.count(line) == 1 and not any(word in stderr for word in noise)


@pytest.mark.slow
def test_ctrl_c_sigterm_and_kill_of_prune_nproc_then_resume(calib: Path, data_ctx: RunContext, tmp_path: Path) -> None:
    """Issue 41 audit items 3 and 4 on real processes: Ctrl-C on the terminal of `tsenor prune --nproc 2` exits
    130 with one line (was: exit 1, "unexpected SignalException", the line twice, torch's "death signal");
    SIGTERM to the launcher alone exits 75 after saving the block in hand; `kill -9` of the launcher takes its
    ranks with it (was: they ran on, wrote the output, and a rerun was refused as "in use"). The last rerun's
    checkpoint is an uninterrupted single process's, bit for bit."""
    model = make_tiny_llama(tmp_path / "model", num_layers=8)
    out = tmp_path / "run-out"
    args = [
        "prune", "--model", str(model), "--method", "sparsegpt", "--nm", "2:4", "--solver", "exhaustive",
        "--nsamples", "4", "--seqlen", "32", "--calib-data", str(calib), "--output", str(out), "--nproc", "2",
        "--data-dir", str(data_ctx.data_dir), "--offline",
    ]  # fmt: skip

    proc, terminal = _on_a_terminal(args)
    _wait_for_state(out, 1, proc)
    os.write(terminal, b"\x03")
    _, stderr = proc.communicate(timeout=300)
    os.close(terminal)
    assert proc.returncode == 130, stderr
    # The Ctrl-C lands inside block 2 ("at block 2/8") or between blocks ("after block 1/8"): both are right,
    # and which one is a matter of timing (CI on 841606d saw the second).
    stop = re.search(r"interrupted (?:at|after) block \d+/8; ", stderr)
    assert stop is not None and _said_once(stderr, stop.group(0)), stderr

    proc, terminal = _on_a_terminal(args)
    _wait_for_state(out, 2, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher alone: it passes the signal on
    _, stderr = proc.communicate(timeout=300)
    os.close(terminal)
    assert proc.returncode == EXIT_RESUMABLE, stderr
    assert _said_once(stderr, "stopped by SIGTERM after block "), stderr

    proc, terminal = _on_a_terminal(args)
    _wait_for_state(out, 4, proc)
    assert len(_run_pids(str(out))) == 3  # the launcher and its two ranks
    proc.kill()
    proc.communicate(timeout=60)
    os.close(terminal)
    deadline = time.monotonic() + 30
    while _run_pids(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _run_pids(str(out)) == []
    assert not (out / "model.safetensors").exists()

    done = subprocess.run(
        [sys.executable, "-m", "tsenor_cli", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming after block " in done.stderr
    single = tmp_path / "single"
    alone = invoke([*without_option(args, "--nproc"), "--output", str(single), "--no-resume-state"])
    assert alone.exit_code == 0, alone.output
    assert _sha(out / "model.safetensors") == _sha(single / "model.safetensors")


def test_two_processes_prune_mllamas_skipped_block_as_one_does(
    calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """The block Mllama's text-only forward skips (pruning/block/idle.py) under --nproc: its q_proj's statistics
    summed across the ranks in the single process's order, its other linears by magnitude on every rank;
    the checkpoint is the single process's, bit for bit."""
    from helpers_tiny import make_tiny_model

    source = make_tiny_model(tmp_path / "mllama", "mllama")
    single, dist = tmp_path / "single", tmp_path / "dist"
    api.prune_model(_cfg(source, calib, single, "sparsegpt", True, seqlen=24), data_ctx)
    outcomes = _spawn(
        tmp_path, [{"name": "mllama", "cfg": _cfg(source, calib, dist, "sparsegpt", True, seqlen=24)}], data_ctx
    )
    assert all(outcome["mllama"] == "ok" for outcome in outcomes), outcomes
    assert _sha(single / "model.safetensors") == _sha(dist / "model.safetensors")
    layers = json.loads((dist / PRUNE_FILE).read_text())["layers"]
    idle = [layer for layer in layers if ".layers.1." in layer["name"]]
    assert len(idle) == 7 and all(layer["status"] == "pruned" for layer in idle)
