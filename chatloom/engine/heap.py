"""Handing the heap's free memory back to the system once a replica is built.

Loading a model frees far more than it keeps (dequantized tensors, numpy intermediates of the packed
layouts), and glibc keeps what was freed on its heap for later allocations rather than returning it:
after loading the SmolLM2-1.7B shape in Q4_K_M, about 265 MiB of the process's resident memory was
such free heap. malloc_trim returns it. Elsewhere than glibc this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util


def return_free_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim); whether it could."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
