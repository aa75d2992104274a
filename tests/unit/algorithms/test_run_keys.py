"""Loop-level keys (issue #11 §4): the save deadline, validation sample printing, save_consolidated."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlpost.algorithms.deadline import SaveDeadline
from rlpost.algorithms.grpo import save_checkpoint, val_sample_line
from rlpost.algorithms.rollouts import RolloutBatch
from rlpost.config.schema.checkpoint import CheckpointingConfig
from rlpost.config.schema.grpo import GRPOSaveState
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.runtime.checkpointing import CheckpointManager


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_deadline_fires_when_a_step_and_a_save_no_longer_fit() -> None:
    clock = Clock()
    d = SaveDeadline("00:00:01:00", started_at=clock.now, clock=clock)  # 60 s
    assert d.enabled and d.budget_s == 60.0
    clock.now += 30
    d.step_took(10.0)
    assert not d.due()  # 30 + 10 < 60
    d.save_took(15.0)
    assert not d.due()  # 30 + 10 + 15 = 55 < 60
    clock.now += 6
    assert d.due()  # 36 + 10 + 15 >= 60
    assert "checkpoint_must_save_by=00:00:01:00: saved step 3" in d.message(3) and "resume" in d.message(3)


def test_deadline_uses_the_slowest_step() -> None:
    clock = Clock()
    d = SaveDeadline("00:00:00:50", started_at=clock.now, clock=clock)
    d.step_took(20.0)
    d.step_took(5.0)
    clock.now += 31
    assert d.due()  # 31 + max(20, 5) >= 50


def test_no_budget_never_fires() -> None:
    clock = Clock()
    d = SaveDeadline(None, started_at=0.0, clock=clock)
    d.step_took(1e9)
    assert not d.enabled and not d.due()


class Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _batch(prompts: list[str], responses: list[str], rewards: list[float]) -> RolloutBatch:
    n = len(prompts)
    return RolloutBatch(
        rows=[{"prompt_ids": [ord(ch) for ch in p]} for p in prompts], group_ids=torch.arange(n),
        gen=BatchedDataDict(generation_lengths=torch.ones(n)), input_lengths=torch.ones(n), responses=responses,
        rewards=torch.tensor(rewards),
    )


def test_val_sample_line_is_one_short_line() -> None:
    b = _batch(["Copy 7:", "x" * 500], ["7", "line one\nline two" * 100], [1.0, 0.1])
    line = val_sample_line(Tok(), b, 0, 10, 1, 2)
    assert line == "validation sample 1/2 at step 10: Copy 7: -> 7 (reward 1.000)"
    long = val_sample_line(Tok(), b, 1, 10, 2, 2)
    assert "\n" not in long and len(long) <= 200 and long.endswith("(reward 0.100)") and "..." in long


class RecordingPolicy:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def save_checkpoint(self, weights: str, optimizer: str, hf_export: bool = True) -> None:
        self.calls.append(hf_export)
        Path(weights).mkdir(parents=True)
        (Path(weights) / "w.safetensors").write_bytes(b"w")
        if hf_export:
            (Path(weights) / "hf").mkdir()
            (Path(weights) / "hf" / "config.json").write_text("{}")


@pytest.mark.parametrize("consolidated", [True, False])
def test_save_consolidated_decides_the_hf_export(tmp_path: Path, consolidated: bool) -> None:
    ck = CheckpointingConfig(metric_name=None, save_consolidated=consolidated)
    policy = RecordingPolicy()
    c = SimpleNamespace(
        cfg=SimpleNamespace(checkpointing=ck), save_state=GRPOSaveState(), sides=[], policy=policy,
        checkpointer=CheckpointManager(ck, tmp_path), dataloader=SimpleNamespace(state_dict=lambda: {}),
        config_dict={}, model_fp="fp",
    )
    save_checkpoint(c, 1, {})  # type: ignore[arg-type]
    assert policy.calls == [consolidated]
    hf = tmp_path / "checkpoints" / "step_1" / "policy" / "weights" / "hf"
    assert hf.is_dir() == consolidated


def test_policy_facade_forwards_hf_export() -> None:
    from rlpost.models.policy.interfaces import PolicyWorker
    from rlpost.models.policy.lm_policy import Policy

    calls: list[Any] = []
    p = Policy.__new__(Policy)
    p.worker_group = SimpleNamespace(run_all=lambda *a: calls.append(a) or [])  # type: ignore[attr-defined]
    p.save_checkpoint("w", "o", hf_export=False)
    assert calls == [(PolicyWorker.save_checkpoint, "w", "o", False)]
