"""A checkpoint is what its config.json says (issue 47, item 1; `tsenor_cli/models/conformance.py`).

The fourth audit's cases on a tiny 4-block LLaMA whose config.json was edited after saving: 5 blocks said
and 4 stored (prune wrote block 4 as fresh random weights, exit 0), 3 said and 4 stored (block 3 dropped
without a line), an `intermediate_size` of 256 over weights of 128 (exit 1 "unexpected", and a streamed
eval printed a perplexity), and one tensor stored under another name. Each is refused in one line naming
the first tensors and the count, exit 7, before any output, by `prune`, its dry run and `eval`, streamed
and whole alike; what transformers renames on load, tied weights and pickle or sharded weights are not.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers_cli import invoke
from helpers_tiny import LOCAL_CTX, make_tiny_llama, make_tiny_model

from tsenor_cli.errors import CheckpointMismatchError
from tsenor_cli.models.conformance import check_checkpoint, conformance, stored_shapes
from tsenor_cli.models.loading import meta_model, read_config

EXIT = CheckpointMismatchError.exit_code

# case → (config.json changes or a renamed tensor, the parts of the line)
CASES: dict[str, tuple[dict[str, object] | None, tuple[str, ...]]] = {
    "more blocks": (
        {"num_hidden_layers": 5},
        (
            "config.json describes 5 decoder block(s), the weights hold 4",
            "9 tensor(s) of the model missing from the weights (model.layers.4.self_attn.q_proj.weight,",
        ),
    ),
    "fewer blocks": (
        {"num_hidden_layers": 3},
        (
            "config.json describes 3 decoder block(s), the weights hold 4",
            "9 stored tensor(s) the model has no place for (model.layers.3.",
        ),
    ),
    "another width": (
        {"intermediate_size": 256},
        ("12 tensor(s) of another shape (model.layers.0.mlp.down_proj.weight: config 64×256, stored 64×128;",),
    ),
    "a renamed tensor": (
        None,
        (
            "1 tensor(s) of the model missing from the weights (model.layers.1.mlp.up_proj.weight)",
            "1 stored tensor(s) the model has no place for (model.layers.1.mlp.up_projX.weight)",
        ),
    ),
}


def _case(good: Path, folder: Path, case: str) -> Path:
    """A copy of `good` (4 blocks) with its config.json edited, or one tensor renamed in its weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, folder)
    changes = CASES[case][0]
    if changes is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
    else:
        tensors = load_file(folder / "model.safetensors")
        tensors["model.layers.1.mlp.up_projX.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("conformance") / "good", num_layers=4)


def _refused(result: object, case: str, name: str) -> str:
    exit_code, exception = getattr(result, "exit_code"), getattr(result, "exception")  # noqa: B009
    assert exit_code == EXIT, getattr(result, "output")  # noqa: B009
    message = str(exception)
    assert "\n" not in message
    assert message.startswith(f"the weights of {name} do not match its config.json: ")
    assert message.endswith("(re-download or re-copy it), or fix config.json (nothing was written)")
    for part in CASES[case][1]:
        assert part in message, (part, message)
    return message


@pytest.mark.parametrize("case", list(CASES))
def test_the_audit_cases_are_refused_by_prune_its_dry_run_and_eval_streamed_or_whole(
    good: Path, tmp_path: Path, calibration_text: Path, case: str
) -> None:
    """The same line from every command and both ways of reading the weights, before any output: the
    prune's --output is not created, eval writes no eval.json."""
    folder = _case(good, tmp_path / "model", case)
    out, evaluated = tmp_path / "out", tmp_path / "evaluated"
    common = ["--nm", "2:4", "--calib-data", str(calibration_text), "--nsamples", "2", "--seqlen", "16"]
    lines = {
        "prune": _refused(invoke(["prune", str(folder), *common, "--output", str(out)]), case, str(folder)),
        "prune --no-stream": _refused(
            invoke(["prune", str(folder), *common, "--output", str(out), "--no-stream"]), case, str(folder)
        ),
        "prune --dry-run": _refused(invoke(["prune", str(folder), *common, "--dry-run"]), case, str(folder)),
        "eval": _refused(
            invoke(["eval", str(folder), "--ppl", "wikitext2", "--max-windows", "1", "--output", str(evaluated)]),
            case,
            str(folder),
        ),
        "eval --no-stream": _refused(
            invoke(["eval", str(folder), "--ppl", "wikitext2", "--max-windows", "1", "--no-stream"]),
            case,
            str(folder),
        ),
    }
    assert len(set(lines.values())) == 1, lines  # one verdict, whichever path reads the weights
    assert not out.exists() and not evaluated.exists()


def test_verify_and_finetune_give_the_same_verdict(good: Path, tmp_path: Path, calibration_text: Path) -> None:
    """A pruned checkpoint whose config.json was edited since (a block more): verify passed it (exit 0)
    and finetune trained block 4 from random weights; both refuse it with the load's line."""
    pruned = tmp_path / "pruned"
    args = ["--nm", "2:4", "--method", "magnitude", "--output", str(pruned)]
    assert invoke(["prune", str(good), *args]).exit_code == 0
    config = json.loads((pruned / "config.json").read_text())
    (pruned / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    verified = invoke(["verify", str(pruned)])
    assert verified.exit_code == EXIT and "config.json describes 5 decoder block(s), the weights hold 4" in str(
        verified.exception
    )
    out = tmp_path / "finetuned"
    common = ["--data", str(calibration_text), "--seqlen", "16", "--max-steps", "1", "--ppl", "none"]
    tuned = invoke(["finetune", str(pruned), *common, "--output", str(out)])
    assert tuned.exit_code == EXIT, tuned.output
    assert str(tuned.exception) == str(verified.exception).replace(str(pruned), str(pruned), 1)
    assert not out.exists()


def test_the_python_api_refuses_the_folder_before_any_output(good: Path, tmp_path: Path) -> None:
    from tsenor_cli.pattern import SparsityPattern
    from tsenor_cli.pruning.methods.types import MatrixPruneConfig
    from tsenor_cli.pruning.run.api import prune
    from tsenor_cli.pruning.settings.config import PruneConfig

    folder = _case(good, tmp_path / "model", "fewer blocks")
    cfg = PruneConfig(
        model=str(folder), matrix=MatrixPruneConfig(SparsityPattern.from_nm(2, 4, transposable=True)),
        method="magnitude",
        output=tmp_path / "out",
    )  # fmt: skip
    with pytest.raises(CheckpointMismatchError, match=r"config\.json describes 3 decoder block"):
        prune(str(folder), cfg, ctx=LOCAL_CTX)
    assert not (tmp_path / "out").exists()


def _meta(folder: Path) -> object:
    return meta_model(read_config(str(folder), str(folder), True, LOCAL_CTX, trust_remote_code=False))


def test_what_transformers_accepts_is_accepted(tiny_llama: Callable[..., Path], tmp_path: Path) -> None:
    """Tied weights stored once (tied output head), an untied head stored, old per-layer rotary buffers
    (transformers ignores them), pickle weights (mapped, no tensor read) and a sharded checkpoint."""
    tied = tiny_llama(num_layers=2)
    assert "lm_head.weight" not in stored_shapes(tied)  # type: ignore[operator]
    check_checkpoint(tied, _meta(tied))
    untied = make_tiny_llama(tmp_path / "untied", num_layers=2, tie_word_embeddings=False)
    check_checkpoint(untied, _meta(untied))

    from safetensors.torch import load_file, save_file

    rotary = tmp_path / "rotary"
    shutil.copytree(tied, rotary)
    tensors = load_file(rotary / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, rotary / "model.safetensors", metadata={"format": "pt"})
    check_checkpoint(rotary, _meta(rotary))

    pickle = tmp_path / "pickle"
    shutil.copytree(tied, pickle)
    torch.save(load_file(pickle / "model.safetensors"), pickle / "pytorch_model.bin")
    (pickle / "model.safetensors").unlink()
    assert stored_shapes(pickle) == stored_shapes(tied)
    check_checkpoint(pickle, _meta(pickle))
    config = json.loads((pickle / "config.json").read_text())
    (pickle / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointMismatchError, match=r"describes 3 decoder block"):
        check_checkpoint(pickle, _meta(pickle))

    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tied).save_pretrained(sharded, max_shard_size="200KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    check_checkpoint(sharded, _meta(sharded))


def test_a_missing_tied_head_is_missing_when_the_config_unties_it(
    tiny_llama: Callable[..., Path], tmp_path: Path
) -> None:
    """A config saying the output head is its own weight, over weights that hold only the embedding:
    transformers would initialise the head at random."""
    folder = tmp_path / "untied"
    shutil.copytree(tiny_llama(num_layers=2), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    found = conformance(_meta(folder), stored_shapes(folder) or {})
    assert found.missing == ("lm_head.weight",) and not found.extra and not found.mismatched


def test_a_multimodal_checkpoint_in_its_legacy_layout_matches_and_a_missing_vision_layer_does_not(
    tmp_path: Path,
) -> None:
    """LLaVA's save_pretrained writes the legacy ``language_model.model.…`` names, which transformers
    renames on load: they match. A vision layer the config names and the weights lack is missing."""
    folder = make_tiny_model(tmp_path / "llava", "llava")
    check_checkpoint(folder, _meta(folder))
    found = conformance(_meta(folder), stored_shapes(folder) or {})
    assert found.ok and found.config_blocks == found.stored_blocks
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] += 1
    (folder / "config.json").write_text(json.dumps(config))
    found = conformance(_meta(folder), stored_shapes(folder) or {})
    assert found.missing and all(".vision_tower." in name for name in found.missing)
