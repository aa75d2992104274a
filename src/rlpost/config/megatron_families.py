"""The HF architectures the Megatron-Core worker converts (rlpost.models.megatron.convert), and the pre-flight check
that a Megatron run's model is one of them: an exit 2 naming the model's type, before Ray starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlpost.config.errors import ConfigError

ARCHITECTURES: dict[str, str] = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
"""model_type -> the HF architecture each converter handles."""


def architecture_of(hf: Mapping[str, Any], converter_type: str = "auto") -> str:
    """The architecture a Megatron run converts: `converter_type`, or config.json's (its `architectures`, else its
    `model_type`'s)."""
    if converter_type != "auto":
        return converter_type
    archs = list(hf.get("architectures") or [])
    return str(archs[0]) if archs else ARCHITECTURES.get(str(hf.get("model_type", "")), "")


def check_converted(hf: Mapping[str, Any], key: str, converter_type: str = "auto") -> None:
    """ConfigError at `key` (the Megatron block's converter_type) when Megatron has no converter for the model."""
    arch = architecture_of(hf, converter_type)
    if arch in ARCHITECTURES.values():
        return
    what = f"model_type={hf.get('model_type')!r}" + (f" ({arch})" if arch else "")
    raise ConfigError(key, converter_type, f"Megatron-Core converts {', '.join(ARCHITECTURES.values())}; this model "
                      f"is {what}", "policy=dtensor trains any transformers causal LM (docs/models.md)")
