"""The model card (README.md) of a pruned checkpoint: the Hub's metadata (base model, tags, model-index)
and the text a person reads, made from the run's records (pruning/run/card.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from huggingface_hub import ModelCard

from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.pruning.run.card import base_model, card_text, refresh_card
from tsenor_cli.runfiles import (
    EVAL_FILE,
    MODEL_CARD,
    PRUNE_FILE,
    EvalReport,
    LayerRecord,
    PerplexityRecord,
    PruneReport,
    TaskScore,
    ZeroShotResult,
)


def _report(model: str, pattern: SparsityPattern | None) -> PruneReport:
    layers = (
        LayerRecord(0, "model.layers.0.mlp.up_proj", 64, 32, "pruned", recon_error=0.01),
        LayerRecord(0, "model.layers.0.mlp.gate", 1, 32, "ignored", reason="a gate"),
    )
    settings = {"model": model, "nsamples": 128, "seqlen": 2048, "seed": 0, "solver": "tsenor"}
    return PruneReport(
        method="alps",
        pattern=pattern,
        sparsity=pattern.sparsity if pattern is not None else 0.6,
        settings=settings,
        layers=layers,
        calibration="offline C4-en sample",
        seconds=1.0,
        output=None,
        command=None,
        versions={},
        linear_params=2048,
        linear_nonzero=1024,
    )


def _evaluation() -> EvalReport:
    tokens = 1000
    ppl = PerplexityRecord(21.5, math.log(21.5) * tokens, tokens, 8, 2048, "WikiText-2 test", None, 1.0)
    piqa = TaskScore("piqa", 0.655, 0.03, None, None, 200, None, "1.0")
    zeroshot = ZeroShotResult((piqa,), 0.655, "acc", 0, 200, "offline", "0.4.13")
    return EvalReport("m", "/m", "llama", "float32", "cpu", 2048, 8, {"wikitext2": ppl}, zeroshot, {}, 1.0)


def test_the_card_names_the_base_model_pattern_method_and_calibration() -> None:
    text = card_text(_report("smollm2-135m", SparsityPattern.parse("16:32")))
    card = ModelCard(text)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model's source
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"tsenor", "16:32-sparsity", "transposable-sparsity"} <= set(card.data.tags)
    assert "every 32×32 tile keeps at most 16 weights per row and per column" in card.text
    assert "128 samples of 2048 tokens, seed 0: offline C4-en sample" in card.text
    assert "1 matrix pruned, 1 left dense; density of the decoder's linear weights 0.5000" in card.text
    assert "## Evaluation" not in card.text and card.data.eval_results is None


def test_base_model_is_a_hub_id_only() -> None:
    assert base_model("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert base_model("/data/ckpts/llama") is None and base_model("./llama") is None
    assert "unstructured-sparsity" in ModelCard(card_text(_report("/ckpt", None))).data.tags


def test_an_evaluated_checkpoint_gets_the_table_and_the_model_index(tmp_path: Path) -> None:
    """refresh_card rebuilds README.md from the folder's records once eval.json is there."""
    report = _report("meta-llama/Llama-3.1-8B", SparsityPattern.parse("2:4", transposable=False))
    (tmp_path / PRUNE_FILE).write_text(json.dumps(report.to_json()))
    refresh_card(tmp_path)
    assert "## Evaluation" not in (tmp_path / MODEL_CARD).read_text()
    (tmp_path / EVAL_FILE).write_text(json.dumps(_evaluation().to_json()))
    refresh_card(tmp_path)
    card = ModelCard.load(tmp_path / MODEL_CARD)
    assert "| wikitext2 | perplexity | 21.50 | 8 windows of 2048 tokens |" in card.text
    assert "| piqa | accuracy | 65.50% | 200 examples (--limit 200) |" in card.text
    results = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert results == {("wikitext2", "perplexity"): 21.5, ("piqa", "accuracy"): 0.655}
    one = replace(_evaluation(), perplexity={"wikitext2": replace(_evaluation().perplexity["wikitext2"], windows=1)})
    (tmp_path / EVAL_FILE).write_text(json.dumps(one.to_json()))
    refresh_card(tmp_path)  # one window is said so (it said "1 windows")
    assert "| wikitext2 | perplexity | 21.50 | 1 window of 2048 tokens |" in (tmp_path / MODEL_CARD).read_text()
    dense = tmp_path / "dense"
    dense.mkdir()
    refresh_card(dense)  # no tsenor_report.json: not ours to describe
    assert not (dense / MODEL_CARD).exists()


def test_a_packed_card_names_the_distribution_pip_installs() -> None:
    """The packed card says what to install before loading: pyproject's project name (`tsenor`, which it
    once said, is not this package)."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["name"]
    text = ModelCard(card_text(_report("smollm2-135m", SparsityPattern.parse("2:4")), packed=True)).text
    assert f"Load it with `pip install {project}`, then `import tsenor_cli`" in text
    assert "pip install" not in ModelCard(card_text(_report("smollm2-135m", SparsityPattern.parse("2:4")))).text
