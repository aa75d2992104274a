"""What a Megatron-Core worker scores besides logprobs: a critic's values (a one-output head in place of the output
layer) and a distillation teacher's top-k logprobs. Both run megatron's forward-only schedule
(`rlpost.models.megatron.model.forward_collect`) and come back aligned like logprobs: position t holds what was
computed at t - 1, for the state that emits token t (position 0: zeros, never read). Both need whole-vocabulary
logits, so a tensor-parallel size of 1 (MasterConfig refuses the rest)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from rlpost.models.megatron.model import forward_collect, scale_and_mask_logits, vocab_shard_range

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel


class ValueHead(nn.Module):
    """A linear map of each position's final hidden state to one value, called as megatron's output layer is
    (hidden [S, B, H] -> ([S, B, 1], None)); the tied embedding weight megatron offers is not used."""

    def __init__(self, hidden_size: int, init_std: float) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.linear.weight, std=init_std)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output
        return self.linear(hidden), None


def attach_value_head(gpt: GPTModel, hidden_size: int, init_std: float) -> None:
    """Replace the last pipeline stage's output layer by a ValueHead. On every stage the output layer stops being
    tied to the embedding: the last stage then asks for no output weight, and no stage all-reduces the tied
    weight's gradients between the first and the last stage. The head takes the device and dtype of the model's
    parameters (bf16 inside megatron's Float16Module), so it reads the hidden states in their own dtype."""
    gpt.share_embeddings_and_output_weights = False
    if gpt.post_process:
        first = next(gpt.parameters())
        gpt.output_layer = ValueHead(hidden_size, init_std).to(device=first.device, dtype=first.dtype)


def _shift(x: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> the same, moved one position later (position 0 zeros)."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def forward_values(model: nn.Module, input_ids: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """A value model's values [B, S] (fp32), aligned like logprobs."""
    return forward_collect(model, input_ids, lambda out, ids: _shift(out[..., 0].float()), (),
                           micro_batch_size=micro_batch_size)


def forward_topk(model: nn.Module, input_ids: torch.Tensor, k: int | None, temperature: float,
                 micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's top-k token indices [B, S, k] and its log-softmax over the unpadded vocabulary at them [B, S, k]
    (k None: the whole vocabulary), aligned like logprobs."""
    _, _, vocab = vocab_shard_range(model, None)
    width = vocab if k is None else min(k, vocab)

    def collect(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = scale_and_mask_logits(out, temperature, 0, vocab)[..., :vocab]
        top = torch.log_softmax(logits.float(), dim=-1).topk(width, dim=-1)
        # indices ride in the float tensor beside the values: exact below 2^24, far above any vocabulary
        return _shift(torch.cat([top.values, top.indices.float()], dim=-1))

    both = forward_collect(model, input_ids, collect, (2 * width,), micro_batch_size=micro_batch_size)
    return both[..., width:].long(), both[..., :width]
