"""The streamed checkpoint writer (models/saving.py) writes, byte for byte, the files save_pretrained writes."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_tiny import ARCHITECTURES, LOCAL_CTX, MULTIMODAL, random_causal_lm, random_model

from tsenor_cli.errors import UsageError
from tsenor_cli.models.checkpoint import INDEX_NAME, WEIGHTS_NAME, Checkpoint
from tsenor_cli.models.loading import meta_model
from tsenor_cli.models.saving import parse_size, plan_shards, save_streamed, saved_tensors, write_weights
from tsenor_cli.pattern import SparsityPattern
from tsenor_cli.tensorfile import TensorSpec, file_header, write_file

# Two MoE layouts (tests/test_moe.py has them all): fused (E, out, in) stacks, and gpt-oss's (E, in, out) with biases.
MOE = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16},
}


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _assert_same_folders(streamed: Path, reference: Path) -> None:
    got, expected = _files(streamed), _files(reference)
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name] == expected[name], f"{name} differs"


def _both(model: Any, tmp_path: Path, **options: Any) -> tuple[Path, Path]:
    """(save_streamed's folder, save_pretrained's folder) of `model` with the same options."""
    reference, streamed = tmp_path / "reference", tmp_path / "streamed"
    model.save_pretrained(reference, save_original_format=False, **options)
    save_streamed(streamed, model, **options)
    return streamed, reference


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shard", [None, "60KB", "20KB"])
def test_streamed_save_is_save_pretrained_byte_for_byte(tmp_path: Path, tied: bool, shard: str | None) -> None:
    model = random_causal_lm(num_layers=3, tie_word_embeddings=tied)
    options = {} if shard is None else {"max_shard_size": shard}
    streamed, reference = _both(model, tmp_path, **options)
    _assert_same_folders(streamed, reference)
    if shard is not None:
        index = json.loads((streamed / INDEX_NAME).read_text())
        # the (256, 64) fp32 embedding (65.5 KB) is larger than either limit: a shard of its own
        assert len(set(index["weight_map"].values())) > 3
    assert ("lm_head.weight" in Checkpoint.open(streamed).tensors) is not tied


def test_bf16_and_mixed_dtypes_match_safetensors_layout(tmp_path: Path) -> None:
    model = random_causal_lm(num_layers=2).to(torch.bfloat16)
    model.model.norm.float()  # two dtypes in one file: safetensors orders the data by dtype, then name
    streamed, reference = _both(model, tmp_path, max_shard_size="30KB")
    _assert_same_folders(streamed, reference)


@pytest.mark.parametrize("family", sorted(ARCHITECTURES) + sorted(MOE))
def test_every_family_is_written_as_save_pretrained_writes_it(tmp_path: Path, family: str) -> None:
    model = random_causal_lm(family, **{**ARCHITECTURES.get(family, {}), **MOE.get(family, {})})
    streamed, reference = _both(model, tmp_path, max_shard_size="100KB")
    _assert_same_folders(streamed, reference)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MULTIMODAL))
def test_multimodal_models_are_written_as_save_pretrained_writes_them(tmp_path: Path, family: str) -> None:
    streamed, reference = _both(random_model(family), tmp_path, max_shard_size="5MB")
    _assert_same_folders(streamed, reference)


def test_skeleton_and_tensors_read_one_at_a_time_give_the_same_checkpoint(tmp_path: Path) -> None:
    """The streamed case: no model in memory, a meta skeleton from the config, the tensors read from
    another checkpoint in reverse order."""
    model = random_causal_lm(num_layers=3)
    source = tmp_path / "source"
    model.save_pretrained(source, max_shard_size="40KB")
    reference = tmp_path / "reference"
    model.save_pretrained(reference, max_shard_size="60KB", save_original_format=False)
    skeleton = meta_model(model.config)
    checkpoint = Checkpoint.open(source)
    keys = [spec.key for spec in reversed(saved_tensors(skeleton))]
    save_streamed(tmp_path / "streamed", skeleton, checkpoint.iter_read(keys), max_shard_size="60KB")
    _assert_same_folders(tmp_path / "streamed", reference)


def test_shard_plan_puts_an_oversized_tensor_before_the_shard_being_filled() -> None:
    specs = [TensorSpec(name, (n,), torch.float32) for name, n in (("a", 10), ("b", 10), ("big", 100), ("c", 10))]
    # 100 bytes per shard: a+b (80 B) are filling when big (400 B) comes; c would pass 100 B.
    assert [[s.key for s in shard] for shard in plan_shards(specs, 100)] == [["big"], ["a", "b"], ["c"]]


def test_header_matches_safetensors_for_awkward_names(tmp_path: Path) -> None:
    from safetensors.torch import save

    tensors = {
        "ü.w": torch.ones(3),
        'q"uote': torch.ones(2, dtype=torch.bfloat16),
        "z": torch.ones(1, dtype=torch.int64),
    }
    blob = save(tensors, metadata={"format": "pt"})
    specs = [TensorSpec(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    header, offsets = file_header(specs, {"format": "pt"})
    assert blob[: len(header)] == header
    assert offsets["z"] == len(header)  # int64 first, as safetensors orders it


# One metadata key: safetensors writes several in a hash map's order, which varies from call to call.
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"note": "ü"}])
def test_a_file_written_tensor_by_tensor_is_the_file_safetensors_writes(
    metadata: dict[str, str] | None, tmp_path: Path
) -> None:
    from safetensors.torch import save

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "hidden": torch.randn(3, 5, 4, generator=gen),
        "dense": torch.randn(4, 6, generator=gen).t(),  # not contiguous: written through one copy of its own
        "a.bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(5),
        "mask": torch.rand(2, 3, generator=gen) > 0.5,
        "empty": torch.zeros(0, 4),
    }
    write_file(tmp_path / "f.safetensors", tensors, metadata)
    reference = save({key: t.contiguous() for key, t in tensors.items()}, metadata=metadata)
    assert (tmp_path / "f.safetensors").read_bytes() == reference


def test_bad_streams_are_refused(tmp_path: Path) -> None:
    specs = [TensorSpec("a", (2,), torch.float32), TensorSpec("b", (3,), torch.float32)]
    cases = [
        ([("a", torch.ones(2))], "1 tensors were never given, e.g. b"),
        ([("a", torch.ones(2)), ("a", torch.ones(2))], "a was given twice"),
        ([("a", torch.ones(3))], r"a is \(3,\) torch.float32, the checkpoint expects \(2,\)"),
        ([("c", torch.ones(2))], "c is not one the checkpoint holds"),
    ]
    for number, (stream, message) in enumerate(cases):
        folder = tmp_path / str(number)
        folder.mkdir()
        with pytest.raises(ValueError, match=message):
            write_weights(folder, specs, stream, total_parameters=5)
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5 MB") == 1_500_000 and parse_size(7) == 7
    for bad in ("2GiB", "GB", "-1GB"):
        with pytest.raises(UsageError, match="shard size"):
            parse_size(bad)


@pytest.mark.slow
@pytest.mark.realmodel
@pytest.mark.parametrize("shard", ["2GB", "150MB"])
def test_real_smollm2_is_written_as_save_pretrained_writes_it(tmp_path: Path, shard: str) -> None:
    from tsenor_cli.models.loading import load_model

    model = load_model("smollm2-135m", LOCAL_CTX).model
    streamed, reference = _both(model, tmp_path, max_shard_size=shard)
    _assert_same_folders(streamed, reference)
    assert (WEIGHTS_NAME in _files(streamed)) is (shard == "2GB")


def _write_model_folder(loaded: Any, out: Path, sparsity: Any, files: dict[str, str], tensors: Any = None) -> None:
    """The run folder's checkpoint writer (`runfiles.write.write_model_folder`) with the model's files
    (`models.saving.save_model`), in the shards every prune and finetune output has."""
    from tsenor_cli.models.saving import SavedModel, save_model
    from tsenor_cli.pruning.run.output import MAX_SHARD_SIZE
    from tsenor_cli.runfiles.write import write_model_folder

    saved = SavedModel(loaded.model, loaded.tokenizer, MAX_SHARD_SIZE, tensors=tensors)
    write_model_folder(out, sparsity, files, partial(save_model, saved=saved, sparsity=sparsity))


def test_prune_output_folder_is_what_save_pretrained_wrote(tmp_path: Path, tiny: Path) -> None:
    """runfiles/write.write_model_folder (every prune and finetune output) against the save_pretrained
    path it replaced: the same files, byte for byte, and the checkpoint loads."""
    from transformers import AutoModelForCausalLM

    from tsenor_cli.models.loading import load_model
    from tsenor_cli.pruning.run.output import MAX_SHARD_SIZE
    from tsenor_cli.runfiles import SPARSITY_FILE, SPARSITY_KEY, SparsityRecord

    loaded = load_model(str(tiny), LOCAL_CTX)
    sparsity = SparsityRecord.of("magnitude", SparsityPattern.parse("2:4"), [], solver=None, solver_requested=None)
    _write_model_folder(loaded, tmp_path / "out", sparsity, {"extra.txt": "x"})
    reference = tmp_path / "reference"
    setattr(loaded.model.config, SPARSITY_KEY, sparsity.summary())
    loaded.model.save_pretrained(reference, max_shard_size=MAX_SHARD_SIZE, save_original_format=False)
    loaded.tokenizer.save_pretrained(reference)
    # transformers 5 saves how the tokenizer was loaded; the output leaves that out (nothing else differs)
    settings = json.loads((reference / "tokenizer_config.json").read_text())
    assert settings.pop("local_files_only") is True and settings.pop("is_local") is True
    (reference / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    (reference / "extra.txt").write_text("x")
    (reference / SPARSITY_FILE).write_text(json.dumps(sparsity.to_json(), indent=1) + "\n")
    _assert_same_folders(tmp_path / "out", reference)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected = loaded.model.state_dict()
    assert all(torch.equal(tensor, expected[key]) for key, tensor in again.state_dict().items())


def test_the_checkpoints_generation_config_is_kept_by_a_streamed_and_a_whole_load(tmp_path: Path, tiny: Path) -> None:
    """Audit item 2: the EOS list and sampling settings of generation_config.json reach the output whether
    the model was loaded whole or streamed (whose skeleton is built from config.json alone)."""
    import shutil

    from tsenor_cli.models.loading import load_model
    from tsenor_cli.runfiles import GENERATION_CONFIG_FILE, SparsityRecord

    source = tmp_path / "source"
    shutil.copytree(tiny, source)
    settings = {"eos_token_id": [2, 7], "bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (source / GENERATION_CONFIG_FILE).write_text(json.dumps(settings))
    sparsity = SparsityRecord.of("magnitude", SparsityPattern.parse("2:4"), [], solver=None, solver_requested=None)
    for stream in (False, True):
        loaded = load_model(str(source), LOCAL_CTX, stream=stream)
        out = tmp_path / f"out-{stream}"
        tensors = loaded.checkpoint.iter_read(loaded.checkpoint.keys()) if loaded.checkpoint is not None else None
        _write_model_folder(loaded, out, sparsity, {}, tensors=tensors)
        written = json.loads((out / GENERATION_CONFIG_FILE).read_text())
        assert {key: written.get(key) for key in settings} == settings, f"stream={stream}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_writing_in_another_dtype_is_save_pretrained_of_the_cast_model(tmp_path: Path, dtype: torch.dtype) -> None:
    """save_streamed(dtype=…) of an fp32 model writes what model.to(dtype).save_pretrained writes, the
    floating tensors cast as they pass (a bf16 checkpoint pruned in fp32 on the CPU is saved in bf16)."""
    model = random_causal_lm(seed=3)
    streamed = tmp_path / "streamed"
    save_streamed(streamed, model, dtype=dtype)
    reference = tmp_path / "reference"
    model.to(dtype).save_pretrained(reference, save_original_format=False)
    _assert_same_folders(streamed, reference)
    assert json.loads((streamed / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")


def test_output_dtype_is_the_checkpoints_unless_asked(tmp_path: Path, tiny: Path) -> None:
    """--dtype auto means the checkpoint's dtype (transformers' "auto"), whatever the run computes in."""
    from tsenor_cli.models.loading import load_model, output_dtype

    source = tmp_path / "bf16"
    random_causal_lm(seed=1).to(torch.bfloat16).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((tiny / name).read_bytes())
    loaded = load_model(str(source), LOCAL_CTX, dtype=torch.float32)
    assert loaded.model.dtype == torch.float32 and loaded.source_dtype == torch.bfloat16
    assert output_dtype(None, loaded.source_dtype, torch.float32) == torch.bfloat16
    assert output_dtype("auto", loaded.source_dtype, torch.float32) == torch.bfloat16
    assert output_dtype("fp32", loaded.source_dtype, torch.bfloat16) == torch.float32
    assert output_dtype(None, None, torch.float32) == torch.float32
    streamed = load_model(str(source), LOCAL_CTX, dtype=torch.float32, stream=True)
    assert streamed.source_dtype == torch.bfloat16


def test_the_output_carries_no_conversion_or_loading_keys(tmp_path: Path, tiny: Path) -> None:
    """No `_model_name_or_path` from a GGUF conversion in config.json, no `local_files_only` from our
    offline loading in tokenizer_config.json (issue 41, Output)."""
    import shutil

    from tsenor_cli.models.loading import load_model
    from tsenor_cli.runfiles import SparsityRecord

    source = tmp_path / "source"
    shutil.copytree(tiny, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "_model_name_or_path": "Smollm2 135M 8k Lc100K"}))
    loaded = load_model(str(source), LOCAL_CTX)
    sparsity = SparsityRecord.of("magnitude", SparsityPattern.parse("2:4"), [], solver=None, solver_requested=None)
    _write_model_folder(loaded, tmp_path / "out", sparsity, {})
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "_model_name_or_path" not in written and written["hidden_size"] == config["hidden_size"]
    tokenizer = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local"} & set(tokenizer) and "eos_token" in tokenizer
