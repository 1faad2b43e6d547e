"""`tsenor bench prune`: the phase recorder, the projections (hand-worked), the shipped LLaMA shapes,
and a CPU smoke run of the whole benchmark through the CLI on a scaled-down LLaMA-3.2-1B shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers_cli import invoke
from typer.testing import CliRunner

import tsenor_cli.phases as phases_module
from tsenor_cli.bench.prune import (
    E2EResult,
    RunResult,
    _alps_projection,
    _project_whole,
    _whole_model,
    default_tokens,
    host_peak_phases,
    merge_section,
    refine_ratios,
    scale_shape,
    shape_config,
    to_markdown,
    transposable_ratios,
    write_random_checkpoint,
)
from tsenor_cli.cli import app
from tsenor_cli.errors import InputNotFoundError, UsageError
from tsenor_cli.phases import PHASES, REFINE_PHASES, host_peak, phase, record_phases, reset_host_peak


def _clock(monkeypatch: pytest.MonkeyPatch, times: list[float]) -> None:
    """Make the phase recorder read `times` from its clock, one per reading (the real clock untouched)."""
    ticks: Iterator[float] = iter(times)
    monkeypatch.setattr(phases_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


def test_phases_are_exclusive_of_nested_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    with record_phases(torch.device("cpu")) as recorder:
        # method 0→10 holds the mask solver 1→3 and CG 4→4.5: the method's own time is 10 − 2 − 0.5.
        _clock(monkeypatch, [0.0, 1.0, 3.0, 4.0, 4.5, 10.0, 20.0, 21.0])
        with phase("method", layer="model.layers.0.mlp.up_proj"):
            with phase("solver"):
                pass
            with phase("cg"):
                pass
        with phase("rerun"):  # no layer: counted in the totals only
            pass
    assert recorder.seconds == {"solver": 2.0, "cg": 0.5, "method": 7.5, "rerun": 1.0}
    assert recorder.layers == {"model.layers.0.mlp.up_proj": {"solver": 2.0, "cg": 0.5, "method": 7.5}}
    assert recorder.peak is None and recorder.peaks == {}  # no device peaks off CUDA


def test_phase_outside_a_recording_records_nothing() -> None:
    import torch

    with record_phases(torch.device("cpu")) as recorder:
        pass
    with phase("method"):
        pass
    assert recorder.seconds == {}
    assert phases_module._ACTIVE.get() is None


def _run(seconds: float) -> RunResult:
    return RunResult("alps", "transposable", "16:32", "flow", seconds, {}, 0.0, None, {}, 1, None, True)


def test_alps_projection_hand_worked() -> None:
    # Layer a: 10 iterations in 1 s (0.1 s/it); layer b: 20 in 4 s (0.2 s/it). SmolLM2: 30 each.
    # At 30 iterations: 3 s + 6 s instead of 5 s, so 12 s becomes 16 s.
    result = _run(12.0)
    layer_phases = {
        "model.layers.0.self_attn.q_proj": {"method": 0.6, "solver": 0.4, "cg": 9.0},
        "model.layers.0.mlp.down_proj": {"method": 3.0, "solver": 1.0, "factorize": 9.0},
    }
    iterations = {"model.layers.0.self_attn.q_proj": 10, "model.layers.0.mlp.down_proj": 20}
    ref = {"self_attn.q_proj": 30.0, "mlp.down_proj": 30.0}
    _alps_projection(result, layer_phases, iterations, ref)
    assert result.alps_iterations_mean == 15.0
    assert result.alps_seconds_per_iteration == pytest.approx(5.0 / 30)
    assert result.reference_iterations_mean == 30.0
    assert result.seconds_at_reference_iterations == pytest.approx(16.0)
    assert [layer["reference_iterations"] for layer in result.alps_layers] == [30.0, 30.0]


def test_alps_projection_without_reference_runs_leaves_it_unset() -> None:
    result = _run(12.0)
    _alps_projection(result, {"model.layers.0.mlp.up_proj": {"method": 1.0}}, {"model.layers.0.mlp.up_proj": 4}, {})
    assert result.alps_seconds_per_iteration == 0.25
    assert result.seconds_at_reference_iterations is None


def test_transposable_ratios_pair_the_kinds_of_each_method() -> None:
    t_run, o_run, lone = _run(13.0), _run(10.0), _run(5.0)
    o_run.kind, lone.method = "ordinary", "wanda"
    t_run.seconds_at_reference_iterations, o_run.seconds_at_reference_iterations = 26.0, 20.0
    assert transposable_ratios([t_run, o_run, lone]) == {"alps": (1.3, 1.3)}


def test_refine_ratios_pair_each_refined_run_with_its_plain_twin() -> None:
    plain, refined, other_kind, lone = _run(10.0), _run(19.0), _run(8.0), _run(30.0)
    refined.refine = lone.refine = "block"
    other_kind.kind, lone.method = "ordinary", "wanda"  # ordinary alps has no refined twin, wanda no plain one
    assert refine_ratios([plain, refined, other_kind, lone]) == {("alps", "transposable 16:32"): (10.0, 19.0)}
    other_refined = _run(17.0)
    other_refined.kind, other_refined.refine = "ordinary", "block"
    # Transposable / ordinary pairs the refined runs among themselves, apart from the plain ones.
    assert transposable_ratios([plain, refined, other_kind, other_refined]) == {
        "alps": (10.0 / 8.0, None),
        "alps + refine": (19.0 / 17.0, None),
    }


def test_whole_model_projection_hand_worked() -> None:
    # 2 of 16 blocks in 30 s: calibration 2 + capture 1 once; the write's 3 s × 1.5 params; the other 24 s × 8.
    phases = {"calibration": 2.0, "capture": 1.0, "write": 3.0, "method": 20.0}
    assert _whole_model(30.0, phases, params_ratio=1.5, blocks_ratio=8.0) == pytest.approx(3.0 + 4.5 + 24.0 * 8)


# LLaMA-3.1-70B built with 1 of its 80 blocks: the embeddings and output head (untied, 128256 × 8192
# each), the final norm (8192) and one block (855,654,400: attention 150,994,944, MLP 3 × 8192 × 28672,
# two norms of 8192).
PARAMS_70B, PARAMS_70B_ONE_BLOCK = 70_553_706_496, 2 * 128256 * 8192 + 8192 + 855_654_400


def test_the_70b_projection_hand_worked() -> None:
    """One 70B block in 100 s on 16 × 512 calibration tokens: calibration 1 + capture 2 once, the
    checkpoint write 10 s × 70553706496 / 2957008896 parameters, the other 100 − 3 − 10 = 87 s × 80 blocks.
    At the default 128 × 2048 tokens (32 times the run's), capture, statistics and rerun take 32 times
    as long: capture 64 once, and the per-block rest gains (32 − 1) × (statistics 4 + rerun 1) = 155 s."""
    shape = {"layers": 80, "blocks_built": 1, "params": PARAMS_70B, "params_built": PARAMS_70B_ONE_BLOCK}
    phases = {"calibration": 1.0, "capture": 2.0, "statistics": 4.0, "factorize": 30.0, "updates": 50.0}
    phases |= {"rerun": 1.0, "write": 10.0}
    result = _run(100.0)
    result.phases = phases
    tokens_ratio = default_tokens() / (16 * 512)
    assert tokens_ratio == 32
    _project_whole(result, shape, tokens_ratio)
    save = 10.0 * PARAMS_70B / 2_957_008_896
    assert result.projected_whole_seconds == pytest.approx(3.0 + save + 87.0 * 80)
    assert result.projected_whole_seconds_default_calibration == pytest.approx(1.0 + 64.0 + save + (87.0 + 155.0) * 80)
    whole = _run(100.0)
    _project_whole(whole, shape | {"blocks_built": 80}, tokens_ratio)
    assert whole.projected_whole_seconds is None and whole.projected_whole_seconds_default_calibration is None


def test_the_host_peak_is_what_runs_after_the_reset() -> None:
    """`reset_host_peak` forgets what ran before it (the random model's build): a 256 MiB buffer freed
    before the reset is not in the next peak, one made after it is."""
    import torch

    before = torch.ones(64 << 20)  # 256 MiB, touched
    del before
    start = reset_host_peak()
    if start is None:
        pytest.skip("this kernel cannot reset the peak resident set")
    assert host_peak() < start + (128 << 20)  # the freed buffer is not in the peak any more
    after = torch.ones(64 << 20)
    assert host_peak() >= start + (250 << 20)
    del after


def test_each_phase_keeps_the_host_peak_reached_inside_it() -> None:
    """A recording for a device credits the resident-set peak to the phases open when it was reached (a
    phase's includes its nested phases'), and keeps the peak over the recording although each boundary
    resets the high-water mark: a 256 MiB buffer made and freed inside `solver`, nested in `statistics`,
    is in both of their peaks and the recording's, not in the `save` that follows."""
    import torch

    if reset_host_peak() is None:
        pytest.skip("this kernel cannot reset the peak resident set")
    with record_phases(torch.device("cpu")) as recorder:
        start = host_peak()
        with phase("statistics"), phase("solver"):
            buffer = torch.ones(64 << 20)  # 256 MiB, touched
            del buffer
        with phase("save"):
            pass
    assert recorder.host_peak is not None and recorder.host_peak >= start + (250 << 20)
    assert recorder.host_peaks["solver"] == recorder.host_peaks["statistics"] == recorder.host_peak
    assert recorder.host_peaks["save"] < start + (128 << 20)
    assert host_peak_phases(recorder.host_peak, recorder.host_peaks) == "statistics, solver"
    assert host_peak_phases(recorder.host_peak + 1, recorder.host_peaks) == "outside the phases"  # between two
    assert host_peak_phases(None, {}) == "–"


def test_a_recording_without_a_device_reads_no_host_memory() -> None:
    """A plain run's recording (no device) makes no system call for the host's peak: none recorded."""
    with record_phases() as recorder, phase("statistics"):
        pass
    assert recorder.host_peak is None and recorder.host_peaks == {}


def test_the_host_table_sets_the_peak_against_the_dry_run_estimate() -> None:
    """The Markdown's host table: the resident set at the start, the peak, the estimate, the peak over
    it whole and less the start (what the estimate predicts: `RunResult`), and where it was not measured."""
    measured, unmeasured = _run(10.0), _run(10.0)
    measured.host_start_bytes, measured.host_peak_bytes, measured.host_estimate_bytes = 1 << 30, 5 << 30, 4 << 30
    measured.host_peak_over_estimate, measured.host_added_over_estimate = 1.25, 1.0
    unmeasured.kind, unmeasured.host_estimate_bytes = "ordinary", 4 << 30
    env = {"device": "cpu", "torch": "t", "transformers": "x", "date": "d", "cpu_rss_high_water_bytes": 1 << 30}
    shape = {"model": "m", "layers": 1, "blocks_built": 1, "scale_down": 1, "dtype": "bfloat16", "tokenizer": "tok"}
    shape |= {"source": "streamed", "checkpoint": {"bytes": 3 << 30, "seconds": 2.0}}
    config = {"nsamples": 16, "seqlen": 512, "seed": 0, "refine": ["none"]}
    for run in (measured, unmeasured):
        run.phases = dict.fromkeys(PHASES, 0.0)
    measured.host_phase_peak_bytes = {"load": 2 << 30, "write": 5 << 30}
    text = to_markdown(E2EResult(config, env, shape, [measured, unmeasured]))
    assert "| alps | transposable 16:32 | 1 | 5 | 4 | 1.25 | 1.00 | write |" in text
    assert "| alps | ordinary 16:32 | n/a | n/a | 4 | n/a | n/a | – |" in text
    assert "safetensors checkpoint of 3 GiB in 2.0 s" in text


@pytest.mark.realmodel
def test_the_random_checkpoint_is_the_models_own_tensors(tmp_path: Path) -> None:
    """`write_random_checkpoint` writes every tensor transformers' own save would (and loads back with no
    missing key), seeded: matrices normal with the config's initializer_range, norms ones."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tsenor_cli.models.embedded import materialize
    from tsenor_cli.settings import cache_dir_default

    config, _ = shape_config("llama-3.1-70b", 1, scale_down=64)
    tokenizer = AutoTokenizer.from_pretrained(materialize("smollm2-135m", cache_dir_default()))
    cpu = torch.device("cpu")
    written = write_random_checkpoint(tmp_path / "a", config, tokenizer, cpu, torch.bfloat16, 0)
    write_random_checkpoint(tmp_path / "b", config, tokenizer, cpu, torch.bfloat16, 0)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert written["bytes"] == sum(t.numel() * 2 for t in a.values()) and all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert set(a) == set(model.state_dict())  # 128256 × 128 embeddings and head, one block, the final norm
    assert float(a["model.layers.0.mlp.down_proj.weight"].float().std()) == pytest.approx(0.02, rel=0.05)
    assert bool((a["model.norm.weight"] == 1).all()) and (tmp_path / "a" / "tokenizer.json").is_file()


def test_merge_section_replaces_its_own_and_keeps_the_others() -> None:
    head = "# title\n\n"
    one = merge_section(head, "a/cpu", "table A1\n")
    two = merge_section(one, "b/cuda", "table B\n")
    three = merge_section(two, "a/cpu", "table A2\n")
    assert three.startswith(head)
    assert "table A2\n" in three and "table A1" not in three and "table B\n" in three
    assert three.index("table A2") < three.index("table B")  # replaced in place


@pytest.mark.parametrize(
    ("name", "params", "layers", "tied"),
    # The published parameter counts of the three checkpoints.
    [
        ("llama-3.2-1b", 1_235_814_400, 16, True),
        ("llama-3.2-3b", 3_212_749_824, 28, True),
        ("llama-3.1-8b", 8_030_261_248, 32, False),
        ("llama-3.1-70b", 70_553_706_496, 80, False),
    ],
)
def test_shipped_shapes_have_the_published_sizes(name: str, params: int, layers: int, tied: bool) -> None:
    from tsenor_cli.models.loading import meta_model

    config, published_layers = shape_config(name, None)
    assert published_layers == layers and config.num_key_value_heads == 8 and config.vocab_size == 128256
    assert config.tie_word_embeddings is tied
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500000.0
    assert sum(p.numel() for p in meta_model(config).parameters()) == params


@pytest.mark.realmodel
def test_the_smollm2_shape_is_the_embedded_models(smollm2_path: Path) -> None:
    """configs/models/smollm2-135m.json, the shape the refinement benchmark runs at, is the embedded
    checkpoint's own config: the same 134,515,008 parameters (tied embeddings counted once), 30 blocks."""
    from transformers import AutoConfig

    from tsenor_cli.models.loading import meta_model

    config, layers = shape_config("smollm2-135m", None)
    embedded = AutoConfig.from_pretrained(smollm2_path)

    def shape(c: Any) -> dict[str, Any]:
        return {k: v for k, v in c.to_dict().items() if not k.startswith("_")}  # names and paths aside

    assert layers == 30 and shape(config) == shape(embedded)
    assert sum(p.numel() for p in meta_model(config).parameters()) == 134_515_008


def test_scale_shape_divides_widths_and_keeps_head_dim() -> None:
    raw = json.loads(Path("configs/models/llama-3.2-1b.json").read_text())
    small = scale_shape(raw, 16)
    assert (small["hidden_size"], small["intermediate_size"]) == (128, 512)
    assert (small["num_attention_heads"], small["num_key_value_heads"], small["head_dim"]) == (2, 1, 64)
    assert small["vocab_size"] == raw["vocab_size"] and small["num_hidden_layers"] == 16
    with pytest.raises(UsageError, match="does not divide"):
        scale_shape(raw, 3)


def test_bad_model_and_blocks_are_usage_errors() -> None:
    with pytest.raises(InputNotFoundError, match=r"llama-3\.2-1b"):
        shape_config("llama-9", None)
    with pytest.raises(UsageError, match="between 1 and 16"):
        shape_config("llama-3.2-1b", 17)


@pytest.mark.realdata
@pytest.mark.realmodel
def test_bench_prune_cpu_smoke(tmp_path: Path, smollm2_path: Path) -> None:
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    args = ["bench", "prune", "--model", "llama-3.2-1b", "--blocks", "1", "--scale-down", "32"]
    args += ["--nsamples", "2", "--seqlen", "32", "--methods", "alps", "--output", str(out), "--markdown", str(md)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["shape"]["blocks_built"] == 1 and data["shape"]["layers"] == 16 and data["shape"]["hidden"] == 64
    assert "SmolLM2" in data["shape"]["tokenizer"]
    runs = {run["kind"]: run for run in data["runs"]}
    assert set(runs) == {"transposable", "ordinary"}
    for run in runs.values():
        assert run["verified"], run
        plain = [name for name in PHASES if name not in REFINE_PHASES]
        assert run["seconds"] > 0 and set(run["phases"]) == set(plain)
        # Every phase the pipeline has ran (plan … write); ALPS's whole update loop is in there.
        assert all(run["phases"][name] > 0 for name in plain), run["phases"]
        assert sum(run["phases"].values()) + run["other_seconds"] == pytest.approx(run["seconds"])
        assert run["estimate_bytes"] > 0 and run["peak_bytes"] is None  # no CUDA here
        layers = run["alps_layers"]
        assert len(layers) == 7 and all(layer["iterations"] >= 1 for layer in layers)
        assert all(layer["reference_iterations"] > 1 for layer in layers)  # read from docs/results/runs
        assert run["seconds_at_reference_iterations"] > 0
        assert run["projected_whole_seconds"] > run["seconds"]  # 16 blocks from 1, labelled a projection
    assert runs["transposable"]["solver"] == "flow" and runs["ordinary"]["solver"] is None
    text = md.read_text()
    assert "<!-- tsenor bench prune: llama-3.2-1b/1-of-16/scale-32/cpu/alps -->" in text and "**Projection**" in text
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = next(line for line in rows if line.startswith("| method | pattern | solver |"))
    table = rows[rows.index(header) : rows.index(header) + 2 + len(runs)]
    assert len({line.count("|") for line in table}) == 1, table  # header, rule and rows line up


@pytest.mark.realdata
@pytest.mark.realmodel
def test_bench_prune_with_and_without_refinement(tmp_path: Path, smollm2_path: Path) -> None:
    """`--refine none,block`: each method × kind runs plain and refined; the refined run's refinement and
    dense-stream forward are phases of their own (zero in the plain run), and the tables give the
    refined / plain wall time of the pair."""
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    args = ["bench", "prune", "--model", "llama-3.2-1b", "--blocks", "1", "--scale-down", "32", "--nsamples", "4"]
    args += ["--seqlen", "32", "--methods", "sparsegpt", "--kinds", "ordinary", "--refine", "none,block"]
    result = CliRunner().invoke(app, [*args, "--output", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    runs = {run["refine"]: run for run in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"none", "block"} and all(run["verified"] for run in runs.values())
    for mode, run in runs.items():
        assert set(run["phases"]) == set(PHASES)
        assert sum(run["phases"].values()) + run["other_seconds"] == pytest.approx(run["seconds"])
        assert all((run["phases"][name] > 0) == (mode == "block") for name in REFINE_PHASES), run["phases"]
    text = md.read_text()
    assert "<!-- tsenor bench prune: llama-3.2-1b/1-of-16/scale-32/cpu/sparsegpt/refine-none,block -->" in text
    ratio = runs["block"]["seconds"] / runs["none"]["seconds"]
    plain_s, refined_s = f"{runs['none']['seconds']:.1f}", f"{runs['block']['seconds']:.1f}"
    assert f"| sparsegpt | ordinary 16:32 | {plain_s} | {refined_s} | {ratio:.2f} |" in text
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = next(line for line in rows if line.startswith("| method | pattern | solver |"))
    table = rows[rows.index(header) : rows.index(header) + 4]
    assert "| dense stream | refine |" in header and table[3].startswith("| sparsegpt + refine | ordinary 16:32 |")
    assert len({line.count("|") for line in table}) == 1, table


def test_bench_prune_refuses_an_unknown_refine_mode() -> None:
    result = invoke(["bench", "prune", "--refine", "none,layer", "--blocks", "1"])
    assert result.exit_code == 2
    assert str(result.exception) == "--refine: unknown layer; choose from none, block"
