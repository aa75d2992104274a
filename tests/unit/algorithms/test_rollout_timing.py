"""Scoring is timed apart from generation, and a slow or timed-out scoring prints one warning line."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from rlpost.algorithms.rollouts import run_rollout, score
from rlpost.config.schema.env import EnvConfig, SyntheticEnvConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.environments.synthetic import SyntheticEnvironment
from rlpost.runtime.timer import Timer


class _SleepyEnv(EnvironmentInterface):
    """Scores every response 1.0 after `seconds`, reporting the given timeouts."""

    def __init__(self, cfg: EnvConfig, seconds: float = 0.0, timeouts: int = 0, unfinished: int = 0) -> None:
        self.cfg, self.seconds, self.timeouts, self.unfinished = cfg, seconds, timeouts, unfinished

    def step(self, responses: list[str], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        time.sleep(self.seconds)
        return EnvironmentReturn([1.0] * len(responses), self.timeouts, unfinished=self.unfinished)

    def shutdown(self, graceful: bool = True) -> None:
        pass


class _DigitTokenizer:
    """Token id d decodes to the digit d; 10 is padding."""

    pad_token_id = 10

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(str(i) for i in ids if i != self.pad_token_id)


class _EchoGeneration:
    """A stand-in engine: answers each prompt with its last token, after `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        time.sleep(self.seconds)
        ids, lengths = batch["input_ids"], batch["input_lengths"]
        last = ids[torch.arange(len(lengths)), lengths - 1]
        out = torch.cat([ids, torch.full((len(lengths), 1), 10)], dim=1)
        out[torch.arange(len(lengths)), lengths] = last
        return BatchedDataDict(output_ids=out, generation_lengths=torch.ones(len(lengths), dtype=torch.long))


def _rows(n: int, env_name: str) -> list[dict[str, Any]]:
    return [{"prompt_ids": [1, i % 10], "expected_answer": str(i % 10), "env_name": env_name, "loss_multiplier": 1.0}
            for i in range(n)]


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("rlpost: warning:")]


def test_reward_time_is_booked_under_reward_calculation_not_generation(capsys: pytest.CaptureFixture[str]) -> None:
    timer = Timer()
    envs: dict[str, EnvironmentInterface] = {"slow": _SleepyEnv(EnvConfig(), seconds=0.6)}
    batch = run_rollout(_rows(4, "slow"), torch.zeros(4, dtype=torch.long), _EchoGeneration(0.05),
                        _DigitTokenizer(), envs, timer=timer, label="step 1")
    assert batch.responses == ["0", "1", "2", "3"] and batch.rewards.tolist() == [1.0] * 4
    assert timer.times["reward_calculation"] >= 0.6
    assert timer.times["generation"] < timer.times["reward_calculation"] - 0.5
    assert _warnings(capsys.readouterr().err) == []  # 0.6 s is under the default slow_warning_s


def test_a_slow_step_prints_one_warning_line(capsys: pytest.CaptureFixture[str]) -> None:
    envs: dict[str, EnvironmentInterface] = {
        "math": _SleepyEnv(EnvConfig(num_workers=1, slow_warning_s=0.1), seconds=0.2, timeouts=2),
        "other": _SleepyEnv(EnvConfig(), seconds=0.0),
    }
    rows = _rows(3, "math") + _rows(2, "other")
    _, metrics = score(["0"] * 5, rows, envs, label="step 3")
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1
    assert lines[0].startswith("rlpost: warning: step 3: rewards took ")
    assert "for 5 samples (2 timed out after 10 s, env.math.num_workers=1); raise num_workers" in lines[0]
    assert metrics["reward_timeouts"] == 2.0


def test_deadline_misses_are_named_in_the_warning(capsys: pytest.CaptureFixture[str]) -> None:
    env = _SleepyEnv(EnvConfig(num_workers=2, batch_timeout_s=300.0), timeouts=5, unfinished=4)
    _, metrics = score(["0"] * 8, _rows(8, "math"), {"math": env}, label="step 7")
    (line,) = _warnings(capsys.readouterr().err)
    assert "(1 timed out after 10 s, 4 unfinished at the 300 s batch deadline, env.math.num_workers=2)" in line
    assert metrics["reward_unfinished"] == 4.0


def test_quick_complete_scoring_and_unlabelled_scoring_stay_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    score(["0"], _rows(1, "a"), {"a": _SleepyEnv(EnvConfig())}, label="step 1")
    score(["0"], _rows(1, "a"), {"a": _SleepyEnv(EnvConfig(), timeouts=1)})
    assert _warnings(capsys.readouterr().err) == []


def test_a_real_verifier_env_is_timed_and_reported(capsys: pytest.CaptureFixture[str]) -> None:
    env = SyntheticEnvironment(SyntheticEnvConfig(task="copy_digit", num_workers=2, slow_warning_s=1e-6))
    try:
        timer = Timer()
        batch = run_rollout(_rows(6, "synthetic"), torch.arange(6), _EchoGeneration(0.0), _DigitTokenizer(),
                            {"synthetic": env}, timer=timer, label="step 2")
    finally:
        env.shutdown()
    assert batch.rewards.tolist() == [1.0] * 6
    assert timer.times["reward_calculation"] > 0.0 and "generation" in timer.times
    (line,) = _warnings(capsys.readouterr().err)
    assert "step 2: rewards took" in line and "for 6 samples (env.synthetic.num_workers=2)" in line
