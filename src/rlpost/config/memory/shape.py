"""The sizes a memory estimate needs, read from a model's config.json alone (no weights, no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlpost.config.lora_params import parameter_counts, saved_tables
from rlpost.config.model_counts import dims, mlp_width, tied_head
from rlpost.config.schema.lora import LoRAConfig

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each precision."""


@dataclass(frozen=True)
class ModelShape:
    """One decoder-only model's sizes."""

    hidden: int
    """hidden_size."""
    layers: int
    """num_hidden_layers."""
    vocab: int
    """vocab_size."""
    intermediate: int
    """The MLP's inner width one token runs through (a mixture of experts: its chosen experts' together)."""
    q_dim: int
    """Query width: attention heads x head_dim."""
    kv_dim: int
    """Key (and value) width: key/value heads x head_dim."""
    params: int
    """All parameters (a tied output layer counted once, LoRA adapters included)."""
    trainable: int
    """Parameters the optimizer updates (the adapters under LoRA, else all)."""
    layer_params: int
    """Parameters of one decoder layer."""
    tied: bool
    """The output layer is the embedding."""
    largest_trained: int = 0
    """Elements of the largest tensor the optimizer updates: the embedding (or the output layer) in full
    fine-tuning, else an MLP's fused gate and up projection; nothing of note under LoRA (rank-r adapters)."""
    softcapped_logits: bool = False
    """The logits are soft-capped (Gemma 2's `final_logit_softcapping`): both backends make them whole, not a chunk
    of tokens at a time."""

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], lora: LoRAConfig | None = None, megatron: bool = False
                ) -> ModelShape | None:
        """The shape of the model `hf` describes with `lora` applied; None for a layout rlpost cannot count."""
        try:
            counts = parameter_counts(hf, lora or LoRAConfig(), megatron)
            _, heads, kv_heads, head_dim = dims(hf)
            width = mlp_width(hf)
        except (KeyError, TypeError, ValueError):  # a config.json without the sizes: nothing to count
            return None
        if counts is None:
            return None
        trainable, total = counts
        h, layers, vocab = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
        tied = tied_head(hf)
        body = total - (trainable if lora is not None and lora.enabled else 0) - vocab * h * (1 if tied else 2) - h
        if lora is None or not lora.enabled:
            largest = max(vocab * h, 2 * width * h)
        else:  # the adapters, and with modules_to_save an embedding trained in full
            largest = vocab * h if saved_tables(lora, tied) else 0
        return cls(hidden=h, layers=layers, vocab=vocab, intermediate=width, q_dim=heads * head_dim,
                   kv_dim=kv_heads * head_dim, params=total, trainable=trainable, layer_params=body // layers,
                   tied=tied, largest_trained=largest, softcapped_logits=bool(hf.get("final_logit_softcapping")))

    def kv_bytes_per_token(self, precision: str) -> int:
        """Bytes one token takes in an engine's KV cache: keys and values of every layer."""
        return 2 * self.layers * self.kv_dim * BYTES.get(precision, 4)

    def saved_per_token(self, tp: int = 1) -> int:
        """Elements one decoder layer keeps for its backward, per token: the two norms' inputs and outputs and the
        residual (hidden-wide, whole on every TP rank), and, split over TP, the query, the rotated query, the
        attention output, keys and values before and after rotation, and the MLP's gate, up, activation and
        product."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return 5 * h + (3 * q + 3 * kv + 4 * i) // tp


def read_shape(model_dir: str, key: str) -> ModelShape | None:
    """The shape of the model whose config.json is in `model_dir` (no adapters); None when there is none or rlpost
    cannot count its layout. `key` names the directory's config key in errors."""
    from rlpost.config.layout import read_hf_config

    hf = read_hf_config(model_dir, key)
    return ModelShape.from_hf(hf) if hf is not None else None
