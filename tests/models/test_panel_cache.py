"""The weight cache (models/panel_cache.py): a K-quant file's panels are packed into files on the first
load and mapped on later ones, with the same bits; a changed source or layout is packed again; a cache
that cannot be written costs nothing but the packing."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from chatloom.models.kernels import load_kernels
from chatloom.models.loader import load_model
from chatloom.models.packed_linear import KQuantLinear, kquant_matmul_supported
from chatloom.models.panel_cache import PanelCache, cache_folder, default_folder

import tiny_checkpoints as tc

kernels = load_kernels()
pytestmark = pytest.mark.skipif(not kquant_matmul_supported(kernels), reason="super-block panels need AVX-512")
SEQS = [list(range(3, 40)), [7, 8, 9]]


@pytest.fixture
def gguf(tmp_path):
    cfg = tc.hf_config("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64)
    path = tmp_path / "kq.gguf"
    tc.write_kquant_gguf(path, cfg, seed=2)
    return path


def _load(path, cache_dir, int8=False):
    """A load through the cache (waiting until its files are committed), and the cache's counters."""
    seen = []
    real = PanelCache.__init__

    def record(self, folder):
        real(self, folder)
        seen.append(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(PanelCache, "__init__", record)
        loaded = load_model(str(path), "fp32", int8_matmul=int8, weight_cache=cache_dir)
    for cache in seen:
        cache.wait()
    return loaded, (seen[0] if seen else None)


def _panel_files(cache_dir):
    return sorted(p for p in cache_dir.rglob("*.panels"))


@pytest.mark.parametrize("int8", [False, True])
def test_a_later_load_maps_the_panels_with_the_same_bits(gguf, tmp_path, int8):
    if int8 and not (hasattr(kernels, "kquant_int8_supported") and kernels.kquant_int8_supported()):
        pytest.skip("the int8 super-block kernel needs AVX-512 VNNI")
    plain = load_model(str(gguf), "fp32", int8_matmul=int8)
    first, cache = _load(gguf, tmp_path / "wc", int8)
    assert cache.written > 0 and cache.mapped == 0 and cache.unsaved == 0
    files = _panel_files(tmp_path / "wc")
    assert files and not list((tmp_path / "wc").rglob("*.tmp"))  # every file renamed once synced
    second, cache = _load(gguf, tmp_path / "wc", int8)
    assert cache.mapped == first_bytes(first) and cache.written == 0
    assert _panel_files(tmp_path / "wc") == files
    layer = second.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, KQuantLinear) and _mapped_file(layer.blob) in files
    want = plain.model.dense_logits(SEQS)
    for got in (first.model.dense_logits(SEQS), second.model.dense_logits(SEQS)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _mapped_file(t: torch.Tensor):
    """The file whose mapping holds the tensor's memory (from /proc/self/maps), or None."""
    from pathlib import Path

    address = t.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return Path(fields[5].strip()) if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def first_bytes(loaded) -> int:
    return sum(m.blob.numel() for m in loaded.model.modules() if isinstance(m, KQuantLinear))


def test_exact_and_int8_panels_are_kept_apart(gguf, tmp_path):
    if not (hasattr(kernels, "kquant_int8_supported") and kernels.kquant_int8_supported()):
        pytest.skip("the int8 super-block kernel needs AVX-512 VNNI")
    _, exact = _load(gguf, tmp_path / "wc", False)
    _, fast = _load(gguf, tmp_path / "wc", True)
    assert exact.written and fast.written and not fast.mapped  # Q6_K packs differently for int8


def test_a_rewritten_source_is_packed_again_and_its_old_folder_removed(gguf, tmp_path):
    _load(gguf, tmp_path / "wc")
    old = {p.parent for p in _panel_files(tmp_path / "wc")}
    cfg = tc.hf_config("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64)
    tc.write_kquant_gguf(gguf, cfg, seed=3)  # other weights under the same name
    os.utime(gguf, ns=(os.stat(gguf).st_atime_ns, os.stat(gguf).st_mtime_ns + 10**9))
    loaded, cache = _load(gguf, tmp_path / "wc")
    assert cache.written and not cache.mapped
    assert {p.parent for p in _panel_files(tmp_path / "wc")}.isdisjoint(old) and not any(d.exists() for d in old)
    plain = load_model(str(gguf), "fp32")
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.dense_logits(SEQS), plain.model.dense_logits(SEQS)))


def test_a_file_that_does_not_match_the_packer_is_packed_again(gguf, tmp_path, caplog):
    _load(gguf, tmp_path / "wc")
    victim = max(_panel_files(tmp_path / "wc"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF  # as a changed layout or a damaged file would differ
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        loaded, cache = _load(gguf, tmp_path / "wc")
    assert cache.stale == 1 and cache.written == victim.stat().st_size
    assert "does not hold what the kernels pack now" in caplog.text
    plain = load_model(str(gguf), "fp32")
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.dense_logits(SEQS), plain.model.dense_logits(SEQS)))


def test_a_cache_that_cannot_be_written_only_costs_the_packing(gguf, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        loaded, cache = _load(gguf, blocked / "wc")
    assert cache.unsaved == first_bytes(loaded) and not cache.written
    assert caplog.text.count("weight cache:") == 1  # said once, not per layer
    plain = load_model(str(gguf), "fp32")
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.dense_logits(SEQS), plain.model.dense_logits(SEQS)))


def test_a_full_disk_leaves_no_file_behind(gguf, tmp_path, monkeypatch, caplog):
    import errno

    def no_room(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with caplog.at_level(logging.WARNING):
        loaded, cache = _load(gguf, tmp_path / "wc")
    assert "the disk is full" in caplog.text and not cache.written
    assert not _panel_files(tmp_path / "wc") and not list((tmp_path / "wc").rglob("*.tmp"))


def test_leftovers_of_a_dead_writer_are_removed(gguf, tmp_path):
    _load(gguf, tmp_path / "wc")
    folder = _panel_files(tmp_path / "wc")[0].parent
    dead = folder / f".x.panels.{2**22 + 12345}.tmp"  # above any pid this machine hands out
    dead.write_bytes(b"half")
    alive = folder / f".y.panels.{os.getpid()}.tmp"
    alive.write_bytes(b"being written")
    _load(gguf, tmp_path / "wc")
    assert not dead.exists() and alive.exists()


def test_the_setting_names_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_folder() == tmp_path / "chatloom" / "weights"
    assert cache_folder("auto") == tmp_path / "chatloom" / "weights"
    assert cache_folder("") is None and cache_folder("off") is None and cache_folder(" OFF ") is None
    assert cache_folder("~/w") == cache_folder("~/w").expanduser() and cache_folder("/srv/w").as_posix() == "/srv/w"
