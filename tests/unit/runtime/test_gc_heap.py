"""rlpost.runtime.gc_heap: the collector paused over a block, what the block made frozen (or freed first), and the
starts that use it (the driver's checks, a policy worker, a vLLM engine) collect a few
times instead of hundreds."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

import pytest

from rlpost.runtime.gc_heap import YOUNG_THRESHOLD, collect_and_freeze, import_frozen, paused_gc, raise_young_threshold


class _Node:
    """A weak-referenceable object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    was, thresholds = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()  # what a test froze goes back to the oldest generation
    (gc.enable if was else gc.disable)()


def _cycle() -> weakref.ref[_Node]:
    """A cyclic object with no other reference: only a collection frees it."""
    return weakref.ref(_Node())


def test_the_block_runs_without_the_collector_and_freezes_what_it_made() -> None:
    gc.enable()
    before = gc.get_freeze_count()
    with paused_gc():
        assert not gc.isenabled()
        kept = [{"x": i} for i in range(1000)]  # tracked containers
        garbage = _cycle()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + 1000
    gc.collect()
    assert garbage() is not None  # frozen: cyclic garbage made inside the block is never collected
    assert len(kept) == 1000


def test_without_freeze_the_blocks_garbage_is_collected_afterwards() -> None:
    gc.enable()
    before = gc.get_freeze_count()
    with paused_gc(freeze=False):
        garbage = _cycle()
    assert gc.isenabled() and gc.get_freeze_count() == before
    gc.collect()
    assert garbage() is None


def test_collect_and_freeze_frees_garbage_and_freezes_the_rest() -> None:
    with paused_gc(freeze=False):
        garbage = _cycle()
        kept = _Node()
    collect_and_freeze()
    assert garbage() is None
    assert gc.get_freeze_count() > 0 and kept.me is kept


def test_a_nested_block_and_a_process_without_the_collector_are_left_alone() -> None:
    gc.enable()
    with paused_gc():
        with paused_gc():
            pass
        assert not gc.isenabled()  # the inner block did not turn it back on
    assert gc.isenabled()
    gc.disable()
    before = gc.get_freeze_count()
    with paused_gc():
        pass
    assert not gc.isenabled() and gc.get_freeze_count() == before


def test_the_collector_comes_back_after_an_error() -> None:
    gc.enable()
    with pytest.raises(ValueError), paused_gc():
        raise ValueError("boom")
    assert gc.isenabled()


def test_import_frozen_imports_and_freezes_once() -> None:
    gc.enable()
    sys.modules.pop("colorsys", None)
    import_frozen("colorsys")
    assert "colorsys" in sys.modules and gc.get_freeze_count() > 0 and gc.isenabled()
    gc.unfreeze()
    garbage = _cycle()  # a second engine's start must not freeze what the first left as cyclic garbage
    import_frozen("colorsys")
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert garbage() is None


def test_the_young_threshold_is_raised_never_lowered() -> None:
    gc.set_threshold(700, 11, 12)
    raise_young_threshold()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 11, 12)
    gc.set_threshold(10 * YOUNG_THRESHOLD, 11, 12)
    raise_young_threshold()
    assert gc.get_threshold() == (10 * YOUNG_THRESHOLD, 11, 12)
