"""What MetricsLogger writes to TensorBoard, read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlpost.config.schema.logger import LoggerConfig
from rlpost.runtime.metrics_logger import MetricsLogger


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_every_scalar_of_every_step_reads_back_as_its_own_series(tmp_path: Path) -> None:
    log = MetricsLogger(LoggerConfig(), tmp_path)
    for step in (1, 2, 3):
        log.log({"train/reward": 0.25 * step, "timing/train/generation": step / 8, "note": "not a scalar",
                 "train/nan": float("nan")}, step)
    log.close()
    assert scalars(tmp_path / "tensorboard") == {
        "train/reward": [(1, 0.25), (2, 0.5), (3, 0.75)],
        "timing/train/generation": [(1, 0.125), (2, 0.25), (3, 0.375)],
    }

    log = MetricsLogger(LoggerConfig(), tmp_path)  # resumed from the step-2 checkpoint: step 3 is run again
    log.truncate_after(2)
    log.log({"train/reward": 3.0, "timing/train/generation": 0.5}, 3)
    log.close()
    assert scalars(tmp_path / "tensorboard") == {
        "train/reward": [(1, 0.25), (2, 0.5), (3, 3.0)],
        "timing/train/generation": [(1, 0.125), (2, 0.25), (3, 0.5)],
    }
