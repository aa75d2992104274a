"""`rlpost train algo=rloo` learns the default task (REINFORCE with a leave-one-out baseline on GRPO's machinery)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cli_runs import AC, metrics, train

pytestmark = pytest.mark.slow


def test_rloo_learns_the_default_task(cache: Path, tmp_path: Path) -> None:
    run = tmp_path / "rloo"
    out = train(run, cache, "algo=rloo", "grpo.max_num_steps=45", "grpo.val_period=0", "checkpointing=disabled", AC)
    assert "RLOO" in out.stderr + out.stdout  # the progress bar's label
    lines = metrics(run)
    rewards = [m["train/reward"] for m in lines]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1
    assert last > first + 0.25, rewards
    # the advantages are unnormalised leave-one-out baselines: bounded by the reward range [0, 1]
    assert all(-1.0 <= m["train/advantages/min"] and m["train/advantages/max"] <= 1.0 for m in lines)
