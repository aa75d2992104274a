"""Mixture-of-experts layers (Qwen3-MoE, Mixtral) between an HF checkpoint and Megatron-Core's local MoE spec.

Per layer (HF checkpoint name -> megatron local-spec name, TP split; Mixtral's block is `block_sparse_moe` and its
gate/up/down are w1/w3/w2, rlpost.models.expert_weights.LAYOUTS):
  mlp.gate.weight                     -> mlp.router.weight                              replicated
  mlp.experts.E.{gate,up}_proj.weight -> mlp.experts.local_experts.E.linear_fc1.weight  dim 0, [gate; up] per rank
  mlp.experts.E.down_proj.weight      -> mlp.experts.local_experts.E.linear_fc2.weight  dim 1
Each expert is split over TP as a dense MLP is (megatron's expert tensor parallelism defaults to the TP size). Under
expert parallelism (`expert_model_parallel_size`) rank r of the expert-parallel group holds the r-th contiguous block
of experts under local indices; the export gathers them back over that group
(rlpost.models.megatron.export.gather_experts).

Routing: transformers takes the softmax over all experts, keeps the top k and (Mixtral; Qwen3-MoE with
`norm_topk_prob`) renormalises them, which equals megatron's softmax over the top-k logits
(`moe_router_pre_softmax=False`); without renormalisation it is megatron's softmax before the top k. The
load-balancing loss is not trained on (`moe_router_load_balancing_type="none"`), as on the DTensor worker, and every
token reaches its experts (no capacity factor, so no token is dropped).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlpost.config.model_families import ARCHITECTURES, MOE_MODEL_TYPES
from rlpost.models.expert_weights import LAYOUTS, ExpertLayout

MOE_ARCHS = {ARCHITECTURES[t]: t for t in MOE_MODEL_TYPES}
"""The mixture-of-experts architectures converted, and their model_type (their checkpoint layout's key)."""


@dataclass(frozen=True)
class MoEDims:
    """A mixture of experts' sizes and routing."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    """One expert's inner width."""
    renormalize: bool
    """The top-k routing weights are renormalised to sum to 1."""
    layout: ExpertLayout


def moe_dims(hf_config: Any, arch: str) -> MoEDims | None:
    """The MoE sizes of a config of `arch`; None for a dense architecture. NotImplementedError for a variant the
    conversion does not take (dense layers between sparse ones, shared experts)."""
    if arch not in MOE_ARCHS:
        return None
    if arch == "Qwen3MoeForCausalLM":
        if int(getattr(hf_config, "decoder_sparse_step", 1) or 1) != 1 or list(getattr(hf_config, "mlp_only_layers",
                                                                                       None) or []):
            raise NotImplementedError(f"{arch} with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is "
                                      "not converted: every layer must be sparse")
        experts = int(getattr(hf_config, "num_local_experts", None) or hf_config.num_experts)  # transformers: the first
        width = int(hf_config.moe_intermediate_size)
        renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
    else:
        experts, width, renormalize = int(hf_config.num_local_experts), int(hf_config.intermediate_size), True
    return MoEDims(experts, int(hf_config.num_experts_per_tok), width, renormalize, LAYOUTS[MOE_ARCHS[arch]])


def transformer_kwargs(d: MoEDims) -> dict[str, Any]:
    """The TransformerConfig fields of the experts and their router."""
    return dict(num_moe_experts=d.num_experts, moe_router_topk=d.topk, moe_ffn_hidden_size=d.ffn_hidden_size,
                moe_router_pre_softmax=not d.renormalize, moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)


def local_experts(d: MoEDims, ep_rank: int, ep_size: int) -> range:
    """The global indices of the experts expert-parallel rank `ep_rank` holds (a contiguous block, megatron's)."""
    if d.num_experts % ep_size:
        raise ValueError(f"{d.num_experts} experts do not split evenly over expert_model_parallel_size={ep_size}")
    per = d.num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layer: str, d: MoEDims, ep_rank: int = 0, ep_size: int = 1
                   ) -> dict[str, torch.Tensor]:
    """Full (TP-unsplit) megatron tensors of the router and of expert-parallel rank `ep_rank`'s experts of HF layer
    prefix `layer` (`model.layers.g.`), under names relative to decoder.layers.<i> (the experts by local index)."""
    lay, block = d.layout, f"{layer}{d.layout.block}."
    out = {"mlp.router.weight": hf[block + "gate.weight"]}
    for i, e in enumerate(local_experts(d, ep_rank, ep_size)):
        x = f"{block}experts.{e}."
        out[f"mlp.experts.local_experts.{i}.linear_fc1.weight"] = torch.cat(
            [hf[f"{x}{lay.gate}.weight"], hf[f"{x}{lay.up}.weight"]], dim=0)
        out[f"mlp.experts.local_experts.{i}.linear_fc2.weight"] = hf[f"{x}{lay.down}.weight"]
    return out


def megatron_to_hf(m: Mapping[str, torch.Tensor], layer: str, d: MoEDims) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_megatron: the checkpoint's tensors (one matrix per expert) of HF layer prefix `layer`."""
    lay, block = d.layout, f"{layer}{d.layout.block}."
    out = {block + "gate.weight": m["mlp.router.weight"]}
    for e in range(d.num_experts):
        gate, up = m[f"mlp.experts.local_experts.{e}.linear_fc1.weight"].chunk(2, dim=0)
        x = f"{block}experts.{e}."
        out.update({f"{x}{lay.gate}.weight": gate, f"{x}{lay.up}.weight": up,
                    f"{x}{lay.down}.weight": m[f"mlp.experts.local_experts.{e}.linear_fc2.weight"]})
    return out


def hf_shapes(layer: str, hidden: int, d: MoEDims) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of megatron_to_hf's tensors, in its order."""
    lay, block, f = d.layout, f"{layer}{d.layout.block}.", d.ffn_hidden_size
    out: list[tuple[str, tuple[int, ...]]] = [(block + "gate.weight", (d.num_experts, hidden))]
    for e in range(d.num_experts):
        x = f"{block}experts.{e}."
        out += [(f"{x}{lay.gate}.weight", (f, hidden)), (f"{x}{lay.up}.weight", (f, hidden)),
                (f"{x}{lay.down}.weight", (hidden, f))]
    return out


def allow_moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router names `te_general_gemm` whether or not Transformer Engine imported (a
    NameError without it); define it as absent, so the router takes its torch matmul."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
