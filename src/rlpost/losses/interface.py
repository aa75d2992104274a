"""The loss protocol the workers call: `LossType`, `LossFunction` (NeMo RL's `nemo_rl.algorithms.interfaces`,
re-exported at `rlpost.algorithms.interfaces`).

A leaf: it imports only torch and typing (BatchedDataDict under TYPE_CHECKING only).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from rlpost.distributed.batched_data_dict import BatchedDataDict


class VocabParallelArgs(TypedDict, total=False):
    """The keyword arguments a worker adds to a loss (and logprob) call with tensor parallelism: the logits hold this
    rank's vocabulary slice (empty without tensor parallelism)."""

    vocab_parallel_group: dist.ProcessGroup | None
    vocab_parallel_rank: int | None


class LossType(enum.Enum):
    """How a loss reduces over the batch: mean over valid tokens or mean over valid sequences."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


@runtime_checkable
class LossFunction(Protocol):
    """A loss computed on one micro-batch and normalised by counts of the WHOLE global batch.

    `loss_type` tells the worker which global count the loss divides by (tokens or sequences).
    """

    loss_type: LossType
    needs_prev_logprobs: bool
    """The loop computes prev_logprobs (the pre-update policy's) only when the loss reads them."""
    needs_reference_logprobs: bool
    """The loop runs the reference model only when the loss reads reference_policy_logprobs."""
    # Optional, read with getattr: `chunked_logits: bool`. True when the loss reads its logits only through
    # rlpost.ops.logprobs.next_token_logprobs (and slices of them): the worker may then hand it HeadLogits, the output
    # layer read a chunk of tokens at a time, so the whole [B, S, V] logits never exist. Absent: real logits.

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Compute the loss of one micro-batch.

        Args:
            next_token_logits: [B, S, V] logits of the model on `data["input_ids"]` (already divided by the
                sampling temperature); logits at position t predict token t + 1. rlpost.ops.chunked_head.HeadLogits for a loss
                with `chunked_logits` set.
            data: the micro-batch: per-token tensors [B, S] aligned with input_ids (position 0 holds 0),
                `token_mask` [B, S], `sample_mask` [B], and whatever the loss needs (advantages, logprobs, ...).
            global_valid_seqs: scalar, number of valid sequences (sum of sample_mask) over the whole global
                batch on all data-parallel ranks.
            global_valid_toks: scalar, number of valid tokens (sum of token_mask[:, 1:] * sample_mask) over the
                whole global batch on all data-parallel ranks.
            vocab_parallel_rank, vocab_parallel_group: with tensor parallelism, the logits hold this rank's vocabulary
                slice [B, S, V / tp] and logprobs need a log-softmax over the group (rlpost.ops.logprobs); None
                when the logits are whole.

        Returns:
            (loss, metrics): a scalar loss whose sum over all micro-batches and ranks of a global batch is the
            global-batch loss, and a dict of python-float metrics normalised the same way (sum them over
            micro-batches to get the global value).
        """
        ...
