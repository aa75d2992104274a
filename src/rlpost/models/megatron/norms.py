"""The RMSNorms of the families megatron-core's layer does not have, computed as transformers computes them.

- `RMSNorm`: in fp32, scaled by the weight, back in the input's dtype (OLMo 2's norms). `GemmaRMSNorm` scales by
  `1 + weight` (Gemma 2 and 3; its weight starts at zero). Both are built as megatron builds a norm
  (`config=..., hidden_size=..., eps=...`), so they stand in any norm slot of a layer or block spec.
- `post_norm_linear(linear, norm)`: a row-parallel linear whose (TP-reduced, whole) output is normalised, under
  `<linear>.post_norm.weight`: OLMo 2's norms after attention and the MLP, Gemma's sandwich norms. A LoRA adapter
  on it joins the linear's output before the norm (`BEFORE_NORM`), as the merged weight would.

A norm's weight is replicated over TP. Under sequence parallelism each rank normalises its part of the sequence, so
the weight is marked `sequence_parallel` and megatron sums its gradient over the TP group.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, mean_sq: torch.Tensor) -> torch.Tensor:
    """x normalised by its mean of squares `mean_sq`, in fp32, times `scale`, back in x's dtype."""
    return (scale * (x.float() * torch.rsqrt(mean_sq + eps))).to(x.dtype)


class RMSNorm(nn.Module):
    """An RMSNorm over the last dimension: `weight * x / rms(x)`."""

    offset = 0.0
    """Added to the weight before it scales (Gemma's norms: 1)."""

    def __init__(self, hidden_size: int, config: Any = None, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - self.offset))
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))  # type: ignore[attr-defined]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight.float() + self.offset if self.offset else self.weight
        return rms_norm(x, scale, self.eps, x.float().pow(2).mean(-1, keepdim=True))


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `(1 + weight) * x / rms(x)`, the sum made in fp32."""

    offset = 1.0


BEFORE_NORM = "before_norm"
"""The attribute of a post-norm linear that holds a forward hook run on the linear's output before its norm (a LoRA
adapter's, rlpost.models.megatron.lora): called as a torch forward hook, (module, args, output) -> output."""


def post_norm_linear(base: type, norm: type[RMSNorm]) -> type:
    """`base` (megatron's RowParallelLinear) whose output, whole after the TP reduction, goes through `norm`."""

    class PostNormRowParallelLinear(base):
        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_norm = norm(output_size, config, config.layernorm_epsilon)

        def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            output = super().forward(input_)
            if (adapter := getattr(self, BEFORE_NORM, None)) is not None:
                output = adapter(self, (input_,), output)
            out, bias = output
            if bias is not None:
                raise ValueError("a post-norm follows a linear without bias")
            return self.post_norm(out), None

    return PostNormRowParallelLinear


def sandwich_spec(spec: ModuleSpec, before: type, after: type[RMSNorm], q_norm: type | None,
                  k_norm: type | None) -> ModuleSpec:
    """A copy of the local GPT layer spec with `before` as the norms before attention and the MLP, `after` ending
    `linear_proj` and `linear_fc2` (post_norm_linear), and the q / k norms."""
    spec = copy.deepcopy(spec)
    layer = spec.submodules
    attention = layer.self_attention.submodules
    layer.input_layernorm = before
    layer.pre_mlp_layernorm = before
    attention.linear_proj = post_norm_linear(attention.linear_proj, after)
    layer.mlp.submodules.linear_fc2 = post_norm_linear(layer.mlp.submodules.linear_fc2, after)
    attention.q_layernorm = q_norm
    attention.k_layernorm = k_norm
    return spec
