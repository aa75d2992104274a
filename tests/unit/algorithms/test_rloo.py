"""`algo=rloo`: its unit's advantages against a plain-Python leave-one-out reference, its config and its plan."""

from __future__ import annotations

import pytest
import torch

from rlpost.algorithms.grpo_unit import UNIT as GRPO_UNIT
from rlpost.algorithms.rloo import UNIT
from rlpost.algorithms.units import unit_of
from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.config.schema.master import MasterConfig
from rlpost.plan import plan_rows


def _leave_one_out(groups: list[int], rewards: list[float]) -> list[float]:
    """r_i minus the mean of the other rewards of i's group, in plain Python."""
    out = []
    for i, (g, r) in enumerate(zip(groups, rewards, strict=True)):
        others = [rewards[j] for j, h in enumerate(groups) if h == g and j != i]
        out.append(r - sum(others) / len(others))
    return out


def _rloo() -> MasterConfig:
    _, m = load_master_config(["algo=rloo"])
    assert isinstance(m, MasterConfig)
    return m


def test_rloo_advantages_equal_the_leave_one_out_reference() -> None:
    m = _rloo()
    groups = [0, 1, 0, 2, 1, 0, 2, 1]  # three prompts, samples interleaved
    rewards = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 0.25, 0.0]
    got = UNIT.advantages(m, torch.tensor(groups), torch.tensor(rewards, dtype=torch.float64))
    assert got.tolist() == pytest.approx(_leave_one_out(groups, rewards), abs=1e-12)
    # GRPO's unit divides by the group's std: a different advantage on the same batch
    grpo = GRPO_UNIT.advantages(load_master_config([])[1], torch.tensor(groups),  # type: ignore[arg-type]
                                torch.tensor(rewards, dtype=torch.float64))
    assert not torch.allclose(grpo, got)


def test_algo_rloo_is_grpo_with_its_unit_and_refuses_grpo_advantage_switches() -> None:
    m = _rloo()
    assert m.algo == "rloo" and unit_of(m) is UNIT
    assert dict(plan_rows(m))["advantages"].startswith("RLOO: each sample's reward minus the mean of its prompt's "
                                                       f"other {m.grpo.num_generations_per_prompt - 1}")
    for override, key in (("grpo.normalize_rewards=true", "grpo.normalize_rewards"),
                          ("grpo.use_leave_one_out_baseline=false", "grpo.use_leave_one_out_baseline"),
                          ("grpo.num_generations_per_prompt=1", "grpo.num_generations_per_prompt")):
        with pytest.raises(ConfigError) as err:
            load_master_config(["algo=rloo", override])
        assert err.value.key == key, override
