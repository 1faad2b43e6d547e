"""The safetensors checkpoint reader (models/checkpoint.py): single file or sharded, key by key, and every
bad checkpoint one line with its exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_tiny import random_causal_lm
from safetensors.torch import save_file

from tsenor_cli.errors import BadInputError, InputNotFoundError
from tsenor_cli.models.checkpoint import INDEX_NAME, WEIGHTS_NAME, Checkpoint


def _saved(path: Path, **options: object) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random LLaMA (3 blocks, tied head) saved to `path` with save_pretrained(**options); its tensors."""
    model = random_causal_lm(num_layers=3)
    model.save_pretrained(path, **options)
    return path, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def test_single_file_reads_every_tensor_bit_for_bit(tmp_path: Path) -> None:
    folder, expected = _saved(tmp_path / "m")
    checkpoint = Checkpoint.open(folder)
    assert set(checkpoint.keys()) == set(expected)
    assert {info.file for info in checkpoint.tensors.values()} == {WEIGHTS_NAME}
    got = checkpoint.read(checkpoint.keys())
    assert all(torch.equal(got[key], expected[key]) and got[key].dtype == torch.float32 for key in expected)
    assert checkpoint.nbytes() == sum(t.numel() * 4 for t in expected.values())


def test_sharded_checkpoint_reads_each_key_from_its_shard(tmp_path: Path) -> None:
    folder, expected = _saved(tmp_path / "m", max_shard_size="60KB")
    weight_map = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2  # really sharded
    checkpoint = Checkpoint.open(folder)
    assert {key: info.file for key, info in checkpoint.tensors.items()} == weight_map
    block = checkpoint.keys_under("model.layers.1")
    assert sorted(block) == sorted(k for k in expected if k.startswith("model.layers.1."))
    got = dict(checkpoint.iter_read(block, dtype=torch.bfloat16))
    assert list(got) == block
    assert all(torch.equal(got[key], expected[key].to(torch.bfloat16)) for key in block)


def test_keys_under_a_block_are_that_block_only(tmp_path: Path) -> None:
    tensors = {f"model.layers.{i}.w": torch.full((2,), float(i)) for i in (1, 10, 11)} | {"model.norm.w": torch.ones(1)}
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.keys_under("model.layers.1") == ["model.layers.1.w"]
    assert checkpoint.tensors["model.layers.10.w"].shape == (2,)
    assert checkpoint.read(["model.layers.11.w"])["model.layers.11.w"].tolist() == [11.0, 11.0]
    with pytest.raises(KeyError, match=r"model\.layers\.2\.w"):
        checkpoint.read(["model.layers.2.w"])


def _sharded(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    folder, _ = _saved(tmp_path / "m", max_shard_size="60KB")
    return folder, json.loads((folder / INDEX_NAME).read_text())["weight_map"]


def test_missing_shard_is_exit_3(tmp_path: Path) -> None:
    folder, weight_map = _sharded(tmp_path)
    gone = sorted(set(weight_map.values()))[1]
    (folder / gone).unlink()
    with pytest.raises(InputNotFoundError, match=f"names the shard {gone}, which is missing") as caught:
        Checkpoint.open(folder)
    assert caught.value.exit_code == 3


def test_index_naming_a_key_its_shard_lacks_is_exit_7(tmp_path: Path) -> None:
    folder, weight_map = _sharded(tmp_path)
    index = json.loads((folder / INDEX_NAME).read_text())
    key = "model.layers.2.mlp.down_proj.weight"
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[key])
    index["weight_map"][key] = other
    (folder / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(BadInputError, match=f"places {key} in {other}, which does not hold it") as caught:
        Checkpoint.open(folder)
    assert caught.value.exit_code == 7


@pytest.mark.parametrize("sharded", [False, True])
def test_truncated_shard_is_exit_7(tmp_path: Path, sharded: bool) -> None:
    folder, _ = _saved(tmp_path / "m", **({"max_shard_size": "60KB"} if sharded else {}))
    victim = sorted(folder.glob("*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(BadInputError, match=f"{victim} is truncated or corrupt") as caught:
        Checkpoint.open(folder)
    assert caught.value.exit_code == 7
    assert "\n" not in str(caught.value)


def test_index_that_is_not_json_is_exit_7(tmp_path: Path) -> None:
    folder, _ = _sharded(tmp_path)
    (folder / INDEX_NAME).write_text("{not json")
    with pytest.raises(BadInputError, match="is not valid JSON"):
        Checkpoint.open(folder)
    (folder / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(BadInputError, match="has no weight_map"):
        Checkpoint.open(folder)


def test_no_safetensors_is_exit_3_naming_the_pickle_files(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(InputNotFoundError, match=r"pytorch_model\.bin, pickle weights.*needs safetensors") as caught:
        Checkpoint.open(tmp_path)
    assert caught.value.exit_code == 3
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(InputNotFoundError, match="holds no weight files"):
        Checkpoint.open(tmp_path)
