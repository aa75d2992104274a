"""A run's model must be of a family its backend takes: exit 2 naming its model_type before Ray (Megatron's
converters; policy=dtensor's TP plans above TP=1)."""

from __future__ import annotations

import pytest

from rlpost.config.errors import ConfigError
from rlpost.config.model_families import ARCHITECTURES, architecture_of, check_converted


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_each_converted_family_passes_by_its_model_type_or_architecture(model_type: str) -> None:
    check_converted({"model_type": model_type}, "k")
    check_converted({"model_type": "x", "architectures": [ARCHITECTURES[model_type]]}, "k")


def test_another_family_is_refused_naming_its_type_and_the_list() -> None:
    with pytest.raises(ConfigError) as e:
        check_converted({"model_type": "falcon", "architectures": ["FalconForCausalLM"]},
                        "policy.megatron_cfg.converter_type")
    line = str(e.value)
    assert "policy.megatron_cfg.converter_type" in line and "model_type='falcon' (FalconForCausalLM)" in line
    assert all(a in line for a in ARCHITECTURES.values())


def test_converter_type_names_the_architecture_over_config_json() -> None:
    assert architecture_of({"model_type": "falcon"}, "LlamaForCausalLM") == "LlamaForCausalLM"
    check_converted({"model_type": "falcon"}, "k", "LlamaForCausalLM")


def test_dtensor_tp_above_1_needs_a_plan_for_the_model() -> None:
    from rlpost.config.model_families import TP_PLAN_ARCHITECTURES, check_tp_plan

    check_tp_plan({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}, "k", 1)  # TP=1: any model
    for arch in TP_PLAN_ARCHITECTURES:
        check_tp_plan({"architectures": [arch]}, "k", 2)
    with pytest.raises(ConfigError) as e:
        check_tp_plan({"model_type": "falcon", "architectures": ["FalconForCausalLM"]},
                      "policy.dtensor_cfg.tensor_parallel_size", 2)
    assert "model_type='falcon' (FalconForCausalLM)" in str(e.value) and "policy=dtensor_v2" in str(e.value)


def test_the_listed_tp_plan_architectures_are_the_plans_the_worker_has() -> None:
    from rlpost.config.model_families import TP_PLAN_ARCHITECTURES
    from rlpost.models.dtensor.parallelize import TP_PLANS

    assert set(TP_PLAN_ARCHITECTURES) == set(TP_PLANS)


def test_megatron_trains_experts_above_tp_1_only_with_sequence_parallelism() -> None:
    from rlpost.config.schema.megatron import check_megatron_experts

    moe = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}
    check_megatron_experts(moe, "policy.megatron_cfg", 1, False)
    check_megatron_experts(moe, "policy.megatron_cfg", 2, True)
    check_megatron_experts({"model_type": "qwen3"}, "policy.megatron_cfg", 2, False)
    with pytest.raises(ConfigError) as e:
        check_megatron_experts(moe, "policy.megatron_cfg", 2, False)
    assert e.value.key == "policy.megatron_cfg.sequence_parallel" and "tensor_model_parallel_size=1" in str(e.value)


def test_expert_parallelism_needs_experts_that_split_evenly_over_it() -> None:
    from rlpost.config.schema.megatron import check_megatron_experts

    check_megatron_experts({"model_type": "mixtral", "num_local_experts": 4}, "m", 1, False, ep=2)
    for hf, words in (({"model_type": "mixtral", "num_local_experts": 3}, "its 3 experts do not split evenly"),
                      ({"model_type": "qwen3"}, "(qwen3) has no experts")):
        with pytest.raises(ConfigError) as e:
            check_megatron_experts(hf, "m", 1, False, ep=2)
        assert e.value.key == "m.expert_model_parallel_size" and words in str(e.value)
