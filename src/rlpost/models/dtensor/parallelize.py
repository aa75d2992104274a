"""One function per parallelism technique, composed in a fixed order: TP, then activation
checkpointing, then FSDP2.

TP plans are rlpost's own, per architecture (TP_PLANS; Qwen2, Llama, Mistral and Gemma 2 share the layout):
column-parallel q/k/v/gate/up, row-parallel o/down, a vocab-sharded embedding, and an lm_head whose logits stay
sharded over the vocabulary (Shard(-1)) so the loss runs through the vocab-parallel log-softmax; per-head q/k norms,
gathered projections and whole experts are the other families' variations (docs/models.md).
transformers 5.x reshapes attention with -1 heads, so local head counts need no patching.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from rlpost.config.layout import fsdp_needed
from rlpost.config.model_families import TP_PLAN_ARCHITECTURES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks of a HF causal LM (model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no model.layers ModuleList; only decoder-only HF LMs are supported")
    return layers


def qwen2_llama_tp_plan() -> dict[str, ParallelStyle]:
    """TP plan for Qwen2/Llama/Mistral/Gemma 2 decoders (relative to the HF CausalLM module)."""
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for proj in ("q_proj", "k_proj", "v_proj"):
        plan[f"model.layers.*.self_attn.{proj}"] = ColwiseParallel()
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    for proj in ("gate_proj", "up_proj"):
        plan[f"model.layers.*.mlp.{proj}"] = ColwiseParallel()
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    return plan


def head_norm_tp_plan() -> dict[str, ParallelStyle]:
    """Qwen2's plan plus per-head q/k norms (Qwen3, Gemma 3): each rank normalises its own heads with the one
    replicated weight, as torch's SequenceParallel does a norm over a sharded sequence (here the heads' dim), so the
    weight's gradient is summed over the TP ranks (every head's share)."""
    plan = qwen2_llama_tp_plan()
    for norm in ("q_norm", "k_norm"):
        plan[f"model.layers.*.self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def experts_tp_plan(head_norms: bool = False) -> dict[str, ParallelStyle]:
    """Mixture-of-experts decoders (Mixtral; Qwen3-MoE with `head_norms`): attention split as Qwen2's (or
    Qwen3's), the router and the experts whole on every TP rank."""
    plan = head_norm_tp_plan() if head_norms else qwen2_llama_tp_plan()
    return {k: v for k, v in plan.items() if ".mlp." not in k}


def gathered_attention_tp_plan(fused_mlp: bool = False) -> dict[str, ParallelStyle]:
    """TP plan for decoders whose attention needs whole projections: OLMo 2 normalises all of q and all of k, and
    Phi-3 fuses q, k and v (and gate and up) in one matrix whose column split would mix them. The projections are
    column-split and their outputs gathered, so every rank computes the whole attention (or MLP); the row-split
    o_proj (down_proj) takes its own slice of it."""
    plan = qwen2_llama_tp_plan()
    gathered, sliced = ColwiseParallel(output_layouts=Replicate()), RowwiseParallel(input_layouts=Replicate())
    for k in [k for k in plan if ".self_attn." in k or (fused_mlp and ".mlp." in k)]:
        del plan[k]
    names = ["qkv_proj"] if fused_mlp else ["q_proj", "k_proj", "v_proj"]
    plan.update({f"model.layers.*.self_attn.{n}": gathered for n in names})
    plan["model.layers.*.self_attn.o_proj"] = sliced
    if fused_mlp:
        plan["model.layers.*.mlp.gate_up_proj"] = gathered
        plan["model.layers.*.mlp.down_proj"] = sliced
    return plan


TP_PLANS: dict[str, Any] = {
    **{arch: qwen2_llama_tp_plan for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                                              "Gemma2ForCausalLM")},
    "Qwen3ForCausalLM": head_norm_tp_plan,
    "Gemma3ForCausalLM": head_norm_tp_plan,
    "Olmo2ForCausalLM": gathered_attention_tp_plan,
    "Phi3ForCausalLM": lambda: gathered_attention_tp_plan(fused_mlp=True),
    "Qwen3MoeForCausalLM": lambda: experts_tp_plan(head_norms=True),
    "MixtralForCausalLM": experts_tp_plan,
}
"""The plan of each architecture the pre-flight lets through at TP > 1 (rlpost.config.model_families)."""
assert set(TP_PLANS) == set(TP_PLAN_ARCHITECTURES)


def get_tp_plan(model: nn.Module, custom_plan: str | None = None) -> dict[str, ParallelStyle]:
    """The built-in plan for the model's architecture, or the one at `custom_plan` (allow-listed import path)."""
    if custom_plan:
        from rlpost.runtime.build import resolve

        obj = resolve(custom_plan, key="policy.dtensor_cfg.custom_parallel_plan")
        return obj() if callable(obj) else dict(obj)
    name = type(model).__name__.removeprefix("FSDP")
    if name not in TP_PLANS:
        raise ValueError(f"no tensor-parallel plan for {name}; known: {sorted(TP_PLANS)} (or set custom_parallel_plan)")
    return TP_PLANS[name]()


def apply_tp(model: Any, tp_mesh: DeviceMesh, custom_plan: str | None = None) -> None:
    """Shard the model over `tp_mesh` with its TP plan (LoRA adapters split to match their layers: see
    rlpost.models.dtensor.lora); re-tie embeddings that the plan split apart."""
    from rlpost.models.dtensor import lora

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    plan = get_tp_plan(model, custom_plan)
    adapted = lora.adapted_layers(model)
    parallelize_module(model, tp_mesh, lora.lora_tp_plan(plan, adapted) if adapted else plan)
    if tied:
        # Both the embedding (Rowwise) and lm_head (Colwise) shard the weight on dim 0 (vocab): same DTensor layout.
        model.lm_head.weight = model.get_input_embeddings().weight


def apply_ac(model: nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant activation checkpointing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    cpu_offload: bool = False,
) -> None:
    """FSDP2: each decoder layer, then the root. fp32 master weights; compute in `param_dtype`, reduce in fp32."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp}
    if cpu_offload and dp_mesh.device_type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(model, **kwargs)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    precision: str,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    custom_plan: str | None = None,
) -> nn.Module:
    """TP -> AC -> FSDP2 on a ('dp', 'tp') or ('dp', 'cp', 'tp') mesh (FSDP2 only where
    `rlpost.config.layout.fsdp_needed`): the parameters are sharded over the data- and context-parallel ranks
    together, which hold the same parameters and see different tokens."""
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], custom_plan)
    if activation_checkpointing:
        apply_ac(model)
    names = mesh.mesh_dim_names or ()
    shard_mesh = mesh["dp", "cp"]._flatten("dp_cp") if "cp" in names else mesh["dp"]
    if fsdp_needed(shard_mesh.size(), mesh["tp"].size(), precision, cpu_offload):
        apply_fsdp(model, shard_mesh, DTYPES[precision], cpu_offload)
    return model
