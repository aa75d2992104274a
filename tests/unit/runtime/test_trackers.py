"""The W&B and MLflow trackers behind MetricsLogger: the same rows as metrics.jsonl and the config, read back with the
trackers' own readers (mlflow.search_runs; W&B's offline run file through wandb's record schema), and a tracker that
cannot start is one warning line while the others go on."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from rlpost.config.schema.logger import LoggerConfig, MlflowConfig, WandbConfig
from rlpost.runtime.metrics_logger import MetricsLogger
from rlpost.runtime.trackers import flat, mlflow_key, run_label
from tests import wandb_records

ROWS = [{"train/reward": 0.1, "train/loss": 2.0}, {"train/reward": 0.3, "train/loss": 1.5, "not/scalar": "x"},
        {"train/reward": 0.6, "train/loss": float("nan")}]
CONFIG = "grpo:\n  max_num_steps: 3\npolicy:\n  optimizer:\n    kwargs:\n      lr: 0.001\n"


def _log_run(cfg: LoggerConfig, run_dir: Path) -> MetricsLogger:
    logger = MetricsLogger(cfg, run_dir)
    logger.log_hyperparams(CONFIG)
    for step, row in enumerate(ROWS, start=1):
        logger.log(row, step)
    logger.close()
    return logger


@pytest.fixture(autouse=True)
def _no_wandb_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: offline
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_and_mlflow_hold_the_rows_and_the_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run-a"
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=True, mlflow_enabled=True, resource_metrics=False)
    _log_run(cfg, run_dir)
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    path = wandb_records.run_file(run_dir)
    hist = wandb_records.history(path)
    assert [h["_step"] for h in hist] == [1, 2, 3]
    assert [h["train/reward"] for h in hist] == [r["train/reward"] for r in jsonl]
    assert "train/loss" not in hist[2] and "not/scalar" not in hist[1]  # the same finite scalars as the JSONL
    assert wandb_records.config(path)["grpo"] == {"max_num_steps": 3}

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    df = mlflow.search_runs(experiment_names=["rlpost"])
    assert len(df) == 1 and df.loc[0, "tags.mlflow.runName"] == "run-a" and df.loc[0, "status"] == "FINISHED"
    assert df.loc[0, "metrics.train/reward"] == pytest.approx(0.6)  # the last step's
    assert df.loc[0, "params.policy.optimizer.kwargs.lr"] == "0.001"
    history = mlflow.MlflowClient().get_metric_history(df.loc[0, "run_id"], "train/reward")
    assert [(m.step, m.value) for m in history] == [(1, 0.1), (2, 0.3), (3, 0.6)]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_tracker_that_cannot_start_is_one_warning_and_the_others_go_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"http://127.0.0.1:{_closed_port()}"
    cfg = LoggerConfig(tensorboard_enabled=False, wandb_enabled=True, mlflow_enabled=True, resource_metrics=False,
                       wandb=WandbConfig(name="named"), mlflow=MlflowConfig(tracking_uri=uri))
    logger = _log_run(cfg, tmp_path / "run")
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("rlpost: warning: ")]
    assert len(warnings) == 1 and "logger.mlflow_enabled: the tracker did not start" in warnings[0], err
    assert logger.trackers == []  # closed
    assert len(wandb_records.history(wandb_records.run_file(tmp_path / "run"))) == 3
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def test_names_and_params() -> None:
    assert run_label(Path("/x/multirun/2026-01-01/12-00-00/3")) == "12-00-00/3"
    assert run_label(Path("/x/outputs/run")) == "run"
    assert flat({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": "1", "a.c": "[1, 2]", "d": "None"}
    assert mlflow_key("resources/vllm-replica0/cpu_percent") == "resources/vllm-replica0/cpu_percent"
    assert mlflow_key("gpu:0/used%") == "gpu_0/used_"
