"""Losses of preference pairs: `DPOLossFn` (algo=dpo) and `PreferenceLoss` (Bradley-Terry, algo=rm), NeMo RL's.

A micro-batch holds whole pairs, interleaved: rows 2k (chosen) and 2k + 1 (rejected) answer the same prompt
(the loop builds batches that way and the config keeps micro-batches even, unpacked, so no pair is split).
Both losses are SEQUENCE_LEVEL: they divide by the global number of pairs, global_valid_seqs / 2, so the sum
over micro-batches and data-parallel ranks is the global mean, and so are the metrics.

DPO (Rafailov et al. 2023), with lp / lp_ref the policy's / reference's logprobs of the response tokens (m):
  r_i = sum_t (lp - lp_ref) * m          (or the mean over m, preference_average_log_probs)
  L_pref = mean_pairs -log sigmoid(beta * (r_chosen - r_rejected))
  L_sft  = mean_pairs -sum_t lp_chosen * m  (or the mean, sft_average_log_probs)
  L = preference_loss_weight * L_pref + sft_loss_weight * L_sft
Reward model: the model's scores s (one per sequence) replace beta * r: L = mean_pairs -log sigmoid(s_c - s_r).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlpost.config.schema.loss import DPOLossConfig, PreferenceLossConfig
from rlpost.losses.clipped_pg import LossConfigLike, _coerce_config, _slice_inputs, masked_mean
from rlpost.losses.interface import LossType

if TYPE_CHECKING:
    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.ops.chunked_head import HeadLogits


def _pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected): the even and the odd rows."""
    if x.shape[0] % 2:
        raise ValueError(f"a preference micro-batch holds whole pairs; got {x.shape[0]} rows")
    return x[0::2], x[1::2]


def _pair_metrics(margin: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor, pair_mask: torch.Tensor,
                  n_pairs: torch.Tensor) -> dict[str, float]:
    """Accuracy (margin > 0), reward means and margin, each summed over pairs / global pairs."""

    def gmean(x: torch.Tensor) -> float:
        return float(masked_mean(x.detach(), pair_mask, global_normalization_factor=n_pairs).item())

    return {
        "accuracy": gmean((margin > 0).to(margin.dtype)),
        "rewards_chosen_mean": gmean(chosen),
        "rewards_rejected_mean": gmean(rejected),
        "reward_margin": gmean(margin),
        "num_valid_samples": float(pair_mask.sum().item()) * 2,
    }


class DPOLossFn:
    """NeMo RL's DPOLossFn on interleaved pairs; reads `reference_policy_logprobs` (the loop computes them)."""

    loss_type = LossType.SEQUENCE_LEVEL
    needs_prev_logprobs = False
    needs_reference_logprobs = True
    chunked_logits = True

    def __init__(self, cfg: LossConfigLike | None = None) -> None:
        self.cfg: DPOLossConfig = DPOLossConfig() if cfg is None else _coerce_config(cfg, DPOLossConfig)
        self.cfg.check("loss_fn")

    def __call__(
        self,
        next_token_logits: torch.Tensor | HeadLogits,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        del global_valid_toks
        c = self.cfg
        lp, token_mask, sample_mask, _ = _slice_inputs(next_token_logits, data, vocab_parallel_group,
                                                       vocab_parallel_rank)  # [B, S-1]
        lp_ref = data["reference_policy_logprobs"][:, 1:].to(lp.dtype)  # [B, S-1]
        n_tok = token_mask.sum(-1).clamp(min=1.0)  # [B]
        logratio = ((lp - lp_ref) * token_mask).sum(-1)  # [B]
        if c.preference_average_log_probs:
            logratio = logratio / n_tok
        rewards = c.reference_policy_kl_penalty * logratio  # [B]
        r_c, r_r = _pairs(rewards)
        pair_mask, _ = _pairs(sample_mask)
        n_pairs = global_valid_seqs / 2
        margin = r_c - r_r  # [B/2]
        pref = masked_mean(-F.logsigmoid(margin), pair_mask, global_normalization_factor=n_pairs)
        nll = -(lp * token_mask).sum(-1)  # [B]
        if c.sft_average_log_probs:
            nll = nll / n_tok
        nll_c, _ = _pairs(nll)
        sft = masked_mean(nll_c, pair_mask, global_normalization_factor=n_pairs)
        loss = c.preference_loss_weight * pref + c.sft_loss_weight * sft
        with torch.no_grad():
            # k3 estimate of KL(pi || pi_ref) per token on the chosen responses (the text the policy learns to
            # produce; on the rejected ones, which it learns to avoid, the estimator is not a KL and explodes).
            logr = (lp_ref - lp).clamp(-20, 20)
            k3_seq = ((torch.exp(logr) - 1 - logr) * token_mask).sum(-1) / n_tok  # [B]
            k3_c, _ = _pairs(k3_seq)
            metrics = {
                "loss": float(loss.item()),
                "preference_loss": float(pref.item()),
                "sft_loss": float(sft.item()),
                "kl_to_reference": float(masked_mean(k3_c, pair_mask, global_normalization_factor=n_pairs).item()),
                **_pair_metrics(margin, r_c, r_r, pair_mask, n_pairs),
            }
        return loss, metrics


class PreferenceLoss:
    """Bradley-Terry loss of a reward model: the worker hands the scores [B, 1] (one per sequence) as the logits."""

    loss_type = LossType.SEQUENCE_LEVEL
    needs_prev_logprobs = False
    needs_reference_logprobs = False

    def __init__(self, cfg: LossConfigLike | None = None) -> None:
        self.cfg: PreferenceLossConfig = (PreferenceLossConfig() if cfg is None
                                          else _coerce_config(cfg, PreferenceLossConfig))

    def __call__(
        self,
        next_token_logits: torch.Tensor,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        del global_valid_toks, vocab_parallel_rank, vocab_parallel_group
        scores = next_token_logits.to(torch.promote_types(next_token_logits.dtype, torch.float32))
        scores = scores.reshape(scores.shape[0], -1)
        if scores.shape[1] != 1:
            raise ValueError(f"PreferenceLoss needs one score per sequence (a reward model); got {tuple(scores.shape)}"
                             " (a causal LM's logits?)")
        s_c, s_r = _pairs(scores[:, 0])
        pair_mask, _ = _pairs(data["sample_mask"].to(scores.dtype))
        n_pairs = global_valid_seqs / 2
        margin = s_c - s_r
        loss = masked_mean(-F.logsigmoid(margin), pair_mask, global_normalization_factor=n_pairs)
        with torch.no_grad():
            metrics = {"loss": float(loss.item()), **_pair_metrics(margin, s_c, s_r, pair_mask, n_pairs)}
        return loss, metrics
