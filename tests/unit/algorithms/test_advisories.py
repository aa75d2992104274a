"""Run-health advisories: each rule fires on the rows built to trigger it, once as a warning line and at every step
it holds as advisories/<rule>; healthy rows fire nothing."""

from __future__ import annotations

import pytest
import torch

from rlpost.algorithms.advisories import RunHealth
from rlpost.algorithms.grpo import zero_variance_share
from rlpost.config.schema.advisories import AdvisoriesConfig

HEALTHY = {"train/zero_variance_groups": 0.2, "train/truncated_fraction": 0.05, "train/token_mult_prob_error": 1.0,
           "resources/generation_tokens_per_s": 1000.0, "resources/training_tokens_per_s": 5000.0,
           "timing/train/total_step_time": 1.0}


def feed(health: RunHealth, rows: list[dict[str, float]]) -> list[list[str]]:
    return [health.observe(step, dict(row)) for step, row in enumerate(rows, start=1)]


def rising_reward(n: int) -> list[dict[str, float]]:
    return [{**HEALTHY, "train/reward": 0.01 * step} for step in range(n)]


def test_a_healthy_run_fires_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert all(f == [] for f in feed(RunHealth(AdvisoriesConfig()), rising_reward(60)))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("rule", "change", "first"), [
    ("zero_variance", {"train/zero_variance_groups": 1.0}, 10),   # after `window` steps in a row
    ("truncated", {"train/truncated_fraction": 0.9}, 10),
    ("prob_error_drift", {"train/token_mult_prob_error": 1.05}, 1),
    ("throughput", {"resources/generation_tokens_per_s": 100.0}, 10),
    ("stall", {"timing/train/total_step_time": 9.0}, 1),
])
def test_each_rule_fires_once_as_a_line_and_at_every_step_as_a_count(rule: str, change: dict[str, float], first: int,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    health = RunHealth(AdvisoriesConfig())
    feed(health, rising_reward(10))  # the run's own history: 10 healthy steps
    capsys.readouterr()
    rows = [{**HEALTHY, "train/reward": 0.2 + 0.01 * i, **change} for i in range(12)]
    fired = [rule in f for f in feed(health, rows)]
    assert fired.index(True) == first - 1 and all(fired[first - 1:])
    err = capsys.readouterr().err
    assert err.count("rlpost: warning:") == 1 and f"advisories/{rule}" in err, err


def test_a_flat_reward_fires_after_its_steps_and_the_row_counts_it() -> None:
    health = RunHealth(AdvisoriesConfig(flat_reward_steps=5))
    rows = [{**HEALTHY, "train/reward": 0.3} for _ in range(6)]
    out = [dict(r) for r in rows]
    for step, row in enumerate(out, start=1):
        health.observe(step, row)
    assert ["advisories/flat_reward" in r for r in out] == [False, False, False, False, True, True]


def test_single_token_runs_do_not_count_truncation_and_a_rule_set_to_none_is_off() -> None:
    rows = [{**HEALTHY, "train/truncated_fraction": 1.0} for _ in range(15)]
    assert not any(feed(RunHealth(AdvisoriesConfig(), multi_token=False), rows))
    assert not any(feed(RunHealth(AdvisoriesConfig(truncated_share=None)), rows))
    assert not any(feed(RunHealth(AdvisoriesConfig(enabled=False)), rows))


def test_the_zero_variance_share_counts_groups_with_one_reward() -> None:
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert zero_variance_share(groups, torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5, 0.2])) == 0.5


def test_the_report_lists_the_advisories_and_bands_their_steps() -> None:
    from rlpost.report.figures import CURVES, curve_figure
    from rlpost.report.runs import Run, advisory_steps

    rows = [{"step": float(s), "train/reward": 0.1, **({"advisories/stall": 1.0} if s in (3, 4, 7) else {})}
            for s in range(1, 9)]
    assert advisory_steps(rows) == {"stall": [3, 4, 7]}
    fig = curve_figure(next(p for p in CURVES if p.id == "reward"),
                       [Run(path=__import__("pathlib").Path("r"), rows=rows, overrides=[], config_text="", status={},
                            messages=[])])
    assert fig is not None
    assert [(s.x0, s.x1) for s in fig.layout.shapes] == [(2.5, 4.5), (6.5, 7.5)]


def test_a_scheduled_save_or_validation_is_no_stall_and_one_slow_step_no_collapse() -> None:
    health = RunHealth(AdvisoriesConfig())
    feed(health, rising_reward(10))
    saving = {**HEALTHY, "timing/train/total_step_time": 30.0, "timing/train/checkpointing": 29.0}
    slow = {**HEALTHY, "resources/generation_tokens_per_s": 10.0}
    assert feed(health, [saving, slow, HEALTHY]) == [[], [], []]
