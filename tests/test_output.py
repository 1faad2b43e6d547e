"""What `tsenor prune --output` holds, as a user of transformers and the Hub expects it (issue 41, Output):
the source's dtype, a model card, a small config.json with the sparsity record beside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from helpers_cli import invoke
from huggingface_hub import ModelCard
from safetensors import safe_open

from tsenor_cli.runfiles import CONFIG_FILE, MODEL_CARD, SPARSITY_FILE, SPARSITY_KEY, read_sparsity


def test_a_bf16_checkpoint_pruned_on_the_cpu_is_written_in_bf16_with_its_card(
    tiny: Path, calibration_text: Path, tmp_path: Path
) -> None:
    """Default flags compute in fp32 on the CPU; the output keeps the checkpoint's bf16 (twice smaller),
    unless --dtype names one."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tiny / name, source / name)
    flags = ["--nm", "2:4", "--method", "magnitude", "--calib-data", str(calibration_text)]
    flags += ["--nsamples", "2", "--seqlen", "16"]
    out = tmp_path / "out"
    result = invoke(["prune", "--model", str(source), *flags, "--output", str(out)])
    assert result.exit_code == 0, result.output
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        dtypes = {handle.get_slice(key).get_dtype() for key in handle.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["dtype"] == "bfloat16" and "_model_name_or_path" not in config
    summary = config[SPARSITY_KEY]
    assert summary["record"] == SPARSITY_FILE and summary["weights_pruned"] == 14 and "pruned_weights" not in summary
    record = read_sparsity(out)
    assert record is not None and len(record.pruned) == 14
    card = ModelCard.load(out / MODEL_CARD)
    assert "tsenor" in card.data.tags and "2:4-sparsity" in card.data.tags and "magnitude" in card.text
    asked = tmp_path / "fp32"
    result = invoke(["prune", "--model", str(source), *flags, "--dtype", "fp32", "--output", str(asked)])
    assert result.exit_code == 0, result.output
    assert json.loads((asked / CONFIG_FILE).read_text())["dtype"] == "float32"
    assert (asked / "model.safetensors").stat().st_size > 1.9 * (out / "model.safetensors").stat().st_size
