"""The block-by-block engine and `tsenor prune` / `tsenor verify` end to end on a tiny random LLaMA."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import LOCAL_CTX, make_tiny_llama
from safetensors.torch import load_file, save_file

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.runfiles import RESUME_DIR
from tsenor_cli.settings import RunContext

FAST = ["--nm", "2:4", "--solver", "exhaustive", "--nsamples", "4", "--seqlen", "32", "--calib-data", "wikitext2"]


def _tree_hash(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def _weights_hash(path: Path) -> str:
    tensors = load_file(str(path / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_prune_cli_end_to_end(tiny: Path, tmp_path: Path, data_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    before = _tree_hash(tiny)
    out = tmp_path / "pruned"
    args = ["prune", "--model", str(tiny), "--method", "wanda", *FAST, "--output", str(out), "--json"]
    result = invoke([*args, "--data-dir", str(data_dir), "--offline"])
    assert result.exit_code == 0, result.output
    assert _tree_hash(tiny) == before  # the input checkpoint is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned"]  # no temp leftovers
    # ordinary permissions on everything written (save_pretrained and mkdtemp leave some private)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o644 for p in out.iterdir()}
    assert out.stat().st_mode & 0o777 == 0o755
    report = json.loads((out / "tsenor_report.json").read_text())
    assert json.loads(result.stdout) == report
    assert report["context"] == {"data_dir": str(data_dir.resolve()), "offline": True}
    valid = data_dir / "wikitext-2-raw" / "wiki.valid.raw"  # offline WikiText-2 calibration text
    assert report["calibration_source"] == {
        "kind": "offline",
        "files": [{"path": str(valid.resolve()), "sha256": hashlib.sha256(valid.read_bytes()).hexdigest()}],
        "hub": None,
    }
    assert all("reconstruction_error" not in layer for layer in report["layers"])  # one name per field
    assert report["totals"]["layers_pruned"] == 14 and report["settings"]["seed"] == 0
    assert all(0.0 < layer["recon_error"] < 1.0 and layer["gap"] == 0.0 for layer in report["layers"])
    assert "rel. error" in (out / "tsenor_report.md").read_text()
    # `tsenor report` reads the same file (docs/reference/run-files.md).
    from tsenor_cli.runfiles import PruneReport

    parsed = PruneReport.from_json(report)
    assert parsed.to_json() == report
    assert parsed.method == "wanda" and parsed.sparsity == pytest.approx(0.5)
    assert parsed.pattern is not None and (parsed.pattern.n, parsed.pattern.m, parsed.pattern.transposable) == (
        2,
        4,
        True,
    )
    assert len(parsed.layers) == 14 and all(layer.recon_error is not None for layer in parsed.layers)
    config = json.loads((out / "config.json").read_text())
    assert config["tsenor_sparsity"]["pattern"] == "2:4" and config["tsenor_sparsity"]["transposable"] is True
    model = AutoModelForCausalLM.from_pretrained(out)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert float((q == 0).float().mean()) == pytest.approx(0.5)
    with torch.no_grad():
        logits = model(torch.arange(10)[None, :]).logits
    assert bool(torch.isfinite(logits).all())
    verified = invoke(["verify", str(out)])
    assert verified.exit_code == 0, verified.output
    assert "satisfy 2:4" in verified.output


def test_verify_flags_a_tampered_weight(tiny: Path, tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "pruned"
    assert invoke(["prune", "--model", str(tiny), "--method", "magnitude", *FAST, "--output", str(out)]).exit_code == 0
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    w = tensors[name].clone()
    w[0, :4] = 1.0  # a full row of a 4×4 tile: 4 > N = 2
    tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    result = invoke(["verify", str(out)])
    assert result.exit_code == 6
    rows = {line.split()[0]: line.split()[-1] for line in result.output.splitlines() if line.startswith("model.")}
    # The untouched blocks' rows fold into one; the tampered weight keeps its own row.
    assert rows["model.layers.1.mlp.up_proj"] == "VIOLATION" and rows["model.layers.0.mlp.up_proj"] == "ok"
    assert rows["model.layers.{0-1}.mlp.down_proj"] == "ok" and len(rows) == 8


def test_reconstruction_methods_beat_wanda_through_the_engine(tmp_path: Path, data_ctx: RunContext) -> None:
    src = make_tiny_llama(
        tmp_path / "one", hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, num_layers=1
    )
    errors = {}
    for name in ("wanda", "sparsegpt", "alps"):
        cfg = PruneConfig(
            model=str(src),
            matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True), solver="exhaustive"),
            method=name,
            calib_data="wikitext2",
            nsamples=4,
            seqlen=32,
            output=tmp_path / name,
        )
        errors[name] = prune_model(cfg, data_ctx).totals()["mean_recon_error"]
    assert errors["alps"] < errors["wanda"] and errors["sparsegpt"] < errors["wanda"]


def test_statistics_passes_stop_early_with_identical_results(tiny: Path) -> None:
    """Each sequential group's statistics pass stops once its linears have run (no MLP for [q,k,v] or [o]),
    and pruning gives bit-for-bit the weights and errors of full block passes, also with a skipped linear."""
    import copy

    from tsenor_cli.models.loading import load_model
    from tsenor_cli.pruning.block.engine import BlockPruner
    from tsenor_cli.pruning.block.gather import group_input_stats, linear_groups
    from tsenor_cli.pruning.block.slots import linear_slots
    from tsenor_cli.pruning.methods.registry import get_pruner
    from tsenor_cli.replay import capture_block_inputs

    loaded = load_model(str(tiny), LOCAL_CTX)
    structure = loaded.structure
    cpu = torch.device("cpu")
    samples = 3
    ids = torch.randint(0, 1000, (samples, 16), generator=torch.Generator().manual_seed(0))
    inputs = capture_block_inputs(structure, ids, cpu)
    hidden, call = inputs.hidden, inputs.calls[0]  # hidden (3, 16, 64)
    block = structure.blocks[0]
    linears = structure.block_linears(0)
    groups = linear_groups(block, linears, call, hidden[:1]).groups
    assert len(groups) == 4  # [q,k,v], [o], [gate,up], [down]
    entered: list[str] = []
    watched = {"o_proj": linears["self_attn.o_proj"], "mlp": block.get_submodule("mlp")}
    handles = [m.register_forward_pre_hook(lambda _m, _a, n=n: entered.append(n)) for n, m in watched.items()]
    try:
        reached = []
        for group in groups:
            group_linears = {name: linears[name] for name in group}
            entered.clear()
            early = group_input_stats(block, group_linears, hidden, call, cpu)
            reached.append((entered.count("o_proj"), entered.count("mlp")))
            full = group_input_stats(block, group_linears, hidden, call, cpu, stop_early=False)
            for name in group:
                assert torch.equal(early[name].require_gram(), full[name].require_gram())
                assert torch.equal(early[name].sq_norms, full[name].sq_norms)
                assert early[name].tokens == full[name].tokens == samples * 16
                # q/k/v and gate/up read one tensor: one shared InputStats, added to once per sample
                assert early[name] is early[group[0]]
    finally:
        for handle in handles:
            handle.remove()
    # (o_proj entered, MLP entered) per pass: [q,k,v] stops before both, [o] before the MLP.
    assert reached == [(0, 0), (samples, 0), (samples, samples), (samples, samples)]

    slots = linear_slots(structure)
    skipped = {"model.layers.0.self_attn.v_proj": "left dense by the test"}  # [q,k] must stop before v runs
    matrix_cfg = MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True), solver="exhaustive")
    results = {}
    for stop_early in (True, False):
        pruned = copy.deepcopy(block)
        pruner = BlockPruner(
            structure,
            slots,
            get_pruner("sparsegpt"),  # updates the kept weights, so later groups depend on earlier ones
            matrix_cfg,
            cpu,
            lambda _msg: None,
            skipped=skipped,
            stop_early=stop_early,
        )
        records = pruner.prune(pruned, 0, hidden, call)
        results[stop_early] = (pruned.state_dict(), [(r.status, r.recon_error, r.density) for r in records])
    (early_weights, early_records), (full_weights, full_records) = results[True], results[False]
    assert early_records == full_records and early_records[2][0] == "skipped"
    assert all(torch.equal(early_weights[name], full_weights[name]) for name in full_weights)
    assert not torch.equal(early_weights["mlp.down_proj.weight"], linears["mlp.down_proj"].weight)  # it was pruned


def test_resume_after_a_kill_equals_an_uninterrupted_run(tiny: Path, tmp_path: Path, data_ctx: RunContext) -> None:
    def cfg(output: Path, resume: bool) -> PruneConfig:
        return PruneConfig(
            model=str(tiny),
            matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True), solver="exhaustive"),
            method="sparsegpt",
            calib_data="wikitext2",
            nsamples=4,
            seqlen=32,
            output=output,
            resume=resume,
        )

    full = tmp_path / "full"
    prune_model(cfg(full, resume=False), data_ctx)

    class Killed(RuntimeError):
        pass

    def kill_after_first(index: int) -> None:
        if index == 0:
            raise Killed

    out = tmp_path / "resumed"
    with pytest.raises(Killed):
        prune_model(cfg(out, resume=True), data_ctx, after_block=kill_after_first)
    assert sorted(p.name for p in out.iterdir()) == [RESUME_DIR]
    # With --no-resume-state the half-done folder is refused, not silently overwritten.
    args = ["prune", "--model", str(tiny), "--method", "sparsegpt", *FAST, "--output", str(out)]
    refused = invoke([*args, "--no-resume-state"])
    assert refused.exit_code == 4 and "--force" in str(refused.exception)
    messages: list[str] = []
    report = prune_model(cfg(out, resume=True), data_ctx, progress=messages.append)
    assert report.resumed_from_block == 1
    assert any("resuming after block 1/2" in m for m in messages)
    assert not any(m == "block 1/2" for m in messages)  # block 0 was not redone
    assert _weights_hash(out) == _weights_hash(full)
    assert not (out / RESUME_DIR).exists()
    full_errors = [r["recon_error"] for r in json.loads((full / "tsenor_report.json").read_text())["layers"]]
    assert [r.recon_error for r in report.layers] == full_errors
    # the resumed run records the calibration source its first part used
    full_source = json.loads((full / "tsenor_report.json").read_text())["calibration_source"]
    assert report.calibration_source is not None and report.calibration_source.to_json() == full_source


def test_dry_run_writes_nothing(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "never"
    result = invoke(["prune", "--model", str(tiny), "--nm", "16:32", "--dry-run", "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert len(plan["layers"]) == 14 and plan["incompatible"] == 0
    assert plan["estimated_device_bytes"] > 0
    assert not out.exists()
    # A dry run fails where the run would (exit 5), after printing the plan that shows why.
    bad = invoke(["prune", "--model", str(tiny), "--nm", "24:48", "--dry-run"])
    assert bad.exit_code == 5 and "NO:" in bad.output
    assert "cannot take 24:48" in str(bad.exception)
    skipped = invoke(["prune", "--model", str(tiny), "--nm", "24:48", "--skip-incompatible", "--dry-run", "--json"])
    assert skipped.exit_code == 5 and "nothing would be pruned" in str(skipped.exception)


def test_config_file_values_are_overridden_by_flags(tiny: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f'model: {tiny}\nnm: "8:16"\nmethod: magnitude\nnsamples: 7\n')
    result = invoke(["prune", "--config", str(recipe), "--nsamples", "3", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["nsamples"] == 3 and plan["pattern"] == "8:16" and plan["method"] == "magnitude"
    # An N:M pattern needs no quotes: YAML 1.1's base-60 reading (8:16 as 496) is not ours (it was exit 2).
    unquoted = tmp_path / "unquoted.yaml"
    unquoted.write_text(f"model: {tiny}\nnm: 8:16\nmethod: magnitude\nnsamples: 7\n")
    bare = invoke(["prune", "--config", str(unquoted), "--nsamples", "3", "--dry-run", "--json"])
    assert bare.exit_code == 0, bare.output
    same = ("model", "nsamples", "pattern", "method", "blocks", "layers")
    assert {key: json.loads(bare.output).get(key) for key in same} == {key: plan.get(key) for key in same}
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(f"model: {tiny}\nnm: '8:16'\nlearning_rate: 1\n")
    assert invoke(["prune", "--config", str(unknown), "--dry-run"]).exit_code == 2
    typo = tmp_path / "typo.yaml"
    typo.write_text(f"model: {tiny}\nnm: 8:16\nmethd: wanda\n")
    refused = invoke(["prune", "--config", str(typo), "--dry-run"])
    assert refused.exit_code == 2
    assert str(refused.exception).startswith(f"--config {typo}: unknown key 'methd' (did you mean 'method'?); known")


def test_every_bad_input_gets_its_exit_code(tiny: Path, tmp_path: Path, data_dir: Path) -> None:
    base = ["prune", "--model", str(tiny), "--method", "magnitude", "--solver", "exhaustive"]
    cases = {
        2: [*base, "--nm", "16-32", "--output", str(tmp_path / "a")],
        3: ["prune", "--model", str(tmp_path / "missing" / "model"), "--nm", "2:4", "--output", str(tmp_path / "c")],
        5: [*base, "--nm", "24:48", "--nsamples", "2", "--seqlen", "16", "--output", str(tmp_path / "d")],
    }
    for code, args in cases.items():
        result = invoke(args)
        assert result.exit_code == code, (args, result.output)
        assert "; " in str(result.exception) or code == 2  # the message names the fix
    both = invoke([*base, "--nm", "2:4", "--sparsity", "0.5", "--output", str(tmp_path / "b")])
    assert both.exit_code == 2 and "exactly one" in str(both.exception)
    unreadable = invoke(
        [*base, "--nm", "2:4", "--calib-data", str(tmp_path / "nope.txt"), "--output", str(tmp_path / "e")]
    )
    assert unreadable.exit_code == 3
    incompatible = invoke([*base, "--nm", "24:48", "--output", str(tmp_path / "f")])
    assert incompatible.exit_code == 5 and "--skip-incompatible" in str(incompatible.exception)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    taken = invoke([*base, "--nm", "2:4", "--output", str(existing)])
    assert taken.exit_code == 4 and (existing / "keep.txt").read_text() == "mine"
    onto_input = invoke([*base, "--nm", "2:4", *FAST[4:], "--output", str(tiny), "--force"])
    assert onto_input.exit_code == 2
    assert (tiny / "config.json").is_file() and "tsenor_sparsity" not in (tiny / "config.json").read_text()
    for name in ("a", "b", "c", "d", "e", "f"):
        assert not (tmp_path / name).exists()


def test_skip_incompatible_leaves_layers_dense(tmp_path: Path, data_dir: Path) -> None:
    src = make_tiny_llama(tmp_path / "odd", hidden_size=64, intermediate_size=80, num_layers=1)
    out = tmp_path / "out"
    args = ["prune", "--model", str(src), "--method", "wanda", "--nm", "16:32", "--solver", "exact"]
    args += ["--nsamples", "2", "--seqlen", "16", "--calib-data", "wikitext2", "--output", str(out)]
    assert invoke(args).exit_code == 5
    result = invoke([*args, "--skip-incompatible"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "tsenor_report.json").read_text())
    skipped = {r["name"] for r in report["layers"] if r["status"] == "skipped"}
    assert skipped == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"}
    assert invoke(["verify", str(out)]).exit_code == 0
    shutil.rmtree(out)


@pytest.mark.realmodel
@pytest.mark.realdata
@pytest.mark.slow
def test_smollm2_prunes_end_to_end_with_sane_perplexity(
    smollm2_path: Path, tmp_path: Path, data_dir: Path, data_ctx: RunContext
) -> None:
    """SmolLM2-135M, wanda 2:4 transposable (exhaustive = provably optimal masks), 4×64 calibration.

    2:4 rather than 16:32 keeps this under a few minutes on a busy 2-core CPU: a 16:32 solve of one
    576×1536 layer takes ~15 s there, i.e. ~20 min for the 210 layers.
    """
    from tsenor_cli.evaluation.runner import EvalConfig, evaluate_model
    from tsenor_cli.models.loading import load_model

    out = tmp_path / "smol"
    args = ["prune", "--model", str(smollm2_path), "--method", "wanda", "--nm", "2:4", "--solver", "exhaustive"]
    args += ["--nsamples", "4", "--seqlen", "64", "--no-sequential", "--output", str(out)]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    assert invoke(["verify", str(out)]).exit_code == 0
    eval_cfg = EvalConfig(ppl_datasets=("wikitext2",), seqlen=256, max_windows=2)
    dense = evaluate_model(load_model(str(smollm2_path), LOCAL_CTX), eval_cfg, data_ctx).perplexity["wikitext2"].ppl
    pruned = evaluate_model(load_model(str(out), LOCAL_CTX), eval_cfg, data_ctx).perplexity["wikitext2"].ppl
    # Measured: dense 30.9, wanda 2:4 transposable 1637 (row-wise 2:4: 143) — 50% in 4×4 tiles is harsh on a
    # 135M model. Sane = finite, worse than dense, far better than a uniform guess over the vocabulary.
    assert math.isfinite(pruned) and dense < pruned < min(200 * dense, 49152 / 10)


def test_shipped_recipes_parse() -> None:
    from tsenor_cli.pruning.settings.recipe import read_recipe

    recipes = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert len(recipes) == 30  # 3 LLaMA models × 3 methods × 3 patterns + the local SmolLM2 recipe + 2 quality
    for recipe in recipes:
        values = read_recipe(recipe)
        assert values["method"] in ("alps", "sparsegpt", "wanda") and values["nm"] in ("16:32", "8:16", "2:4")
        assert values["seed"] == 0
