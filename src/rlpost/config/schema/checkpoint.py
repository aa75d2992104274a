"""Checkpointing config (`checkpointing=default`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlpost.config.errors import ConfigError, did_you_mean, require
from rlpost.config.fields import POSITIVE, POSITIVE_OR_NONE, Block, checked


@dataclass
class CheckpointingConfig(Block):
    """Periodic, atomic checkpoints and automatic resume."""

    enabled: bool = True
    """Save checkpoints and resume from the latest one."""
    checkpoint_dir: str | None = None
    """Directory of step_N checkpoints; None = <run dir>/checkpoints."""
    metric_name: str | None = "val:accuracy"
    """'val:<metric>' or 'train:<metric>' ranking checkpoints for keep_top_k; None = keep the newest."""
    higher_is_better: bool = True
    """Direction of metric_name."""
    keep_top_k: int | None = checked(3, POSITIVE_OR_NONE)
    """Checkpoints kept (the latest is always kept too); None = keep all."""
    save_period: int = checked(10, POSITIVE)
    """Save every this many steps (and at the last step)."""
    checkpoint_must_save_by: str | None = None
    """Wall-clock budget 'DD:HH:MM:SS' from the run's start: when the next step (plus a save) would pass it,
    the run saves a checkpoint and stops with exit 0; re-running the command resumes."""
    model_save_format: str = "safetensors"
    """Tensor file format of checkpoints: only 'safetensors' ('torch_save' pickles, which can run code when loaded)."""
    save_consolidated: bool = True
    """Write the consolidated HF export (policy/weights/hf, loadable with from_pretrained) in every checkpoint."""
    force_resume: bool = False
    """Resume even if the checkpoint's model or config fingerprint differs."""
    save_on_interrupt: bool = False
    """On Ctrl-C / SIGTERM, finish the current step and save a checkpoint before exiting."""

    def check(self, path: str) -> None:
        super().check(path)
        require(
            self.model_save_format == "safetensors",
            f"{path}.model_save_format",
            self.model_save_format,
            "rlpost writes checkpoints as safetensors only: torch_save writes pickles, and loading a pickle can "
            "run code",
            "use checkpointing.model_save_format=safetensors",
        )
        if self.metric_name is not None:
            require(
                self.metric_name.startswith(("val:", "train:")),
                f"{path}.metric_name",
                self.metric_name,
                "must start with 'val:' or 'train:'",
            )
        if self.checkpoint_must_save_by is not None:
            key = f"{path}.checkpoint_must_save_by"
            require(wall_budget_s(self.checkpoint_must_save_by) is not None, key, self.checkpoint_must_save_by,
                    "must be 'DD:HH:MM:SS' (hours < 24, minutes and seconds < 60) and more than 0 seconds")
            require(self.enabled, key, self.checkpoint_must_save_by,
                    "saving before the deadline needs checkpointing.enabled=true")


    def check_metric(self, path: str, logged: list[str] | None) -> None:
        """metric_name must be one of the metrics a training step `logged` (None: a custom loss, unknown)."""
        if not self.enabled or not self.metric_name or logged is None or self.metric_name in logged:
            return
        raise ConfigError(f"{path}.metric_name", self.metric_name,
                          f"no training step logs this metric; valid: {', '.join(logged)}",
                          did_you_mean(self.metric_name, logged))


def wall_budget_s(text: str) -> float | None:
    """Seconds of a 'DD:HH:MM:SS' budget; None when malformed or zero."""
    m = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", str(text))
    if m is None:
        return None
    d, h, mi, s = (int(x) for x in m.groups())
    if h >= 24 or mi >= 60 or s >= 60:
        return None
    total = float(((d * 24 + h) * 60 + mi) * 60 + s)
    return total if total > 0 else None
