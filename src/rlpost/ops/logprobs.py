"""Next-token log-probabilities from logits, optionally sharded over the vocabulary (tensor parallel).

Computation is in fp32 (fp64 if the logits are fp64), whatever the logits' dtype.
Convention (docs/architecture.md, "Conventions that keep the numbers right"): the result is [B, S] aligned with
`input_ids`; position t holds log p(input_ids[t] | tokens < t), computed from logits[t - 1]; position 0 holds 0.

Both entry points share one autograd Function, `_NextTokenLogprobs`:
- forward, per chunk of positions, in fp32: m = max_v x (all-reduced MAX over the group),
  lse = m + log(sum_v exp(x - m)) (sum all-reduced SUM), target logit picked by the rank that owns the token id
  (others contribute 0, all-reduced SUM); logprob = target - lse.
- backward, per chunk: d logprob / d x_local = onehot_local(target) - softmax_local(x), where softmax_local uses the
  GLOBAL lse, so grad_x = g * onehot - g * softmax_local. No communication is needed in backward: each rank owns
  the gradient of its own vocabulary slice, and the upstream gradient g is identical on every rank.
Only the input logits and the per-position lse [B, S-1] are saved; the softmax is recomputed chunk by chunk in
backward, so the fp32 working set is bounded by chunk_size * V_local per row in both passes.
Without a group the same code is the ordinary (unsharded) log-softmax gather; unchunked as well (the training loss's
case), the forward is torch's fused logsumexp and the backward builds its gradient in place, so that common case
makes as few passes over the [B, S, V] logits as it can.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist


class LazyLogits(Protocol):
    """Logits that compute their own next-token logprobs (rlpost.ops.chunked_head.HeadLogits, the output layer read
    a chunk of tokens at a time)."""

    def next_token_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor: ...


def _chunks(length: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """[start, end) ranges covering [0, length) in steps of chunk_size (one range if None)."""
    step = length if chunk_size is None or chunk_size <= 0 else chunk_size
    return [(s, min(s + step, length)) for s in range(0, length, max(step, 1))]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when any input is fp64 (low-precision inputs are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def vocab_max_and_logsumexp(x: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the largest entry, the logsumexp) of x's last dimension, [...] each, over the whole vocabulary: x holds this
    rank's slice of it and the max (MAX) and the sum of exponentials (SUM) are all-reduced over `group`."""
    m = x.max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sumexp = torch.exp(x - m.unsqueeze(-1)).sum(dim=-1)
    if group is not None:
        dist.all_reduce(sumexp, op=dist.ReduceOp.SUM, group=group)
    return m, m + torch.log(sumexp)


class _NextTokenLogprobs(torch.autograd.Function):
    """logprob[b, t] = x[b, t, target[b, t] - vocab_start] - logsumexp_over_all_ranks(x[b, t, :])."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,  # [B, T, V_local] (any float dtype)
        target: torch.Tensor,  # [B, T] global token ids
        vocab_start: int,
        vocab_end: int,
        group: dist.ProcessGroup | None,
        chunk_size: int | None,
    ) -> torch.Tensor:
        distributed = group is not None
        dtype = _compute_dtype(logits)
        if not distributed and len(_chunks(target.shape[1], chunk_size)) <= 1:
            # One rank, one chunk: torch's fused logsumexp (one pass instead of max, subtract, exp, sum, log).
            x = logits.to(dtype)  # [B, T, V]
            lse_all = torch.logsumexp(x, dim=-1)  # [B, T]
            out = x.gather(-1, target.unsqueeze(-1)).squeeze(-1) - lse_all  # [B, T]
            ctx.save_for_backward(logits, target, None, lse_all)  # owned=None: backward takes the same path
            return out
        out = torch.empty(target.shape, dtype=dtype, device=logits.device)  # [B, T]
        lse_all = torch.empty_like(out)  # [B, T]
        owned = (target >= vocab_start) & (target < vocab_end)  # [B, T]
        local_target = torch.where(owned, target - vocab_start, torch.zeros_like(target))  # [B, T]
        for s, e in _chunks(target.shape[1], chunk_size):
            x = logits[:, s:e].to(dtype)  # [B, c, V_local]
            _, lse = vocab_max_and_logsumexp(x, group)  # [B, c]
            picked = x.gather(-1, local_target[:, s:e].unsqueeze(-1)).squeeze(-1)  # [B, c]
            picked = picked * owned[:, s:e]
            if distributed:
                dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
            lse_all[:, s:e] = lse
            out[:, s:e] = picked - lse
        ctx.save_for_backward(logits, local_target, owned, lse_all)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, local_target, owned, lse_all = ctx.saved_tensors
        g_all = grad_out.to(lse_all.dtype)  # [B, T]
        if owned is None:  # one rank, one chunk: -g * softmax, plus g at the target, built in place
            grad = torch.sub(logits.to(lse_all.dtype), lse_all.unsqueeze(-1)).exp_().mul_((-g_all).unsqueeze(-1))
            grad.scatter_add_(-1, local_target.unsqueeze(-1), g_all.unsqueeze(-1))
            return grad.to(logits.dtype), None, None, None, None, None
        grad_logits = torch.empty_like(logits)  # [B, T, V_local]
        for s, e in _chunks(local_target.shape[1], ctx.chunk_size):
            g = g_all[:, s:e]  # [B, c]
            softmax = torch.exp(logits[:, s:e].to(lse_all.dtype) - lse_all[:, s:e].unsqueeze(-1))  # [B, c, V_local]
            grad = softmax * (-g).unsqueeze(-1)  # [B, c, V_local]
            onehot_g = (g * owned[:, s:e]).unsqueeze(-1)  # [B, c, 1]
            grad.scatter_add_(-1, local_target[:, s:e].unsqueeze(-1), onehot_g)
            grad_logits[:, s:e] = grad.to(grad_logits.dtype)
        return grad_logits, None, None, None, None, None


def _shifted(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    vocab_start: int,
    vocab_end: int,
    group: dist.ProcessGroup | None,
    chunk_size: int | None,
) -> torch.Tensor:
    """Apply the Function on logits[:, :-1] vs input_ids[:, 1:] and prepend the position-0 zero. -> [B, S]"""
    if logits.shape[:2] != input_ids.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} disagree on [B, S]")
    lp = _NextTokenLogprobs.apply(
        logits[:, :-1], input_ids[:, 1:].long(), vocab_start, vocab_end, group, chunk_size
    )  # [B, S-1]
    zero = torch.zeros(lp.shape[0], 1, dtype=lp.dtype, device=lp.device)  # [B, 1]
    return torch.cat([zero, lp], dim=1)  # [B, S]


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Next-token logprobs [B, S] (fp32 or fp64, position 0 = 0) from full-vocabulary logits [B, S, V].

    chunk_size bounds the number of sequence positions processed at once (None = all).
    """
    return _shifted(logits, input_ids, 0, logits.shape[-1], None, chunk_size)


def vocab_parallel_logprobs(
    local_logits: torch.Tensor,
    input_ids: torch.Tensor,
    vocab_start: int,
    vocab_end: int,
    group: dist.ProcessGroup | None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Next-token logprobs [B, S] from logits sharded over the vocabulary across `group`.

    local_logits: [B, S, vocab_end - vocab_start], this rank's slice [vocab_start, vocab_end) of the vocabulary.
    Every rank of the group must call this with the same input_ids; every rank gets the same result, and the
    gradient flows to each rank's own local logits. group=None means an unsharded vocabulary.
    """
    if local_logits.shape[-1] != vocab_end - vocab_start:
        raise ValueError(
            f"local vocab size {local_logits.shape[-1]} != vocab_end - vocab_start = {vocab_end - vocab_start}"
        )
    return _shifted(local_logits, input_ids, vocab_start, vocab_end, group, chunk_size)


def next_token_logprobs(
    logits: torch.Tensor | LazyLogits,
    input_ids: torch.Tensor,
    vocab_parallel_group: dist.ProcessGroup | None = None,
    vocab_parallel_rank: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Dispatch used by the losses: full-vocabulary logits, or TP-sharded ones when a group is given.

    With a group, rank r owns the equal slice [r * V_local, (r + 1) * V_local) (Megatron's vocab split);
    vocab_parallel_rank defaults to the caller's rank in the group. LazyLogits carry their own group and chunk size.
    """
    if not isinstance(logits, torch.Tensor):
        return logits.next_token_logprobs(input_ids)
    if vocab_parallel_group is None:
        return logprobs_from_logits(logits, input_ids, chunk_size)
    rank = dist.get_rank(vocab_parallel_group) if vocab_parallel_rank is None else vocab_parallel_rank
    v_local = logits.shape[-1]
    start = rank * v_local
    return vocab_parallel_logprobs(logits, input_ids, start, start + v_local, vocab_parallel_group, chunk_size)
