"""Checkpointing config (`checkpointing=default`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from rlpost.config.errors import one_of, positive, require


@dataclass
class CheckpointingConfig:
    """Periodic, atomic checkpoints and automatic resume."""

    enabled: bool = True
    """Save checkpoints and resume from the latest one."""
    checkpoint_dir: Optional[str] = None
    """Directory of step_N checkpoints; None = <run dir>/checkpoints."""
    metric_name: Optional[str] = "val:accuracy"
    """'val:<metric>' or 'train:<metric>' ranking checkpoints for keep_top_k; None = keep the newest."""
    higher_is_better: bool = True
    """Direction of metric_name."""
    keep_top_k: Optional[int] = 3
    """Checkpoints kept (the latest is always kept too); None = keep all."""
    save_period: int = 10
    """Save every this many steps (and at the last step)."""
    checkpoint_must_save_by: Optional[str] = None
    """Wall-clock budget 'DD:HH:MM:SS' after which the run saves and exits."""
    model_save_format: str = "safetensors"
    """'safetensors' or 'torch_save' for the consolidated export."""
    save_consolidated: bool = False
    """Also write a consolidated HF model directory."""
    force_resume: bool = False
    """Resume even if the checkpoint's model or config fingerprint differs."""
    save_on_interrupt: bool = False
    """On Ctrl-C / SIGTERM, finish the current step and save a checkpoint before exiting."""

    def check(self, path: str) -> None:
        positive(f"{path}.save_period", self.save_period)
        positive(f"{path}.keep_top_k", self.keep_top_k, allow_none=True)
        one_of(f"{path}.model_save_format", self.model_save_format, ("safetensors", "torch_save"))
        if self.metric_name is not None:
            require(
                self.metric_name.startswith(("val:", "train:")),
                f"{path}.metric_name",
                self.metric_name,
                "must start with 'val:' or 'train:'",
            )
        if self.checkpoint_must_save_by is not None:
            require(
                re.fullmatch(r"\d+:\d\d:\d\d:\d\d", self.checkpoint_must_save_by) is not None,
                f"{path}.checkpoint_must_save_by",
                self.checkpoint_must_save_by,
                "must be 'DD:HH:MM:SS'",
            )
