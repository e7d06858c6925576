"""Optional C++ kernels, compiled on first use with the machine's C++ compiler.

Attention that reads K/V straight from the paged pool (paged_attention.cpp), a float32
matmul over weights packed at load time (gemm.cpp), an int8-activation matmul for
GGUF-quantized weights (int8_gemm.cpp) and fused layer ops (layers.cpp). When no compiler
is available (or CHATLOOM_RUNTIME__KERNELS=0), callers fall back to the pure PyTorch path.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
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
        sources_bytes = b"".join(p.read_bytes() for p in sorted(here.glob("*.[ch]*")))
        cpu = cpu_signature()
        name = library_name(sources_bytes, cpu)
        cache = Path(runtime.kernel_cache or Path.home() / ".cache" / "chatloom" / "kernels")
        # A finished library depends only on the sources and the CPU, so a checkout whose sources match
        # one built before on this kind of CPU loads that library instead of compiling again.
        finished = cache / "built" / f"{name}.so"
        try:
            if finished.exists():
                _module = _import_library(name, finished)
            else:
                # The build folder is per checkout: ninja records absolute source paths, so two
                # checkouts sharing one would keep rebuilding each other's objects.
                checkout_key = str(here.resolve()).encode() + b"\0" + sources_bytes + cpu
                checkout = hashlib.sha1(checkout_key).hexdigest()[:10]
                build_dir = cache / checkout
                _module = _build(name, sorted(here.glob("*.cpp")), build_dir)
                _publish(build_dir / f"{name}.so", finished)
        except Exception as exc:  # no compiler, no headers: run without kernels
            log.warning("C++ kernels unavailable, using the PyTorch attention path: %s", exc)
            _failed = True
    return _module


def library_name(sources: bytes, cpu: bytes) -> str:
    """The compiled library's name: its sources and, as it is built with -march=native, the CPU (a
    library built on one CPU may not run on another sharing the cache folder)."""
    return f"chatloom_kernels_{hashlib.sha1(sources + cpu).hexdigest()[:10]}"


def cpu_signature() -> bytes:
    """The CPU as the compiler's -march=native sees it: its model and instruction set flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.machine().encode() + platform.processor().encode()
    first = text.split("\n\n", 1)[0]
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags")
    return "\n".join(line for line in first.splitlines() if line.split(":", 1)[0].strip() in wanted).encode()


def _build(name: str, sources: list[Path], build_dir: Path):
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own lock is a file its build removes when it ends: a process killed while building (SIGTERM
    # or SIGKILL at a server's first start) leaves it, and every later build would wait for it forever.
    # Builders here hold an OS lock for the whole build, which goes with their process: once this one
    # holds it, no live process is building, and a torch lock file found is stale.
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return load(name=name, sources=[str(p) for p in sources],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def _import_library(name: str, path: Path):
    import torch  # noqa: F401  (the library links against torch's own)

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _publish(library: Path, finished: Path) -> None:
    """Copy a freshly built library where other checkouts look, atomically."""
    finished.parent.mkdir(parents=True, exist_ok=True)
    partial = finished.with_name(f"{finished.name}.{os.getpid()}.partial")
    shutil.copyfile(library, partial)
    os.replace(partial, finished)
