"""Dropping this process's mapped pages of a file's byte ranges it has consumed (Linux).

transformers reads a safetensors shard through a private memory map of the file and hands the packed
loader views of it. Taking a view faults in a page of it, and the kernel maps around the fault whatever of
the file its page cache holds: 64 KiB, or a whole large folio (2 MiB on ext4 for a file written in large
chunks and still cached). Those pages count in the process's resident set until the map closes, after the
last weight has loaded, so every packed tensor touched adds to the load's peak on top of the dense matrices
decoded from it (`docs/measurements/benchmarks-checkpoint.md`). Once a matrix is decoded,
`MappedPages.release` tells the kernel that this process needs the whole pages inside its values' and
code's bytes no more (``madvise(MADV_DONTNEED)``): they leave the resident set, the page cache keeps them,
and a later read of the same bytes faults them in again from the file.

Dropping a page of a private map discards whatever was written into it; only pages the map still shares
with the file (``/proc/self/pagemap``: present and file-backed) are dropped, and only whole pages inside the
given ranges, never a page that also holds a neighbouring tensor's bytes. Linux only: it alone exposes the
maps and page flags this needs; elsewhere the pages stay mapped until transformers closes the file.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from tsenor_cli.progress import logger

_PAGE = mmap.PAGESIZE
_MAPS, _PAGEMAP = Path("/proc/self/maps"), Path("/proc/self/pagemap")
# The kernel's pagemap flags of a page: present in memory, swapped out, and "file-page or shared-anon"
# (set for a page of a private map while it is still the file's own, clear once written to).
_PRESENT, _SWAPPED, _FILE_PAGE = 1 << 63, 1 << 62, 1 << 61
# The most of a file one page fault maps in (a PMD-sized large folio of the page cache on x86-64): a view
# smaller than this shares the folio with its neighbours, so reading it later maps them in again.
FAULT_BLOCK = 2 << 20


@dataclass(frozen=True)
class _Mapping:
    """One map of a file in this process: its first address, its length and the file offset it starts at."""

    start: int
    length: int
    offset: int


@cache
def supported() -> bool:
    """Whether this system exposes what `MappedPages` needs (Linux's /proc/self/maps and a readable
    /proc/self/pagemap). Some sandboxes (gVisor, hardened kernels) hide them: the load then keeps the map's
    pages, which costs memory, not correctness, and one log line says so."""
    if not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED")):
        return False
    try:
        with _PAGEMAP.open("rb") as handle:
            handle.read(8)
        _MAPS.read_bytes()
    except OSError as error:
        logger.info(
            "packed load: %s unreadable (%s); the file's mapped pages stay resident until the load ends",
            _PAGEMAP,
            error.strerror,
        )
        return False
    return True


@cache
def _madvise() -> Callable[[int, int, int], int]:
    """libc's madvise, setting errno for `ctypes.get_errno`."""
    function = ctypes.CDLL(None, use_errno=True).madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def file_mappings(path: Path) -> list[_Mapping]:
    """This process's maps of the file `path` (matched by device and inode, not by name), from /proc/self/maps."""
    stat = Path(path).stat()
    inode = f" {stat.st_ino} ".encode()
    lines = [line for line in _MAPS.read_bytes().splitlines() if inode in line]  # a cheap filter before parsing
    found = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or int(fields[4]) != stat.st_ino:
            continue
        major, minor = (int(part, 16) for part in fields[3].split(b":"))
        if os.makedev(major, minor) != stat.st_dev:
            continue
        start, end = (int(part, 16) for part in fields[0].split(b"-"))
        found.append(_Mapping(start, end - start, int(fields[2], 16)))
    return found


def _shares_file(address: int, length: int) -> bool:
    """Whether every page of [address, address + length) is either not mapped at all or the file's own page
    (present, file-backed): then dropping it loses nothing a later read cannot fault in again."""
    with _PAGEMAP.open("rb") as handle:
        handle.seek(address // _PAGE * 8)
        entries = memoryview(handle.read(length // _PAGE * 8)).cast("Q")
    return all(entry & _FILE_PAGE if entry & _PRESENT else not entry & _SWAPPED for entry in entries)


class MappedPages:
    """Drops this process's mapped pages of files' byte ranges once they are consumed (module docstring),
    for the life of one load. A page shared by two consumed ranges (one matrix's values and the next one's
    code) is dropped once both are. Each file's maps are read from /proc/self/maps once and again only when
    a range lies outside them (a map seen once and since gone would only have its address checked page by
    page, `_shares_file`)."""

    def __init__(self, paths: Iterable[Path] = ()) -> None:
        self.paths = [Path(path) for path in paths]  # the files `view_span` looks for a tensor in
        self.maps: dict[Path, list[_Mapping]] = {}
        self.consumed: dict[Path, list[tuple[int, int]]] = {}
        self.refused = False  # the kernel refused a drop (locked memory, `release`): the rest stay mapped

    def view_span(self, tensor: torch.Tensor) -> tuple[Path, int, int] | None:
        """(file, offset, nbytes) of `tensor`'s bytes when it is a view of a map of one of `paths` (a CPU
        tensor lying inside one), else None (a copy, a GPU tensor, or a system `supported` says no to)."""
        if not supported() or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for path in self.paths:
            if path not in self.maps:
                self.maps[path] = file_mappings(path)
            for mapping in self.maps[path]:
                if mapping.start <= address and address + nbytes <= mapping.start + mapping.length:
                    return path, address - mapping.start + mapping.offset, nbytes
        return None

    def _covering(self, path: Path, offset: int, nbytes: int) -> list[_Mapping]:
        def covered(maps: list[_Mapping]) -> bool:
            return any(m.offset <= offset and offset + nbytes <= m.offset + m.length for m in maps)

        if path not in self.maps or not covered(self.maps[path]):
            self.maps[path] = file_mappings(path)
        return self.maps[path]

    def _consume(self, path: Path, offset: int, nbytes: int) -> tuple[int, int]:
        """Record [offset, offset + nbytes) as consumed → the file's byte range of the pages to drop now:
        those it touches that lie wholly inside the consumed bytes around it."""
        low, high = offset, offset + nbytes
        apart = []
        for start, end in self.consumed.get(path, []):
            if end < low or start > high:
                apart.append((start, end))
            else:
                low, high = min(low, start), max(high, end)
        self.consumed[path] = [*apart, (low, high)]
        first = max(-(-low // _PAGE), offset // _PAGE)
        last = min(high // _PAGE, -(-(offset + nbytes) // _PAGE))
        return first * _PAGE, last * _PAGE

    def release(self, path: Path, spans: Iterable[tuple[int, int]]) -> int:
        """Record the (offset, nbytes) byte ranges `spans` of the file `path` as consumed and drop this
        process's mapped pages of it that lie wholly inside consumed bytes, in every map of it this process
        holds → the bytes whose pages were dropped (present or not). A range holding a page that is not the
        file's own (a private copy, or swapped out) is left as it is. Nothing on a system `supported` says no to."""
        if not supported() or self.refused:
            return 0
        released = 0
        for offset, nbytes in spans:
            first, last = self._consume(path, offset, nbytes)
            for mapping in self._covering(path, offset, nbytes):
                low, high = max(first, mapping.offset), min(last, mapping.offset + mapping.length)
                if high <= low:
                    continue
                address = mapping.start + low - mapping.offset
                if not _shares_file(address, high - low):
                    continue
                if _madvise()(address, high - low, mmap.MADV_DONTNEED) != 0:
                    # EINVAL for locked pages (mlockall, a memlock'd job): keeping them costs memory, not
                    # correctness, as on a system `supported` says no to.
                    logger.info(
                        "packed load: the kernel keeps %s's mapped pages (madvise: %s); they stay resident "
                        "until the load ends",
                        path.name,
                        os.strerror(ctypes.get_errno()),
                    )
                    self.refused = True
                    return released
                released += high - low
        return released
