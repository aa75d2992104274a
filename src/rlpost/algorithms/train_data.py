"""Rollouts + advantages -> the [B, S] training batch (NeMo RL's layout).

Per-token tensors are aligned with input_ids (the prompt then the response, right-padded to a
multiple of policy.make_sequence_length_divisible_by); token_mask is 1 on response tokens only (in a
multi-turn episode, on the model's turns only: the rollout's gen["token_mask"]);
advantages are broadcast over the response; sample_mask = loss_multiplier (0 for over-long prompts
and, with overlong filtering, truncated samples).
"""

from __future__ import annotations

import torch

from rlpost.algorithms.rollouts import RolloutBatch
from rlpost.distributed.batched_data_dict import BatchedDataDict


def build_train_data(
    batch: RolloutBatch, advantages: torch.Tensor, sample_mask: torch.Tensor, pad_id: int, multiple: int = 1
) -> BatchedDataDict:
    ids = batch.gen["output_ids"]  # [B, S0]
    lp = batch.gen["logprobs"].float()  # [B, S0]
    b, s0 = ids.shape
    s = ((s0 + multiple - 1) // multiple) * multiple
    if s > s0:
        ids = torch.nn.functional.pad(ids, (0, s - s0), value=pad_id)
        lp = torch.nn.functional.pad(lp, (0, s - s0))
    if "token_mask" in batch.gen:  # multi-turn: the model's tokens only, never the environment's
        token_mask = torch.nn.functional.pad(batch.gen["token_mask"].float(), (0, s - s0))
    else:
        pos = torch.arange(s)[None, :]  # [1, S]
        start = batch.input_lengths[:, None]  # [B, 1]
        end = batch.gen["unpadded_sequence_lengths"][:, None]  # [B, 1]
        token_mask = ((pos >= start) & (pos < end)).float()  # [B, S]
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=batch.gen["unpadded_sequence_lengths"].long(),
        token_mask=token_mask,
        sample_mask=sample_mask.float(),
        advantages=advantages.float()[:, None].expand(b, s).clone() * token_mask,
        generation_logprobs=lp * token_mask,
    )
