"""`auto`, the default mask method: what it picks per device and M, and that results, the CLI and the
pruning report name the solver that ran beside the one asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_tiny import make_tiny_llama
from typer.testing import CliRunner

from tsenor_cli.cli import app
from tsenor_cli.errors import UsageError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.solver import METHODS, resolve_method, solve, to_blocks
from tsenor_cli.solver.auto import HOST_SCORES


def _scores(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_auto_picks_flow_on_cpu_tsenor_on_cuda_and_exhaustive_for_m4() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_method("auto", cpu, 16).name == "flow"
    assert resolve_method("auto", cpu, 32).name == "flow"
    assert resolve_method("auto", cpu, 32, 1 << 26).name == "flow"
    assert resolve_method("auto", cuda, 16).name == "tsenor"  # a plan's whole matrix
    # On CUDA a solve of few tiles goes to the host's exact flow (launch-bound on the GPU, issue 42 item 3):
    # up to HOST_SCORES scores inclusive, the GPU's tsenor beyond.
    assert resolve_method("auto", cuda, 32, HOST_SCORES).name == "flow"
    assert resolve_method("auto", cuda, 32, HOST_SCORES + 32 * 32).name == "tsenor"
    assert resolve_method("auto", cuda, 16, 2048 * 16).name == "flow"  # a SparseGPT slab: 2048 rows × M
    assert resolve_method("auto", cpu, 4).name == "exhaustive"
    assert resolve_method("auto", cuda, 4).name == "exhaustive"
    # Every other name runs itself, on every device.
    for name in METHODS:
        if name != "auto":
            assert resolve_method(name, cuda, 16).name == name


def test_solve_result_names_what_ran(device: torch.device) -> None:
    scores = _scores(64, 64).to(device)
    res = solve(scores, 8, 16)  # the default method
    assert (res.requested, res.method) == ("auto", "flow")  # few tiles: flow on the CPU and from CUDA
    assert res.mask.device == scores.device
    large = solve(_scores(1024, 1024).to(device), 8, 16)  # 2^20 scores, past HOST_SCORES
    assert large.method == ("tsenor" if device.type == "cuda" else "flow")
    blocks = to_blocks(res.mask, 16)
    assert bool((blocks.sum(1) == 8).all()) and bool((blocks.sum(2) == 8).all())
    m4 = solve(scores, 2, 4)
    assert (m4.requested, m4.method) == ("auto", "exhaustive")
    named = solve(scores, 8, 16, "tsenor")
    assert (named.requested, named.method) == ("tsenor", "tsenor")


def test_auto_is_the_picked_method_call_for_call(device: torch.device) -> None:
    """Same mask, objective and bound as asking for the picked method by name; its options and warm
    start go through."""
    scores = _scores(96, 96, seed=3).to(device)
    picked = resolve_method("auto", device, 32, scores.numel()).name
    for options in ({}, {"max_elements": 32 * 32 * 3}):
        ours = solve(scores, 16, 32, **options)
        theirs = solve(scores, 16, 32, picked, **options)
        assert torch.equal(ours.mask, theirs.mask)
        assert ours.upper_bound == theirs.upper_bound
    first = solve(scores, 16, 32)
    noise = torch.randn(scores.shape, generator=torch.Generator().manual_seed(1)).to(device)
    noisy = (scores * (1 + 0.01 * noise)).abs()
    warm = solve(noisy, 16, 32, init=first)
    assert torch.equal(warm.mask, solve(noisy, 16, 32, picked, init=first).mask)


def test_auto_block_function_dispatches_like_solve() -> None:
    """`METHODS["auto"].fn` on (B, M, M) blocks is the picked method's block function."""
    blocks = torch.rand(12, 16, 16, generator=torch.Generator().manual_seed(5))
    ours = METHODS["auto"].fn(blocks, 8)
    flow = METHODS["flow"].fn(blocks, 8)
    assert torch.equal(ours.mask, flow.mask)


def test_options_of_the_method_auto_does_not_run_are_refused() -> None:
    with pytest.raises(ValueError, match=r"sweeps do not apply to method 'auto' \(which runs 'flow' here\)"):
        solve(_scores(32, 32), 8, 16, sweeps=2)


def test_cli_solver_choices_come_from_the_registry(tmp_path: Path) -> None:
    help_text = " ".join(CliRunner().invoke(app, ["prune", "--help"]).output.split())
    for name in METHODS:
        assert name in help_text
    cfg = MatrixPruneConfig(SparsityPattern.from_nm(8, 16, transposable=True), solver="hungarian")
    with pytest.raises(UsageError, match=r"unknown --solver 'hungarian'; choose one of: auto, .*flow.*tsenor"):
        PruneConfig(model="m", matrix=cfg)


@pytest.mark.parametrize(
    ("solver", "nm", "transposable", "ran"),
    [("auto", (8, 16), True, "flow"), ("tsenor", (8, 16), True, "tsenor"), ("auto", (2, 4), True, "exhaustive")],
)
def test_solver_that_runs(solver: str, nm: tuple[int, int], transposable: bool, ran: str) -> None:
    pattern = SparsityPattern.from_nm(*nm, transposable=transposable)
    cfg = PruneConfig(model="m", matrix=MatrixPruneConfig(pattern, solver=solver))
    assert cfg.solver_that_runs(torch.device("cpu")) == ran
    ordinary = PruneConfig(model="m", matrix=MatrixPruneConfig(SparsityPattern.from_nm(*nm, transposable=False)))
    assert ordinary.solver_that_runs(torch.device("cpu")) is None


def test_prune_report_names_the_solver_that_ran(tmp_path: Path, data_dir: Path) -> None:
    """The default solver on CPU: the report and the checkpoint's metadata say `flow` ran and keep
    `auto` as asked; certified gaps are at round-off (flow is exact)."""
    tiny = make_tiny_llama(tmp_path / "src", num_layers=1)
    out = tmp_path / "pruned"
    args = ["prune", "--model", str(tiny), "--method", "magnitude", "--nm", "8:16", "--nsamples", "2"]
    result = CliRunner().invoke(app, [*args, "--seqlen", "16", "--calib-data", "wikitext2", "--output", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "tsenor_report.json").read_text())
    assert report["settings"]["solver"] == "flow"
    assert report["settings"]["layer"]["solver"] == "auto"
    assert all(layer["gap"] <= 1e-12 for layer in report["layers"])
    meta = json.loads((out / "config.json").read_text())["tsenor_sparsity"]
    assert (meta["solver"], meta["solver_requested"]) == ("flow", "auto")
    assert "solver flow (asked for auto)" in (out / "tsenor_report.md").read_text()
