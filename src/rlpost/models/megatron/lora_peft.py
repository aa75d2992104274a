"""The adapters of a Megatron LoRA model under PEFT's HF names (rlpost.models.megatron.lora puts them on the
model): a fused layer's adapter becomes one adapter per HF layer, the TP shards are gathered and the pipeline stages
exchange theirs, for the adapter checkpoint, the PEFT export and the adapter refit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlpost.models.megatron.export import gather_tp, stage_layout, unwrap_model
from rlpost.models.megatron.lora import ADAPTED, LINEARS
from rlpost.models.peft_adapter import PEFT_PREFIX

HF_NAMES = {"linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "linear_proj": ("self_attn.o_proj",), "linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
            "linear_fc2": ("mlp.down_proj",)}
"""The HF layers each Megatron linear fuses (their order in its output rows)."""
FUSED_HF_NAMES = {"linear_qkv": ("self_attn.qkv_proj",), "linear_fc1": ("mlp.gate_up_proj",)}
"""Phi-3's HF layers for the same Megatron linears (its checkpoint fuses them too)."""


def _hf_adapters(leaf: str, g: int, a: torch.Tensor, b: torch.Tensor, dims: Any) -> dict[str, torch.Tensor]:
    """PEFT's tensors of one full Megatron adapter of global layer g. A fused layer's adapter is one adapter per HF
    layer with the same A each (W_q + s B_q A, ...): its B is split like the fused weight's rows."""
    from rlpost.models.megatron.convert import split_qkv

    names = FUSED_HF_NAMES.get(leaf) if dims.fused_projections else None
    if names is not None:  # Phi-3: one HF layer, rows [q; k; v] or [gate; up]
        bs: tuple[torch.Tensor, ...] = (torch.cat(split_qkv(b, dims)) if leaf == "linear_qkv" else b,)
    elif leaf == "linear_qkv":
        bs = split_qkv(b, dims)
    elif leaf == "linear_fc1":
        bs = tuple(b.chunk(2, dim=0))
    else:
        bs = (b,)
    out = {}
    for hf, part in zip(names or HF_NAMES[leaf], bs, strict=True):
        p = f"{PEFT_PREFIX}model.layers.{g}.{hf}"
        out[f"{p}.lora_A.weight"] = a.clone()
        out[f"{p}.lora_B.weight"] = part.contiguous()
    return out


def peft_state(model: nn.Module, dims: Any, tp_group: Any, pp_group: Any) -> dict[str, torch.Tensor]:
    """Collective over the TP x PP group: every rank of it gets the whole model's adapters under PEFT's names
    (`base_model.model.model.layers.<g>.self_attn.q_proj.lora_A.weight`, ...), fp32 on the CPU. Each stage's ranks
    gather the TP shards of its layers (B under column-parallel layers, A under row-parallel ones), then the stages
    exchange theirs."""
    import torch.distributed as dist

    gpt = unwrap_model(model)
    offset = stage_layout(gpt)[0]
    mine: dict[str, torch.Tensor] = {}
    for name, module in gpt.named_modules():
        if not hasattr(module, ADAPTED):
            continue
        leaf = name.rsplit(".", 1)[-1]
        g = offset + int(name.split("decoder.layers.", 1)[1].split(".", 1)[0])
        a, b = module.lora_A.detach(), module.lora_B.detach()
        if LINEARS[leaf] == "column":
            b = gather_tp(f"{name}.weight", b, tp_group)
        else:
            a = gather_tp(f"{name}.weight", a, tp_group)
        mine.update(_hf_adapters(leaf, g, a.float().cpu(), b.float().cpu(), dims))
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return mine
    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    return {k: v for stage in stages for k, v in stage.items()}
