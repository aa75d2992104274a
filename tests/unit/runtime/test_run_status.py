"""run_status.json: what a launcher reads to decide whether starting the run again continues it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpost.runtime.run_status import read_status, resumable, write_status


def test_written_and_read_back(tmp_path: Path) -> None:
    assert read_status(tmp_path) is None
    write_status(tmp_path, "stopped", 143, 4, "rlpost: error: interrupted by SIGTERM")
    assert read_status(tmp_path) == {"state": "stopped", "exit_status": 143, "steps": 4,
                                     "error": "rlpost: error: interrupted by SIGTERM"}
    write_status(tmp_path / "missing", "failed", 2)  # an unwritable directory is left alone
    (tmp_path / "run_status.json").write_text("{broken")
    assert read_status(tmp_path) is None


@pytest.mark.parametrize("state, code, again", [("stopped", 0, True), ("stopped", 143, True), ("failed", 3, True),
                                                ("failed", 2, False), ("failed", 1, False), ("finished", 0, False)])
def test_what_resumes(tmp_path: Path, state: str, code: int, again: bool) -> None:
    write_status(tmp_path, state, code)  # type: ignore[arg-type]
    assert resumable(read_status(tmp_path)) is again


def test_a_run_that_ended_early_says_how_far_it_got(tmp_path: Path) -> None:
    """run_status.json's steps for a stopped or failed run: the last step metrics.jsonl records."""
    from rlpost.runtime.run_status import steps_done

    assert steps_done(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 0.5}\n{"step": 2, "x": 0.4}\n{"step": 3, "x"')
    assert steps_done(tmp_path) == 2  # the killed run's partial last line is skipped
