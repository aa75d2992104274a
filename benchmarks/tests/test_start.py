"""benchmarks.start: the summary of its rounds, and the first-row clock on a real (failing) launch."""

from __future__ import annotations

import pytest

from benchmarks import start as bs


def test_the_summary_takes_medians_and_pairs_each_round() -> None:
    r = bs.summarise([16.0, 12.0, 13.0], [8.0, 6.0, 10.0], [0.5, 4.0, 1.0])
    assert r["first_step_median_s"] == 13.0 and r["bare_engine_median_s"] == 8.0
    assert r["exit_median_s"] == 1.0 and r["exit_limit_s"] == bs.EXIT_LIMIT_S
    assert r["ratio_median"] == 2.0  # per round 2.0, 2.0, 1.3: the median of the pairs, not 13 / 8
    assert r["meets_target"] is True and r["target_s"] == 15.0
    assert bs.summarise([15.5], [9.0], [1.0])["meets_target"] is False
    rows = bs.table_rows(r)
    assert [row.ratio for row in rows] == [2.0, round(1.0 / bs.EXIT_LIMIT_S, 3)]


def test_a_run_that_writes_no_metrics_row_is_an_error() -> None:
    """A bad override exits 2 before any step: the clock does not report a time for it."""
    with pytest.raises(RuntimeError, match="exited 2 without a metrics row"):
        bs.first_row_s(["grpo.no_such_key=1"])
