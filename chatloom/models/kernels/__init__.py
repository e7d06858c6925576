"""Optional C++ kernels, compiled on first use with the machine's C++ compiler.

Attention that reads K/V straight from the paged pool (paged_attention.cpp), a float32
matmul over weights packed at load time (gemm.cpp), an int8-activation matmul for
GGUF-quantized weights (int8_gemm.cpp) and fused layer ops (layers.cpp). When no compiler
is available (or CHATLOOM_RUNTIME__KERNELS=0), callers fall back to the pure PyTorch path.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_lock = threading.Lock()
_module = None
_failed = False


def load_kernels():
    """The compiled module, or None when kernels are disabled or cannot be built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    from chatloom.settings import environment_settings

    runtime = environment_settings().runtime
    if not runtime.kernels:
        return None
    with _lock:
        if _module is not None or _failed:
            return _module
        here = Path(__file__).parent
        sources = sorted(here.glob("*.cpp"))
        # The checkout's path is part of the key: ninja records absolute source paths, so two checkouts
        # sharing one build folder would keep rebuilding each other's objects.
        sources_bytes = b"".join(p.read_bytes() for p in sorted(here.glob("*.[ch]*")))
        digest = hashlib.sha1(str(here.resolve()).encode() + b"\0" + sources_bytes).hexdigest()[:10]
        try:
            from torch.utils.cpp_extension import load

            build_dir = Path(runtime.kernel_cache or Path.home() / ".cache" / "chatloom" / "kernels") / digest
            build_dir.mkdir(parents=True, exist_ok=True)
            _module = load(name=f"chatloom_kernels_{digest}", sources=[str(p) for p in sources],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        except Exception as exc:  # no compiler, no headers: run without kernels
            log.warning("C++ kernels unavailable, using the PyTorch attention path: %s", exc)
            _failed = True
    return _module
