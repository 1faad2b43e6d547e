"""`memory.keep_freed_memory`: glibc's malloc keeps blocks under 32 MiB in its arenas once it is set."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tsenor_cli.pruning.block.memory import keep_freed_memory

# A fresh process mallocs 20 MiB and reports how many bytes glibc holds in blocks it mapped by themselves
# (`mallinfo2().hblkhd`), with and without `keep_freed_memory` first.
_PROBE = """
import ctypes, sys
from tsenor_cli.pruning.block.memory import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory() is None
class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblkhd
block = libc.malloc(20 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_block_under_32_mib_comes_from_the_heap_once_set() -> None:
    why = keep_freed_memory()
    if why is not None:
        pytest.skip(why)
    assert _mapped("default") >= 20 << 20  # glibc maps a block over 128 KiB by itself (its default)
    assert _mapped("kept") == 0
