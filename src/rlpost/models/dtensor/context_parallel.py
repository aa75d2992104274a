"""Context parallelism for a DTensor policy: each rank of a `cp` group holds one contiguous slice of every sequence.

`policy.dtensor_cfg.context_parallel_size=N` splits the sequence dimension of each micro-batch over N ranks that
share one data-parallel shard. Every decoder layer then holds activations for S / N tokens, which is what grows with
the sequence; the parameters are sharded by FSDP2 over the data- and context-parallel ranks together.

- **Attention (the all-gather form).** A rank's queries are its own slice; its keys and values are gathered from the
  group up to the end of that slice (an all-gather whose backward sums the gradients of the keys and values back to
  the ranks that own them) and attended with a lower-right causal mask. This splits any number of attention heads,
  which the all-to-all (Ulysses) form cannot: SmolLM2-135M has 9 query and 3 key/value heads.
- **Output.** The decoder's final hidden states are gathered back to whole sequences (the same autograd all-gather)
  before the output layer, so the losses, the chunked output layer and every metric see whole sequences, unchanged.
  Each rank of the group computes the same loss; the all-gather's backward sums their identical gradients, which
  makes each rank's share `N x` its true gradient, and FSDP2's mean over the `dp x cp` ranks divides it back out: the
  worker keeps scaling the loss by the data-parallel size alone.
- A micro-batch whose length is not a multiple of N is padded on the right (causal: earlier tokens never see the
  padding) and the gathered states are cut back to the length it had.

The attention is registered with transformers' `AttentionInterface` under `ATTENTION_NAME` and selected on the
model's config; the gather is a forward hook on the decoder (`model.model`). Full causal attention only: a layer with
a sliding window or a logit soft-cap is refused at its first call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.nn.attention.bias import causal_lower_right

ATTENTION_NAME = "rlpost_context_parallel"
"""The name the attention is registered under in transformers' AttentionInterface."""


class ContextParallel:
    """The slice of each sequence this rank holds, and the two pieces that make the model work on slices."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._length = 0
        """The micro-batch's sequence length before padding (set by `inputs`, read by the output gather)."""

    def inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """This rank's `input_ids` slice [B, S_pad / N] and its `position_ids` (S padded to a multiple of N)."""
        b, s = input_ids.shape
        self._length = s
        padded = -(-s // self.size) * self.size
        if padded != s:
            input_ids = nn.functional.pad(input_ids, (0, padded - s))
        local = padded // self.size
        start = self.rank * local
        positions = torch.arange(start, start + local, device=input_ids.device).expand(b, local)
        return {"input_ids": input_ids[:, start:start + local], "position_ids": positions}

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, S_pad / N, H] slices -> the whole [B, S, H] on every rank (backward: each rank's slice of the sum)."""
        return all_gather_single_autograd(hidden.contiguous(), 1, self.group)[:, :self._length]

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        """transformers' attention contract: q/k/v [B, heads, S / N, D] -> ([B, S / N, heads, D], None)."""
        if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
            raise ValueError("context parallelism supports full causal attention only: this model's layers use a "
                             "sliding window or a logit soft-cap (set policy.dtensor_cfg.context_parallel_size=1)")
        local = query.shape[2]
        end = (self.rank + 1) * local  # keys up to the end of this rank's slice: the rest are in its future
        key = all_gather_single_autograd(key.contiguous(), 2, self.group)[:, :, :end]
        value = all_gather_single_autograd(value.contiguous(), 2, self.group)[:, :, :end]
        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(local, end), dropout_p=dropout, scale=scaling,
        )
        return out.transpose(1, 2).contiguous(), None


def enable(model: nn.Module, cp: ContextParallel) -> None:
    """Make `model` (an HF decoder-only LM) run on sequence slices: its attention gathers keys and values over the
    group, and its decoder's output is gathered back to whole sequences."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, cp.attention)
    model.config._attn_implementation = ATTENTION_NAME  # type: ignore[union-attr]
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, nn.Module):
        raise ValueError(f"{type(model).__name__}: no decoder at model.model; context parallelism needs an HF LM")

    def gathered(_module: nn.Module, _args: Any, output: Any) -> Any:
        output.last_hidden_state = cp.gather(output.last_hidden_state)
        return output

    decoder.register_forward_hook(gathered)
