"""`SequencePackingLossWrapper`: apply any LossFunction to a packed micro-batch, one sequence at a time.

A packed micro-batch runs the model on one row [1, T] holding N sequences (layout of rlpost.data.packing);
the loss functions expect padded rows [B, S]. For sequence i the wrapper takes the logits
[:, cu_seqlens_padded[i] : cu_seqlens_padded[i] + len_i] (len_i = cu_seqlens[i+1] - cu_seqlens[i]), the i-th row
of the micro-batch data trimmed to len_i on every per-token tensor, calls the wrapped loss and sums the losses and
the metrics over sequences. Summing is exact because every loss divides by the GLOBAL valid token / sequence
counts (global_valid_toks / global_valid_seqs), never by a count of its own micro-batch; for the same reason the
metrics, already globally normalised, sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlpost.losses.interface import LossFunction, LossType

if TYPE_CHECKING:
    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.ops.chunked_head import HeadLogits


class SequencePackingLossWrapper:
    """Wrap `loss_fn` for packed logits; `data` holds the micro-batch's N sequences as rows [N, S]."""

    def __init__(
        self,
        loss_fn: LossFunction,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_q_padded: torch.Tensor | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.cu_seqlens_q = cu_seqlens_q  # [N+1] cumulative real lengths
        self.cu_seqlens_q_padded = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded  # [N+1]
        self.loss_type: LossType = loss_fn.loss_type

    def __call__(
        self,
        next_token_logits: torch.Tensor | HeadLogits,  # [1, T, V] (V may be a vocab-parallel shard)
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        n_seq = self.cu_seqlens_q.numel() - 1
        if n_seq != data.size:
            raise ValueError(f"cu_seqlens describe {n_seq} sequences but the data holds {data.size} rows")
        full_len = int(data["input_ids"].shape[1])
        total: torch.Tensor | None = None
        metrics: dict[str, float] = {}
        for i in range(n_seq):
            length = int(self.cu_seqlens_q[i + 1] - self.cu_seqlens_q[i])
            start = int(self.cu_seqlens_q_padded[i])
            logits_i = next_token_logits[:, start : start + length]  # [1, L, V]
            data_i = data.slice(i, i + 1).trim_seq(length, full_len)  # rows [1, L]
            loss_i, metrics_i = self.loss_fn(logits_i, data_i, global_valid_seqs,  # type: ignore[arg-type]
                                             global_valid_toks, vocab_parallel_rank, vocab_parallel_group)
            total = loss_i if total is None else total + loss_i
            for k, v in metrics_i.items():
                metrics[k] = metrics.get(k, 0.0) + v
        if total is None:
            total = next_token_logits.sum() * 0.0 if isinstance(next_token_logits, torch.Tensor) else \
                next_token_logits.zero()
        return total, metrics
