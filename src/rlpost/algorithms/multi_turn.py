"""Multi-turn rollouts (grpo.max_rollout_turns > 1): the model and the environment take turns.

An episode starts from the prompt. Each turn the engine continues the whole sequence so far; the sample's
environment reads that turn (`EnvironmentInterface.step`) and returns a reward, whether the episode is over,
and otherwise an observation (e.g. a tool result), the next turn's stop strings and its updated metadata. The
observation's tokens are appended and the next turn starts. An episode ends when the environment says so,
after grpo.max_rollout_turns turns, or when the sequence reaches policy.max_total_sequence_length (then it is
cut there, marked truncated and counted in `rollout/budget_truncated`).

Only the model's tokens are trained: the result's `token_mask` is 1 on generated tokens and 0 on the prompt
and on every environment token; `logprobs` holds the engine's logprob at each generated token. The episode's
reward is the sum of its turns' rewards.

Two drivers give the same episodes for the same seeds (turn t of sample i samples with `turn_seed`):
- `run_multi_turn_rollout`: turns in lock-step, one batched generate() per turn for the episodes still running;
- `run_async_multi_turn_rollout`: one coroutine per episode, each turn its own request (`generate_async`), so a
  short episode never waits for a long one; used with vLLM's async engine (NeMo RL's `_should_use_async_rollouts`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlpost.algorithms.rollouts import (
    EnvTurn,
    RolloutBatch,
    _phase,
    padded_batch,
    run_rollout,
    step_envs,
    turn_metrics,
)
from rlpost.config.schema.master import MasterConfig
from rlpost.data.rows import PromptRow
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.models.generation.interfaces import GenerationInterface
from rlpost.runtime.timer import Timer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def turn_seed(seed: int, turn: int) -> int:
    """Sampling seed of an episode's turn: turn 0 uses the sample's own seed (so one turn = a single-turn rollout)."""
    return (seed + turn * 7_919_003) % (2**31 - 1)


@dataclass
class Episode:
    """One sample's conversation so far."""

    row: PromptRow
    ids: list[int]
    """Prompt, then every turn's tokens (model and environment)."""
    mask: list[int]
    """1 on the model's tokens."""
    logprobs: list[float]
    seed: int | None
    metadata: dict[str, object]
    """What the environment reads: the row, updated by the environment's next_metadata."""
    stops: list[str] | None = None
    reward: float = 0.0
    turns: int = 0
    generated: int = 0
    env_tokens: int = 0
    done: bool = False
    truncated: bool = False
    """The last turn hit max_new_tokens, or the sequence hit the budget."""
    budget_cut: bool = False
    text: list[str] = field(default_factory=list)
    """Each turn's text (model, environment, model, ...)."""

    @staticmethod
    def start(row: PromptRow, seed: int | None) -> Episode:
        n = len(row["prompt_ids"])
        return Episode(row, list(row["prompt_ids"]), [0] * n, [0.0] * n, seed, dict(row))


@dataclass
class TurnSettings:
    """How the episodes of one rollout run."""

    max_turns: int
    max_seq_len: int
    greedy: bool = False


def turn_settings(cfg: MasterConfig, greedy: bool = False) -> TurnSettings:
    """grpo.max_rollout_turns within policy.max_total_sequence_length."""
    return TurnSettings(cfg.grpo.max_rollout_turns, cfg.policy.max_total_sequence_length, greedy)


class MultiTurn:
    """The per-episode rules both drivers share: one turn's request, taking the model's turn, taking the
    environment's answer."""

    def __init__(self, settings: TurnSettings, tokenizer: PreTrainedTokenizerBase) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)

    def request(self, episodes: list[Episode]) -> BatchedDataDict:
        """The generate() input continuing `episodes` (their sequences, seeds of this turn, stop strings)."""
        data = padded_batch([e.ids for e in episodes], self.pad_id)
        if all(e.seed is not None for e in episodes):
            data["seeds"] = torch.tensor([turn_seed(int(e.seed), e.turns) for e in episodes  # type: ignore[arg-type]
                                          ], dtype=torch.long)
        if any(e.stops for e in episodes):
            data["stop_strings"] = [e.stops for e in episodes]
        return data

    def take_generation(self, e: Episode, out: BatchedDataDict, i: int) -> str:
        """Append row i of a generate() result to episode e; the turn's text."""
        start = len(e.ids)
        n = int(out["generation_lengths"][i])
        new = out["output_ids"][i, start : start + n].tolist()
        e.ids += new
        e.mask += [1] * n
        e.logprobs += out["logprobs"][i, start : start + n].tolist()
        e.generated += n
        e.turns += 1
        e.truncated = bool(out["truncated"][i])
        text = str(self.tokenizer.decode(new, skip_special_tokens=True))
        e.text.append(text)
        return text

    def take_env(self, e: Episode, ret: EnvironmentReturn, k: int) -> None:
        """Apply the environment's answer k (of its return) to episode e: reward, end, observation."""
        e.reward += float(ret.rewards[k])
        if ret.next_metadata is not None:
            e.metadata = {**e.metadata, **ret.next_metadata[k]}
        over = ret.observations is None or ret.terminateds is None or bool(ret.terminateds[k])
        if self.cut_if_full(e) or over or e.turns >= self.settings.max_turns:
            e.done = True
            return
        obs = ret.observations[k] if ret.observations is not None else ""
        obs_ids = [int(t) for t in self.tokenizer.encode(obs, add_special_tokens=False)]
        e.ids += obs_ids
        e.mask += [0] * len(obs_ids)
        e.logprobs += [0.0] * len(obs_ids)
        e.env_tokens += len(obs_ids)
        e.text.append(obs)
        e.stops = list(s) if ret.next_stop_strings is not None and (s := ret.next_stop_strings[k]) else None
        self.cut_if_full(e)

    def cut_if_full(self, e: Episode) -> bool:
        """True (and the episode ended, cut to the budget) when its sequence has no room for another token."""
        budget = self.settings.max_seq_len
        if len(e.ids) < budget:
            return False
        del e.ids[budget:], e.mask[budget:], e.logprobs[budget:]
        e.done = e.truncated = e.budget_cut = True
        return True

    def batch(self, episodes: list[Episode], group_ids: torch.Tensor, metrics: dict[str, float]) -> RolloutBatch:
        """The finished episodes as a RolloutBatch (gen carries token_mask for the trainer)."""
        b = len(episodes)
        width = max(len(e.ids) for e in episodes)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        lps = torch.zeros((b, width), dtype=torch.float32)
        mask = torch.zeros((b, width), dtype=torch.float32)
        for i, e in enumerate(episodes):
            n = len(e.ids)
            ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
            lps[i, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
            mask[i, :n] = torch.tensor(e.mask, dtype=torch.float32)
        prompt_lengths = torch.tensor([len(e.row["prompt_ids"]) for e in episodes], dtype=torch.long)
        gen = BatchedDataDict(
            output_ids=ids,
            logprobs=lps,
            token_mask=mask,
            generation_lengths=torch.tensor([e.generated for e in episodes], dtype=torch.long),
            unpadded_sequence_lengths=torch.tensor([len(e.ids) for e in episodes], dtype=torch.long),
            truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool),
        )
        turns = torch.tensor([e.turns for e in episodes], dtype=torch.float32)
        metrics = {
            **metrics,
            "rollout/mean_turns": float(turns.mean()),
            "rollout/max_turns_reached": float(sum(1 for e in episodes if e.turns >= self.settings.max_turns)),
            "rollout/budget_truncated": float(sum(1 for e in episodes if e.budget_cut)),
            "rollout/mean_env_tokens": float(sum(e.env_tokens for e in episodes) / b),
        }
        return RolloutBatch([e.row for e in episodes], group_ids, gen, prompt_lengths, ["".join(e.text) for e in episodes],
                            torch.tensor([e.reward for e in episodes], dtype=torch.float32), metrics)


def _add(total: dict[str, float], part: dict[str, float]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v


def run_multi_turn_rollout(
    rows: list[PromptRow],
    group_ids: torch.Tensor,
    generation: GenerationInterface,
    tokenizer: PreTrainedTokenizerBase,
    envs: dict[str, EnvironmentInterface],
    settings: TurnSettings,
    seeds: list[int] | None = None,
    timer: Timer | None = None,
    label: str | None = None,
) -> RolloutBatch:
    """Episodes in lock-step: each turn, one batched generate() for the running ones, then their environments."""
    mt = MultiTurn(settings, tokenizer)
    episodes = [Episode.start(r, seeds[i] if seeds else None) for i, r in enumerate(rows)]
    metrics: dict[str, float] = {}
    for _ in range(settings.max_turns):
        running = [e for e in episodes if not e.done and not mt.cut_if_full(e)]
        if not running:
            break
        with _phase(timer, "generation"):
            out = generation.generate(mt.request(running), greedy=settings.greedy)
            texts = [mt.take_generation(e, out, i) for i, e in enumerate(running)]
        with _phase(timer, "reward_calculation"):
            turns = step_envs(texts, [e.metadata for e in running], envs)
            for t in turns:
                for k, i in enumerate(t.idx):
                    mt.take_env(running[i], t.ret, k)
            _add(metrics, turn_metrics(turns, envs, len(running), label))
    return mt.batch(episodes, group_ids, metrics)


def run_async_multi_turn_rollout(
    rows: list[PromptRow],
    group_ids: torch.Tensor,
    generation: GenerationInterface,
    tokenizer: PreTrainedTokenizerBase,
    envs: dict[str, EnvironmentInterface],
    settings: TurnSettings,
    seeds: list[int] | None = None,
    timer: Timer | None = None,
    label: str | None = None,
) -> RolloutBatch:
    """One coroutine per episode: its turns go to the engine as they come (generate_async), so episodes of
    different lengths overlap. Environment calls are serialized per environment (its worker pool is not
    re-entrant). The whole rollout is booked under "generation" (the phases interleave)."""
    mt = MultiTurn(settings, tokenizer)
    episodes = [Episode.start(r, seeds[i] if seeds else None) for i, r in enumerate(rows)]
    metrics: dict[str, float] = {}

    async def play(e: Episode, locks: dict[str, asyncio.Lock]) -> None:
        name = e.row["env_name"]
        while not e.done and not mt.cut_if_full(e):
            out = await generation.generate_async(mt.request([e]), greedy=settings.greedy)
            text = mt.take_generation(e, out, 0)
            async with locks[name]:
                turns: list[EnvTurn] = await asyncio.to_thread(step_envs, [text], [e.metadata], envs)
            mt.take_env(e, turns[0].ret, 0)
            _add(metrics, turn_metrics(turns, envs, 1, label))

    async def play_all() -> None:
        locks = {name: asyncio.Lock() for name in envs}
        await asyncio.gather(*(play(e, locks) for e in episodes))

    with _phase(timer, "generation"):
        asyncio.run(play_all())
    return mt.batch(episodes, group_ids, metrics)


def run_rollouts(
    rows: list[PromptRow],
    group_ids: torch.Tensor,
    generation: GenerationInterface,
    tokenizer: PreTrainedTokenizerBase,
    envs: dict[str, EnvironmentInterface],
    settings: TurnSettings,
    use_async: bool = False,
    seeds: list[int] | None = None,
    timer: Timer | None = None,
    label: str | None = None,
) -> RolloutBatch:
    """The rollout for grpo.max_rollout_turns: single-turn (rollouts.run_rollout) for 1, else multi-turn,
    per-episode coroutines when `use_async` (vLLM's async engine), lock-step otherwise."""
    if settings.max_turns == 1:
        return run_rollout(rows, group_ids, generation, tokenizer, envs, greedy=settings.greedy, seeds=seeds,
                           timer=timer, label=label)
    driver = run_async_multi_turn_rollout if use_async else run_multi_turn_rollout
    return driver(rows, group_ids, generation, tokenizer, envs, settings, seeds=seeds, timer=timer, label=label)
