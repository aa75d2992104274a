"""Atomic checkpoints, keep-top-k, resume refusal on a fingerprint mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpost.config.schema.checkpoint import CheckpointingConfig
from rlpost.runtime.checkpointing import CheckpointManager, CheckpointMismatch, config_diff


def save(m: CheckpointManager, step: int, acc: float, cfg: dict | None = None) -> Path:
    tmp = m.begin(step)
    (tmp / "payload").write_text(str(step))
    return m.finalize(tmp, step, {"total_steps": step, "val:accuracy": acc}, "fp-model", cfg or {"a": 1})


def test_keep_top_k_by_metric_and_latest(tmp_path: Path) -> None:
    m = CheckpointManager(CheckpointingConfig(keep_top_k=2, metric_name="val:accuracy"), tmp_path)
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.7), (5, 0.2)]:
        save(m, step, acc)
    assert m.steps() == [2, 4, 5]  # the two best, plus the latest
    assert m.latest() == tmp_path / "checkpoints" / "step_5"


def test_kill_during_write_leaves_previous_usable(tmp_path: Path) -> None:
    m = CheckpointManager(CheckpointingConfig(), tmp_path)
    save(m, 1, 0.5)
    tmp = m.begin(2)  # a write that never finishes (the process is killed here)
    (tmp / "payload").write_text("partial")
    assert m.latest() == tmp_path / "checkpoints" / "step_1"
    m2 = CheckpointManager(CheckpointingConfig(), tmp_path)  # the next start
    assert not (tmp_path / "checkpoints" / "tmp_step_2").exists()
    assert m2.latest() == tmp_path / "checkpoints" / "step_1"
    assert json.loads((m2.latest() / "training_info.json").read_text())["total_steps"] == 1


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    m = CheckpointManager(CheckpointingConfig(), tmp_path)
    save(m, 3, 0.1)
    save(m, 3, 0.2)
    assert json.loads((m.latest() / "training_info.json").read_text())["val:accuracy"] == 0.2
    assert not (tmp_path / "checkpoints" / "old_step_3").exists()


def test_resume_refuses_other_model_or_config(tmp_path: Path) -> None:
    m = CheckpointManager(CheckpointingConfig(), tmp_path)
    ck = save(m, 1, 0.5, {"policy": {"lr": 1.0}, "grpo": {"max_num_steps": 10}})
    m.check_resume(ck, "fp-model", {"policy": {"lr": 1.0}, "grpo": {"max_num_steps": 20}})  # allowed change
    with pytest.raises(CheckpointMismatch, match=r"model fingerprint fp-model != other"):
        m.check_resume(ck, "other", {"policy": {"lr": 1.0}, "grpo": {"max_num_steps": 10}})
    with pytest.raises(CheckpointMismatch, match=r"policy.lr: 1.0 -> 2.0"):
        m.check_resume(ck, "fp-model", {"policy": {"lr": 2.0}, "grpo": {"max_num_steps": 10}})
    forced = CheckpointManager(CheckpointingConfig(force_resume=True), tmp_path)
    forced.check_resume(ck, "other", {"policy": {"lr": 2.0}})


def test_config_diff_ignores_resumable_keys() -> None:
    assert config_diff({"logger": {"x": 1}, "a": 1}, {"logger": {"x": 2}, "a": 1}) == []
    assert config_diff({"a": {"b": 1}}, {"a": {"b": 2, "c": 3}}) == ["a.b", "a.c"]
    # a finished SFT / DPO / RM run trains further with a larger budget, as GRPO does
    for algo in ("grpo", "sft", "dpo", "rm"):
        assert config_diff({algo: {"max_num_steps": 60, "lr": 1}}, {algo: {"max_num_steps": 120, "lr": 1}}) == []
    assert config_diff({"sft": {"seed": 1}}, {"sft": {"seed": 2}}) == ["sft.seed"]


def test_a_checkpoint_without_its_training_info_is_moved_aside_as_corrupt(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """It was skipped without a word and later written over: now it is corrupt_step_N, named in one warning."""
    m = CheckpointManager(CheckpointingConfig(), tmp_path)
    save(m, 1, 0.5)
    save(m, 2, 0.6)
    (tmp_path / "checkpoints" / "step_2" / "training_info.json").unlink()
    assert m.incomplete() == [tmp_path / "checkpoints" / "step_2"]
    assert m.latest_verified() == tmp_path / "checkpoints" / "step_1"
    assert (tmp_path / "checkpoints" / "corrupt_step_2" / "payload").read_text() == "2"  # kept, not deleted
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "step_2 is corrupt (no training_info.json)" in err, err
