"""Logger config (`logger=default`): console, JSONL, TensorBoard, W&B, MLflow and per-step resource metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpost.config.errors import require
from rlpost.config.fields import NON_NEGATIVE, Block, checked
from rlpost.config.schema.advisories import AdvisoriesConfig


@dataclass
class TensorboardConfig:
    """TensorBoard writer."""

    log_dir: str | None = None
    """Event-file directory; None = <run dir>/tensorboard."""


@dataclass
class WandbConfig:
    """Weights & Biases (`logger.wandb_enabled=true`; NeMo RL's `logger.wandb` block)."""

    project: str = "rlpost"
    """W&B project."""
    name: str | None = None
    """Run name; None = the run directory's name (a sweep job: <sweep dir name>/<job number>)."""
    dir: str | None = None
    """Where wandb writes its run files (`wandb/offline-run-*` or `wandb/run-*`); None = the run directory."""
    mode: str | None = None
    """online, offline or disabled; None = online when an API key is configured (WANDB_API_KEY or `wandb login`),
    else offline (sync later with `wandb sync <dir>/wandb/offline-run-*`)."""

    def check(self, path: str) -> None:
        require(self.mode in (None, "online", "offline", "disabled"), f"{path}.mode", self.mode,
                "must be online, offline, disabled or null")


@dataclass
class MlflowConfig:
    """MLflow (`logger.mlflow_enabled=true`; NeMo RL's `logger.mlflow` block)."""

    experiment_name: str = "rlpost"
    """MLflow experiment, created when missing."""
    run_name: str | None = None
    """Run name; None = the run directory's name (a sweep job: <sweep dir name>/<job number>)."""
    tracking_uri: str | None = None
    """Tracking server (http://host:port) or store URI; None = a local SQLite store, sqlite:///<run dir>/mlflow.db
    (artifacts in <run dir>/mlartifacts)."""


@dataclass
class LoggerConfig(Block):
    """Where metrics go."""

    log_dir: str | None = None
    """Directory of metrics.jsonl; None = the Hydra run directory."""
    jsonl_enabled: bool = True
    """Write one JSON object per step to <log_dir>/metrics.jsonl."""
    tensorboard_enabled: bool = True
    """Write TensorBoard event files."""
    wandb_enabled: bool = False
    """Log each step's metrics and the config to Weights & Biases (`logger.wandb`); a tracker that fails to start is
    one warning line and the run goes on without it."""
    mlflow_enabled: bool = False
    """Log each step's metrics and the config to MLflow (`logger.mlflow`); a tracker that fails to start is one
    warning line and the run goes on without it."""
    swanlab_enabled: bool = False
    """SwanLab (not available in rlpost)."""
    monitor_gpus: bool = False
    """Log each policy rank's CUDA memory (and utilisation when NVML is installed) every step as gpu/rank<r>/*
    (GPU only)."""
    resource_metrics: bool = True
    """Log every step, under resources/: each Ray actor's CPU % and RSS (actors on the driver's node; with a GPU, each
    process's GPU memory and each device's utilisation), the driver's own, and the tokens/s of generation and
    training (rlpost.runtime.resources)."""
    console_progress: bool = True
    """Show a rich progress bar with step, reward and step time."""
    ray_timeline: bool = False
    """At the end of the run (or its failure), write Ray's task timeline to <log_dir>/ray_timeline.json: every call of
    every actor (engines, policy workers, a reward model's scorer, the replay buffer) on one clock, each worker's row
    named after its actor, and the driver's timed phases (timing/*) beside them; a Chrome trace to open in Perfetto
    (ui.perfetto.dev) or chrome://tracing (rlpost.runtime.ray_timeline)."""
    tensorboard: TensorboardConfig = field(default_factory=TensorboardConfig)
    """TensorBoard options."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B options."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow options."""
    advisories: AdvisoriesConfig = field(default_factory=AdvisoriesConfig)
    """Run-health advisories: warnings when a run goes nowhere (zero-variance groups, truncation, drift, a flat
    reward, collapsing throughput, stalls)."""

    def check(self, path: str) -> None:
        super().check(path)
        require(
            not self.swanlab_enabled,
            f"{path}.swanlab_enabled",
            True,
            "this backend is not bundled with rlpost",
            "use W&B (logger.wandb_enabled), MLflow (logger.mlflow_enabled), TensorBoard or metrics.jsonl",
        )
        self.wandb.check(f"{path}.wandb")
        self.advisories.check(f"{path}.advisories")


@dataclass
class GRPOLoggerConfig(LoggerConfig):
    """LoggerConfig plus GRPO's sample printing."""

    num_val_samples_to_print: int = checked(0, NON_NEGATIVE)
    """Validation samples printed to the console at each validation, one line each: prompt -> response (reward)."""
