"""Every family's parameters and adaptable layers counted from config.json alone equal the transformers model's: in
all, per token (a mixture of experts runs k of its experts), and under LoRA as peft adapts it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlpost.config.lora_params import describe, linear_shapes, megatron_shapes, parameter_counts, tiny_hf_config
from rlpost.config.model_counts import base_parameters, experts
from rlpost.config.model_families import ARCHITECTURES, CAUSAL_LMS
from rlpost.config.schema.lora import LoRAConfig
from rlpost.config.schema.model import TinyModelConfig
from rlpost.models.dtensor import lora


def family_hf(architecture: str, **overrides: Any) -> dict[str, Any]:
    """A small config.json of the family (GQA, an untied head) with `overrides`."""
    t = TinyModelConfig(architecture=architecture, hidden_size=64, num_layers=3, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=96, tie_word_embeddings=False)
    return {**tiny_hf_config(t), **overrides}


CASES: dict[str, dict[str, Any]] = {
    **{arch: family_hf(arch) for arch in CAUSAL_LMS},
    "llama biases": family_hf("llama", attention_bias=True, mlp_bias=True),
    "gemma2 head tied by default": {k: v for k, v in family_hf("gemma2").items() if k != "tie_word_embeddings"},
    "olmo2 tied": family_hf("olmo2", tie_word_embeddings=True),
    "qwen3_moe dense layers": family_hf("qwen3_moe", num_experts=6, num_experts_per_tok=3, mlp_only_layers=[0],
                                        decoder_sparse_step=1, moe_intermediate_size=48),
    "qwen3_moe every second layer": family_hf("qwen3_moe", decoder_sparse_step=2),
    "qwen3_moe as transformers saves it": {**{k: v for k, v in family_hf("qwen3_moe").items() if k != "num_experts"},
                                           "num_local_experts": 3},
    "mixtral 8 experts": family_hf("mixtral", num_local_experts=8, num_experts_per_tok=2),
}


def build(hf: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in hf.items() if k != "model_type"} | {"pad_token_id": 0, "bos_token_id": 1,
                                                                   "eos_token_id": 2}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(hf["model_type"], **fields))


def numel(model: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)  # a tied head once


def idle_experts(model: torch.nn.Module, hf: dict[str, Any]) -> int:
    """The expert parameters a token does not run, counted on the model: each layer's fused expert tensors, less
    the share of the experts it routes to."""
    n, k, _ = experts(hf)
    fused = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return fused * (n - k) // n if n else 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameters_in_all_and_per_token_equal_the_models(case: str) -> None:
    hf = CASES[case]
    model = build(hf)
    total = numel(model)
    assert base_parameters(hf) == (total, total - idle_experts(model, hf))
    assert parameter_counts(hf, LoRAConfig()) == (total, total)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_adaptable_layers_and_lora_counts_are_the_ones_peft_adapts(case: str) -> None:
    hf, cfg = CASES[case], LoRAConfig(enabled=True, dim=4)
    model = lora.inject(build(hf), cfg)
    adapted = {name.split(".")[-4] for name, _ in model.named_parameters() if lora.is_adapter(name)}
    assert adapted == set(linear_shapes(hf) or ())
    assert parameter_counts(hf, cfg) == (numel(model, trainable=True), numel(model))


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_megatron_fuses_every_converted_family_into_its_four_layers(architecture: str) -> None:
    hf = family_hf(architecture)
    shapes, fused = linear_shapes(hf), megatron_shapes(hf)
    moe = architecture in ("qwen3_moe", "mixtral")  # the attention's alone: the experts are not adapted
    assert shapes is not None and fused is not None
    assert set(fused) == {"linear_qkv", "linear_proj", *(() if moe else ("linear_fc1", "linear_fc2"))}
    assert sum(i * o for i, o in fused.values()) == sum(i * o for i, o in shapes.values())
    assert fused["linear_qkv"] == (64, 64 + 2 * 32) and (moe or fused["linear_fc1"] == (64, 2 * 96))


def test_the_plan_row_of_a_mixture_of_experts_names_what_a_token_runs() -> None:
    hf = CASES["mixtral 8 experts"]
    total, active = base_parameters(hf) or (0, 0)
    row = describe(hf, LoRAConfig())
    assert row.startswith(f"{total:,}, all trained") and f"{active:,} per token (2 of 8 experts in each of 3 layers)" in row
    under_lora = describe(hf, LoRAConfig(enabled=True, dim=4))
    assert "LoRA adapts the attention alone" in under_lora and "on q_proj, k_proj, v_proj, o_proj;" in under_lora
    assert "per token" not in describe(CASES["llama"], LoRAConfig())
    routers = sum(p.numel() for name, p in build(hf).named_parameters() if name.endswith("mlp.gate.weight"))
    frozen = describe(hf, LoRAConfig(), megatron=True, frozen_routers=True)  # Megatron's freeze_moe_router
    assert frozen.startswith(f"{total - routers:,} trained of {total:,}: the routers frozen"), frozen
    assert describe(CASES["llama"], LoRAConfig(), frozen_routers=True).endswith("all trained")
