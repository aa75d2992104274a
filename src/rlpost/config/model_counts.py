"""A model's decoder layers from its config.json alone (no torch): the linear layers LoRA can adapt and the
parameters, in all and per token, of every family `model.tiny.architecture` builds (rlpost.config.model_families).

A mixture of experts keeps each layer's experts as fused tensors (transformers' `gate_up_proj [E, 2I, H]`): they are
no linear layers, so its adaptable layers are the attention's; a token runs `num_experts_per_tok` of the experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlpost.config.model_families import MOE_MODEL_TYPES

Shapes = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class Family:
    """How one family's decoder layer departs from Llama's (q/k/v/o, gate/up/down, two hidden-wide RMSNorms)."""

    fused: bool = False
    """q/k/v are one `qkv_proj`, gate/up one `gate_up_proj` (Phi-3)."""
    layer_norms: int = 2
    """Hidden-wide norms per layer (Gemma's sandwich norms: 4)."""
    head_norms: str = ""
    """Query/key norms: "head" (one head_dim-wide weight each: Qwen3, Gemma 3), "full" (over all heads: OLMo 2)."""
    qkv_bias: bool = False
    """q/k/v carry biases whatever the config says (Qwen2)."""
    expert_width_key: str = "intermediate_size"
    """The config key of one expert's inner width."""
    tied: bool = False
    """Whether the output head is the embedding when config.json does not say (transformers' default for the
    family)."""


FAMILIES: dict[str, Family] = {
    "llama": Family(), "mistral": Family(), "qwen2": Family(qkv_bias=True), "qwen3": Family(head_norms="head"),
    "gemma2": Family(layer_norms=4, tied=True), "gemma3_text": Family(layer_norms=4, head_norms="head", tied=True),
    "olmo2": Family(head_norms="full"), "phi3": Family(fused=True),
    "qwen3_moe": Family(head_norms="head", expert_width_key="moe_intermediate_size"),
    "mixtral": Family(),
}
"""model_type -> its layer's departures from Llama's."""


def family(hf: Mapping[str, Any]) -> Family | None:
    """The family of the model `hf` describes; None for a layout rlpost does not count."""
    return FAMILIES.get(str(hf.get("model_type")))


def tied_head(hf: Mapping[str, Any]) -> bool:
    """Whether the output head is the embedding (config.json's tie_word_embeddings, else the family's default)."""
    if "tie_word_embeddings" in hf:
        return bool(hf["tie_word_embeddings"])
    return (fam := family(hf)) is not None and fam.tied


def dims(hf: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(hidden, heads, key/value heads, head_dim)."""
    h, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return h, heads, int(hf.get("num_key_value_heads") or heads), int(hf.get("head_dim") or h // heads)


def attention_shapes(hf: Mapping[str, Any]) -> Shapes | None:
    """(in_features, out_features) of each attention projection, by name; None for an unknown layout."""
    fam = family(hf)
    if fam is None:
        return None
    h, heads, kv, hd = dims(hf)
    if fam.fused:
        return {"qkv_proj": (h, (heads + 2 * kv) * hd), "o_proj": (heads * hd, h)}
    return {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h)}


def mlp_shapes(hf: Mapping[str, Any], width: int) -> Shapes:
    """The gated MLP's linears at inner `width` (one expert's matrices, in a mixture of experts)."""
    h = int(hf["hidden_size"])
    if (fam := family(hf)) is not None and fam.fused:
        return {"gate_up_proj": (h, 2 * width), "down_proj": (width, h)}
    return {"gate_proj": (h, width), "up_proj": (h, width), "down_proj": (width, h)}


def linear_shapes(hf: Mapping[str, Any]) -> Shapes | None:
    """The decoder's linear layers LoRA can adapt, by name: the attention's, and a dense MLP's (a mixture of experts
    keeps its experts as fused tensors); None for an unknown layout."""
    attention = attention_shapes(hf)
    if attention is None:
        return None
    return attention if is_moe(hf) else {**attention, **mlp_shapes(hf, int(hf["intermediate_size"]))}


def num_experts(hf: Mapping[str, Any]) -> int:
    """Experts per sparse layer: `num_experts` or `num_local_experts` (the hub's Qwen3-MoE configs write the first,
    transformers the second); 0 where neither is set."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def is_moe(hf: Mapping[str, Any]) -> bool:
    """Whether the model is a mixture of experts."""
    return hf.get("model_type") in MOE_MODEL_TYPES and num_experts(hf) > 0


def experts(hf: Mapping[str, Any]) -> tuple[int, int, int]:
    """(experts per sparse layer, experts each token runs, sparse layers); (0, 0, 0) for a dense model."""
    fam = family(hf)
    if fam is None or not is_moe(hf):
        return 0, 0, 0
    layers = int(hf["num_hidden_layers"])
    step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
    sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return num_experts(hf), int(hf["num_experts_per_tok"]), sparse


def expert_parameters(hf: Mapping[str, Any]) -> int:
    """One expert's parameters (0 for a dense model)."""
    fam = family(hf)
    if fam is None or not is_moe(hf):
        return 0
    return sum(i * o for i, o in mlp_shapes(hf, int(hf[fam.expert_width_key])).values())


def mlp_width(hf: Mapping[str, Any]) -> int:
    """The MLP's inner width one token runs through in a layer: the dense MLP's, or its experts' together."""
    fam = family(hf)
    if fam is None or not is_moe(hf):
        return int(hf["intermediate_size"])
    return int(hf["num_experts_per_tok"]) * int(hf[fam.expert_width_key])


def _layer_extras(hf: Mapping[str, Any], fam: Family, attention: Shapes) -> int:
    """A layer's norms and biases."""
    h, heads, kv, hd = dims(hf)
    extras = fam.layer_norms * h
    extras += {"head": 2 * hd, "full": (heads + kv) * hd}.get(fam.head_norms, 0)
    if fam.qkv_bias or hf.get("attention_bias"):
        extras += sum(o for n, (_, o) in attention.items() if n != "o_proj")
        extras += h if hf.get("attention_bias") else 0  # o_proj's
    if hf.get("mlp_bias") and not is_moe(hf):
        extras += sum(o for _, o in mlp_shapes(hf, int(hf["intermediate_size"])).values())
    return extras


def base_parameters(hf: Mapping[str, Any]) -> tuple[int, int] | None:
    """(all, per token) parameters of the model, a tied output head counted once; per token counts the experts a
    token runs (equal to all for a dense model). None for an unknown layout."""
    fam, attention = family(hf), attention_shapes(hf)
    if fam is None or attention is None:
        return None
    h, layers, vocab = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
    dense_mlp = sum(i * o for i, o in mlp_shapes(hf, int(hf["intermediate_size"])).values())
    n_experts, per_tok, sparse = experts(hf)
    per_layer = sum(i * o for i, o in attention.values()) + _layer_extras(hf, fam, attention)
    mlps = (layers - sparse) * dense_mlp + sparse * (n_experts * expert_parameters(hf) + n_experts * h)  # + router
    total = vocab * h * (1 if tied_head(hf) else 2) + layers * per_layer + mlps + h
    return total, total - sparse * (n_experts - per_tok) * expert_parameters(hf)
