"""Metric fan-out: metrics.jsonl (one object per step), TensorBoard scalars, the experiment trackers (W&B, MLflow:
rlpost.runtime.trackers), a rich console bar; and the run's resource monitor (rlpost.runtime.resources), which the
step loop samples into each row.

On resume from step S, `truncate_after(S)` drops what the interrupted run logged after S (and any
partial last line), so the re-run steps appear once; `restore_row(S, row)` puts back step S's row, from the
checkpoint, when the run was killed between writing the checkpoint and writing the row.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

from rlpost.config.schema.logger import LoggerConfig
from rlpost.runtime.resources import ResourceMonitor
from rlpost.runtime.trackers import Tracker, call_each, start_trackers

TB_FLUSH_S = 1.0
"""TensorBoard's events reach the disk at most this long after they were logged (a flush after every step would make
the driver wait for the writer thread each step); metrics.jsonl is flushed at every row."""


def _scalar(v: object) -> float | None:
    try:
        f = float(v)  # type: ignore[arg-type]  # whatever float() takes; the rest is not a scalar
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def scalar_metrics(metrics: Mapping[str, object]) -> dict[str, float]:
    """The finite scalars of a metrics dict: what a row keeps."""
    return {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}


class MetricsLogger:
    """Writes each `log(metrics, step)` call as one JSONL line, as TensorBoard scalars and to each tracker."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path) -> None:
        self.dir = Path(cfg.log_dir) if cfg.log_dir else run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.jsonl = self.path.open("a") if cfg.jsonl_enabled else None
        self.tb = None
        self._tb_flushed = 0.0  # time.monotonic() of the last TensorBoard flush
        self.tb_dir = Path(cfg.tensorboard.log_dir) if cfg.tensorboard.log_dir else self.dir / "tensorboard"
        if cfg.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.tb_dir))
        self.trackers: list[Tracker] = start_trackers(cfg, run_dir)
        self.resources = ResourceMonitor() if cfg.resource_metrics else None
        """logger.resource_metrics: sampled by the step loop into each step's row (resources/*)."""

    def truncate_after(self, step: int) -> int:
        """Atomically rewrite metrics.jsonl keeping only well-formed rows with step <= `step`, and have
        TensorBoard discard its events after `step`. Returns the number of rows dropped."""
        dropped = 0
        if self.jsonl is not None:
            self.jsonl.close()
            keep = []
            for line in self.path.read_text(errors="replace").splitlines(keepends=True):
                try:
                    row = json.loads(line) if line.endswith("\n") else None
                    ok = isinstance(row, dict) and int(row["step"]) <= step
                except (ValueError, KeyError, TypeError):
                    ok = False
                if ok:
                    keep.append(line)
                else:
                    dropped += 1
            if dropped:
                tmp = self.path.with_name(self.path.name + ".tmp")
                with tmp.open("w") as f:
                    f.writelines(keep)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            self.jsonl = self.path.open("a")
        if self.tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=step + 1)
        return dropped

    def restore_row(self, step: int, row: Mapping[str, object] | None) -> bool:
        """After `truncate_after(step)`: log `row` as step `step`'s when metrics.jsonl has no row for that step
        (the run died after its checkpoint, before its line). True when it did."""
        if row is None or self.jsonl is None:
            return False
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                if int(json.loads(line)["step"]) == step:
                    return False
            except (ValueError, KeyError, TypeError):
                continue
        self.log(row, step)
        return True

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        clean = scalar_metrics(metrics)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self.jsonl.flush()
        if self.tb is not None and clean:
            # one event holding every scalar of the step (add_scalar per key would write one event each, and a GRPO
            # step logs dozens of metrics); TensorBoard reads each value as its own scalar series
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in clean.items()])
            self.tb._get_file_writer().add_summary(summary, step)
            if time.monotonic() - self._tb_flushed >= TB_FLUSH_S:
                self.tb.flush()
                self._tb_flushed = time.monotonic()
        if self.trackers and clean:
            self.trackers = call_each(self.trackers, "log", clean, step)

    def log_hyperparams(self, text: str) -> None:
        """The run's resolved config (YAML): TensorBoard's text tab, each tracker's config."""
        if self.tb is not None:
            self.tb.add_text("config", f"```\n{text}\n```", 0)
        if self.trackers:
            import yaml

            config = yaml.safe_load(text)
            self.trackers = call_each(self.trackers, "log_config", config if isinstance(config, dict) else {})

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        call_each(self.trackers, "close")
        self.trackers = []
