"""A model given by its hub id: its snapshot in the HF cache is streamed as a local folder is (a hub id used to
load whole, 70B of weights in host memory), fetched as `hf download` fetches it, and evaluated again as a no-op.

The hub cannot be reached here, so the CLI runs offline against an HF cache laid out as huggingface_hub lays
it out (`refs/main`, `snapshots/<commit>/` links into `blobs/`), in a process of its own: the cache folder is
read from the environment when huggingface_hub and transformers are imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_cli import invoke
from safetensors.torch import load_file

from tsenor_cli.models import loading
from tsenor_cli.settings import RunContext

pytestmark = pytest.mark.realdata

REPO_ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "tsenor-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PRUNE = ["--nm", "2:4", "--method", "wanda", "--nsamples", "4", "--seqlen", "32"]


def hub_cache(root: Path, repo_id: str, folder: Path) -> Path:
    """An HF cache under `root` holding `folder`'s files as the snapshot of `repo_id` at `COMMIT` (each file
    a blob named by its sha256, linked from the snapshot) → the snapshot folder."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def tsenor(args: list[str], cache: Path, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """`tsenor ARGS` in its own process, offline, with the HF cache at `cache`."""
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TSENOR_DATA_DIR": str(data_dir)}
    command = [sys.executable, "-m", "tsenor_cli", *args]
    return subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def test_a_cached_hub_id_is_streamed_and_gives_its_folders_checkpoint_and_evaluation(
    tiny: Path, data_dir: Path, tmp_path: Path
) -> None:
    """The prune of the hub id reads its snapshot block by block and writes what the prune of the same
    files in a folder writes, bit for bit; `tsenor eval` of the hub id streams too, and again is a no-op."""
    cache = tmp_path / "hub"
    hub_cache(cache, REPO_ID, tiny)
    out, local = tmp_path / "from-hub", tmp_path / "from-folder"
    pruned = tsenor(["prune", REPO_ID, "-o", str(out), *PRUNE], cache, data_dir)
    assert pruned.returncode == 0, pruned.stderr[-3000:]
    assert f"{REPO_ID}: streaming from its snapshot in the HF cache, {cache}" in pruned.stderr
    assert "Loading weights" not in pruned.stderr  # transformers' whole load, which a hub id used to take
    assert invoke(["prune", str(tiny), "-o", str(local), *PRUNE, "--data-dir", str(data_dir)]).exit_code == 0
    ours, theirs = load_file(out / "model.safetensors"), load_file(local / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(ours[key].equal(theirs[key]) for key in ours)
    assert json.loads((out / "tsenor_report.json").read_text())["settings"]["model"] == REPO_ID

    evaluate = ["eval", REPO_ID, "--ppl", "wikitext2", "--seqlen", "32", "--max-windows", "1", "-o", str(tmp_path)]
    first = tsenor(evaluate, cache, data_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "streaming from its snapshot" in first.stderr
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["model"] == REPO_ID and written["model_identity"] is not None
    again = tsenor(evaluate, cache, data_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"already held this command's evaluation of {REPO_ID} as it is now; nothing written" in again.stderr
    assert again.stdout == first.stdout and json.loads((tmp_path / "eval.json").read_text()) == written


def test_a_shard_missing_from_the_offline_cache_is_one_line_and_nothing_is_written(
    tiny: Path, data_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(sharded, max_shard_size="5MB")
    for path in tiny.iterdir():
        if not path.name.endswith((".safetensors", ".json")):
            (sharded / path.name).write_bytes(path.read_bytes())
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    cache = tmp_path / "hub"
    (hub_cache(cache, REPO_ID, sharded) / shards[-1].name).unlink()  # an interrupted `hf download`
    out = tmp_path / "out"
    result = tsenor(["prune", REPO_ID, "-o", str(out), *PRUNE], cache, data_dir)
    assert result.returncode == 3, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {REPO_ID} is not in the local HF cache and the hub is off"), last
    assert not out.exists()


def test_a_hub_id_with_pickle_weights_only_is_loaded_whole_with_one_line(
    tiny: Path, data_dir: Path, tmp_path: Path
) -> None:
    """Streaming needs safetensors: a hub model whose weights are pickles (as a local folder of them) is
    not refused, it loads whole and one line says why."""
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for path in tiny.iterdir():
        if path.name != "model.safetensors":
            (pickled / path.name).write_bytes(path.read_bytes())
    torch.save(load_file(tiny / "model.safetensors"), pickled / "pytorch_model.bin")
    cache = tmp_path / "hub"
    hub_cache(cache, REPO_ID, pickled)
    result = tsenor(["eval", REPO_ID, "--ppl", "wikitext2", "--seqlen", "32", "--max-windows", "1"], cache, data_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    said = f"{REPO_ID} has pickle weights only; streaming needs safetensors, so it is loaded whole"
    assert said in result.stderr.splitlines()


def test_the_snapshot_fetches_the_small_files_then_the_shards_its_index_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a hub id's streamed load asks huggingface_hub for (the hub, which this test cannot reach, is
    replaced by a stand-in that records the calls): the config, tokenizer and processor files, then exactly
    the shards the index names; not a repository's other copies of the weights (`original/`, consolidated
    or GGUF files). The model's own code only with --trust-remote-code."""
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in set(weight_map.values()):
        (snapshot / name).write_bytes(b"")
    calls: list[tuple[str, list[str], bool]] = []

    def snapshot_download(repo_id: str, *, allow_patterns: list[str], local_files_only: bool, **_: Any) -> str:
        calls.append((repo_id, allow_patterns, local_files_only))
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    online = RunContext(data_dir=None, offline=False, cache_dir=tmp_path / "cache")
    assert loading.hub_snapshot(REPO_ID, online, trust_remote_code=False) == snapshot
    assert calls == [
        (REPO_ID, list(loading.SNAPSHOT_FILES), False),
        (REPO_ID, sorted(set(weight_map.values())), False),
    ]
    calls.clear()
    loading.hub_snapshot(REPO_ID, online, trust_remote_code=True)
    assert calls[0][1] == [*loading.SNAPSHOT_FILES, "*.py"]
    # No index: model.safetensors alone; a snapshot without it and pickle weights only is loaded whole (None).
    (snapshot / "model.safetensors.index.json").unlink()
    for name in set(weight_map.values()):
        (snapshot / name).unlink()
    calls.clear()
    (snapshot / "pytorch_model.bin").write_bytes(b"")
    assert loading.hub_snapshot(REPO_ID, online, trust_remote_code=False) is None
    assert calls[1][1] == ["model.safetensors"]


def test_a_damaged_index_in_the_snapshot_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tsenor_cli.errors import BadInputError

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors.index.json").write_text("{not json")

    def snapshot_download(*_args: object, **_kwargs: object) -> str:
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    with pytest.raises(BadInputError, match="is not valid JSON"):
        loading.hub_snapshot(REPO_ID, RunContext(None, True, tmp_path), trust_remote_code=False)
