"""The output layer of a DTensor policy, read in chunks (rlpost.ops.chunked_head.HeadLogits).

`head_logits(model, head, inputs, ...)` runs the model with its output layer returning its own input, so the
[tokens, vocabulary] logits are never computed: the result holds the final hidden states and the layer's weight, and
whoever reads it (the loss's logprobs, the token-accuracy metric) goes through the vocabulary a chunk of tokens at a
time. The module tree is left as it is; only the layer's `forward` is replaced for the call.

- FSDP2: the output layer's weight belongs to the root's parameter group, which stays unsharded from the forward to
  the end of the backward (torch does not reshard the root after its forward); the weight is taken during the
  forward, and its gradient is reduced by the root's post-backward like any other.
- Tensor parallelism: the layer is ColwiseParallel, its weight a DTensor sharded on the vocabulary (dim 0); this
  rank's rows start at rank x ceil(V / TP) (torch's Shard(0) split), and the readers reduce over the TP group.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rlpost.config.layout import chunk_tokens
from rlpost.ops.chunked_head import HeadLogits


def output_layer(model: nn.Module) -> nn.Linear | None:
    """The causal LM's output layer when it is a plain bias-free Linear (what HeadLogits computes), else None (a
    value or reward model's head, an adapter-wrapped layer, or a model that soft-caps its logits after the layer,
    as Gemma 2 does): those callers take the model's own logits."""
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if type(head) is nn.Linear and head.bias is None else None


@contextmanager
def _passthrough(head: nn.Linear) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Within the block, `head(x)` returns x and records (x, the weight as the forward sees it)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        seen.append((hidden, head.weight))
        return hidden

    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        del head.forward


def head_logits(model: nn.Module, head: nn.Linear, inputs: dict[str, Any], temperature: float,
                chunk_size: int | None, tp_group: dist.ProcessGroup | None) -> HeadLogits:
    """Run `model(**inputs)` without its output layer's matmul; the logits it would have made, as HeadLogits."""
    with _passthrough(head) as seen:
        model(**inputs)
    hidden, weight = seen[-1]
    if isinstance(hidden, DTensor):
        hidden = hidden.to_local()  # the layer's input is replicated over the TP group
    start = 0
    if isinstance(weight, DTensor):
        if tp_group is not None:
            start = dist.get_rank(tp_group) * math.ceil(weight.shape[0] / dist.get_world_size(tp_group))
        weight = weight.to_local()
    return HeadLogits(hidden, weight, temperature, chunk_tokens(chunk_size, weight.shape[0]), start, tp_group)
