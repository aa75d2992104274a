"""LoRA on the Megatron-Core workers (`policy.megatron_cfg.peft`): adapters on the decoder's tensor-parallel linears.

Each adapted linear (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`) gets two parameters of its own,
`lora_A` [r, in] and `lora_B` [out, r], and a forward hook that adds alpha / r * B @ A x to the layer's output (on a
linear that ends in a norm, OLMo 2's and Gemma's, to its output before the norm: `norms.BEFORE_NORM`). The
base weights are frozen, so megatron's DDP and optimizer hold the adapters alone. Tensor parallelism follows the base
weight's split:

- column-parallel (qkv, fc1: output split): A is replicated and B split on its output like the weight. The rank-r
  activation passes `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward) before B, so every
  rank gets A's whole gradient;
- row-parallel (proj, fc2: input split): A is split on its input like the weight and B replicated. The partial
  rank-r activations are summed by `reduce_from_tensor_model_parallel_region` before B.

The adapter output so has the base output's layout, and A and B are initialised from the full tensors (one seed per
layer name), so TP=2 trains the same adapters as TP=1. Merging is local to each shard: W_shard + s * B_shard @ A
(column) or W_shard + s * B @ A_shard (row) is the merged weight's shard; export merges before it gathers.
`peft.modules_to_save` (embed_tokens, lm_head) train in full: the word embeddings and the output layer (both when
tied, the last stage's copy too); the reference swaps in their base values beside `adapters_off`.
The reference policy is the model with the adapters switched off (`adapters_off`). Sequence parallelism is refused
(the column hook needs the whole sequence), and the layers are megatron's own (the local layer spec): Transformer
Engine's fused layer-norm linear hides the normalised input the adapter needs.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from rlpost.config.lora_params import MEGATRON_LINEARS, adapted_modules
from rlpost.config.schema.lora import LoRAConfig
from rlpost.models.megatron.norms import BEFORE_NORM

LINEARS = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}
"""How megatron splits the weight of each decoder linear an adapter can go on (MEGATRON_LINEARS)."""

ADAPTED = "_rlpost_lora_active"
"""The attribute that marks an adapted linear (its value: whether the adapter is on)."""




SAVED_PARAMS = {"embed_tokens": "embedding.word_embeddings.weight", "lm_head": "output_layer.weight"}
"""The Megatron parameter each name of `modules_to_save` (HF's) stands for."""


def is_adapter(name: str) -> bool:
    """Whether a state-dict key is an adapter's."""
    return name.endswith((".lora_A", ".lora_B"))


def is_saved_param(name: str, cfg: LoRAConfig, tied: bool) -> bool:
    """Whether a parameter trains in full (`modules_to_save`); with tied embeddings either name means both."""
    names = set(SAVED_PARAMS) if tied and cfg.modules_to_save else set(cfg.modules_to_save)
    return any(name == SAVED_PARAMS[n] or name.endswith(f".{SAVED_PARAMS[n]}") for n in names)


def _full_a(name: str, rank: int, fan_in: int) -> torch.Tensor:
    """The full A of the layer `name` (its parameter name prefix), the same on every rank: peft's initialisation
    (Kaiming-uniform with a = sqrt(5)) from a seed of the name."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    a = torch.empty(rank, fan_in)
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
    return a.uniform_(-bound, bound, generator=g)


def inject(model: nn.Module, cfg: LoRAConfig, tp_rank: int, tp_size: int) -> list[str]:
    """Add adapters to every chosen linear of `model` (a GPTModel) and freeze everything else; the names of the
    adapted layers. Call before megatron's DDP and optimizer are built."""
    from megatron.core.tensor_parallel.layers import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
    for name, p in model.named_parameters():
        p.requires_grad_(is_saved_param(name, cfg, tied))
    chosen = set(adapted_modules(cfg, MEGATRON_LINEARS))
    scale = cfg.alpha / cfg.dim
    dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    adapted: list[str] = []
    for name, module in model.named_modules():
        kind = LINEARS.get(name.rsplit(".", 1)[-1])
        if kind is None or name.rsplit(".", 1)[-1] not in chosen or ".experts." in name:  # experts stay frozen
            continue
        weight = module.weight
        out_local, in_local = int(weight.shape[0]), int(weight.shape[1])
        if kind == "column":
            a = _full_a(name, cfg.dim, in_local)
            b = torch.zeros(out_local, cfg.dim)
        else:
            a = _full_a(name, cfg.dim, in_local * tp_size)[:, tp_rank * in_local:(tp_rank + 1) * in_local]
            b = torch.zeros(out_local, cfg.dim)
        module.lora_A = nn.Parameter(a.contiguous().to(weight.device, weight.dtype))
        module.lora_B = nn.Parameter(b.to(weight.device, weight.dtype))
        if kind == "column":
            set_defaults_if_not_set_tensor_model_parallel_attributes(module.lora_A)
            set_tensor_model_parallel_attributes(module.lora_B, True, 0, 1)
        else:
            set_tensor_model_parallel_attributes(module.lora_A, True, 1, 1)
            set_defaults_if_not_set_tensor_model_parallel_attributes(module.lora_B)
        module.lora_scale = scale
        setattr(module, ADAPTED, True)
        if hasattr(module, "post_norm"):  # OLMo 2's and Gemma's: the adapter joins the output before the norm
            setattr(module, BEFORE_NORM, _hook(kind, scale, dropout))
        else:
            module.register_forward_hook(_hook(kind, scale, dropout))
        adapted.append(name)
    if not adapted:
        raise ValueError("policy.megatron_cfg.peft: no linear layer matched target_modules / exclude_modules")
    return adapted


def _hook(kind: str, scale: float, dropout: nn.Module) -> Any:
    """The forward hook adding the adapter's output: the rank-r activation goes through megatron's TP mapping for a
    column-parallel layer (identity forward, all-reduce backward) or a row-parallel one (all-reduce forward)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    to_rank_r = copy_to_tensor_model_parallel_region if kind == "column" else reduce_from_tensor_model_parallel_region

    def hook(module: Any, args: tuple[Any, ...], output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        if not getattr(module, ADAPTED):
            return output
        h = to_rank_r(nn.functional.linear(dropout(args[0]), module.lora_A))
        out, bias = output
        return out + scale * nn.functional.linear(h, module.lora_B), bias

    return hook


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter's contribution switched off inside the block."""
    layers = [m for m in model.modules() if hasattr(m, ADAPTED)]
    for m in layers:
        setattr(m, ADAPTED, False)
    try:
        yield
    finally:
        for m in layers:
            setattr(m, ADAPTED, True)


def merged_local(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """This rank's shard of the merged model from a local state dict with adapters (megatron names): each adapted
    `X.weight` becomes X.weight + scale * X.lora_B @ X.lora_A, and the adapter entries are dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if is_adapter(key):
            continue
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        if layer is not None and f"{layer}.lora_A" in state:
            a, b = state[f"{layer}.lora_A"].float(), state[f"{layer}.lora_B"].float()
            value = (value.float() + scale * (b @ a)).to(value.dtype)
        out[key] = value
    return out


def scale_of(model: nn.Module) -> float | None:
    """alpha / r of the model's adapters; None when it has none."""
    scales: list[Any] = [m.lora_scale for m in model.modules() if hasattr(m, ADAPTED)]
    return float(scales[0]) if scales else None
