"""OLMo 2 on Megatron-Core: post-norms and q/k norms over the whole projection, as submodules of the local layer spec.

An OLMo 2 decoder layer has no norm before attention or the MLP. It normalises each one's output instead,
`h = x + post_attention_layernorm(attn(x))`, `y = h + post_feedforward_layernorm(mlp(h))`, and its q and k norms
are RMSNorms over the whole projection (all heads at once), where Qwen3's are per head. megatron-core's layer has
neither, so the spec (`olmo2_spec`) puts:

- `IdentityOp` in place of `input_layernorm` and `pre_mlp_layernorm`;
- a post-norm linear (`norms.post_norm_linear`) in place of `linear_proj` and `linear_fc2`: the row-parallel linear,
  then an RMSNorm of its (TP-reduced, whole) output, under `<linear>.post_norm.weight` (replicated over TP);
- `ProjectionNorm` in place of `q_layernorm` and `k_layernorm`: an RMSNorm over every head of the projection. Under
  TP a rank holds its heads' slice of the weight (`projection_weight`, split over TP like the heads and marked
  tensor-parallel) and the mean of squares is all-reduced over the TP group (its backward sums the ranks'
  gradients). The model config keeps `qk_layernorm` off: megatron would sum those norms' gradients over TP, which is
  right for Qwen3's replicated per-head weights and wrong for these slices.

The local spec on every device (Transformer Engine fuses norms into the next linear, which this layer does not have).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce as all_reduce_with_grad

from rlpost.config.model_families import ARCHITECTURES
from rlpost.models.megatron.norms import RMSNorm, rms_norm, sandwich_spec

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec

ARCHITECTURE = ARCHITECTURES["olmo2"]


class ProjectionNorm(nn.Module):
    """OLMo 2's q or k norm, called as megatron's per-head norm is on [s, b, heads, head_dim] (this rank's heads),
    normalising over all heads of the projection. `heads` is "query" or "key"."""

    heads = "query"

    def __init__(self, hidden_size: int, config: Any, eps: float, **_: Any) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None
        tp = dist.get_world_size(group) if group is not None else 1
        self.group = group if tp > 1 else None
        """The TP group the mean of squares is all-reduced over; None at TP=1."""
        total = config.num_attention_heads if self.heads == "query" else config.num_query_groups
        if total % tp:
            raise ValueError(f"OLMo 2's {self.heads} norm needs its {total} heads to split over TP={tp}")
        self.total = total * hidden_size
        self.projection_weight = nn.Parameter(torch.ones(total // tp * hidden_size))
        # split over TP like the heads: megatron counts each rank's slice in the grad norm and never sums its grads
        self.projection_weight.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.projection_weight.partition_dim = 0  # type: ignore[attr-defined]
        self.projection_weight.partition_stride = 1  # type: ignore[attr-defined]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, n, d = x.shape
        flat = x.reshape(s, b, n * d)
        sq = flat.float().pow(2).sum(-1, keepdim=True)
        if self.group is not None:
            sq = all_reduce_with_grad(sq, group=self.group)
        return rms_norm(flat, self.projection_weight, self.eps, sq / self.total).reshape(s, b, n, d)


class KeyProjectionNorm(ProjectionNorm):
    heads = "key"


def olmo2_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of the local GPT layer spec with OLMo 2's norms (see the module docstring)."""
    from megatron.core.transformer.identity_op import IdentityOp

    return sandwich_spec(spec, IdentityOp, RMSNorm, ProjectionNorm, KeyProjectionNorm)


NORMS = {"self_attention.linear_proj.post_norm.weight": "post_attention_layernorm.weight",
         "mlp.linear_fc2.post_norm.weight": "post_feedforward_layernorm.weight",
         "self_attention.q_layernorm.projection_weight": "self_attn.q_norm.weight",
         "self_attention.k_layernorm.projection_weight": "self_attn.k_norm.weight"}
"""A layer's norms: megatron name -> HF name under the layer's prefix (full, TP-unsplit)."""


def hf_to_megatron(hf: Any, h: str) -> dict[str, torch.Tensor]:
    """The norms of HF layer prefix `h` under their megatron names."""
    return {name: hf[h + hf_name] for name, hf_name in NORMS.items()}


def megatron_to_hf(m: Any, h: str) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_megatron."""
    return {h + hf_name: m[name] for name, hf_name in NORMS.items()}
