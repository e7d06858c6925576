"""Give back the calling thread's OpenMP worker threads.

PyTorch (and the C++ kernels) run parallel work on libgomp, which keeps a pool of worker threads
for every thread that ever started a parallel region. libgomp lets those workers spin briefly
between regions, so a decode step's many short matmuls start at once; but when it manages more
threads than the machine has cores, it stops spinning and every region waits for its workers to
be woken. A server has several threads that touch torch (the model is loaded on one, the engine
steps on another, benchmarks step a second engine...), so on a 2-core machine their pools alone
switch spinning off: a batch-1 decode step took 15-16 ms on the engine thread against 10.5 ms
when it was the only pool. Threads that are done with torch for now release their pool here; a
later parallel region makes a new one (a thread start, about 0.1 ms).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp PyTorch loaded (its own copy in torch/lib, else the system's), or None."""
    import torch

    candidates = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    for name in candidates + ["libgomp.so.1"]:  # dlopen of a loaded library returns that library
        try:
            lib = ctypes.CDLL(name)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP workers (not inside a parallel region). True if released."""
    lib = _libgomp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0


def then_release(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), then release this thread's pool: for torch work on a borrowed thread
    (asyncio.to_thread's executor keeps its threads, and with them their pools)."""
    try:
        return fn(*args, **kwargs)
    finally:
        release_thread_pool()
