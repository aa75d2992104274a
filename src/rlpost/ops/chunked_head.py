"""The output layer in chunks of tokens: next-token log-probabilities straight from the final hidden states, so the
whole [tokens, vocabulary] logits never exist, in the forward pass or the backward.

`head_logprobs(hidden, weight, target, chunk_size, temperature, ...)` takes the hidden states [N, H] (the rows of a
batch, flattened), the output layer's weight [V_local, H] (this rank's slice of the vocabulary under tensor
parallelism) and the target token ids [N]. Per chunk of `chunk_size` tokens, in fp32 (fp64 for fp64 inputs):

- forward: x = hidden_c @ weight.T / temperature [c, V_local]; lse = logsumexp over the whole vocabulary (MAX and
  SUM all-reduced over the group); the target's logit comes from the rank that owns its id (SUM all-reduced);
  logprob = target logit - lse. Only lse [N] is kept besides the inputs.
- backward: x is recomputed, d logprob / d x = onehot(target) - softmax(x) with the global lse, so
  dx = g * (onehot - softmax) / temperature; grad_hidden_c = dx @ weight, grad_weight += dx.T @ hidden_c. Under
  tensor parallelism every rank's grad_hidden is the part from its own vocabulary slice: they are all-reduced (SUM),
  as the backward of the copy into the tensor-parallel region would.

The working set is chunk_size x V_local in both passes (plus the weight's gradient, [V_local, H]), against
N x V_local for logits computed whole (ops/logprobs.py): at 8k tokens and SmolLM2's 49k vocabulary that is 1.5 GiB
of fp32 logits, and as much again for their gradient. Values and gradients equal the unchunked path
(tests/unit/ops/test_chunked_head.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlpost.ops.logprobs import _chunks, _compute_dtype


class _HeadLogprobs(torch.autograd.Function):
    """logprob[n] = (hidden[n] @ weight.T / T)[target[n]] - logsumexp over the whole vocabulary."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V_local, H]
        target: torch.Tensor,  # [N] global token ids
        chunk_size: int | None,
        temperature: float,
        vocab_start: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        dtype = _compute_dtype(hidden, weight)
        v_local = weight.shape[0]
        owned = (target >= vocab_start) & (target < vocab_start + v_local)  # [N]
        local_target = torch.where(owned, target - vocab_start, torch.zeros_like(target))  # [N]
        w = weight.to(dtype)
        out = torch.empty(target.shape, dtype=dtype, device=hidden.device)  # [N]
        lse_all = torch.empty_like(out)  # [N]
        for s, e in _chunks(target.shape[0], chunk_size):
            x = hidden[s:e].to(dtype) @ w.T  # [c, V_local]
            if temperature != 1.0:
                x.div_(temperature)
            m = x.max(dim=-1).values  # [c]
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            sumexp = torch.exp(x - m.unsqueeze(-1)).sum(dim=-1)  # [c]
            picked = x.gather(-1, local_target[s:e].unsqueeze(-1)).squeeze(-1) * owned[s:e]  # [c]
            if group is not None:
                dist.all_reduce(sumexp, op=dist.ReduceOp.SUM, group=group)
                dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
            lse_all[s:e] = m + torch.log(sumexp)
            out[s:e] = picked - lse_all[s:e]
        ctx.save_for_backward(hidden, weight, local_target, owned, lse_all)
        ctx.chunk_size, ctx.temperature, ctx.group = chunk_size, temperature, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local_target, owned, lse_all = ctx.saved_tensors
        dtype = lse_all.dtype
        w = weight.to(dtype)
        g_all = grad_out.to(dtype)  # [N]
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)  # [N, H]
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)  # [V_local, H]
        for s, e in _chunks(local_target.shape[0], ctx.chunk_size):
            h = hidden[s:e].to(dtype)  # [c, H]
            x = h @ w.T  # [c, V_local]
            if ctx.temperature != 1.0:
                x.div_(ctx.temperature)
            g = g_all[s:e]  # [c]
            dx = x.sub_(lse_all[s:e].unsqueeze(-1)).exp_().mul_((-g).unsqueeze(-1))  # -g * softmax, in place
            dx.scatter_add_(-1, local_target[s:e].unsqueeze(-1), (g * owned[s:e]).unsqueeze(-1))
            if ctx.temperature != 1.0:
                dx.div_(ctx.temperature)
            grad_hidden[s:e] = dx @ w
            grad_weight.addmm_(dx.T, h)
        if ctx.group is not None:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    chunk_size: int | None,
    temperature: float = 1.0,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """log p(target[n] | hidden[n]) [N] through the output layer `weight` [V_local, H] (rows vocab_start onward of
    the vocabulary; the whole of it without a group), `chunk_size` tokens at a time (None: all at once). Every rank
    of `group` passes the same hidden states and targets and gets the same result."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [N, H] and [V, H]")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target {tuple(target.shape)} must be [N] for hidden {tuple(hidden.shape)}")
    out: torch.Tensor = _HeadLogprobs.apply(hidden, weight, target.long(), chunk_size, float(temperature),
                                            vocab_start, group)
    return out
