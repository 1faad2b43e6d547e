"""`--ignore` / `--targets`: pattern semantics, errors, recipes, and ignored layers left dense end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import make_tiny_llama
from safetensors.torch import load_file

from tsenor_cli.errors import UsageError
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.methods.types import MatrixPruneConfig
from tsenor_cli.pruning.settings.config import PruneConfig
from tsenor_cli.pruning.settings.selection import check_patterns, excluded_layers, matches
from tsenor_cli.runfiles import read_sparsity

NAMES = [f"model.layers.{b}.{local}" for b in (0, 1) for local in ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj")]


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(" ".join(f"block {i} reads what block {i - 1} wrote and prunes half of it." for i in range(60)))
    return path


def test_globs_and_regexes_on_full_names() -> None:
    name = "model.layers.10.mlp.down_proj"
    assert matches("*.mlp.down_proj", name) and matches("model.layers.1?.*", name)
    assert matches(name, name) and not matches("mlp.down_proj", name)  # a plain name matches only itself
    assert not matches("*.MLP.*", name)  # case-sensitive, like module names
    # re: is matched at the start of the name (re.match, as llm-compressor does), not anywhere in it
    assert matches(r"re:.*down_proj$", name) and matches(r"re:model\.layers\.1", name)
    assert not matches("re:mlp", name) and matches("re:.*mlp", name)


def test_excluded_layers_reasons() -> None:
    assert excluded_layers(NAMES, (), ()) == {}
    assert excluded_layers(NAMES, ["*.down_proj", "re:model\\.layers\\.1\\."], ()) == {
        "model.layers.0.mlp.down_proj": "matched --ignore *.down_proj",
        "model.layers.1.self_attn.q_proj": "matched --ignore re:model\\.layers\\.1\\.",
        "model.layers.1.mlp.up_proj": "matched --ignore re:model\\.layers\\.1\\.",
        "model.layers.1.mlp.down_proj": "matched --ignore *.down_proj",
    }
    only_mlp = excluded_layers(NAMES, ["*.down_proj"], ["*.mlp.*"])
    assert only_mlp == {
        "model.layers.0.self_attn.q_proj": "not matched by --targets",
        "model.layers.0.mlp.down_proj": "matched --ignore *.down_proj",
        "model.layers.1.self_attn.q_proj": "not matched by --targets",
        "model.layers.1.mlp.down_proj": "matched --ignore *.down_proj",
    }


def test_targets_and_ignore_that_cancel_out_are_refused_with_or_without_outside_linears() -> None:
    """Issue 41 audit item 5: --targets and --ignore naming the same linears leave nothing to prune, on a
    multimodal model (vision linears selectable) as on a text model; a vision linear --targets names and
    --ignore leaves is something to prune."""
    vision = ["model.vision_tower.layers.0.mlp.fc1", "model.vision_tower.layers.0.mlp.fc2"]
    refused = r"--ignore/--targets leave none of the 6 linear layers to prune; loosen the patterns"
    with pytest.raises(UsageError, match=refused):
        excluded_layers(NAMES, ["*"], ["*"])
    with pytest.raises(UsageError, match=refused):
        excluded_layers(NAMES, ["*"], ["*"], selectable=vision)
    with pytest.raises(UsageError, match=refused):
        excluded_layers(NAMES, ["model.vision_tower.*"], ["model.vision_tower.*"], selectable=vision)
    kept = excluded_layers(NAMES, ["*.fc1"], ["model.vision_tower.*"], selectable=vision)
    assert set(kept) == set(NAMES)  # the decoder untouched, fc2 pruned


def test_bad_patterns_are_one_line_usage_errors() -> None:
    with pytest.raises(UsageError, match=r"--ignore '\*\.mlp\.dwn_proj' matches no linear layer"):
        excluded_layers(NAMES, ["*.mlp.dwn_proj"], ())
    with pytest.raises(UsageError, match="--targets 're:lm_head' matches no linear layer"):
        excluded_layers(NAMES, (), ["re:lm_head"])
    with pytest.raises(UsageError, match="leave none of the 6 linear layers to prune"):
        excluded_layers(NAMES, ["model.*"], ())
    with pytest.raises(UsageError, match=r"--ignore 're:\(' is not a valid regular expression"):
        check_patterns(["re:("], "--ignore")
    with pytest.raises(UsageError, match="--targets got an empty pattern"):
        PruneConfig(
            model="x", matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)), targets=(" ",)
        )
    cfg = PruneConfig(model="x", matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)))
    with_ignore = PruneConfig(
        model="x", matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)), ignore=("*.q_proj",)
    )
    assert with_ignore.result_fields()["ignore"] == ["*.q_proj"] and cfg.result_hash() != with_ignore.result_hash()


def test_ignored_layers_stay_dense_and_are_reported(tiny: Path, calib: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["prune", "--model", str(tiny), "--method", "sparsegpt", "--nm", "2:4", "--solver", "exhaustive"]
    args += ["--nsamples", "2", "--seqlen", "32", "--calib-data", str(calib), "--output", str(out)]
    args += ["--ignore", "*.mlp.down_proj", "--ignore", r"re:model\.layers\.1\.self_attn\.q_"]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    source, pruned = load_file(str(tiny / "model.safetensors")), load_file(str(out / "model.safetensors"))
    ignored = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    for name in ignored:
        assert torch.equal(pruned[f"{name}.weight"], source[f"{name}.weight"])  # bit-for-bit dense
    assert float((pruned["model.layers.1.self_attn.k_proj.weight"] == 0).float().mean()) == 0.5

    report = json.loads((out / "tsenor_report.json").read_text())
    status = {layer["name"]: (layer["status"], layer["reason"]) for layer in report["layers"]}
    assert status["model.layers.0.mlp.down_proj"] == ("ignored", "matched --ignore *.mlp.down_proj")
    assert status["model.layers.1.self_attn.q_proj"] == (
        "ignored",
        r"matched --ignore re:model\.layers\.1\.self_attn\.q_",
    )
    assert sum(s == "pruned" for s, _ in status.values()) == 11
    totals = report["totals"]
    assert (totals["layers_pruned"], totals["layers_skipped"], totals["layers_ignored"]) == (11, 0, 3)
    # Hand count: a block's linears hold q 64·64 + k,v 2·32·64 + o 64·64 + gate,up 2·128·64 + down 64·128
    # = 36864 weights; 2 blocks = 73728, of which 2·8192 (down) + 4096 (q of block 1) = 20480 stay dense
    # and the other 53248 keep exactly half (transposable 2:4, random weights have no zeros).
    assert totals["linear_params"] == 73728 and totals["linear_nonzero"] == 20480 + 53248 // 2
    assert totals["linear_density"] == pytest.approx(47104 / 73728)
    all_params = sum(t.numel() for t in source.values())  # the tied lm_head is stored once
    assert totals["model_params"] == all_params and totals["model_nonzero"] == all_params - 53248 // 2
    markdown = (out / "tsenor_report.md").read_text()
    assert f"- ignored (left dense): {', '.join(ignored)}" in markdown
    assert "| model.layers.0.mlp.down_proj | 64×128 | ignored: matched --ignore *.mlp.down_proj |" in markdown
    assert "- density: model " in markdown and "decoder weight matrices 0.6389" in markdown

    record = read_sparsity(out)
    assert record is not None and [w.name for w in record.dense] == ignored
    assert {w.status for w in record.dense} == {"ignored"} and all(
        w.reason is not None and w.reason.startswith("matched --ignore") for w in record.dense
    )
    verified = invoke(["verify", str(out), "--json"])
    assert verified.exit_code == 0, verified.output
    checked = [layer["name"] for layer in json.loads(verified.output)["layers"]]
    assert len(checked) == 11 and not set(checked) & set(ignored)


def test_the_run_takes_its_selection_from_the_plan_it_was_given(
    tiny: Path, calib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan is the only place the selection is made (issue 40): a plan made with an --ignore the run's
    config lacks decides what stays dense, in the nn.Linear check before calibration and in the watch,
    and every selection the run applies is the plan's own object."""
    from dataclasses import replace

    from tsenor_cli.pruning.plan.plan import PrunePlan, plan_model
    from tsenor_cli.pruning.run import api
    from tsenor_cli.pruning.run.api import prune_model
    from tsenor_cli.pruning.settings.selection import Selection
    from tsenor_cli.settings import RunContext, cache_dir_default

    plans: list[PrunePlan] = []

    def planned_with_ignore(cfg: PruneConfig, ctx: RunContext, progress: object = None, **kw: object) -> PrunePlan:
        plans.append(plan_model(replace(cfg, ignore=("*.mlp.down_proj",)), ctx, progress, **kw))  # type: ignore[arg-type]
        return plans[-1]

    applied: list[Selection] = []
    excluded = Selection.excluded

    def spied(self: Selection, names: list[str]) -> dict[str, str]:
        applied.append(self)
        return excluded(self, names)

    monkeypatch.setattr(api, "plan_model", planned_with_ignore)
    monkeypatch.setattr(Selection, "excluded", spied)
    cfg = PruneConfig(
        model=str(tiny), matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)), method="magnitude",
        calib_data=str(calib), nsamples=2, seqlen=32, output=tmp_path / "out",
    )  # fmt: skip
    ctx = RunContext(data_dir=None, offline=True, cache_dir=cache_dir_default())
    report = prune_model(cfg, ctx)
    status = {layer.name: (layer.status, layer.reason) for layer in report.layers}
    down = [f"model.layers.{b}.mlp.down_proj" for b in (0, 1)]
    assert all(status[name] == ("ignored", "matched --ignore *.mlp.down_proj") for name in down)
    assert sum(s == "pruned" for s, _ in status.values()) == len(status) - 2 == 12
    # Made once by the plan, applied to the plan's names and to the watched ones: the same object each time.
    assert len(plans) == 1 and len(applied) == 2 and all(used is plans[0].selection for used in applied)


def test_targets_from_a_recipe_and_errors_before_any_output(tiny: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {tiny}\nnm: '2:4'\ntargets: '*.mlp.*'\nignore: ['*.up_proj']\n")
    result = invoke(["prune", "--config", str(recipe), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    kept = [layer["name"] for layer in plan["layers"] if layer["ignored"] is None]
    assert kept == [f"model.layers.{b}.mlp.{p}" for b in (0, 1) for p in ("gate_proj", "down_proj")]
    assert plan["ignored"] == 10
    # A flag given on the command line replaces the recipe's list.
    flagged = invoke(["prune", "--config", str(recipe), "--ignore", "*.gate_proj", "--dry-run", "--json"])
    kept = [layer["name"] for layer in json.loads(flagged.output)["layers"] if layer["ignored"] is None]
    assert kept == [f"model.layers.{b}.mlp.{p}" for b in (0, 1) for p in ("up_proj", "down_proj")]

    bad_type = tmp_path / "bad.yaml"
    bad_type.write_text(f"model: {tiny}\nnm: '2:4'\nignore: 3\n")
    refused = invoke(["prune", "--config", str(bad_type), "--dry-run"])
    assert refused.exit_code == 2 and "ignore must be a pattern string or a list" in str(refused.exception)

    out = tmp_path / "never"
    typo = invoke(["prune", "--model", str(tiny), "--nm", "2:4", "--ignore", "*.mlp.dwn_proj", "--output", str(out)])
    assert typo.exit_code == 2 and "matches no linear layer" in str(typo.exception)
    assert not out.exists()


def test_ignoring_incompatible_layers_replaces_skip_incompatible(tmp_path: Path) -> None:
    odd = make_tiny_llama(tmp_path / "odd", intermediate_size=80, num_layers=1)  # MLP dims 16:32 cannot tile
    base = ["prune", "--model", str(odd), "--nm", "16:32", "--dry-run"]
    stops = invoke(base)
    assert stops.exit_code == 5 and "NO: " in stops.output
    result = invoke([*base, "--ignore", "*.mlp.*"])
    assert result.exit_code == 0 and "NO: " not in result.output
    assert "ignored: matched --ignore *.mlp.*" in result.output


def test_many_ignored_layers_are_counted_by_reason_in_the_summary() -> None:
    from tsenor_cli.pruning.methods.types import LayerRecord
    from tsenor_cli.report.markdown import MAX_LISTED_IGNORED, prune_markdown
    from tsenor_cli.runfiles import PruneReport

    cfg = PruneConfig(model="m", matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)))
    layers = [LayerRecord(0, f"model.layers.{i}.q", 4, 4, "ignored", "not matched by --targets") for i in range(13)]
    layers += [
        LayerRecord(0, "model.layers.0.o", 4, 4, "ignored", "matched --ignore *.o"),
        LayerRecord(0, "p", 4, 4, "pruned"),
    ]
    report = PruneReport(
        method="alps",
        pattern=None,
        sparsity=0.5,
        settings={**cfg.result_fields(), "device": "cpu", "solver": "flow"},
        layers=tuple(layers),
        calibration="c",
        seconds=1.0,
        output=None,
        command=None,
        versions={},
        model_params=100,
        model_nonzero=90,
        linear_params=60,
        linear_nonzero=50,
    )
    assert len(layers) - 1 > MAX_LISTED_IGNORED
    markdown = prune_markdown(report)
    assert "- ignored (left dense): 13 not matched by --targets; 1 matched --ignore *.o (each in the table)" in markdown
    assert "- density: model 0.9000 (90 of 100 parameters nonzero), decoder weight matrices 0.8333" in markdown
    assert markdown.count("| ignored: ") == 14


@pytest.mark.parametrize("dry_run", [False, True])
def test_targets_and_ignore_that_cancel_out_on_a_multimodal_model_are_refused(
    dry_run: bool, calib: Path, tmp_path: Path
) -> None:
    """The audit's case on a tiny LLaVA: --targets '*' --ignore '*' (and the vision tower named by both) was
    a dense copy with exit 0; now exit 2 with the text model's line, nothing written."""
    from helpers_tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "llava", "llava")
    out = tmp_path / "out"
    base = ["prune", "--model", str(model), "--nm", "2:4", "--nsamples", "2", "--seqlen", "16"]
    base += ["--calib-data", str(calib), "--output", str(out), *(["--dry-run"] if dry_run else [])]
    for pattern in ("*", "model.vision_tower.*"):
        result = invoke([*base, "--targets", pattern, "--ignore", pattern])
        assert result.exit_code == 2, result.output
        assert "leave none of the" in str(result.exception) and "loosen the patterns" in str(result.exception)
        assert not out.exists()
