"""One generation batch: prompts -> engine -> responses -> rewards (single turn).

Rows arrive already tokenized (`prompt_ids`) and repeated num_generations_per_prompt times; the
result keeps everything the loop needs afterwards: the engine's output tensors, the decoded
responses, the rewards, and the per-sample group ids (identical prompt -> same group).
Generation and scoring are timed apart (`generation`, `reward_calculation`), and a slow or
timed-out scoring prints one warning line naming the step and the env settings to change.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rlpost.data.rows import PromptRow
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.models.generation.interfaces import GenerationInterface
from rlpost.runtime import console
from rlpost.runtime.timer import Timer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RolloutBatch:
    """Generated samples of one batch, in row order."""

    rows: list[PromptRow]
    """The dataset rows (with prompt_ids, loss_multiplier), one per sample."""
    group_ids: torch.Tensor
    """[B] int: samples of the same prompt share a group id."""
    gen: BatchedDataDict
    """Engine outputs: output_ids, logprobs, generation_lengths, unpadded_sequence_lengths, truncated."""
    input_lengths: torch.Tensor
    """[B] prompt lengths."""
    responses: list[str]
    """Decoded responses (special tokens removed)."""
    rewards: torch.Tensor
    """[B] float rewards as the environments returned them."""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.rows)

    def select(self, idx: list[int]) -> RolloutBatch:
        t = torch.tensor(idx, dtype=torch.long)
        return RolloutBatch(
            rows=[self.rows[i] for i in idx],
            group_ids=self.group_ids[t],
            gen=self.gen.select_indices(idx),
            input_lengths=self.input_lengths[t],
            responses=[self.responses[i] for i in idx],
            rewards=self.rewards[t],
            metrics=dict(self.metrics),
        )

    @staticmethod
    def concat(parts: list[RolloutBatch]) -> RolloutBatch:
        offset, gids = 0, []
        for p in parts:
            gids.append(p.group_ids + offset)
            offset += int(p.group_ids.max()) + 1 if p.size else 0
        return RolloutBatch(
            rows=[r for p in parts for r in p.rows],
            group_ids=torch.cat(gids),
            gen=BatchedDataDict.from_batches([p.gen for p in parts]),
            input_lengths=torch.cat([p.input_lengths for p in parts]),
            responses=[s for p in parts for s in p.responses],
            rewards=torch.cat([p.rewards for p in parts]),
            metrics=dict(parts[-1].metrics),
        )


def padded_batch(seqs: list[list[int]], pad_id: int) -> BatchedDataDict:
    """Right-padded input_ids [B, P] and input_lengths [B] of token sequences (a generate() input)."""
    lens = [len(q) for q in seqs]
    width = max(lens, default=0)
    ids = torch.tensor([list(q) + [pad_id] * (width - n) for q, n in zip(seqs, lens, strict=True)],
                       dtype=torch.long).reshape(len(seqs), width)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lens, dtype=torch.long))


def prompts_batch(rows: list[PromptRow], pad_id: int) -> BatchedDataDict:
    """The generate() input of rows' prompt_ids."""
    return padded_batch([r["prompt_ids"] for r in rows], pad_id)


@dataclass
class EnvTurn:
    """One environment's answer to its share of a batch: the sample indices it got and its return."""

    name: str
    idx: list[int]
    ret: EnvironmentReturn
    seconds: float


def step_envs(
    responses: list[str], rows: Sequence[Mapping[str, object]], envs: dict[str, EnvironmentInterface]
) -> list[EnvTurn]:
    """Each row's environment (row["env_name"]) steps on its responses, one call per environment. `rows`: the
    prompt rows, or (multi-turn) the episodes' metadata."""
    by_env: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_env.setdefault(str(r["env_name"]), []).append(i)
    turns = []
    for name, idx in by_env.items():
        t0 = time.perf_counter()
        ret = envs[name].step([responses[i] for i in idx], [rows[i] for i in idx])
        turns.append(EnvTurn(name, idx, ret, time.perf_counter() - t0))
    return turns


def turn_metrics(turns: list[EnvTurn], envs: dict[str, EnvironmentInterface], n: int, label: str | None) -> dict[str, float]:
    """reward_timeouts / reward_errors / reward_unfinished of one batch of env steps; with a `label` (e.g.
    "step 3"), a slow or timed-out scoring prints one warning line."""
    notes = [note for t in turns if (note := _slow_note(t.name, envs[t.name], t.ret, t.seconds)) is not None]
    if label is not None and notes:
        console.warn(
            f"{label}: rewards took {sum(t.seconds for t in turns):.1f} s for {n} samples ({'; '.join(notes)}); "
            "raise num_workers or lower timeout_s"
        )
    metrics = {
        "reward_timeouts": float(sum(t.ret.timeouts for t in turns)),
        "reward_errors": float(sum(t.ret.errors for t in turns)),
        "reward_unfinished": float(sum(t.ret.unfinished for t in turns)),
    }
    for t in turns:  # the environments' own counters (e.g. calculator_calls), summed
        for key, value in t.ret.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
    return metrics


def score(
    responses: list[str],
    rows: list[PromptRow],
    envs: dict[str, EnvironmentInterface],
    label: str | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards [B] from each row's environment; timeouts / errors counted as metrics.

    With a `label` (e.g. "step 3"), a slow or timed-out scoring prints one warning line.
    """
    rewards = torch.zeros(len(rows))
    turns = step_envs(responses, rows, envs)
    for t in turns:
        rewards[torch.tensor(t.idx)] = torch.tensor(t.ret.rewards, dtype=torch.float32)
    return rewards, turn_metrics(turns, envs, len(rows), label)


def _slow_note(name: str, env: EnvironmentInterface, ret: EnvironmentReturn, seconds: float) -> str | None:
    """What the warning says about one environment, or None when its scoring was quick and complete."""
    cfg = env.cfg
    slow = cfg is not None and seconds > cfg.slow_warning_s
    if not slow and ret.timeouts == 0:
        return None
    parts: list[str] = []
    killed = ret.timeouts - ret.unfinished
    if killed:
        parts.append(f"{killed} timed out" + (f" after {cfg.timeout_s:g} s" if cfg else ""))
    if ret.unfinished:
        parts.append(f"{ret.unfinished} unfinished" + (f" at the {cfg.batch_timeout_s:g} s batch deadline" if cfg else ""))
    if cfg is not None:
        parts.append(f"env.{name}.num_workers={cfg.num_workers}")
    else:
        parts.append(f"env {name}")
    return ", ".join(parts)


def run_rollout(
    rows: list[PromptRow],
    group_ids: torch.Tensor,
    generation: GenerationInterface,
    tokenizer: PreTrainedTokenizerBase,
    envs: dict[str, EnvironmentInterface],
    greedy: bool = False,
    seeds: list[int] | None = None,
    timer: Timer | None = None,
    label: str | None = None,
) -> RolloutBatch:
    """Generate for `rows` and score the responses.

    With a `timer`, generation (and decoding) is booked under "generation" and scoring under
    "reward_calculation"; `label` names the step in the slow-reward warning.
    """
    batch = seeded_prompts(rows, tokenizer, seeds)
    with _phase(timer, "generation"):
        gen = generation.generate(batch, greedy=greedy)
    return finish_rollout(rows, group_ids, batch["input_lengths"], gen, tokenizer, envs, timer, label)


def seeded_prompts(rows: list[PromptRow], tokenizer: PreTrainedTokenizerBase,
                   seeds: list[int] | None) -> BatchedDataDict:
    """The generate() input of `rows`, with their per-row seeds."""
    batch = prompts_batch(rows, tokenizer.pad_token_id)
    if seeds is not None:
        batch["seeds"] = torch.tensor(seeds, dtype=torch.long)
    return batch


def finish_rollout(
    rows: list[PromptRow],
    group_ids: torch.Tensor,
    in_len: torch.Tensor,
    gen: BatchedDataDict,
    tokenizer: PreTrainedTokenizerBase,
    envs: dict[str, EnvironmentInterface],
    timer: Timer | None = None,
    label: str | None = None,
) -> RolloutBatch:
    """The rollout of `rows` from the engine's output `gen` for them: responses decoded (booked under
    "generation"), then scored ("reward_calculation")."""
    with _phase(timer, "generation"):
        out = gen["output_ids"].tolist()
        generated = [out[i][a : a + n] for i, (a, n) in enumerate(zip(in_len.tolist(), gen["generation_lengths"].tolist(),
                                                                     strict=True))]
        responses = [str(tokenizer.decode(g, skip_special_tokens=True)) for g in generated]
    with _phase(timer, "reward_calculation"):
        rewards, metrics = score(responses, rows, envs, label)
    return RolloutBatch(rows, group_ids, gen, in_len, responses, rewards, metrics)


def _phase(timer: Timer | None, name: str) -> ContextManager[None]:
    """`timer.time(name)`, or nothing without a timer."""
    return timer.time(name) if timer is not None else nullcontext()
