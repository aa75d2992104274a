"""What every training loop (GRPO, SFT / DPO / RM) writes into a checkpoint and reads back on resume: the policy
(weights + optimizer), the save state (training_info.json, with the value of checkpointing.metric_name measured at
this step), the dataloader position, Python's RNG and the config."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rlpost.models.policy.interfaces import PolicyInterface
from rlpost.runtime.checkpointing import CheckpointManager, checkpoint_errors, read_json
from rlpost.runtime.metrics_logger import scalar_metrics


class SaveState(Protocol):
    """GRPOSaveState / SupervisedSaveState: checkpoint metric values in `extra`, the rest from `to_dict`."""

    extra: dict[str, float]

    def to_dict(self) -> dict[str, object]: ...


class Loader(Protocol):
    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


def save_rng_state() -> dict[str, list[object]]:
    st = random.getstate()
    return {"python": [st[0], list(st[1]), st[2]]}


def record_checkpoint_metric(save_state: SaveState, metric_name: str | None, metrics: dict[str, float]) -> None:
    """Put the value of 'val:x' / 'train:x' measured at this step into save_state.extra (or drop a stale one)."""
    if not metric_name:
        return
    # Only a value measured at this step ranks this checkpoint; an unmeasured one ranks below
    # every measured one in keep_top_k (a stale value from an earlier step would misrank it).
    kind, key = metric_name.split(":", 1)
    value = metrics.get(f"{'validation' if kind == 'val' else 'train'}/{key}")
    save_state.extra.pop(metric_name, None)
    if value is not None:
        save_state.extra[metric_name] = value


METRICS_ROW = "metrics_row.json"
"""The step's metrics row as it stood when the checkpoint was written: a run killed after the checkpoint and before
its metrics.jsonl line resumes with that line restored (`saved_metrics_row`), not missing."""


def write_checkpoint(checkpointer: CheckpointManager, policy: PolicyInterface, step: int, save_state: SaveState,
                     loader_state: dict[str, int], config_dict: Mapping[str, object], model_fp: str, hf_export: bool,
                     metrics_row: dict[str, float] | None = None,
                     others: Mapping[str, PolicyInterface] | None = None) -> None:
    """Write step_N atomically: policy weights + optimizer (and those of the `others` worker groups, each in the
    directory its key names: PPO's critic), dataloader position, RNG, config, training_info, and the step's metrics
    row so far."""
    tmp = checkpointer.begin(step)
    if metrics_row is not None:
        (tmp / METRICS_ROW).write_text(json.dumps(scalar_metrics(metrics_row)))
    policy.save_checkpoint(str(tmp / "policy" / "weights"), str(tmp / "policy" / "optimizer"), hf_export=hf_export)
    for name, group in (others or {}).items():
        group.save_checkpoint(str(tmp / name / "weights"), str(tmp / name / "optimizer"), hf_export=False)
    (tmp / "train_dataloader.json").write_text(json.dumps(loader_state))
    (tmp / "rng_state.json").write_text(json.dumps(save_rng_state()))
    (tmp / "config.yaml").write_text(json.dumps(config_dict, indent=1, default=str))
    checkpointer.finalize(tmp, step, save_state.to_dict(), model_fp, config_dict)


def saved_metrics_row(last: Path) -> dict[str, float] | None:
    """The metrics row checkpoint `last` recorded (None when it holds none: written without a `metrics_row`)."""
    path = last / METRICS_ROW
    if not path.exists():
        return None
    with checkpoint_errors(path):
        row = read_json(path)
    return row if isinstance(row, dict) else None


def resume_info(checkpointer: CheckpointManager, last: Path, model_fp: str, config_dict: Mapping[str, object]
                ) -> dict[str, Any]:
    """training_info.json of checkpoint `last`, after checking it was made by this model and config."""
    with checkpoint_errors(last / "fingerprint.json"):
        checkpointer.check_resume(last, model_fp, config_dict)
    with checkpoint_errors(last / "training_info.json"):
        return read_json(last / "training_info.json")


def restore_loader_and_rng(last: Path, loader: Loader) -> None:
    """The dataloader position and Python's RNG as checkpoint `last` saved them."""
    with checkpoint_errors(last / "train_dataloader.json"):
        loader.load_state_dict(read_json(last / "train_dataloader.json"))
    with checkpoint_errors(last / "rng_state.json"):
        rng = read_json(last / "rng_state.json")
        random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
