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



def test_tensorboard_is_flushed_at_most_once_a_second_and_fully_on_close(tmp_path: Path) -> None:
    """The driver waits for TensorBoard's writer thread (a flush) at the first step and then at most once a second
    (waiting at every step cost it 0.4 ms a step); the writer thread writes the events meanwhile, and close writes
    whatever is left. metrics.jsonl has every row at once."""
    import time

    from rlpost.runtime.metrics_logger import TB_FLUSH_S

    log = MetricsLogger(LoggerConfig(), tmp_path)
    assert log.tb is not None
    flushes = []
    flush = log.tb.flush
    log.tb.flush = lambda: (flushes.append(time.monotonic()), flush())[1]  # type: ignore[method-assign]
    for step in (1, 2, 3):
        log.log({"train/reward": float(step)}, step)
    assert len(flushes) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    time.sleep(TB_FLUSH_S + 0.05)
    log.log({"train/reward": 4.0}, 4)
    log.log({"train/reward": 5.0}, 5)
    assert len(flushes) == 2
    log.close()
    assert scalars(tmp_path / "tensorboard") == {"train/reward": [(s, float(s)) for s in (1, 2, 3, 4, 5)]}
