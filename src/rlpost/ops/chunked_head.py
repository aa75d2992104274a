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

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from rlpost.ops.logprobs import _chunks, _compute_dtype, vocab_max_and_logsumexp


class _HeadLogprobs(torch.autograd.Function):
    """logprob[n, j] = (hidden[n] @ weight.T / T)[target[n, j]] - logsumexp over the whole vocabulary."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V_local, H]
        target: torch.Tensor,  # [N, k] global token ids
        chunk_size: int | None,
        temperature: float,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        valid_rows: int,
    ) -> torch.Tensor:
        dtype = _compute_dtype(hidden, weight)
        v_local = weight.shape[0]
        owned = (target >= vocab_start) & (target < vocab_start + v_local)  # [N, k]
        local_target = torch.where(owned, target - vocab_start, torch.zeros_like(target))  # [N, k]
        out = torch.empty(target.shape, dtype=dtype, device=hidden.device)  # [N, k]
        lse_all = torch.empty(target.shape[:1], dtype=dtype, device=hidden.device)  # [N]
        chunks = _chunks(target.shape[0], chunk_size)
        kept: torch.Tensor | None = None
        for s, e in chunks:
            x = _logits(hidden[s:e], weight, temperature, dtype, valid_rows)  # [c, V_local]
            picked = x.gather(-1, local_target[s:e]) * owned[s:e]  # [c, k]
            if group is None:
                lse_all[s:e] = torch.logsumexp(x, dim=-1)  # fused: one pass over the chunk
            else:
                lse_all[s:e] = vocab_max_and_logsumexp(x, group)[1]
                dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
            out[s:e] = picked - lse_all[s:e].unsqueeze(-1)
            if len(chunks) == 1:
                kept = x  # one chunk is the whole logits anyway: kept, not computed again in backward
        ctx.save_for_backward(hidden, weight, local_target, owned, lse_all, kept)
        ctx.chunk_size, ctx.temperature, ctx.group, ctx.valid_rows = chunk_size, temperature, group, valid_rows
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local_target, owned, lse_all, kept = ctx.saved_tensors
        dtype = lse_all.dtype
        g_all = grad_out.to(dtype)  # [N, k]
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)  # [N, H]
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)  # [V_local, H]
        for s, e in _chunks(local_target.shape[0], ctx.chunk_size):
            x = kept if kept is not None else _logits(hidden[s:e], weight, ctx.temperature, dtype, ctx.valid_rows)
            g = g_all[s:e]  # [c, k]
            dx = x.sub_(lse_all[s:e].unsqueeze(-1)).exp_().mul_(-g.sum(-1, keepdim=True))  # -sum(g) * softmax
            dx.scatter_add_(-1, local_target[s:e], g * owned[s:e])
            if ctx.temperature != 1.0:
                dx.div_(ctx.temperature)
            dx_mm = dx.to(hidden.dtype)  # the matmuls run in the layer's dtype (bf16 under mixed precision)
            grad_hidden[s:e] = dx_mm @ weight.to(hidden.dtype)
            grad_weight.addmm_(dx_mm.T.to(dtype), hidden[s:e].to(dtype))
        if ctx.group is not None:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def _valid_rows(weight: torch.Tensor, vocab_start: int, vocab_size: int | None) -> int:
    """How many of `weight`'s rows (ids from vocab_start) are real tokens: all of them, or those below vocab_size."""
    return weight.shape[0] if vocab_size is None else vocab_size - vocab_start


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, dtype: torch.dtype,
            valid_rows: int) -> torch.Tensor:
    """hidden @ weight.T / temperature [c, V_local], multiplied in the hidden states' dtype, returned in `dtype`; the
    columns from `valid_rows` on (a padded vocabulary's padding) at the dtype's minimum: no probability mass, and a
    slice of padding alone stays finite."""
    x = (hidden @ weight.to(hidden.dtype).T).to(dtype)
    if temperature != 1.0:
        x.div_(temperature)
    if valid_rows < x.shape[-1]:
        x[:, max(valid_rows, 0):] = torch.finfo(dtype).min
    return x


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    chunk_size: int | None,
    temperature: float = 1.0,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """log p(target[n] | hidden[n]) [N] through the output layer `weight` [V_local, H] (rows vocab_start onward of
    the vocabulary; the whole of it without a group), `chunk_size` tokens at a time (None: all at once); with
    targets [N, k], the log-probability of each of k ids per token [N, k]. Every rank of `group` passes the same
    hidden states and targets and gets the same result. `vocab_size`: the real vocabulary when the layer's is padded
    (ids from it on are never predicted); None: every row is real."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [N, H] and [V, H]")
    if target.shape[:1] != hidden.shape[:1] or target.dim() > 2:
        raise ValueError(f"target {tuple(target.shape)} must be [N] or [N, k] for hidden {tuple(hidden.shape)}")
    valid = _valid_rows(weight, vocab_start, vocab_size)
    targets = target.long().reshape(target.shape[0], -1)  # [N, k]
    out: torch.Tensor = _HeadLogprobs.apply(hidden, weight, targets, chunk_size, float(temperature),
                                            vocab_start, group, valid)
    return out.view(target.shape)


@dataclass(frozen=True)
class HeadLogits:
    """The logits [B, S, V_local] = hidden @ weight.T / temperature of a micro-batch, never made whole: each reader
    (a loss's logprobs, the token-accuracy metric) goes through them `chunk_size` tokens at a time. `weight` is this
    rank's rows [vocab_start, vocab_start + V_local) of the output layer (the whole of it without a group).

    Slicing the batch and sequence dimensions (`logits[:, :-1]`, a packed row's sequence) slices the hidden states."""

    hidden: torch.Tensor
    """[B, S, H] final hidden states (the output layer's input)."""
    weight: torch.Tensor
    """[V_local, H] the output layer's weight (this rank's vocabulary slice)."""
    temperature: float
    """The sampling temperature the logits are divided by."""
    chunk_size: int | None
    """Tokens per chunk (None: all at once)."""
    vocab_start: int = 0
    """The first vocabulary id of `weight`'s rows."""
    group: dist.ProcessGroup | None = None
    """The group the vocabulary is sharded over (None: the whole vocabulary is here)."""
    vocab_size: int | None = None
    """The real vocabulary of a padded output layer (Megatron pads it): ids from it on get no probability."""

    @property
    def _valid_rows(self) -> int:
        return _valid_rows(self.weight, self.vocab_start, self.vocab_size)

    @property
    def device(self) -> torch.device:
        """Where the logits would be: the hidden states' device."""
        return self.hidden.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:2], self.weight.shape[0]))

    def __getitem__(self, key: tuple[slice, ...] | slice) -> HeadLogits:
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > 2 or not all(isinstance(k, slice) for k in keys):
            raise IndexError(f"HeadLogits slices the batch and sequence dimensions only, not {key!r}")
        return replace(self, hidden=self.hidden[keys])

    def next_token_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] log p(input_ids[:, t] | tokens < t) from position t - 1's logits; position 0 holds 0 (the
        convention of rlpost.ops.logprobs)."""
        b, s, h = self.hidden.shape
        if input_ids.shape[:2] != (b, s):
            raise ValueError(f"logits [{b}, {s}, V] and input_ids {tuple(input_ids.shape)} disagree on [B, S]")
        lp = head_logprobs(self.hidden[:, :-1].reshape(-1, h), self.weight, input_ids[:, 1:].reshape(-1),
                           self.chunk_size, self.temperature, self.vocab_start, self.group,
                           self.vocab_size).view(b, s - 1)
        return torch.cat([lp.new_zeros(b, 1), lp], dim=1)

    def logprobs_at(self, indices: torch.Tensor) -> torch.Tensor:
        """[B, S, k] log-probabilities of the ids `indices` [B, S, k] at each position (a teacher's top-k under the
        student, rlpost.losses.teacher_kl), differentiable, a chunk of tokens at a time."""
        b, s, h = self.hidden.shape
        if indices.shape[:2] != (b, s) or indices.dim() != 3:
            raise ValueError(f"logits [{b}, {s}, V] and indices {tuple(indices.shape)} disagree on [B, S, k]")
        return head_logprobs(self.hidden.reshape(-1, h), self.weight, indices.reshape(b * s, -1), self.chunk_size,
                             self.temperature, self.vocab_start, self.group, self.vocab_size).view(indices.shape)

    @torch.no_grad()
    def max_and_logsumexp(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, S] the largest logit, [B, S] the logsumexp) over the whole vocabulary, chunk by chunk, in fp32."""
        b, s, h = self.hidden.shape
        flat = self.hidden.reshape(-1, h)
        dtype = _compute_dtype(self.hidden, self.weight)
        top = torch.empty(flat.shape[0], dtype=dtype, device=flat.device)
        lse = torch.empty_like(top)
        for lo, hi in _chunks(flat.shape[0], self.chunk_size):
            x = _logits(flat[lo:hi], self.weight, self.temperature, dtype, self._valid_rows)  # [c, V_local]
            top[lo:hi], lse[lo:hi] = vocab_max_and_logsumexp(x, self.group)
        return top.view(b, s), lse.view(b, s)

    @torch.no_grad()
    def topk_logprobs(self, k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, S, k] token ids, [B, S, k] their log-probabilities over the whole vocabulary) of the k likeliest
        tokens at each position, likeliest first (k None: every token), a chunk of tokens at a time. The vocabulary
        must be whole here (no group): a teacher scores at tensor-parallel size 1."""
        if self.group is not None:
            raise ValueError("top-k logprobs need the whole vocabulary on one rank (tensor-parallel size 1)")
        b, s, h = self.hidden.shape
        flat = self.hidden.reshape(-1, h)
        dtype = _compute_dtype(self.hidden, self.weight)
        kk = self._valid_rows if k is None else min(k, self._valid_rows)
        idx = torch.empty(flat.shape[0], kk, dtype=torch.long, device=flat.device)
        vals = torch.empty(flat.shape[0], kk, dtype=dtype, device=flat.device)
        for lo, hi in _chunks(flat.shape[0], self.chunk_size):
            x = _logits(flat[lo:hi], self.weight, self.temperature, dtype, self._valid_rows)  # [c, V]
            top = x.topk(kk, dim=-1)
            idx[lo:hi], vals[lo:hi] = top.indices, top.values - torch.logsumexp(x, dim=-1, keepdim=True)
        return idx.view(b, s, kk), vals.view(b, s, kk)

    def zero(self) -> torch.Tensor:
        """A zero scalar in the autograd graph of the hidden states (an empty micro-batch's loss)."""
        return self.hidden.sum() * 0.0
