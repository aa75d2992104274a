"""On-policy distillation's loss (algo=distillation): `DistillationLossFn`, the token mean over the global batch of
the KL to the teacher (rlpost.losses.teacher_kl) on the student's own samples."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlpost.config.schema.loss import DistillationLossConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.clipped_pg import LossConfigLike, _coerce_config
from rlpost.losses.interface import LossType
from rlpost.losses.teacher_kl import teacher_kl
from rlpost.ops.chunked_head import HeadLogits

_EPS = 1e-8


class DistillationLossFn:
    """Token-level KL to the teacher on the student's own samples (on-policy distillation)."""

    loss_type = LossType.TOKEN_LEVEL
    needs_prev_logprobs = False
    needs_reference_logprobs = False
    chunked_logits = True
    """The student's logprobs at the teacher's top-k are read a chunk of tokens at a time (HeadLogits)."""
    TOKEN_MEAN_METRICS = frozenset({"kl_to_teacher", "teacher_topk_mass", "student_topk_mass"})

    def __init__(self, cfg: LossConfigLike | None = None) -> None:
        self.cfg: DistillationLossConfig = DistillationLossConfig() if cfg is None else _coerce_config(
            cfg, DistillationLossConfig)
        self.cfg.check("loss_fn")

    def accumulated_scales(self, global_valid_seqs: float, global_valid_toks: float) -> tuple[float, dict[str, float]]:
        scale = 1.0 / (global_valid_toks + _EPS)
        return scale, {"loss": scale, **{k: scale for k in self.TOKEN_MEAN_METRICS}}

    def __call__(
        self,
        next_token_logits: torch.Tensor | HeadLogits,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        del global_valid_seqs
        if vocab_parallel_group is not None:
            raise ValueError("the distillation loss needs whole-vocabulary logits (no vocab-parallel shards)")
        mask = data["token_mask"][:, 1:].float() * data["sample_mask"].float()[:, None]
        loss, metrics = teacher_kl(next_token_logits, data, mask.to(next_token_logits.device), global_valid_toks,
                                   self.cfg.kl_type, self.cfg.mixed_kl_weight)
        return loss, {"loss": float(loss), **metrics, "num_valid_samples": float(data["sample_mask"].sum())}
