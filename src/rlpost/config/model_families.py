"""The model families each backend takes beyond TP=1, and the pre-flight checks that a run's model is one of them: an
exit 2 naming the model's type, before Ray starts.

- Megatron-Core converts the architectures of ARCHITECTURES (rlpost.models.megatron.convert), at any parallelism.
- policy=dtensor trains any transformers causal LM at TP=1; at TP > 1 it needs one of rlpost's TP plans
  (TP_PLAN_ARCHITECTURES, rlpost.models.dtensor.parallelize.TP_PLANS) or `dtensor_cfg.custom_parallel_plan`;
  policy=dtensor_v2 takes transformers' own tp_plan of the model instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlpost.config.errors import ConfigError

ARCHITECTURES: dict[str, str] = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                 "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
"""model_type -> the HF architecture each converter handles."""


MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
"""The mixture-of-experts families (rlpost.models.expert_weights has their checkpoint layouts)."""


CAUSAL_LMS: dict[str, str] = dict(ARCHITECTURES)
"""model_type -> the causal LM architecture, for every family `model.tiny.architecture` builds."""


TP_PLAN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                         "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM", "Phi3ForCausalLM",
                         "Qwen3MoeForCausalLM", "MixtralForCausalLM")
"""The architectures rlpost's DTensor TP plans cover."""


def attention_implementation(hf_cfg: Any) -> str:
    """transformers' attention a worker or engine runs the model with: SDPA, or its eager attention for a model whose
    attention scores are soft-capped (Gemma 2's `attn_logit_softcapping`), which SDPA would leave out."""
    return "eager" if getattr(hf_cfg, "attn_logit_softcapping", None) else "sdpa"


def architecture_of(hf: Mapping[str, Any], converter_type: str = "auto") -> str:
    """The architecture a Megatron run converts: `converter_type`, or config.json's (its `architectures`, else its
    `model_type`'s)."""
    if converter_type != "auto":
        return converter_type
    archs = list(hf.get("architectures") or [])
    return str(archs[0]) if archs else CAUSAL_LMS.get(str(hf.get("model_type", "")), "")


def check_converted(hf: Mapping[str, Any], key: str, converter_type: str = "auto") -> None:
    """ConfigError at `key` (the Megatron block's converter_type) when Megatron has no converter for the model."""
    arch = architecture_of(hf, converter_type)
    if arch in ARCHITECTURES.values():
        return
    raise ConfigError(key, converter_type, f"Megatron-Core converts {', '.join(ARCHITECTURES.values())}; this model "
                      f"is {_named(hf, arch)}", "policy=dtensor trains any transformers causal LM (docs/models.md)")


def check_tp_plan(hf: Mapping[str, Any], key: str, tp: int) -> None:
    """ConfigError at `key` (policy.dtensor_cfg.tensor_parallel_size) when TP > 1 has no plan for the model."""
    arch = architecture_of(hf)
    if tp == 1 or arch in TP_PLAN_ARCHITECTURES:
        return
    raise ConfigError(key, tp, f"policy=dtensor has tensor-parallel plans for {', '.join(TP_PLAN_ARCHITECTURES)}; "
                      f"this model is {_named(hf, arch)}", "policy=dtensor_v2 uses transformers' own tp_plan, "
                      "or set policy.dtensor_cfg.custom_parallel_plan")


def _named(hf: Mapping[str, Any], arch: str) -> str:
    """The model as a refusal names it: its model_type, and its architecture when known."""
    return f"model_type={hf.get('model_type')!r}" + (f" ({arch})" if arch else "")
