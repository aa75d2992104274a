"""Metric fan-out: metrics.jsonl (one object per step), TensorBoard scalars, a rich console bar."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Optional

from rlpost.config.schema.logger import LoggerConfig


def _scalar(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class MetricsLogger:
    """Writes each `log(metrics, step)` call as one JSONL line and as TensorBoard scalars."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path) -> None:
        self.dir = Path(cfg.log_dir) if cfg.log_dir else run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = (self.dir / "metrics.jsonl").open("a") if cfg.jsonl_enabled else None
        self.tb = None
        self.tb_dir = Path(cfg.tensorboard.log_dir) if cfg.tensorboard.log_dir else self.dir / "tensorboard"
        if cfg.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.tb_dir))

    def log(self, metrics: Dict[str, Any], step: int) -> None:
        clean = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def log_hyperparams(self, text: str) -> None:
        if self.tb is not None:
            self.tb.add_text("config", f"```\n{text}\n```", 0)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
