"""The output layer of a Megatron policy, read in chunks (rlpost.ops.chunked_head.HeadLogits).

Within `passthrough(model)`, GPTModel's output layer returns its input, so the model's output is the final hidden
states [B, S, H] (GPTModel turns [S, B, H] batch-first as it would the logits) and no [tokens, vocabulary] logits are
made; `head_logits` reads them from those states and the layer's weight (the embedding's when the two are tied), this
rank's rows of the padded vocabulary, a chunk of tokens at a time. The ColumnParallelLinear would copy its input into
the tensor-parallel region (its backward all-reduces the input's gradient over the TP group); HeadLogits all-reduces
the hidden states' gradient itself. With sequence parallelism the layer's input is sharded over the sequence, so
`reads_in_chunks` is false and the model makes its logits as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from rlpost.config.layout import chunk_tokens
from rlpost.models.megatron.export import unwrap_model
from rlpost.ops.chunked_head import HeadLogits

if TYPE_CHECKING:
    from rlpost.losses.interface import LossFunction


def reads_in_chunks(model: torch.nn.Module) -> bool:
    """The model's output layer can be read in chunks: a GPT model without sequence parallelism whose logits are not
    soft-capped (Gemma 2; on a middle pipeline stage, which has no output layer, the answer is that of the model's
    config all the same)."""
    gpt = unwrap_model(model)
    return (hasattr(gpt, "shared_embedding_or_output_weight") and not gpt.config.sequence_parallel
            and not getattr(gpt, "final_logit_softcapping", None))


def loss_input(loss_fn: LossFunction, model: torch.nn.Module) -> Literal["logits", "head"]:
    """What train_step hands `loss_fn`: HeadLogits ("head") to a loss with `chunked_logits` where the model allows
    it, else the logits."""
    return "head" if getattr(loss_fn, "chunked_logits", False) and reads_in_chunks(model) else "logits"


@contextmanager
def passthrough(model: torch.nn.Module, active: bool = True) -> Iterator[None]:
    """Within the block (when `active`), the model's output layer returns its input (the last pipeline stage; the
    others have no output layer)."""
    gpt = unwrap_model(model)
    layer = getattr(gpt, "output_layer", None) if active and getattr(gpt, "post_process", True) else None
    if layer is None:
        yield
        return

    def forward(input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return input_, None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def head_logits(model: torch.nn.Module, hidden: torch.Tensor, temperature: float, chunk_size: int | None,
                vocab_start: int, vocab_size: int, group: dist.ProcessGroup | None) -> HeadLogits:
    """The logits the output layer would have made from `hidden` [B, S, H] (what the model returned inside
    `passthrough`): this rank's vocabulary rows from `vocab_start`, the ids from `vocab_size` on being padding."""
    from rlpost.models.megatron import context_parallel as cp

    gpt = unwrap_model(model)
    weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
              else gpt.output_layer.weight)
    weight = cp.replicated(weight)  # under CP every rank reads it on the same whole sequences
    return HeadLogits(hidden, weight, temperature, chunk_tokens(chunk_size, weight.shape[0]), vocab_start, group,
                      vocab_size)
