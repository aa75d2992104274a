"""Verifier workers run in parallel, are warmed before any clock starts, and a batch has a deadline."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpost.config.errors import ConfigError
from rlpost.config.schema.env import SyntheticEnvConfig
from rlpost.environments.verifier_pool import VerifierPool
from tests.unit.environments.pool_fns import hang_or_match, logged_sleep, slow_warmup
from tests.unit.environments.slow_import_fns import match


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, d in events:
        running += d
        peak = max(peak, running)
    return peak


def test_calls_run_in_parallel_up_to_num_workers(tmp_path: Path) -> None:
    pool = VerifierPool(logged_sleep, num_workers=2, timeout_s=30.0)
    try:
        names = ["a", "b", "c", "d"]
        res = pool.run([(n, str(tmp_path)) for n in names])
        assert res.rewards == [1.0] * 4 and res.timeouts == 0 and res.errors == 0
    finally:
        pool.shutdown()
    intervals = [tuple(map(float, (tmp_path / n).read_text().split())) for n in names]
    assert _max_overlap(intervals) == 2  # two at a time: never serial, never more than num_workers


def test_a_stop_cuts_a_slow_batch_short_after_its_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM during the steps (rlpost.runtime.stop_request.STOP) must not wait out a batch deadline of minutes:
    the batch gets GRACE_S more, then what is unfinished scores 0 and counts as a timeout, as at the deadline."""
    import threading

    from rlpost.runtime import stop_request

    monkeypatch.setattr(stop_request, "GRACE_S", 1.0)
    pool = VerifierPool(hang_or_match, num_workers=2, timeout_s=600.0, batch_timeout_s=600.0)
    timer = threading.Timer(1.0, stop_request.STOP.set)
    try:
        timer.start()
        res = pool.run([("a", "a"), ("hang", "x"), ("b", "b"), ("hang", "x"), ("c", "c")])
        assert res.rewards == [1.0, 0.0, 1.0, 0.0, 0.0] and res.unfinished == 3 and res.timeouts == 3
        assert res.seconds < 30.0  # the stop ended it, not the 600 s deadlines
    finally:
        timer.cancel()
        stop_request.STOP.clear()
        pool.shutdown()


def test_batch_deadline_zeroes_and_counts_the_unfinished_samples() -> None:
    pool = VerifierPool(hang_or_match, num_workers=2, timeout_s=600.0, batch_timeout_s=1.5)
    try:
        res = pool.run([("a", "a"), ("hang", "x"), ("b", "b"), ("hang", "x"), ("c", "c")])
        # a and b finish; both workers then hang until the batch deadline, c never starts
        assert res.rewards == [1.0, 0.0, 1.0, 0.0, 0.0]
        assert res.timeouts == 3 and res.unfinished == 3 and res.errors == 0
        assert res.seconds < 60.0  # the batch deadline ended it, not the 600 s per-call timeout
        # the killed workers were replaced and serve the next batch
        assert pool.map([("z", "z"), ("y", "y")]) == ([1.0, 1.0], 0, 0)
    finally:
        pool.shutdown()


def test_a_slow_import_does_not_count_against_the_call_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPOST_TEST_SLOW_IMPORT_S", "1.5")  # inherited by the spawned workers only
    pool = VerifierPool(match, num_workers=2, timeout_s=0.5)
    try:
        assert pool.map([("a", "a"), ("b", "c"), ("d", "d")]) == ([1.0, 0.0, 1.0], 0, 0)
    finally:
        pool.shutdown()


def test_a_replaced_worker_is_warmed_before_its_next_call() -> None:
    pool = VerifierPool(hang_or_match, num_workers=1, timeout_s=0.5, warmup=slow_warmup)
    try:
        res = pool.run([("hang", "x"), ("a", "a"), ("b", "b")])
        assert res.rewards == [0.0, 1.0, 1.0]
        assert res.timeouts == 1 and res.unfinished == 0
    finally:
        pool.shutdown()


def test_a_worker_that_never_gets_ready_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPOST_TEST_SLOW_IMPORT_S", "1.5")
    pool = VerifierPool(match, num_workers=1, timeout_s=0.5, warmup_timeout_s=0.2)
    try:
        with pytest.raises(RuntimeError, match="not ready within 0.2 s"):
            pool.run([("a", "a")])
    finally:
        pool.shutdown()


@pytest.mark.parametrize("field", ["batch_timeout_s", "slow_warning_s"])
def test_deadline_fields_must_be_positive(field: str) -> None:
    cfg = SyntheticEnvConfig(task="copy_digit", **{field: 0.0})
    with pytest.raises(ConfigError, match=f"env.synthetic.{field}"):
        cfg.check("env.synthetic")
