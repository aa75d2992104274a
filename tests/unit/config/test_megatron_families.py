"""A Megatron run's model must be of a family Megatron-Core converts: exit 2 naming its model_type before Ray."""

from __future__ import annotations

import pytest

from rlpost.config.errors import ConfigError
from rlpost.config.megatron_families import ARCHITECTURES, architecture_of, check_converted


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_each_converted_family_passes_by_its_model_type_or_architecture(model_type: str) -> None:
    check_converted({"model_type": model_type}, "k")
    check_converted({"model_type": "x", "architectures": [ARCHITECTURES[model_type]]}, "k")


def test_another_family_is_refused_naming_its_type_and_the_list() -> None:
    with pytest.raises(ConfigError) as e:
        check_converted({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]},
                        "policy.megatron_cfg.converter_type")
    line = str(e.value)
    assert "policy.megatron_cfg.converter_type" in line and "model_type='gemma2' (Gemma2ForCausalLM)" in line
    assert all(a in line for a in ARCHITECTURES.values())


def test_converter_type_names_the_architecture_over_config_json() -> None:
    assert architecture_of({"model_type": "gemma2"}, "LlamaForCausalLM") == "LlamaForCausalLM"
    check_converted({"model_type": "gemma2"}, "k", "LlamaForCausalLM")
