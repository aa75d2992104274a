"""Async GRPO's replay buffer: generation order, a capacity, and no batch past the age limit ever handed out."""

from __future__ import annotations

from rlpost.algorithms.replay_buffer import ReplayBuffer, Trajectories


def _entry(version: int, index: int) -> Trajectories:
    return Trajectories(batch=None, version=version, index=index, loader_state={"epoch": 0, "index": index})


def test_take_returns_batches_in_generation_order_and_drops_the_stale_ones() -> None:
    buf = ReplayBuffer(capacity=3)
    assert all(buf.push(_entry(v, i)) for i, v in enumerate([0, 1, 2], start=1))
    assert not buf.has_room() and not buf.push(_entry(3, 4))  # full: refused, not silently dropped
    # the update from version 3 with max age 1 may use versions >= 2 only
    taken = buf.take(min_version=2)
    assert taken is not None and (taken.version, taken.index) == (2, 3)
    assert buf.stats() == {"size": 0.0, "dropped_stale": 2.0}
    assert taken.extra == {"buffer_size": 0.0, "buffer_dropped_stale": 2.0}  # what the trainer logs, no call needed
    assert buf.take(min_version=0) is None and buf.has_room()


def test_a_fresh_enough_batch_is_never_dropped() -> None:
    buf = ReplayBuffer(capacity=2)
    buf.push(_entry(4, 1))
    buf.push(_entry(5, 2))
    assert [buf.take(min_version=4).index, buf.take(min_version=4).index] == [1, 2]  # type: ignore[union-attr]
    assert buf.stats()["dropped_stale"] == 0.0
