"""A disk cache of K-quant weights in the kernels' panel layout, so that later starts map them.

Packing a Q4_K_M model's layers into super-block panels (kquant_panels.py) is redone at every start,
and most of its cost is not the packing but the fresh memory it fills: on a virtual machine each new
page is zeroed by the guest and faulted in by the host, several seconds for a 3B model's 1.7 GB. Here
each layer's panels are packed once into a file, named by the source file's identity (real path,
size, modification time) and the layer's place in it; later starts map that file read-only. Its pages
are the page cache's: nothing is packed or zeroed again, and replicas of one model on a machine share
the memory, as llama.cpp's mapped weights do. Decoding reads the mapped panels as fast as packed ones
(docs/models.md).

A file found is checked before use by packing each part's first panel again and comparing the bytes,
which catches a changed layout (new kernels) as well as a source rewritten in place. A file is written
beside its final name, preallocated (a full disk is an error here, never a fault while the panels are
written through the mapping), then synced and renamed on a thread of its own while the server starts, so
a crash leaves no half-written file under the final name. When the source changes, the folder of its
earlier version is removed; anything going wrong with the cache means packing in memory, as without it.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from chatloom.models.quant_layout import PANEL, QuantizedWeight
from chatloom.models.weight_repack import file_span

log = logging.getLogger(__name__)

# Packs the given parts' panels: into the tensor when one is given, else into new memory.
Packer = Callable[[list[QuantizedWeight], "torch.Tensor | None"], torch.Tensor]
SOURCE_FILE = "source.json"
OFF = ("", "off")


def default_folder() -> Path:
    """$XDG_CACHE_HOME/chatloom/weights, else ~/.cache/chatloom/weights."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "chatloom" / "weights"


def cache_folder(setting: str) -> Path | None:
    """The folder the `model.weight_cache` setting names: `auto` is default_folder(), "" or `off` is
    none (pack at every start), anything else a path (~ expanded)."""
    value = setting.strip()
    if value.lower() in OFF:
        return None
    return default_folder() if value.lower() == "auto" else Path(value).expanduser()


def _map(path: Path, size: int) -> torch.Tensor | None:
    """The file's bytes, mapped read-only, or None where it is missing or not `size` bytes long."""
    try:
        if path.stat().st_size != size:
            return None
        with warnings.catch_warnings():  # torch warns that the map is read-only: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=(size,)))
    except (OSError, ValueError):
        return None


def _remove_orphans(folder: Path) -> None:
    """Remove the temporary files of writers that died before renaming them (named .NAME.PID.tmp)."""
    for tmp in folder.glob(".*.tmp"):
        try:
            pid = int(tmp.name.rsplit(".", 2)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, IndexError, OSError):
            continue


def _commit(fd: int, tmp: Path, path: Path) -> None:
    """Sync a written file and give it its name: until then a crash leaves only a temporary file, never a
    named one the disk had not finished (its unwritten parts would read as zeros)."""
    try:
        os.fdatasync(fd)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("weight cache: cannot keep %s (%s)", path, exc)
        tmp.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _identity(source: str) -> dict:
    st = os.stat(source)
    return {"path": os.path.realpath(source), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class PanelCache:
    """Panels of one load's layers, mapped from `folder` or packed into it. After the load, `mapped`,
    `written` and `unsaved` count the bytes that came from files, went into new files, and were packed
    in memory (parts not mapped from a file, or the cache unusable). Safe to use from several threads."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.mapped = self.written = self.unsaved = 0
        self.stale = 0  # files found whose first panels did not match: packed again
        self._sources: dict[str, Path | None] = {}
        self._warned = False
        self._lock = threading.Lock()  # pack_linears packs layers on several threads
        self._committer: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def blob(self, parts: list[QuantizedWeight], int8: bool, size: int, pack: Packer) -> torch.Tensor:
        """The `size` bytes of panels of `parts` (with `int8`, for the int8-activation kernel), as
        `pack` makes them: mapped from this layer's file where it exists and checks out, else packed
        into a new file and mapped from it, else packed in memory."""
        spans = [file_span(p.raw) for p in parts]
        folder = None
        if all(spans) and len({s[0] for s in spans}) == 1:
            folder = self._source_folder(spans[0][0])
        if folder is None:
            self._count("unsaved", size)
            return pack(parts, None)
        layer = [[p.kind, p.rows, p.cols, offset] for p, (_, offset) in zip(parts, spans)]
        name = hashlib.sha256(json.dumps([layer, bool(int8)]).encode()).hexdigest()[:32] + ".panels"
        path = folder / name
        found = _map(path, size)
        if found is not None:
            if self._first_panels_match(found, parts, pack):
                self._count("mapped", size)
                return found
            self._count("stale", 1)
            log.warning("weight cache: %s does not hold what the kernels pack now; packing it again", path)
        written = self._write(path, size, parts, pack)
        if written is None:
            self._count("unsaved", size)
            return pack(parts, None)
        self._count("written", size)
        return written

    def _count(self, name: str, amount: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def summary(self) -> str:
        gb = 1e9
        return (f"weight cache {self.folder}: {self.mapped / gb:.2f} GB of panels mapped, "
                f"{self.written / gb:.2f} GB written, {self.unsaved / gb:.2f} GB packed in memory")

    @staticmethod
    def _first_panels_match(found: torch.Tensor, parts: list[QuantizedWeight], pack: Packer) -> bool:
        start = 0
        for p in parts:
            rows = min(PANEL, p.rows)
            first = pack([QuantizedWeight(p.kind, p.raw[:rows], rows, p.cols)], None)
            n = first.numel()
            if start + n > found.numel() or not torch.equal(found[start:start + n], first):
                return False
            start += n * -(-p.rows // PANEL)
        return start == found.numel()

    def _source_folder(self, source: str) -> Path | None:
        """This source file's folder (made, with its description, on first use), or None where the cache
        cannot be used. Folders of the same file's earlier versions, and of files gone, are removed."""
        with self._lock:
            if source not in self._sources:
                self._sources[source] = self._open_source(source)
            return self._sources[source]

    def _open_source(self, source: str) -> Path | None:
        folder = None
        try:
            identity = _identity(source)
            key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
            folder = self.folder / key
            if (folder / SOURCE_FILE).exists():
                _remove_orphans(folder)
            else:
                folder.mkdir(parents=True, exist_ok=True)
                tmp = folder / f".{SOURCE_FILE}.{os.getpid()}.tmp"
                tmp.write_text(json.dumps(identity, indent=1))
                os.replace(tmp, folder / SOURCE_FILE)
                self._sweep(identity["path"], keep=folder)
        except OSError as exc:
            self._warn(f"cannot use {self.folder} ({exc})")
            folder = None
        return folder

    def _sweep(self, path: str, keep: Path) -> None:
        """Remove the folders of `path`'s earlier versions and of sources that no longer exist as they
        were. Files mapped by a running server stay readable: removing a name does not unmap it."""
        for other in self.folder.iterdir():
            if other == keep or not other.is_dir():
                continue
            try:
                identity = json.loads((other / SOURCE_FILE).read_text())
            except (OSError, ValueError):
                continue  # being made by another process, or not ours
            try:
                current = _identity(identity["path"])
            except (OSError, KeyError, TypeError):
                current = None
            if identity.get("path") == path or current != identity:
                shutil.rmtree(other, ignore_errors=True)

    def _write(self, path: Path, size: int, parts: list[QuantizedWeight], pack: Packer) -> torch.Tensor | None:
        """Pack into a new file beside `path` and map it; the file is synced and renamed to `path` on
        the committing thread, so the start does not wait for the disk."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = -1
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.posix_fallocate(fd, 0, size)
            target = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(size,))
            pack(parts, torch.from_numpy(target))
            del target
            written = _map(tmp, size)
            if written is None:
                raise OSError(f"{tmp.name} cannot be mapped")
        except OSError as exc:
            reason = "the disk is full" if exc.errno == errno.ENOSPC else str(exc)
            self._warn(f"cannot write {path.name} in {path.parent} ({reason})")
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            return None
        with self._lock:
            if self._committer is None:
                self._committer = ThreadPoolExecutor(1, thread_name_prefix="chatloom-weight-cache")
            self._pending.append(self._committer.submit(_commit, fd, tmp, path))
        return written

    def wait(self) -> None:
        """Until every file written is on the disk under its name (the interpreter waits too at exit)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _warn(self, what: str) -> None:
        if not self._warned:  # once per load: the next layers would only say the same
            self._warned = True
            log.warning("weight cache: %s; packing weights in memory", what)
