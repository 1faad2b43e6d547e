"""Dropping a memory map's pages of consumed byte ranges (`packed.pages`): only whole pages inside consumed
bytes go, a page shared by two consumed ranges goes once both are, a page written to (a private copy) stays,
and the bytes read back the same afterwards. Hand-worked on a file of a few pages mapped as safetensors
maps a shard (private, copy on write); and a packed load through transformers holding each weight once."""

from __future__ import annotations

import ctypes
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers_tiny import sparsegpt_config
from safetensors import safe_open

from tsenor_cli.packed.files import read_patterns, stored_tensors
from tsenor_cli.packed.pages import MappedPages, file_mappings, supported
from tsenor_cli.pruning.run.api import prune_model
from tsenor_cli.settings import RunContext

pytestmark = pytest.mark.skipif(not supported(), reason="needs Linux's /proc/self/maps and pagemap")

PAGE = mmap.PAGESIZE
PAGES = 8


def present(address: int, pages: int) -> list[bool]:
    """Whether each page from `address` is mapped in this process, from the kernel's pagemap (bit 63)."""
    with Path("/proc/self/pagemap").open("rb") as handle:
        handle.seek(address // PAGE * 8)
        entries = struct.unpack(f"<{pages}Q", handle.read(pages * 8))
    return [bool(entry >> 63) for entry in entries]


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[tuple[Path, mmap.mmap, int]]:
    """A file of PAGES pages (page i filled with byte i + 1), mapped private, every page read once."""
    path = tmp_path / "shard.bin"
    path.write_bytes(b"".join(bytes([i + 1]) * PAGE for i in range(PAGES)))
    with path.open("rb") as handle:
        view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    assert sum(view[i * PAGE] for i in range(PAGES)) == sum(range(1, PAGES + 1))  # fault every page in
    assert all(present(address, PAGES))
    yield path, view, address
    view.close()


def test_the_file_s_map_is_found_by_inode(mapped: tuple[Path, mmap.mmap, int]) -> None:
    path, _, address = mapped
    maps = file_mappings(path)
    assert [(m.start, m.length, m.offset) for m in maps] == [(address, PAGES * PAGE, 0)]


def test_only_whole_pages_inside_the_range_are_dropped_and_the_bytes_read_back(
    mapped: tuple[Path, mmap.mmap, int],
) -> None:
    path, view, address = mapped
    # Bytes [1.5, 4.5) pages: pages 2 and 3 lie wholly inside; 1 and 4 hold bytes outside it.
    released = MappedPages().release(path, [(PAGE + PAGE // 2, 3 * PAGE)])
    assert released == 2 * PAGE
    assert present(address, PAGES) == [True, True, False, False, True, True, True, True]
    assert [view[i * PAGE] for i in range(PAGES)] == list(range(1, PAGES + 1))  # faulted in again from the file


def test_a_page_shared_by_two_consumed_ranges_goes_once_both_are(mapped: tuple[Path, mmap.mmap, int]) -> None:
    path, _, address = mapped
    pages = MappedPages()
    assert pages.release(path, [(0, PAGE + PAGE // 2)]) == PAGE  # page 0; page 1 holds unconsumed bytes
    assert present(address, 3) == [False, True, True]
    # [1.5, 2.5) pages: consumed bytes now run over [0, 2.5) pages, so page 1 goes; page 2 still holds unconsumed bytes.
    assert pages.release(path, [(PAGE + PAGE // 2, PAGE)]) == PAGE
    assert present(address, 3) == [False, False, True]


def test_a_page_written_to_is_a_private_copy_and_stays(mapped: tuple[Path, mmap.mmap, int]) -> None:
    path, view, address = mapped
    view[3 * PAGE] = 0xAB  # copy on write: page 3 is this process's own now, not the file's
    assert MappedPages().release(path, [(2 * PAGE, 2 * PAGE)]) == 0
    assert present(address, PAGES) == [True] * PAGES
    assert view[3 * PAGE] == 0xAB
    assert MappedPages().release(path, [(5 * PAGE, 2 * PAGE)]) == 2 * PAGE  # untouched pages still go


def test_a_file_this_process_has_not_mapped_releases_nothing(tmp_path: Path) -> None:
    path = tmp_path / "other.bin"
    path.write_bytes(bytes(4 * PAGE))
    assert file_mappings(path) == []
    assert MappedPages().release(path, [(0, 4 * PAGE)]) == 0


@pytest.fixture(scope="module")
def packed(
    tiny_llama: Callable[..., Path], calib: Path, data_ctx: RunContext, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A packed prune of a tiny llama whose embeddings are tied (fp32: each packed tensor spans whole pages)."""
    out = tmp_path_factory.mktemp("pages") / "packed"
    prune_model(sparsegpt_config(tiny_llama(num_layers=2), calib, out, resume=False, save_format="packed"), data_ctx)
    return out


def test_a_packed_load_holds_each_weight_once(packed: Path) -> None:
    """Tied weights stay one tensor; each decoded matrix is a storage of its own, neither a view of a larger
    buffer nor of the shard's map; and the shard's map, still open for the dense tensors that are views of
    it, holds no page lying wholly inside a packed tensor's bytes (each dropped once decoded)."""
    from transformers import AutoModelForCausalLM

    import tsenor_cli  # noqa: F401  # registers the packed format

    model = AutoModelForCausalLM.from_pretrained(packed)
    shard = packed / "model.safetensors"
    with safe_open(str(shard), framework="pt") as handle:
        patterns = read_patterns(shard, handle.metadata()) or {}
    assert patterns and model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    maps = file_mappings(shard)
    assert maps, "the dense tensors are no longer views of the shard's map: this check has nothing to look at"

    def in_map(param: torch.Tensor) -> bool:
        return any(m.start <= param.data_ptr() < m.start + m.length for m in maps)

    params = dict(model.named_parameters())
    for key in patterns:
        param = params[key]
        storage = param.untyped_storage()
        assert storage.data_ptr() == param.data_ptr() and storage.nbytes() == param.numel() * param.element_size()
        assert not in_map(param), key
    # Stored as they are: the embeddings (12.6 MB) stay a view of the map, read when used as a dense load
    # leaves them; the norms (256 bytes each) are copies, so no forward pass maps the map's pages again.
    embeddings = model.get_input_embeddings().weight
    assert embeddings.numel() * embeddings.element_size() >= 2 << 20 and in_map(embeddings)
    norms = [name for name in params if "norm" in name]
    assert norms and not any(in_map(params[name]) for name in norms)
    spans = stored_tensors(shard, [*patterns, *(key + pattern.suffix for key, pattern in patterns.items())])
    inside = 0
    for mapping in maps:
        for span in spans.values():
            first = -(-max(span.offset, mapping.offset) // PAGE)
            last = min(span.offset + span.nbytes, mapping.offset + mapping.length) // PAGE
            if last > first:
                inside += last - first
                assert not any(present(mapping.start + first * PAGE - mapping.offset, last - first)), span
    assert inside, "no packed tensor spans a whole page: this check has nothing to look at"


def test_biases_load_as_copies_not_views_of_the_map(
    tiny_llama: Callable[..., Path], calib: Path, data_ctx: RunContext, tmp_path: Path
) -> None:
    """A packed file stores a linear's bias as it is. Left a view of the shard's map, reading it in the
    forward pass would map again the folio it shares with decoded matrices' bytes, so a model with biases
    (Qwen2's q/k/v) would hold its packed file's pages beside the dense matrices; each bias is a copy of its
    stored bytes instead."""
    from transformers import AutoModelForCausalLM

    import tsenor_cli  # noqa: F401  # registers the packed format

    out = tmp_path / "packed"
    config = sparsegpt_config(tiny_llama(model_type="qwen2"), calib, out, resume=False, save_format="packed")
    prune_model(config, data_ctx)
    model = AutoModelForCausalLM.from_pretrained(out)
    shard = out / "model.safetensors"
    maps = file_mappings(shard)
    biases = {name: param for name, param in model.named_parameters() if name.endswith(".bias")}
    assert biases and maps, "no bias, or nothing left mapped: this check has nothing to look at"
    with safe_open(str(shard), framework="pt") as handle:
        for name, param in biases.items():
            assert not any(m.start <= param.data_ptr() < m.start + m.length for m in maps), name
            assert torch.equal(param.detach(), handle.get_tensor(name)), name


def test_unreadable_pagemap_keeps_pages_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sandbox that hides /proc/self/pagemap: nothing is dropped (no error mid-load), one log line says so."""
    from tsenor_cli.packed import pages

    monkeypatch.setattr(pages, "_PAGEMAP", tmp_path / "missing-pagemap")
    pages.supported.cache_clear()
    try:
        with caplog.at_level("INFO", logger="tsenor"):
            assert not pages.supported()
        assert MappedPages([tmp_path / "x"]).release(tmp_path / "x", [(0, 4 * PAGE)]) == 0
        assert MappedPages([tmp_path / "x"]).view_span(torch.zeros(4)) is None
    finally:
        pages.supported.cache_clear()
    assert any("unreadable" in record.getMessage() for record in caplog.records)


def test_a_drop_the_kernel_refuses_keeps_the_pages_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Locked pages (mlock, as a job under mlockall holds them) cannot be dropped (madvise: EINVAL): the load
    goes on with its pages mapped, one log line says so, and that load drops nothing more. The map is
    read-only: locking a private writable one would copy its pages, which are then not the file's."""
    path = tmp_path / "locked.bin"
    path.write_bytes(bytes(PAGES * PAGE))
    with path.open("rb") as handle:
        view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    address = file_mappings(path)[0].start  # a read-only map exposes no buffer address to ctypes
    assert sum(view[i * PAGE] for i in range(PAGES)) == 0 and all(present(address, PAGES))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if libc.mlock(address + 2 * PAGE, 2 * PAGE) != 0:
        view.close()
        pytest.skip("mlock is not allowed here")
    try:
        pages = MappedPages()
        with caplog.at_level("INFO", logger="tsenor"):
            assert pages.release(path, [(2 * PAGE, 2 * PAGE)]) == 0
        assert pages.refused and present(address, PAGES) == [True] * PAGES
        assert pages.release(path, [(6 * PAGE, 2 * PAGE)]) == 0  # unlocked, but this load stopped dropping
        assert present(address, PAGES) == [True] * PAGES
    finally:
        libc.munlock(address + 2 * PAGE, 2 * PAGE)
    try:
        assert [r.getMessage() for r in caplog.records if "keeps" in r.getMessage()] == [
            f"packed load: the kernel keeps {path.name}'s mapped pages (madvise: Invalid argument); they stay "
            "resident until the load ends"
        ]
        assert MappedPages().release(path, [(6 * PAGE, 2 * PAGE)]) == 2 * PAGE  # a new load drops again
        assert present(address, PAGES)[6:] == [False, False]
    finally:
        view.close()
