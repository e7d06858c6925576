"""A serving process's collector pacing: thresholds set, the startup heap frozen, once."""
import gc
import threading
import time

import pytest

from chatloom.serving import gc_pacing
from chatloom.settings import SettingsError, load_settings
from chatloom.settings.tree import RuntimeSettings


@pytest.fixture
def restored_collector(monkeypatch):
    """The test process's collector as it was, whatever the test does to it."""
    thresholds = gc.get_threshold()
    monkeypatch.setattr(gc_pacing, "_paced", None)
    yield
    gc_pacing.stop()
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_start_sets_thresholds_and_freezes_once(restored_collector):
    before = gc.get_freeze_count()
    gc_pacing.start(RuntimeSettings(gc_thresholds=[900, 7, 50], gc_young_interval_ms=0))
    assert gc.get_threshold() == (900, 7, 50)
    frozen = gc.get_freeze_count()
    assert frozen > before + 1000  # the modules, classes and functions imported so far

    # Tracked objects made after the start. The frozen count only falls meanwhile, as frozen objects
    # are freed by reference counting.
    kept = [[i] for i in range(2000)]
    gc_pacing.start(RuntimeSettings(gc_thresholds=[700, 10, 10]))  # a second start changes nothing
    assert gc.get_threshold() == (900, 7, 50)
    assert gc.get_freeze_count() <= frozen  # the new lists were not frozen

    before_load = gc.get_freeze_count()
    gc_pacing.after_load()  # what the model's load built is frozen too
    assert gc.get_freeze_count() >= before_load + len(kept) // 2


def test_without_freezing_only_the_thresholds_change(restored_collector):
    before = gc.get_freeze_count()
    gc_pacing.start(RuntimeSettings(gc_freeze=False, gc_young_interval_ms=0))
    assert gc.get_threshold() == (700, 10, 2000)
    assert not [t for t in threading.enumerate() if t.name == gc_pacing.PACER_THREAD]
    assert gc.get_freeze_count() == before
    gc_pacing.after_load()
    assert gc.get_freeze_count() == before


def test_after_load_does_nothing_in_a_process_that_did_not_start_pacing(restored_collector):
    before = gc.get_freeze_count()
    gc_pacing.after_load()
    assert gc.get_freeze_count() == before


@pytest.mark.parametrize("value", ["[0, 10, 100]", "[700, -1, 100]", "[700, 10]"])
def test_bad_thresholds_are_refused_with_the_setting_named(monkeypatch, value):
    monkeypatch.setenv("CHATLOOM_RUNTIME__GC_THRESHOLDS", value)
    with pytest.raises(SettingsError, match="runtime.gc_thresholds"):
        load_settings()


def test_the_clock_collects_the_younger_generations_from_its_own_thread(restored_collector):
    seen: list[tuple[int, str]] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((info["generation"], threading.current_thread().name))

    gc.callbacks.append(note)
    try:
        gc_pacing.start(RuntimeSettings(gc_freeze=False, gc_young_interval_ms=5))
        deadline = time.monotonic() + 20
        while (1, gc_pacing.PACER_THREAD) not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (1, gc_pacing.PACER_THREAD) in seen
        assert all(gen < 2 for gen, thread in seen if thread == gc_pacing.PACER_THREAD)
        gc_pacing.stop()
        deadline = time.monotonic() + 20
        while [t for t in threading.enumerate() if t.name == gc_pacing.PACER_THREAD] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not [t for t in threading.enumerate() if t.name == gc_pacing.PACER_THREAD]
    finally:
        gc.callbacks.remove(note)


def test_a_negative_interval_is_refused(monkeypatch):
    monkeypatch.setenv("CHATLOOM_RUNTIME__GC_YOUNG_INTERVAL_MS", "-5")
    with pytest.raises(SettingsError, match="runtime.gc_young_interval_ms"):
        load_settings()
