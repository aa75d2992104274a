"""The sweep summary with a failed job (its status and one line in the table and sweep_summary.json), and how
a sweep job's failure is recorded instead of ending the sweep (rlpost.train._failed / _job_error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlpost import sweep_summary, train
from rlpost.algorithms.loop import HealthCheckError
from rlpost.data.datasets import DataError
from rlpost.sweep_summary import (
    FAILURE_FILE,
    SweepSummary,
    best_job,
    failure_lines,
    sweep_rows,
    sweep_status,
)

LINE = "rlpost: error: step 2: train/loss=nan is not finite; the run stopped before saving this step"


def _job(sweep: Path, num: int, lr: str, rewards: list[float], failure: dict | None = None) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"policy.optimizer.kwargs.lr={lr}",
                                                                   "grpo.max_num_steps=2"]))
    (job / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "train/reward": r}) + "\n"
                                               for i, r in enumerate(rewards)))
    if failure is not None:
        (job / FAILURE_FILE).write_text(json.dumps(failure))


def test_a_failed_job_is_listed_with_its_status_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    _job(sweep, 0, "0.003", [0.1, 0.25])
    _job(sweep, 1, "1000000000.0", [0.125], {"exit_status": 3, "error": LINE})
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))

    summary = json.loads((sweep / "sweep_summary.json").read_text())
    rows = summary["jobs"]
    assert [(r["job"], r["exit_status"], r["error"]) for r in rows] == [(0, 0, None), (1, 3, LINE)]
    assert rows[0]["final_reward"] == 0.25
    assert summary["exit_status"] == 3 and sweep_summary.LAST_STATUS == [3]
    assert summary["best"] == {"job": 0, "metric": "train/reward", "value": 0.25,
                               "swept": {"policy.optimizer.kwargs.lr": "0.003"}}  # the failed job is not a candidate
    out = capsys.readouterr().out
    assert "best: policy.optimizer.kwargs.lr=0.003 (job 0, train/reward 0.250)" in out
    assert "status" in out and "failed (exit 3)" in out and "ok" in out
    assert "policy.optimizer.kwargs.lr" in out and "grpo.max_num_steps" not in out  # only the swept key
    assert f"job 1 (exit 3): {LINE}" in out  # the whole line, unwrapped, under the table


def test_every_job_succeeding_prints_no_failure_line_and_the_best_is_the_highest(tmp_path: Path) -> None:
    _job(tmp_path, 0, "0.003", [0.5])
    _job(tmp_path, 1, "0.03", [0.75])
    _job(tmp_path, 2, "0.3", [0.25])
    rows = sweep_rows(tmp_path)
    assert [r["exit_status"] for r in rows] == [0, 0, 0] and sweep_status(rows) == 0
    assert failure_lines(rows) == []
    best = best_job(rows)
    assert best is not None and best["job"] == 1 and best["swept"] == {"policy.optimizer.kwargs.lr": "0.03"}


def test_a_failure_without_a_line_still_says_so(tmp_path: Path) -> None:
    _job(tmp_path, 0, "0.003", [], {"exit_status": 1})
    assert failure_lines(sweep_rows(tmp_path)) == ["job 0 (exit 1): failed (no error line recorded)"]


@pytest.fixture(autouse=True)
def no_sweep_summed_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep_summary, "LAST_STATUS", [])


@pytest.fixture
def in_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(train, "_in_sweep", lambda: 1)
    monkeypatch.setattr(train, "_log_file", lambda: tmp_path / "train.log")
    monkeypatch.setattr(train, "SWEEP_FAILURES", [])


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (HealthCheckError("step 2: train/loss=nan is not finite"), 3, "rlpost: error: step 2: train/loss=nan is not finite"),
        (DataError("data.jsonl:3: empty 'problem'"), 2, "rlpost: error: data.jsonl:3: empty 'problem'"),
        (ZeroDivisionError("division by zero"), 1, "rlpost: error: unexpected ZeroDivisionError: division by zero (traceback in {log})"),
    ],
)
def test_a_sweep_job_failure_is_recorded_and_returns(in_sweep: None, tmp_path: Path, exc: BaseException, code: int,
                                                     line: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = line.format(log=tmp_path / "train.log")
    result = train._job_error(exc, tmp_path)
    assert result["exit_status"] == code and result["error"] == line
    assert json.loads((tmp_path / FAILURE_FILE).read_text()) == {"exit_status": code, "error": line}
    assert capsys.readouterr().err.strip() == line  # the same line a single run prints
    assert train.SWEEP_FAILURES == [(1, code)] and train.sweep_exit_status() == code


def test_the_sweep_ends_with_the_first_failed_jobs_status(in_sweep: None, tmp_path: Path) -> None:
    assert train.sweep_exit_status() == 0
    train.SWEEP_FAILURES.extend([(1, 3), (2, 2)])
    assert train.sweep_exit_status() == 3


@pytest.mark.parametrize("code", [130, 143])
def test_an_interrupt_stops_the_whole_sweep(in_sweep: None, tmp_path: Path, code: int) -> None:
    with pytest.raises(SystemExit) as ended:
        train._failed(code, "rlpost: error: interrupted by SIGINT", tmp_path)
    assert ended.value.code == code and train.SWEEP_FAILURES == [] and not (tmp_path / FAILURE_FILE).exists()


def test_a_single_run_still_exits_with_the_status(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(train, "SWEEP_FAILURES", [])
    with pytest.raises(SystemExit) as ended:
        train._failed(3, LINE, tmp_path)  # no Hydra multirun here: _in_sweep() is None
    assert ended.value.code == 3 and train.SWEEP_FAILURES == []
