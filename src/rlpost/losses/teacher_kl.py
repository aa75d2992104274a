"""The per-token KL between a student and a distillation teacher on the teacher's top-k tokens (or the whole
vocabulary): `topk_kl`, and `teacher_kl`, its token mean over a micro-batch, which on-policy distillation's loss
(rlpost.losses.distillation) and GRPO's add-on term (loss_fn.distillation_kl_coef) use.

The teacher's part of the batch (rlpost.algorithms.distillation) is aligned like a logprob: position t holds the
distribution that emits token t, as `teacher_topk_indices` [B, S, k] and the teacher's full-vocabulary log-softmax at
them, `teacher_topk_logprobs` [B, S, k]. Both distributions are taken on k + 1 outcomes: the k tokens, and "any other
token" with the rest of each one's mass (1 - its sum over the k). Then
  reverse: KL(student || teacher) = sum_j p_s(j) (log p_s(j) - log p_t(j))   (mode-seeking; on-policy distillation's)
  forward: KL(teacher || student) = sum_j p_t(j) (log p_t(j) - log p_s(j))
  mixed:   w * forward + (1 - w) * reverse.
The rest outcome keeps the student from parking mass outside the teacher's top-k; with k = the vocabulary size it
is empty and the KL is exact.
"""

from __future__ import annotations

import torch

from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.ops.chunked_head import HeadLogits

_EPS = 1e-8
_REST_FLOOR = 1e-12
"""The smallest mass of the rest outcome (its log stays finite when the k tokens hold everything)."""
KL_TYPES = ("reverse", "forward", "mixed")


def topk_kl(student_logits: torch.Tensor | HeadLogits, indices: torch.Tensor, teacher_logprobs: torch.Tensor,
            kl_type: str = "reverse", mixed_kl_weight: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token KL [B, T], the student's probability mass on the teacher's top-k [B, T]) for student logits
    [B, T, V] (or the output layer read in chunks, rlpost.ops.chunked_head.HeadLogits) and the teacher's top-k
    indices / logprobs [B, T, k] (see the module docstring)."""
    if isinstance(student_logits, HeadLogits):
        s = student_logits.logprobs_at(indices.long())  # [B, T, k], never the whole [B, T, V]
    else:
        dtype = torch.promote_types(student_logits.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
        s = torch.gather(torch.log_softmax(student_logits.to(dtype), dim=-1), -1, indices.long())  # [B, T, k]
    dtype = s.dtype
    t = teacher_logprobs.to(dtype)
    s_mass = s.exp().sum(-1)  # [B, T]

    def with_rest(lp: torch.Tensor) -> torch.Tensor:  # [B, T, k] -> [B, T, k + 1]: the rest's log-mass appended
        rest = (1.0 - lp.exp().sum(-1, keepdim=True)).clamp(min=_REST_FLOOR)
        return torch.cat([lp, rest.log()], dim=-1)

    s1, t1 = with_rest(s), with_rest(t)
    reverse = (s1.exp() * (s1 - t1)).sum(-1)
    forward = (t1.exp() * (t1 - s1)).sum(-1)
    if kl_type == "reverse":
        kl = reverse
    elif kl_type == "forward":
        kl = forward
    elif kl_type == "mixed":
        kl = mixed_kl_weight * forward + (1.0 - mixed_kl_weight) * reverse
    else:
        raise ValueError(f"unknown kl_type {kl_type!r} (expected one of {KL_TYPES})")
    return kl, s_mass


def teacher_kl(student_logits: torch.Tensor | HeadLogits, data: BatchedDataDict, mask: torch.Tensor, global_valid_toks: torch.Tensor,
               kl_type: str = "reverse", mixed_kl_weight: float = 0.5) -> tuple[torch.Tensor, dict[str, float]]:
    """The token mean over the global batch of the KL to the teacher on `mask` [B, S-1] (student logits [B, S, V]
    predict token t + 1 at t), and its metrics (each a share of the global mean: they sum over micro-batches)."""
    idx = data["teacher_topk_indices"][:, 1:]
    t_lp = data["teacher_topk_logprobs"][:, 1:]
    kl, s_mass = topk_kl(student_logits[:, :-1], idx, t_lp, kl_type, mixed_kl_weight)
    den = global_valid_toks + _EPS
    loss = (kl * mask).sum() / den
    with torch.no_grad():
        t_mass = t_lp.float().exp().sum(-1)  # [B, S-1]
        metrics = {
            "kl_to_teacher": float(loss),
            "teacher_topk_mass": float((t_mass * mask).sum() / den),
            "student_topk_mass": float((s_mass * mask).sum() / den),
        }
    return loss, metrics
