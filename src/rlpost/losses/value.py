"""PPO's critic loss: `ClippedValueLossFn`, the squared error of the values to the GAE returns with an optional
clip of the update (NeMo RL's `MseValueLossFn`, verl's `cliprange_value`).

The critic's "logits" are its one-output head on every position, [B, S, 1]; the value of the state that emits token
t is the head at position t - 1 (the same shift as a logprob), compared with data["returns"][:, t] and clipped around
data["values"][:, t] (the critic's values before this step's update). Token-level: divided by the global count of
valid tokens, like the policy's loss, so the micro-batches and ranks sum to the global mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.interface import LossType

_EPS = 1e-8


class ClippedValueLossFn:
    """0.5 * max((v - R)^2, (v_old + clamp(v - v_old, ±clip) - R)^2), token mean over the global batch."""

    loss_type = LossType.TOKEN_LEVEL
    needs_prev_logprobs = False
    needs_reference_logprobs = False
    TOKEN_MEAN_METRICS = frozenset({"value_clip_fraction", "values", "value_error"})
    """Metrics that are token means over the global batch."""

    def __init__(self, value_clip: float | None) -> None:
        self.value_clip = value_clip

    def accumulated_scales(self, global_valid_seqs: float, global_valid_toks: float) -> tuple[float, dict[str, float]]:
        """The factors that turn parts trained with unit normalisers into global means (see ClippedPGLossFn)."""
        scale = 1.0 / (global_valid_toks + _EPS)
        return scale, {"loss": scale, **{k: scale for k in self.TOKEN_MEAN_METRICS}}

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        del global_valid_seqs, vocab_parallel_rank, vocab_parallel_group
        v = next_token_logits[:, :-1, 0].float()  # [B, S-1]: the state emitting token t is at t - 1
        returns = data["returns"][:, 1:].to(v)
        old = data["values"][:, 1:].to(v)
        mask = data["token_mask"][:, 1:].to(v) * data["sample_mask"].to(v)[:, None]
        err = (v - returns) ** 2
        if self.value_clip is not None:
            clipped = old + (v - old).clamp(-self.value_clip, self.value_clip)
            err_clipped = (clipped - returns) ** 2
            per_token = 0.5 * torch.max(err, err_clipped)
            # the clipped term decides where the update left the clip range and it is the larger error
            clip_frac = (((v - old).abs() > self.value_clip) & (err_clipped > err)).to(v)
        else:
            per_token = 0.5 * err
            clip_frac = torch.zeros_like(v)
        den = global_valid_toks + _EPS
        loss = (per_token * mask).sum() / den
        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "value_clip_fraction": float((clip_frac * mask).sum() / den),
                "values": float((v * mask).sum() / den),
                "value_error": float((err * mask).sum() / den),
                "num_valid_samples": float(data["sample_mask"].sum()),
            }
        return loss, metrics
