"""`tsenor prune --dry-run` accounts for every weight matrix of the decoder blocks before any weight is read.

The plan's model is on the meta device; one block of each kind is watched on random values
(`pruning/plan/probe.py`), so the plan shows what the run's report will: expert stacks with their expert
count, routers and gates left dense by rule, parameters that are not matmul weights, blocks that never
run on text, and "decided at prune time" for what the probe could not watch. Checked against the report
of the real run on the same checkpoint, with the checkpoint's weights deleted for the dry run.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import make_tiny_llama, make_tiny_model
from test_moe import MOE

from tsenor_cli.models.loading import meta_model
from tsenor_cli.models.structure import discover_structure
from tsenor_cli.pruning.plan import advice, probe

SEQ_LEN = 24


@pytest.fixture(scope="module")
def calibration_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(" ".join(["the model reads every token and each block adds what it found"] * 40))
    return path


def _weightless(source: Path, to: Path) -> Path:
    """A copy of the checkpoint folder without its weights: a dry run must not need them."""
    shutil.copytree(source, to, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return to


def _plan(model: Path, *flags: str) -> dict[str, Any]:
    result = invoke(["prune", "--model", str(model), "--nm", "2:4", *flags, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))  # the rule lines go to stderr


def _kind(status: str, reason: str | None) -> str:
    """The report's status of a matrix, or for a matrix left dense by rule, the rule."""
    if reason and reason.split(",")[0] in ("router", "gate"):
        return reason.split(",")[0]
    return status


def test_the_dry_run_of_a_moe_lists_what_the_run_reports(calibration_text: Path, tmp_path: Path) -> None:
    """Qwen3-Next: linear- and full-attention blocks, experts, routers, shared-expert gates and a depthwise
    convolution. Every row of the plan is a matrix of the run's report with the same fate."""
    source = make_tiny_llama(tmp_path / "src", model_type="qwen3_next", **MOE["qwen3_next"])
    plan = _plan(_weightless(source, tmp_path / "weightless"))
    out = tmp_path / "out"
    args = ["prune", "--model", str(source), "--method", "sparsegpt", "--nm", "2:4", "--nsamples", "2"]
    ran = invoke([*args, "--seqlen", str(SEQ_LEN), "--calib-data", str(calibration_text), "--output", str(out)])
    assert ran.exit_code == 0, ran.output
    report = json.loads((out / "tsenor_report.json").read_text())["layers"]

    planned: dict[str, str] = {}
    for layer in plan["layers"]:
        status = {"prune": "pruned", "not a matmul weight": "ignored"}.get(layer["status"], layer["status"])
        planned[layer["name"]] = _kind(status, layer["ignored"])
    reported: dict[str, str] = {}
    experts: dict[str, int] = {}
    for record in report:
        name = record["name"].split("[")[0]  # expert e of a stack is reported as name[e]
        reported[name] = _kind(record["status"], record["reason"])
        experts[name] = experts.get(name, 0) + (record["expert"] is not None)
    assert planned == reported
    stacks = {layer["name"]: layer["experts"] for layer in plan["layers"] if layer["experts"]}
    assert len(stacks) == 4 and set(stacks.values()) == {4}
    assert stacks == {name: count for name, count in experts.items() if count}
    assert sorted(set(planned.values())) == ["gate", "ignored", "pruned", "router"]
    assert plan["decided_at_prune_time"] == 0 and plan["incompatible"] == 0


def test_the_dry_run_of_a_dense_model_probes_one_block_not_the_model(tiny: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    plan = _plan(_weightless(tiny, tmp_path / "weightless"))
    assert len(plan["layers"]) == 14 and {layer["status"] for layer in plan["layers"]} == {"prune"}
    structure = discover_structure(meta_model(AutoConfig.from_pretrained(tiny)))
    block_bytes = sum(p.numel() * p.element_size() for p in structure.blocks[0].parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in structure.base.parameters())
    # One block and the small modules around the blocks (final norm, rotary frequencies), never the
    # token embedding: 0.15 MB here against the model's 12.9 MB.
    assert block_bytes <= plan["probe_bytes"] < block_bytes + 4096
    assert plan["probe_bytes"] < model_bytes / 20


def test_the_dry_run_folds_the_blocks_that_share_a_row(tiny: Path, tmp_path: Path) -> None:
    """Two blocks of seven linears: seven rows, "model.layers.{0-1}.…", until one block's weight differs."""
    args = ["prune", "--model", str(_weightless(tiny, tmp_path / "w")), "--nm", "2:4", "--dry-run"]
    rows = [line.split() for line in invoke(args).stdout.splitlines() if line.startswith("model.")]
    assert len(rows) == 7 and all(row[0].startswith("model.layers.{0-1}.") and row[2] == "yes" for row in rows)
    ignored = invoke([*args, "--ignore", "model.layers.1.mlp.down_proj"])
    rows = [line.split()[:3] for line in ignored.stdout.splitlines() if line.startswith("model.")]
    assert len(rows) == 8 and ["model.layers.0.mlp.down_proj", "64×128", "yes"] in rows
    assert ["model.layers.1.mlp.down_proj", "64×128", "ignored:"] in rows
    # The JSON keeps a row per matrix and block.
    assert len(_plan(tmp_path / "w", "--ignore", "model.layers.1.mlp.down_proj")["layers"]) == 14


def test_blocks_too_large_to_probe_are_decided_at_prune_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = make_tiny_llama(tmp_path / "src", model_type="mixtral", **MOE["mixtral"])
    monkeypatch.setattr(probe, "PROBE_BYTES", 1024)
    result = invoke(["prune", "--model", str(source), "--nm", "2:4", "--dry-run"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("model.layers.")]
    # The expert stacks and the router (a bare 2D parameter): their orientation and role need the watch.
    pending = [row for row in rows if ".experts." in row or ".mlp.gate " in row]
    assert len(pending) == 3 and all(row.startswith("model.layers.{0-1}.") for row in rows)  # both blocks a row
    assert all("decided at prune time: its block" in row and "too large to probe" in row for row in pending)
    # nn.Linear layers are known without watching: still checked against the pattern.
    assert all(row.endswith("  yes") for row in rows if row not in pending) and len(rows) == 7


def test_a_block_the_text_forward_skips_is_planned_as_pruned(tmp_path: Path) -> None:
    """Mllama's cross-attention block: its linears are pruned (pruning/block/idle.py), the table says how."""
    source = make_tiny_model(tmp_path / "mllama", "mllama")
    plan = _plan(source)
    assert {layer["status"] for layer in plan["layers"]} == {"prune"} and plan["idle"] == 0
    result = invoke(["prune", "--model", str(source), "--nm", "2:4", "--dry-run"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("model.language_model.layers.")]
    idle = [row for row in rows if row.startswith("model.language_model.layers.1.")]
    assert len(rows) == 14 and len(idle) == 7  # blocks 0 and 2 share their rows: "layers.{0,2}."
    how = "yes, its block (MllamaCrossAttentionDecoderLayer) never runs on text: calibrated on the text reaching"
    assert all(how in row and row.endswith("else by magnitude") for row in idle)
    assert all(row.endswith("  yes") for row in rows if row not in idle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans a GPU job from a machine without one")
def test_the_plan_measures_its_own_runtime_and_adds_it_to_the_peak(tiny: Path) -> None:
    """The host estimate's runtime is this process's resident memory when the plan is made (measured: the
    interpreter with torch and transformers, hundreds of MB, not zero), outside `total` and inside `peak`;
    the dry run prints both."""
    import psutil

    from tsenor_cli.pruning.block import memory

    before = psutil.Process().memory_info().rss
    host = _plan(tiny, "--nsamples", "4", "--seqlen", "16")["estimated_host_bytes_per_process"]
    after = psutil.Process().memory_info().rss
    assert host["runtime"] > 100 << 20 and before * 0.8 <= host["runtime"] <= after * 1.2
    assert host["peak"] == host["runtime"] + host["total"]
    assert memory.resident_bytes() > 100 << 20
    result = invoke(["prune", "--model", str(tiny), "--nm", "2:4", "--nsamples", "4", "--seqlen", "16", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "over this process's " in result.stdout and "(measured), " in result.stdout
    assert " at the peak; cpu " in result.stdout


def test_the_dry_run_says_what_its_estimate_leaves_out(tiny: Path) -> None:
    """--refine-mask-every's re-solves are not in the host estimate (measured 0.2-0.35 GB above it on
    SmolLM2-135M): the dry run says so under the estimate, and only for that setting."""
    base = ["prune", "--model", str(tiny), "--nm", "16:32", "--nsamples", "4", "--seqlen", "16", "--dry-run"]
    joint = invoke([*base, "--refine", "block", "--refine-mask-every", "2"])
    fixed = invoke([*base, "--refine", "block"])
    assert joint.exit_code == 0 and fixed.exit_code == 0, (joint.output, fixed.output)
    lines = joint.stdout.splitlines()
    caveat = next(i for i, line in enumerate(lines) if line.startswith("not counted above: --refine-mask-every"))
    assert lines[caveat - 1].startswith("estimated memory: host")
    assert "not counted above" not in fixed.stdout


@pytest.mark.parametrize(
    ("nm", "flags", "loads"),
    [
        ("16:32", (), True),
        # On CUDA `auto` solves whole matrices by tsenor and SparseGPT's slabs by flow: flow is loaded too.
        ("16:32", ("--device", "cuda"), True),
        ("2:4", ("--no-transposable",), False),
    ],
)
def test_the_runtime_is_measured_with_the_solver_the_run_loads(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, nm: str, flags: tuple[str, ...], loads: bool
) -> None:
    """A transposable run loads the exact solver's compiled kernels at its first solve (numba, llvmlite:
    file pages and code the fifteenth session's dry run did not see); the plan loads them for float32
    scores before it measures the runtime. A row-wise pattern runs no solver and loads nothing."""
    from tsenor_cli.pruning.block import memory
    from tsenor_cli.pruning.plan import plan
    from tsenor_cli.solver import flow, registry

    calls: list[str] = []
    info = registry.METHODS["flow"]
    assert info.prepare is flow.load_kernels
    monkeypatch.setitem(registry.METHODS, "flow", replace(info, prepare=lambda dtype: calls.append(str(dtype))))
    monkeypatch.setattr(plan, "resident_bytes", lambda: calls.append("measured") or memory.resident_bytes())
    _plan(tiny, "--nm", nm, *flags, "--nsamples", "4", "--seqlen", "16")
    assert calls == (["torch.float32", "measured"] if loads else ["measured"])


def test_loading_the_flow_kernels_compiles_the_dtype_asked_for() -> None:
    """`flow.load_kernels` leaves the compiled solver with a float32 signature (what `prepare` promises)."""
    from tsenor_cli.solver import _flow_jit, flow

    flow.load_kernels(torch.float32)
    assert any("float32" in str(sig) for sig in _flow_jit.solve_tiles.signatures)


def test_a_gpu_run_is_planned_on_a_machine_without_a_gpu(tiny: Path) -> None:
    """The plan is arithmetic: --device cuda is planned here (bf16, the GPU's default), the GPU's memory
    said against the usual cards, and the host of this machine is not the run's, so it is not checked."""
    result = invoke(["prune", "--model", str(tiny), "--nm", "2:4", "--device", "cuda", "--dry-run"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("cuda is not on this machine"))
    assert "fits GPUs of 24 GB" in line and line.endswith("141 GB (H200)")
    plan = _plan(tiny, "--device", "cuda")
    assert plan["device"] == "cuda" and plan["dtype"] == "bfloat16" and plan["device_present"] is False
    assert plan["fits_gpus"][-1] == "141 GB (H200)"


def test_a_plan_that_does_not_fit_names_the_flags_that_would(
    tiny_llama: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 5 with the plan printed; each flag the refusal names makes the same dry run fit (exit 0), and
    flags that do not fit are not named. Four blocks: a streamed run holds one block and the background
    writer another (background.py), so with two --stream would save nothing."""
    tiny = tiny_llama(num_layers=4)
    # Whole loads (--no-stream), so that streaming is one of the fixes the refusal can name.
    host = _plan(tiny, "--nsamples", "64", "--no-stream")["estimated_host_bytes_per_process"]
    # One byte short of the plan: a smaller calibration set, bf16 weights or --stream (one block fewer held) fit.
    monkeypatch.setattr(advice, "available_host_bytes", lambda: host["total"] - 1)
    args = ["prune", "--model", str(tiny), "--no-stream", "--nm", "2:4", "--nsamples", "64", "--dry-run"]
    refused = invoke(args)
    assert refused.exit_code == 5, refused.output
    assert "estimated memory: host" in refused.stdout  # the plan first
    message = str(refused.exception)
    assert message.startswith("--nsamples 64 × --seqlen 512 needs about") and message.endswith("(nothing was written)")
    fixes = message.split("; pass ")[1].removesuffix(" (nothing was written)").split(" or ")
    assert fixes[:2] == ["--stream", "--dtype bf16"] and fixes[2].startswith("--nsamples ")
    for fix in fixes:
        flag, *value = fix.split(" ")
        changed = list(args)
        if flag in changed:
            changed[changed.index(flag) + 1] = value[0]
        else:
            changed += [flag, *value]
        assert invoke(changed).exit_code == 0, fix
    fewer = int(fixes[2].split(" ")[1])
    one_more = [*args[:-2], str(fewer + 1), "--dry-run"]
    assert invoke(one_more).exit_code == 5  # the largest --nsamples that fits


def test_a_fused_moe_with_several_processes_is_refused_by_the_plan(tiny: Path, tmp_path: Path) -> None:
    """--nproc prunes nn.Linear layers only: a fused expert stack is refused by the plan, before any work,
    and once; one process, or nn.Linear layers only, are planned."""
    source = make_tiny_llama(tmp_path / "src", model_type="mixtral", **MOE["mixtral"])
    result = invoke(["prune", "--model", str(source), "--nm", "2:4", "--nproc", "2", "--dry-run"])
    assert result.exit_code == 5, result.output
    assert str(result.exception).startswith("model.layers.0.mlp.experts.gate_up_proj is not an nn.Linear")
    assert str(result.exception).endswith(
        "--nproc prunes nn.Linear layers only: run with one process (nothing was written)"
    )
    assert invoke(["prune", "--model", str(source), "--nm", "2:4", "--dry-run"]).exit_code == 0
    assert invoke(["prune", "--model", str(tiny), "--nm", "2:4", "--nproc", "2", "--dry-run"]).exit_code == 0
