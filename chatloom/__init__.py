"""chatloom: a self-hostable chat service and the LLM serving engine behind it.

Importing the package turns on PyTorch's transparent huge pages for CPU tensors of 2 MB or more
(madvise(MADV_HUGEPAGE)) unless THP_MEM_ALLOC_ENABLE is already set. A decode step streams the
weights, the KV pool and each step's activations through memory; on 4 KB pages the offline
benchmark ran slower in 7 of 8 alternated pairs in each mode (up to 16% in int8 mode; README). PyTorch
reads the switch once, at its first allocation, so it has to be set before any tensor exists:
here, before anything in the package imports torch. THP_MEM_ALLOC_ENABLE=0 keeps 4 KB pages.
"""
import os as _os
import sys as _sys

if _sys.platform.startswith("linux"):
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
