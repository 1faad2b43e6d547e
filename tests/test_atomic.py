"""tsenor_cli.atomic: permissions whatever the umask, and a failure mid-write leaves the old output
intact and no temporary behind."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tsenor_cli import atomic


@pytest.fixture
def private_umask() -> Iterator[None]:
    """umask 077: what a plain open() would create is 0600, so 0644 must come from the helper."""
    before = os.umask(0o077)
    yield
    os.umask(before)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_files_are_0644_whatever_the_umask(tmp_path: Path, private_umask: None) -> None:
    atomic.write_text(tmp_path / "a.txt", "héllo\n")
    atomic.write_bytes(tmp_path / "b.bin", b"\x00\x01")
    atomic.write_json(tmp_path / "sub" / "c.json", {"x": [1, 2]})
    atomic.save_safetensors({"w": torch.arange(6.0).view(2, 3)}, tmp_path / "d.safetensors", {"format": "pt"})
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "sub" / "c.json").read_text() == '{\n  "x": [\n    1,\n    2\n  ]\n}\n'
    assert torch.equal(load_file(str(tmp_path / "d.safetensors"))["w"], torch.arange(6.0).view(2, 3))
    for name in ("a.txt", "b.bin", "sub/c.json", "d.safetensors"):
        assert _mode(tmp_path / name) == 0o644, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "d.safetensors", "sub"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "eval.json"
    atomic.write_json(target, {"old": True})
    before = target.read_bytes()
    with pytest.raises(TypeError):
        atomic.write_json(target, {"new": object()})  # json.dumps fails before anything is written
    with pytest.raises(RuntimeError, match="disk full"), atomic._temp_file(target) as tmp:
        tmp.write_bytes(b'{"new": tru')  # half of the new content is on disk when the failure hits
        raise RuntimeError("disk full")
    bad = {"w": torch.zeros(2)}
    with pytest.raises(TypeError):
        atomic.save_safetensors(bad, tmp_path / "eval.json", metadata={"format": 1})  # type: ignore[dict-item]
    assert target.read_bytes() == before and json.loads(before) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]


def test_atomic_dir_replaces_whole_or_not_at_all(tmp_path: Path, private_umask: None) -> None:
    out = tmp_path / "ckpt"
    with atomic.atomic_dir(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".ckpt.tmp-{os.getpid()}-")
        (tmp / "model.safetensors").write_bytes(b"v1")  # written 0600 under the umask
        (tmp / "nested").mkdir()
        (tmp / "nested" / "x").write_text("1")
    assert _mode(out) == 0o755 and _mode(out / "nested") == 0o755
    assert _mode(out / "model.safetensors") == 0o644 and _mode(out / "nested" / "x") == 0o644

    with pytest.raises(RuntimeError, match="killed"), atomic.atomic_dir(out, replace=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"v2 half")
        raise RuntimeError("killed")
    assert (out / "model.safetensors").read_bytes() == b"v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp folder left

    with atomic.atomic_dir(out) as tmp:  # replace=False: the existing folder wins
        (tmp / "model.safetensors").write_bytes(b"other")
    assert (out / "model.safetensors").read_bytes() == b"v1"
    with atomic.atomic_dir(out, replace=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"v2")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # the old nested/ is gone
    assert (out / "model.safetensors").read_bytes() == b"v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
