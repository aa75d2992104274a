"""When async GRPO's collector may start its next batch: as soon as the weights it will generate with are at most
max_trajectory_age_steps versions older than the policy that trains it (not once the buffer has room)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from rlpost.algorithms.async_grpo import Collector


def _collector(version: int, max_age: int) -> Collector:
    none: Any = None
    return Collector(none, none, version, call_timeout_s=1.0, capacity=max_age)


def test_a_batch_starts_once_the_weights_that_make_it_are_recent_enough() -> None:
    c = _collector(version=0, max_age=1)
    assert c.index == 1 and c.fresh_enough()  # batch 1: trained at step 1 by version 0
    c.index = 2
    assert c.fresh_enough()  # batch 2, trained by version 1: version 0 is one version old
    c.index = 3
    assert not c.fresh_enough()  # batch 3 needs version >= 1: the first update must be staged first
    c.staged_version = 1
    assert c.fresh_enough()  # staged: the engine loads it before it generates the batch
    c.index = 4
    assert not c.fresh_enough()


def test_a_larger_age_limit_lets_generation_run_further_ahead() -> None:
    c = _collector(version=5, max_age=2)  # resumed after step 5
    assert c.index == 6
    c.index = 8
    assert c.fresh_enough()  # batch 8, trained by version 7: version 5 is two versions old
    c.index = 9
    assert not c.fresh_enough()
    c.version = 6  # an in-flight refit moves the engine's version itself (nothing staged)
    assert c.fresh_enough()


class _Engine:
    """Loads a staged copy when told to, and not before (`go`); records what it loaded and what it waited for."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.loaded: list[str] = []
        self.settled: list[str] = []

    def update_weights_from_buckets(self, buckets: Any) -> str:
        assert self.go.wait(timeout=10)
        self.loaded.append(buckets.fingerprint)
        return str(buckets.fingerprint)

    def wait_staged_copy(self, futures: Any, expected: str) -> tuple[str, float]:
        self.settled.append(expected)
        return expected, 0.001


def _slots_collector() -> tuple[Collector, _Engine]:
    engine = _Engine()
    components: Any = SimpleNamespace(generation=engine)
    return Collector(components, None, 0, call_timeout_s=1.0, capacity=1, fused=True), engine


def test_the_trainer_stages_into_a_slot_only_once_no_engine_reads_it() -> None:
    """Update v is staged into slot v % 2 by the training call. While the engine loads version 1 (slot 1), the
    trainer may write update 2 into slot 0 at once, but waits to write update 3 into slot 1 until that load ends."""
    c, engine = _slots_collector()
    c.publish(1, SimpleNamespace(fingerprint="v1"))  # type: ignore[arg-type]
    assert c.staged_version == 1 and c.version == 0
    loading = threading.Thread(target=c.sync_engine)
    loading.start()
    deadline = time.monotonic() + 10
    while c.readers[1] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.readers == [0, 1]
    c.free_slot(0)  # not read: returns at once
    writer = threading.Thread(target=c.free_slot, args=(1,))
    writer.start()
    writer.join(timeout=0.3)
    assert writer.is_alive()  # slot 1 is being read
    engine.go.set()
    loading.join(timeout=10)
    writer.join(timeout=10)
    assert not writer.is_alive() and c.readers == [0, 0]
    assert engine.loaded == ["v1"] and c.version == 1


def test_a_load_sent_early_is_settled_only_before_its_own_slot_is_written() -> None:
    c, engine = _slots_collector()
    c._loading = ([], "v2", 2)  # the engines were sent version 2 (slot 0) while the collector waited
    c.free_slot(1)
    assert engine.settled == [] and c.version == 0  # slot 1: the load goes on
    c.free_slot(0)
    assert engine.settled == ["v2"] and c.version == 2 and c._loading is None


class _OrderedEngine:
    """Records the order of the collector's calls: loads sent, loads waited for (the generation is `_generate`)."""

    runs_calls_in_order = True

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def load_staged_copy_async(self, staged: Any) -> list[str]:
        self.events.append(f"send load {staged.fingerprint}")
        return [staged.fingerprint]

    def wait_staged_copy(self, futures: Any, expected: str) -> tuple[str, float]:
        self.events.append(f"wait load {expected}")
        return expected, 0.004


def _generating_collector(chained: bool) -> tuple[Collector, list[str]]:
    events: list[str] = []
    components: Any = SimpleNamespace(generation=_OrderedEngine(events))
    c = Collector(components, None, 0, call_timeout_s=1.0, capacity=1, fused=True, chained=chained)

    def generate(version: int) -> Any:
        events.append(f"generate as version {version}")
        return SimpleNamespace(generation_s=0.030)

    c._generate = generate  # type: ignore[method-assign]
    return c, events


def test_a_chained_batch_is_sent_behind_its_load_and_the_load_is_checked_after() -> None:
    """Engines that run their calls in order get the batch's generation right behind the load: the load is waited
    for (and its fingerprint checked) only once the batch is back. The batch counts as the loaded version, and its
    generation time leaves out the engines' load."""
    c, events = _generating_collector(chained=True)
    c.publish(1, SimpleNamespace(fingerprint="v1"))  # type: ignore[arg-type]
    with c.engine_lock:
        entry = c._refit_and_generate()
    assert events == ["send load v1", "generate as version 1", "wait load v1"]
    assert c.version == 1 and c._loading is None and c.engine_refit_s == 0.004
    assert abs(entry.generation_s - 0.026) < 1e-9
    events.clear()
    with c.engine_lock:  # nothing newer staged: no load
        c._refit_and_generate()
    assert events == ["generate as version 1"]


def test_without_ordered_calls_the_load_is_waited_for_before_the_batch() -> None:
    c, events = _generating_collector(chained=False)
    c._loading = (["v1"], "v1", 1)  # sent early, while the collector waited for fresh weights
    c.staged_version = 1
    with c.engine_lock:
        c._refit_and_generate()
    assert events == ["wait load v1", "generate as version 1"]
