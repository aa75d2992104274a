"""Context parallelism for a Megatron-Core policy: the ranks of megatron's context-parallel group split each sequence.

`policy.megatron_cfg.context_parallel_size=N` gives every rank of a CP group the same micro-batches (it is one
data-parallel shard) and 1 / N of each sequence, in megatron's load-balanced layout: the sequence, right-padded to a
multiple of 2N, is cut into 2N chunks and rank r holds chunks r and 2N - 1 - r (`local_positions`). That is the layout
megatron's RoPE assumes under CP (`get_pos_emb_on_this_cp_rank`), and it gives every rank the same causal work.

- **Attention (the all-gather form).** `ContextParallelAttention` takes the place of the local spec's
  DotProductAttention, which refuses CP (only Transformer Engine's attention has it). Keys and values are all-gathered
  over the group (autograd: the backward sums their gradients back to the ranks that own them), and each query
  attends to the keys at positions up to its own. It splits any number of heads and runs on gloo and NCCL alike.
- **Output.** The model's output on the rank's chunks (final hidden states inside `output_head.passthrough`, or
  logits) is gathered back to whole sequences in order (`gather`), so every loss, the chunked output layer and
  every metric see whole sequences, unchanged.
- **Gradient scale.** Each rank of the group computes the same loss from the gathered output, so the output
  gather's backward takes the mean of the ranks' identical gradients (not their sum): each rank then holds its
  chunks' true gradient, and megatron's DDP sums the data- and context-parallel ranks' gradients together (the
  converted config's `calculate_per_token_loss`: no averaging), as it sums the data-parallel ranks' without CP. The
  output layer read in chunks after the gather (`output_head.head_logits`) sees whole sequences on every rank, so its
  weight's gradient is divided by N there (`replicated`).

Full causal attention without packing only (MasterConfig refuses CP with packing, pipeline stages, experts and
sequence parallelism).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec


def padded_length(length: int, size: int) -> int:
    """`length` rounded up to a multiple of 2 x size (the chunks of the load-balanced layout)."""
    return -(-length // (2 * size)) * 2 * size


def local_positions(length: int, size: int, rank: int) -> torch.Tensor:
    """The positions rank `rank` of `size` holds of a sequence padded to `length` (a multiple of 2 x size):
    chunk `rank`, then chunk 2 x size - 1 - rank."""
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


@functools.lru_cache(maxsize=16)
def gathered_positions(length: int, size: int) -> torch.Tensor:
    """The position of each row of the ranks' chunks all-gathered in rank order (cached: every layer of every
    micro-batch asks; callers do not write to it)."""
    return torch.cat([local_positions(length, size, r) for r in range(size)])


def _group() -> dist.ProcessGroup:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def _rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank()


def size() -> int:
    """Ranks in this rank's context-parallel group (1 without CP or before megatron's groups exist)."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def split(input_ids: torch.Tensor) -> torch.Tensor:
    """This rank's chunks of `input_ids` [B, S] (right-padded with zeros to a multiple of 2 x CP): [B, S_pad / CP]."""
    n = size()
    if n == 1:
        return input_ids
    s = input_ids.shape[1]
    padded = padded_length(s, n)
    if padded != s:
        input_ids = torch.nn.functional.pad(input_ids, (0, padded - s))
    index = local_positions(padded, n, _rank()).to(input_ids.device)
    return input_ids.index_select(1, index)


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; the backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def replicated(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as used by every rank of the group on the same whole sequences: its gradient divided by CP, since
    DDP sums the ranks' identical gradients."""
    n = size()
    return weight if n == 1 else _ScaleGradient.apply(weight, 1.0 / n)


def gather(out: torch.Tensor, length: int) -> torch.Tensor:
    """The group's outputs [B, S_pad / CP, ...] -> the whole [B, length, ...] in sequence order, on every rank.
    Backward: this rank's chunks of the mean of the ranks' gradients (each rank computes the same loss)."""
    n = size()
    if n == 1:
        return out
    whole = all_gather_single_autograd(replicated(out.contiguous()), 1, _group())
    order = torch.argsort(gathered_positions(whole.shape[1], n)).to(out.device)
    return whole.index_select(1, order[:length])


class ContextParallelAttention(torch.nn.Module):
    """Core attention over the context-parallel group, built and called as megatron's DotProductAttention is:
    query [s, b, heads, d], key / value [s, b, groups, d] (this rank's chunks) -> [s, b, heads x d]. No parameters."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__()
        del layer_number, attn_mask_type, attention_type, cp_comm_type, pg_collection  # causal, by position
        if getattr(config, "window_size", None) is not None:
            raise ValueError("context parallelism supports full causal attention only (the model has a window)")
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        del attention_mask, attn_mask_type  # causal by position, built below
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("context parallelism takes no attention bias and no packed sequences")
        n, rank = size(), _rank()
        local = query.shape[0]
        key = all_gather_single_autograd(key.contiguous(), 0, _group())
        value = all_gather_single_autograd(value.contiguous(), 0, _group())
        positions = gathered_positions(local * n, n).to(query.device)
        mine = positions[rank * local:(rank + 1) * local]
        allowed = positions[None, :] <= mine[:, None]  # [queries, keys]: a key at or before the query's position
        groups = query.shape[2] // key.shape[2]
        q = query.permute(1, 2, 0, 3)  # [b, heads, s, d]
        k = key.permute(1, 2, 0, 3).repeat_interleave(groups, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(local, out.shape[0], -1)


def use_in_spec(spec: ModuleSpec) -> ModuleSpec:
    """The decoder layer spec with ContextParallelAttention as its self-attention's core attention."""
    spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec
