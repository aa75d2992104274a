"""Gather a built (TP/PP-sharded, possibly DDP-wrapped) megatron GPTModel back to full HF tensors.

Used for refit (pushing policy weights into vLLM) and for HF safetensors export. Every rank of the TP x PP group
yields every weight: TP shards are all-gathered over the TP group by the stage that owns a weight, and the owner
stage broadcasts the resulting HF tensor over the PP group. Data-parallel replicas each run their own export.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from rlpost.models.megatron import moe as moe_layers
from rlpost.models.megatron.convert import (
    HFModelDims,
    from_model_keys,
    full_megatron_to_hf,
    hf_model_dims,
    merge_tp_shard,
    tp_split_dim,
)
from rlpost.models.megatron.lora import merged_local, scale_of

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import PretrainedConfig

Unit = tuple[str, int]  # ("embed", -1) | ("layer", global index) | ("final", -1)


def unwrap_model(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside megatron DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = cast(torch.nn.Module, model.module)
    return cast("GPTModel", model)


def stage_layout(gpt: GPTModel) -> tuple[int, int, bool, bool]:
    """(first global layer, number of layers, has the embedding, is the last stage) of this rank's stage."""
    layers = list(gpt.decoder.layers)
    offset = int(layers[0].layer_number) - 1 if layers else 0
    return offset, len(layers), bool(gpt.pre_process), bool(gpt.post_process)


def _hf_unit_shapes(unit: Unit, d: HFModelDims, include_tied_lm_head: bool) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of one export unit in yield order (every rank knows them without communication)."""
    kind, g = unit
    h, q, kv, f, v = (
        d.hidden_size,
        d.num_heads * d.head_dim,
        d.num_kv_heads * d.head_dim,
        d.ffn_hidden_size,
        d.vocab_size,
    )
    if kind == "embed":
        tied_head = [("lm_head.weight", (v, h))] if d.tied_embeddings and include_tied_lm_head else []
        return [("model.embed_tokens.weight", (v, h)), *tied_head]
    if kind == "final":
        return [("model.norm.weight", (h,))] + ([] if d.tied_embeddings else [("lm_head.weight", (v, h))])
    p = f"model.layers.{g}."
    out: list[tuple[str, tuple[int, ...]]] = [] if d.post_norms else [(p + "input_layernorm.weight", (h,))]
    if d.fused_projections:
        out += [(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h))]
    else:
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h))]
        out += [(p + "self_attn.v_proj.weight", (kv, h))]
    if d.qkv_bias:
        out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,))]
        out += [(p + "self_attn.v_proj.bias", (kv,))]
    if d.qk_norm or d.post_norms:  # per head (Qwen3) or over the whole projection (OLMo 2)
        qn, kn = (q, kv) if d.post_norms else (d.head_dim, d.head_dim)
        out += [(p + "self_attn.q_norm.weight", (qn,)), (p + "self_attn.k_norm.weight", (kn,))]
    out += [(p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,))]
    if d.post_norms:
        out += [(p + "post_feedforward_layernorm.weight", (h,))]
    if d.gemma is not None:
        out += [(p + "pre_feedforward_layernorm.weight", (h,)), (p + "post_feedforward_layernorm.weight", (h,))]
    if d.moe is not None:
        return out + moe_layers.hf_shapes(p, h, d.moe)
    if d.fused_projections:
        out += [(p + "mlp.gate_up_proj.weight", (2 * f, h))]
    else:
        out += [(p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h))]
    out += [(p + "mlp.down_proj.weight", (h, f))]
    return out


def _unit_prefixes(unit: Unit, local_index: int, tied: bool) -> tuple[str, ...]:
    """megatron name prefixes of a unit on its owner stage (a tied model's last-stage head copy is skipped)."""
    if unit[0] == "embed":
        return ("embedding.",)
    if unit[0] == "final":
        return ("decoder.final_layernorm.",) if tied else ("decoder.final_layernorm.", "output_layer.")
    return (f"decoder.layers.{local_index}.",)


def gather_tp(name: str, t: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Full megatron tensor from this rank's shard: all_gather over tp_group (replicated tensors as they are)."""
    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    if size == 1 or tp_split_dim(name) is None:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return merge_tp_shard(name, parts)


_LOCAL_EXPERT = re.compile(r"^(?P<head>.*\.mlp\.experts\.local_experts\.)(?P<i>\d+)(?P<tail>\..*)$")


def gather_experts(full: dict[str, torch.Tensor], d: moe_layers.MoEDims | None, ep_group: dist.ProcessGroup | None
                   ) -> dict[str, torch.Tensor]:
    """A stage's (TP-gathered) tensors with every expert of the model: each rank's local experts all-gathered over
    the expert-parallel group and renamed to their global index. Every rank of the group calls it with the same
    names (a collective per expert tensor); a None group or size 1 returns `full` as it is."""
    size = 1 if ep_group is None or d is None else dist.get_world_size(ep_group)
    if size == 1 or d is None:
        return dict(full)
    per = d.num_experts // size
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        m = _LOCAL_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=ep_group)
        for r, part in enumerate(parts):
            out[f"{m['head']}{r * per + int(m['i'])}{m['tail']}"] = part
    return out


def _units(layouts: list[tuple[int, int, bool, bool]]) -> list[tuple[Unit, int, int]]:
    """(unit, owner stage, local layer index) in yield order."""
    out: list[tuple[Unit, int, int]] = [(("embed", -1), s, -1) for s, lay in enumerate(layouts) if lay[2]]
    for s, (off, n, _, _) in enumerate(layouts):
        out += [(("layer", off + i), s, i) for i in range(n)]
    out += [(("final", -1), s, -1) for s, lay in enumerate(layouts) if lay[3]]
    return out


def export_hf_weights(
    model: torch.nn.Module,
    hf_config: PretrainedConfig,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    *,
    dtype: torch.dtype | None = None,
    include_tied_lm_head: bool = True,
    converter_type: str = "auto",
    ep_group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every weight of the model, on EVERY rank of the TP x PP group.

    Collectives (all ranks of the TP x PP group must consume the iterator to the end, in step):
    - one all_gather_object over pp_group of each stage's layout (layer offset, layer count, first/last stage);
    - per unit (embedding, each layer, final norm + head) the ranks of the owning stage all_gather each sharded
      tensor over tp_group and re-layout it to HF (vocab padding dropped, q/k/v and gate/up split);
    - under expert parallelism, each expert tensor is all-gathered over ep_group (megatron's expert-model-parallel
      group), so every rank yields every expert;
    - the owning stage broadcasts each HF tensor over pp_group, so every stage yields it too.
    Order: model.embed_tokens (+ lm_head when tied and include_tied_lm_head), layers 0..L-1, model.norm, lm_head
    (untied). A None group means size 1. dtype casts the yielded tensors. Tensors of unsharded weights may alias
    the model's parameters (clone to keep them across an optimizer step). At most one unit of gathered tensors
    is alive at a time besides what the caller keeps.
    """
    gpt = unwrap_model(model)
    d = hf_model_dims(hf_config, converter_type)
    layout = stage_layout(gpt)
    pp_size = 1 if pp_group is None else dist.get_world_size(pp_group)
    layouts: list[Any] = [layout]
    if pp_size > 1:
        layouts = [None] * pp_size
        dist.all_gather_object(layouts, layout, group=pp_group)
    my_stage = 0 if pp_size == 1 else dist.get_rank(pp_group)
    local = from_model_keys(gpt.state_dict())
    lora_scale = scale_of(gpt)
    if lora_scale is not None:  # LoRA: each shard merged with its adapters before the gather
        local = merged_local(local, lora_scale)
    first = next(gpt.parameters())
    for unit, owner, local_index in _units(layouts):
        shapes = _hf_unit_shapes(unit, d, include_tied_lm_head)
        if owner == my_stage:
            prefixes = _unit_prefixes(unit, local_index, d.tied_embeddings)
            full = {n: gather_tp(n, t, tp_group) for n, t in local.items() if n.startswith(prefixes)}
            full = gather_experts(full, d.moe, ep_group)
            hf = full_megatron_to_hf(full, d, layout[0], include_tied_lm_head)
            tensors = [hf[name].contiguous() for name, _ in shapes]
        else:
            tensors = [torch.empty(shape, dtype=first.dtype, device=first.device) for _, shape in shapes]
        for (name, _), t in zip(shapes, tensors, strict=True):
            if pp_size > 1:
                assert pp_group is not None
                dist.broadcast(t, src=dist.get_global_rank(pp_group, owner), group=pp_group)
            yield name, (t if dtype is None else t.to(dtype))
