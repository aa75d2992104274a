"""The collect phase: the engine sleeps after each generation and is woken for the next, dynamic sampling keeps drawing prompts
until enough groups vary, and train/reward covers every sample generated in the step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from rlpost.algorithms.collect import collect_batch
from rlpost.config.schema.grpo import GRPOConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.runtime.timer import Timer


class _Tokenizer:
    pad_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


class _CountingEngine:
    """Answers every prompt with one token that alternates per sample (so a group's answers vary)."""

    def __init__(self) -> None:
        self.calls = 0
        self.asleep = False
        self.wakes: list[int] = []

    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        self.calls += 1
        n, width = batch["input_ids"].shape
        out = torch.cat([batch["input_ids"], torch.zeros(n, 1, dtype=torch.long)], dim=1)
        out[torch.arange(n), batch["input_lengths"]] = torch.arange(n) % 2 + 1
        return BatchedDataDict(output_ids=out, generation_lengths=torch.ones(n, dtype=torch.long))

    def finish_generation(self) -> bool:
        self.asleep = True
        return True

    def prepare_for_generation(self) -> bool:
        self.wakes.append(self.calls)
        self.asleep = False
        return True


class _TableEnv(EnvironmentInterface):
    """Reward = the row's 'base' when the answer is token 1, else 'base' + the row's 'spread'."""

    def step(self, responses: list[str], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        return EnvironmentReturn([m["base"] + (0.0 if r == "1" else m["spread"]) for r, m in zip(responses, metadata, strict=True)])

    def shutdown(self, graceful: bool = True) -> None:
        pass


def _cfg(grpo: GRPOConfig) -> SimpleNamespace:
    """The config pieces collect reads: grpo, the sequence budget and the engine's rollout mode."""
    generation = SimpleNamespace(async_rollouts=lambda: False)
    policy = SimpleNamespace(max_total_sequence_length=64, generation=generation)
    return SimpleNamespace(grpo=grpo, policy=policy, generation=generation)


def _rows(spread: float, n: int = 2) -> list[dict[str, Any]]:
    return [{"prompt_ids": [5, 6 + i], "base": 0.25, "spread": spread, "env_name": "t", "loss_multiplier": 1.0}
            for i in range(n)]


def test_dynamic_sampling_draws_until_groups_vary_and_reports_every_reward() -> None:
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=2, use_dynamic_sampling=True,
                      batch_multiplier=1.0, dynamic_sampling_max_gen_batches=3)
    engine = _CountingEngine()
    comps = SimpleNamespace(cfg=_cfg(grpo), processor=SimpleNamespace(batch=lambda rows: [dict(r) for r in rows]),
                            generation=engine, tokenizer=_Tokenizer(), envs={"t": _TableEnv()}, policy=None,
                            colocated=False)
    later = iter([_rows(spread=0.5)])  # the second draw varies within each group
    got = collect_batch(comps, _rows(spread=0.0), lambda: next(later), step=1, timer=Timer())
    assert engine.calls == 2 and engine.wakes == [1]  # slept after the first batch, woken before the second
    assert engine.asleep  # and asleep again after the last
    assert got.batch.size == 4 and got.batch.rewards.tolist() == [0.25, 0.75, 0.25, 0.75]
    # train/reward: all 8 generated samples (4 flat ones at 0.25, then 4 varied), not only the kept batch
    assert got.generated_rewards.tolist() == [0.25] * 4 + [0.25, 0.75] * 2
    assert float(got.generated_rewards.mean()) == 0.375 and float(got.batch.rewards.mean()) == 0.5
    assert got.sampler is not None and got.sampler.discarded == 4 and got.sampler.gen_batches == 2


def test_without_dynamic_sampling_one_batch_is_the_step() -> None:
    grpo = GRPOConfig(num_prompts_per_step=2, num_generations_per_prompt=2)
    comps = SimpleNamespace(cfg=_cfg(grpo), processor=SimpleNamespace(batch=lambda rows: [dict(r) for r in rows]),
                            generation=_CountingEngine(), tokenizer=_Tokenizer(), envs={"t": _TableEnv()})
    got = collect_batch(comps, _rows(spread=0.0), lambda: [], step=3, timer=Timer())
    assert got.sampler is None and got.batch.size == 4 and got.generated_rewards.tolist() == [0.25] * 4
