"""benchmarks.memory: its configurations compose, and a run's files are read per worker group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import memory
from rlpost.config.load import load_master_config


@pytest.mark.parametrize("cfg", memory.CONFIGS, ids=[c.name for c in memory.CONFIGS])
def test_every_configuration_composes(cfg: memory.Config, tmp_path: Path) -> None:
    extra = [f"data.train_data_path={memory.long_rows(tmp_path / 'long.jsonl')}"] if "data=sft_jsonl" in cfg.overrides \
        else []
    load_master_config([*cfg.overrides, *extra])


def test_the_largest_rank_of_each_group_is_compared(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in (
        {"resources/policy-0/peak_rss_gib": 0.5},
        {"resources/policy-0/peak_rss_gib": 1.0, "resources/policy-1/peak_rss_gib": 1.5,
         "resources/vllm-replica0/peak_rss_gib": 2.0, "resources/driver/peak_rss_gib": 0.4,
         "resources/policy-0/rss_gib": 9.0},
    )) + "\n")
    assert memory.measured(tmp_path / "metrics.jsonl") == {"policy": 1.5, "engine": 2.0, "driver": 0.4}
    (tmp_path / "plan.json").write_text(json.dumps({"memory": {"workers": [
        {"group": "policy", "rank": 0, "estimate_gib": 1.2}, {"group": "policy", "rank": 1, "estimate_gib": 1.3},
        {"group": "engine", "rank": 0, "estimate_gib": 2.1}]}}))
    assert memory.estimated(tmp_path / "plan.json") == {"policy": 1.3, "engine": 2.1}
