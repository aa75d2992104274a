"""Logger config (`logger=default`): console, JSONL and TensorBoard."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpost.config.errors import require


@dataclass
class TensorboardConfig:
    """TensorBoard writer."""

    log_dir: str | None = None
    """Event-file directory; None = <run dir>/tensorboard."""


@dataclass
class WandbConfig:
    """Weights & Biases (not bundled: must stay disabled)."""

    project: str = "rlpost"
    """Project name."""
    name: str = "rlpost"
    """Run name."""


@dataclass
class LoggerConfig:
    """Where metrics go."""

    log_dir: str | None = None
    """Directory of metrics.jsonl; None = the Hydra run directory."""
    jsonl_enabled: bool = True
    """Write one JSON object per step to <log_dir>/metrics.jsonl."""
    tensorboard_enabled: bool = True
    """Write TensorBoard event files."""
    wandb_enabled: bool = False
    """Weights & Biases (not available in rlpost)."""
    mlflow_enabled: bool = False
    """MLflow (not available in rlpost)."""
    swanlab_enabled: bool = False
    """SwanLab (not available in rlpost)."""
    monitor_gpus: bool = False
    """Log each policy rank's CUDA memory (and utilisation when NVML is installed) every step as gpu/rank<r>/*
    (GPU only)."""
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
    """W&B options (kept for NeMo RL config compatibility)."""

    def check(self, path: str) -> None:
        for name in ("wandb_enabled", "mlflow_enabled", "swanlab_enabled"):
            require(
                not getattr(self, name),
                f"{path}.{name}",
                True,
                "this backend is not bundled with rlpost",
                "use TensorBoard (logger.tensorboard_enabled) or metrics.jsonl",
            )


@dataclass
class GRPOLoggerConfig(LoggerConfig):
    """LoggerConfig plus GRPO's sample printing."""

    num_val_samples_to_print: int = 0
    """Validation samples printed to the console at each validation, one line each: prompt -> response (reward)."""

    def check(self, path: str) -> None:
        super().check(path)
        require(
            self.num_val_samples_to_print >= 0,
            f"{path}.num_val_samples_to_print",
            self.num_val_samples_to_print,
            "must be >= 0",
        )
