"""When async GRPO's collector may start its next batch: as soon as the weights it will generate with are at most
max_trajectory_age_steps versions older than the policy that trains it (not once the buffer has room)."""

from __future__ import annotations

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
