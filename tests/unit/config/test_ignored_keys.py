"""Keys that used to pass validation and do nothing (issue #11 §4): each is now honoured or refused with
exit 2 naming the key: in the schemas (also `rlpost plan`) or, when it depends on the device, in pre-flight."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpost.checks import run_checks
from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.config.schema.checkpoint import wall_budget_s
from rlpost.config.schema.master import MasterConfig
from rlpost.preflight import check_gpu_only_keys


def master(*overrides: str) -> MasterConfig:
    return load_master_config(list(overrides))[1]


def refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        master(*overrides)
    return err.value


def preflight_refused(m: MasterConfig) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        run_checks(m, None)
    return err.value


# ---- schema: device-independent ------------------------------------------------------------------


def test_backend_must_name_the_engine_target_builds() -> None:
    assert master().policy.generation.backend == "vllm"
    assert master("generation=hf").policy.generation.backend == "hf"
    err = refused("policy.generation.backend=hf")
    assert err.key == "policy.generation.backend" and "VllmGeneration" in err.rule and "'vllm' engine" in err.rule
    assert refused("generation=hf", "policy.generation.backend=vllm").key == "policy.generation.backend"
    err = refused("policy.generation.backend=megatron")
    assert err.key == "policy.generation.backend" and "no Megatron generation engine" in err.rule


def test_model_save_format_torch_save_is_refused_as_pickle() -> None:
    err = refused("checkpointing.model_save_format=torch_save")
    assert err.key == "checkpointing.model_save_format" and "pickle" in err.rule


def test_save_consolidated_defaults_to_the_hf_export() -> None:
    assert master().checkpointing.save_consolidated is True
    assert master("checkpointing.save_consolidated=false").checkpointing.save_consolidated is False


@pytest.mark.parametrize("text, seconds", [("00:00:00:05", 5.0), ("01:02:03:04", 93784.0), ("00:00:00:00", None),
                                           ("0:24:00:00", None), ("00:00:61:00", None), ("5s", None)])
def test_wall_budget_parsing(text: str, seconds: float | None) -> None:
    assert wall_budget_s(text) == seconds


def test_checkpoint_must_save_by_needs_a_valid_budget_and_checkpoints() -> None:
    assert master("checkpointing.checkpoint_must_save_by=00:01:00:00").checkpointing.checkpoint_must_save_by
    assert refused("checkpointing.checkpoint_must_save_by=00:25:00:00").key == "checkpointing.checkpoint_must_save_by"
    err = refused("checkpointing.checkpoint_must_save_by=00:01:00:00", "checkpointing.enabled=false")
    assert err.key == "checkpointing.checkpoint_must_save_by" and "checkpointing.enabled=true" in err.rule


def test_data_num_workers_is_refused() -> None:
    err = refused("data.num_workers=4")
    assert err.key == "data.num_workers" and "no worker processes" in err.rule


@pytest.mark.parametrize("policy", ["dtensor", "dtensor_v2", "megatron"])
def test_reward_model_mode_is_refused_outside_algo_rm(policy: str) -> None:
    for algo in ("grpo", "sft", "dpo"):
        err = refused(f"algo={algo}", f"policy={policy}", "policy.reward_model_cfg.enabled=true")
        assert err.key == "policy.reward_model_cfg.enabled" and "algo=rm" in err.rule


def test_reward_model_is_refused_by_the_megatron_backend() -> None:
    err = refused("algo=rm", "policy=megatron")
    assert err.key == "policy._target_" and "DTensor" in err.rule


def test_policy_generation_batch_size_feeds_the_hf_engine_and_is_refused_for_vllm() -> None:
    m = master("generation=hf", "policy.generation_batch_size=16")
    assert m.policy.generation.generation_batch_size == 16  # type: ignore[attr-defined]
    err = refused("policy.generation_batch_size=16")
    assert err.key == "policy.generation_batch_size" and "VllmConfig" in err.rule
    err = refused("generation=hf", "policy.generation_batch_size=16", "policy.generation.generation_batch_size=8")
    assert err.key == "policy.generation_batch_size" and "differs" in err.rule


def test_vllm_expert_parallel_size_must_match_tp() -> None:
    err = refused("policy.generation.vllm_cfg.expert_parallel_size=2")
    assert err.key == "policy.generation.vllm_cfg.expert_parallel_size" and "tensor_parallel_size (1)" in err.rule


def test_megatron_defer_fp32_logits_is_refused() -> None:
    err = refused("policy=megatron", "policy.megatron_cfg.defer_fp32_logits=true")
    assert err.key == "policy.megatron_cfg.defer_fp32_logits" and "not implemented" in err.rule


def test_clear_cache_every_n_steps_must_be_positive() -> None:
    assert refused("policy.dtensor_cfg.clear_cache_every_n_steps=0").key == "policy.dtensor_cfg.clear_cache_every_n_steps"


def test_async_grpo_options_are_refused_while_async_grpo_is_off() -> None:
    for key, value in (("max_trajectory_age_steps", "2"), ("in_flight_weight_updates", "true")):
        err = refused(f"grpo.async_grpo.{key}={value}")
        assert err.key == f"grpo.async_grpo.{key}" and "no effect" in err.rule
    err = refused("grpo.async_grpo.recompute_kv_cache_after_weight_updates=true")
    assert err.key == "grpo.async_grpo.recompute_kv_cache_after_weight_updates" and "in-flight" in err.rule


def test_in_flight_weight_updates_need_the_async_engine() -> None:
    split = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
             "policy.generation.colocated.resources.gpus_per_node=1", "loss_fn.use_importance_sampling_correction=true",
             "grpo.async_grpo.enabled=true", "grpo.async_grpo.in_flight_weight_updates=true"]
    err = refused(*split)
    assert err.key == "grpo.async_grpo.in_flight_weight_updates" and "async engine" in err.rule
    err = refused(*split[:-1], "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true")
    assert err.key == "grpo.async_grpo.recompute_kv_cache_after_weight_updates"


# ---- pre-flight: GPU-only keys on a CPU run ------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("policy.dtensor_cfg.cpu_offload=true", "policy.dtensor_cfg.cpu_offload"),
        ("policy.dtensor_cfg.clear_cache_every_n_steps=4", "policy.dtensor_cfg.clear_cache_every_n_steps"),
        ("policy.offload_optimizer_for_logprob=true", "policy.offload_optimizer_for_logprob"),
        ("logger.monitor_gpus=true", "logger.monitor_gpus"),
    ],
)
def test_gpu_only_keys_are_refused_on_cpu(override: str, key: str) -> None:
    err = preflight_refused(master("cluster.device=cpu", override))
    assert err.key == key and err.rule.startswith("GPU only:") and "cluster.device=cpu" in err.rule


def test_gpu_only_keys_pass_on_a_gpu_run() -> None:
    # the keys' own check: the whole pre-flight refuses cluster.device=cuda on a machine without a GPU
    check_gpu_only_keys(master("cluster.device=cuda", "policy.dtensor_cfg.cpu_offload=true", "logger.monitor_gpus=true",
                               "policy.dtensor_cfg.clear_cache_every_n_steps=4",
                               "policy.offload_optimizer_for_logprob=true"))


def test_vllm_expert_parallelism_needs_a_gpu_and_a_moe_model() -> None:
    ep = ["policy.generation.vllm_cfg.tensor_parallel_size=2", "policy.generation.vllm_cfg.expert_parallel_size=2",
          "cluster.gpus_per_node=2"]
    err = preflight_refused(master("cluster.device=cpu", *ep))
    assert err.key == "policy.generation.vllm_cfg.expert_parallel_size" and err.rule.startswith("GPU only:")
    with pytest.raises(ConfigError) as raised:
        check_gpu_only_keys(master("cluster.device=cuda", *ep))
    err = raised.value
    assert err.key == "policy.generation.vllm_cfg.expert_parallel_size" and "mixture-of-experts" in err.rule


# ---- pre-flight: hf_config_overrides must be fields of the model config ---------------------------


def test_hf_config_overrides_must_be_config_fields(tmp_path: Path) -> None:
    run_checks(master("+policy.hf_config_overrides.rms_norm_eps=0.001"), tmp_path)
    # transformers 5 keeps rope_theta inside rope_parameters: it would drop the key, vLLM would set it.
    err = preflight_refused(master("+policy.hf_config_overrides.rope_theta=1234.0"))
    assert err.key == "policy.hf_config_overrides.rope_theta" and "not a field of the qwen2 config" in err.rule
