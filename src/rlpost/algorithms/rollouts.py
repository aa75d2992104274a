"""One generation batch: prompts -> engine -> responses -> rewards (single turn).

Rows arrive already tokenized (`prompt_ids`) and repeated num_generations_per_prompt times; the
result keeps everything the loop needs afterwards: the engine's output tensors, the decoded
responses, the rewards, and the per-sample group ids (identical prompt -> same group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.environments.interfaces import EnvironmentInterface


@dataclass
class RolloutBatch:
    """Generated samples of one batch, in row order."""

    rows: List[Dict[str, Any]]
    """The dataset rows (with prompt_ids, loss_multiplier), one per sample."""
    group_ids: torch.Tensor
    """[B] int: samples of the same prompt share a group id."""
    gen: BatchedDataDict
    """Engine outputs: output_ids, logprobs, generation_lengths, unpadded_sequence_lengths, truncated."""
    input_lengths: torch.Tensor
    """[B] prompt lengths."""
    responses: List[str]
    """Decoded responses (special tokens removed)."""
    rewards: torch.Tensor
    """[B] float rewards as the environments returned them."""
    metrics: Dict[str, float] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.rows)

    def select(self, idx: List[int]) -> RolloutBatch:
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
    def concat(parts: List[RolloutBatch]) -> RolloutBatch:
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


def prompts_batch(rows: List[Dict[str, Any]], pad_id: int) -> BatchedDataDict:
    """Right-padded input_ids [B, P] and input_lengths [B] from rows' prompt_ids."""
    lengths = torch.tensor([len(r["prompt_ids"]) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if len(rows) else 0
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["prompt_ids"])] = torch.tensor(r["prompt_ids"], dtype=torch.long)
    return BatchedDataDict(input_ids=ids, input_lengths=lengths)


def score(
    responses: List[str], rows: List[Dict[str, Any]], envs: Dict[str, EnvironmentInterface]
) -> tuple[torch.Tensor, Dict[str, float]]:
    """Rewards [B] from each row's environment; timeouts / errors counted as metrics."""
    rewards = torch.zeros(len(rows))
    timeouts = errors = 0
    by_env: Dict[str, List[int]] = {}
    for i, r in enumerate(rows):
        by_env.setdefault(r["env_name"], []).append(i)
    for name, idx in by_env.items():
        ret = envs[name].step([responses[i] for i in idx], [rows[i] for i in idx])
        rewards[torch.tensor(idx)] = torch.tensor(ret.rewards, dtype=torch.float32)
        timeouts += ret.timeouts
        errors += ret.errors
    return rewards, {"reward_timeouts": float(timeouts), "reward_errors": float(errors)}


def run_rollout(
    rows: List[Dict[str, Any]],
    group_ids: torch.Tensor,
    generation: Any,
    tokenizer: Any,
    envs: Dict[str, EnvironmentInterface],
    greedy: bool = False,
    seeds: Optional[List[int]] = None,
) -> RolloutBatch:
    """Generate for `rows` and score the responses."""
    batch = prompts_batch(rows, tokenizer.pad_token_id)
    if seeds is not None:
        batch["seeds"] = torch.tensor(seeds, dtype=torch.long)
    gen = generation.generate(batch, greedy=greedy)
    in_len = batch["input_lengths"]
    gl = gen["generation_lengths"]
    out = gen["output_ids"]
    responses = [
        tokenizer.decode(out[i, int(in_len[i]) : int(in_len[i]) + int(gl[i])].tolist(), skip_special_tokens=True)
        for i in range(len(rows))
    ]
    rewards, metrics = score(responses, rows, envs)
    return RolloutBatch(rows, group_ids, gen, in_len, responses, rewards, metrics)
