"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases (`logger.wandb_enabled`) and MLflow
(`logger.mlflow_enabled`), under NeMo RL's key names (`logger.wandb`, `logger.mlflow`).

Each tracker logs the same finite scalars as metrics.jsonl, at the same step, and the run's resolved config. A tracker
that fails to start is one warning line and the run goes on with the others; one that fails later (a tracking server
gone) is dropped with one warning line too: a tracker never ends a run.

- W&B runs offline when no API key is configured (WANDB_API_KEY, or `wandb login`'s ~/.netrc entry) and writes
  <run dir>/wandb/offline-run-*; `wandb sync <that dir>` uploads it later.
- MLflow logs to a local SQLite store, sqlite:///<run dir>/mlflow.db (artifacts in <run dir>/mlartifacts), unless
  `logger.mlflow.tracking_uri` names a server (http://host:port) or another store. MLflow 3 refuses its plain
  file store (./mlruns), hence SQLite.
"""

from __future__ import annotations

import json
import netrc
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rlpost.config.schema.logger import LoggerConfig, MlflowConfig, WandbConfig
from rlpost.runtime import console as say

MLFLOW_DB = "mlflow.db"
"""The default MLflow store's file under the run directory."""
MLFLOW_ARTIFACTS = "mlartifacts"
"""The default MLflow store's artifact directory under the run directory."""


class Tracker(Protocol):
    """An experiment tracker: the step's scalars, the run's config, and the end of the run."""

    name: str

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def run_label(run_dir: Path) -> str:
    """A run's default name in a tracker: its directory's name, or <sweep dir>/<job> for a sweep job."""
    return f"{run_dir.parent.name}/{run_dir.name}" if run_dir.name.isdigit() else run_dir.name


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"} (lists as JSON), the form MLflow's params take."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat(v, f"{key}."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list | tuple) else str(v)
    return out


def wandb_api_key_configured() -> bool:
    """Whether W&B has a key: WANDB_API_KEY, or the ~/.netrc entry `wandb login` writes for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    """`logger.wandb_enabled`: one wandb run per rlpost run (a sweep: one per job)."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_dir: Path) -> None:
        import wandb

        self.mode = cfg.mode or ("online" if wandb_api_key_configured() else "offline")
        root = Path(cfg.dir) if cfg.dir else run_dir
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project, name=cfg.name or run_label(run_dir), dir=str(root), mode=self.mode,  # type: ignore[arg-type]
            reinit="create_new",  # each job of a sweep in this process is its own run
            settings=wandb.Settings(silent=True, console="off", disable_git=True),
        )
        self.dir = Path(self.run.dir).parent if self.mode != "disabled" else root
        """The run's own directory (wandb/offline-run-* or wandb/run-*)."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


def mlflow_key(name: str) -> str:
    """A metric or param name as MLflow takes it: letters, digits, `_ - . / ` and spaces; anything else becomes `_`."""
    return re.sub(r"[^\w\-./ ]", "_", name)


SERVER_PROBE_S = 5.0
"""How long a tracking server may take to answer its /health page before the tracker counts as not started (MLflow's
own client would retry for minutes)."""


def server_answers(uri: str) -> None:
    """Raise (OSError) unless the MLflow server at `uri` answers its /health page within SERVER_PROBE_S."""
    import urllib.request

    with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=SERVER_PROBE_S) as reply:  # noqa: S310 - http(s)
        if reply.status != 200:
            raise OSError(f"{uri}/health answered {reply.status}")


class MlflowTracker:
    """`logger.mlflow_enabled`: one MLflow run per rlpost run (a sweep: one per job), through MlflowClient (no global
    active run, so a sweep's jobs in one process stay apart)."""

    name = "mlflow"

    def __init__(self, cfg: MlflowConfig, run_dir: Path) -> None:
        import logging

        from mlflow import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store set-up notes would land above the progress bar

        self.uri = cfg.tracking_uri or f"sqlite:///{(run_dir / MLFLOW_DB).resolve()}"
        if self.uri.startswith(("http://", "https://")):
            server_answers(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(cfg.experiment_name)
        if exp is not None:
            exp_id = exp.experiment_id
        elif cfg.tracking_uri:  # a server or a store of the user's: its own artifact root
            exp_id = self.client.create_experiment(cfg.experiment_name)
        else:
            exp_id = self.client.create_experiment(
                cfg.experiment_name, artifact_location=(run_dir / MLFLOW_ARTIFACTS).resolve().as_uri())
        self.run_id = self.client.create_run(exp_id, run_name=cfg.run_name or run_label(run_dir)).info.run_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), float(v), ts, step)
                                                    for k, v in metrics.items()])

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(mlflow_key(k), v[:6000]) for k, v in flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def start_trackers(cfg: LoggerConfig, run_dir: Path) -> list[Tracker]:
    """The enabled trackers that started; each one that did not is one warning line."""
    trackers: list[Tracker] = []
    wanted: list[tuple[bool, str, Any]] = [
        (cfg.wandb_enabled, "logger.wandb_enabled", lambda: WandbTracker(cfg.wandb, run_dir)),
        (cfg.mlflow_enabled, "logger.mlflow_enabled", lambda: MlflowTracker(cfg.mlflow, run_dir)),
    ]
    for enabled, key, start in wanted:
        if not enabled:
            continue
        try:
            trackers.append(start())
        except Exception as exc:  # noqa: BLE001 - a tracker must not stop the run: one line, then the others
            say.warn(f"{key}: the tracker did not start, the run goes on without it ({_reason(exc)})")
    return trackers


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def call_each(trackers: list[Tracker], what: str, *args: Any) -> list[Tracker]:
    """Call `what` on every tracker; those that raise are closed and dropped with one warning line. Returns the
    trackers left."""
    alive: list[Tracker] = []
    for t in trackers:
        try:
            getattr(t, what)(*args)
            alive.append(t)
        except Exception as exc:  # noqa: BLE001 - a tracker failing mid-run is dropped, the run goes on
            say.warn(f"{t.name}: {what} failed, the tracker is dropped for the rest of the run ({_reason(exc)})")
            if what != "close":
                try:
                    t.close()
                except Exception:  # noqa: BLE001, S110 - already reported
                    pass
    return alive
