"""Every option of every config group composes and converts to a typed MasterConfig."""

from __future__ import annotations

import pytest

from rlpost.config.errors import ConfigError
from rlpost.config.load import group_options, groups, load_master_config
from rlpost.config.schema.env import MathEnvConfig, SyntheticEnvConfig
from rlpost.config.schema.generation import HFGenerationConfig, VllmConfig
from rlpost.config.schema.loss import ClippedPGLossConfig, NLLLossConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.megatron import MegatronPolicyConfig
from rlpost.config.schema.policy import DTensorPolicyConfig
from rlpost.config.schema.supervised_master import SupervisedMasterConfig
from tests.unit.config.companions import COMPANIONS

ALL = [(g, o) for g in groups() for o in group_options(g)]


def test_groups_are_the_documented_ones() -> None:
    assert {"policy", "algo", "loss", "generation", "cluster", "model", "data", "env", "logger",
            "checkpointing", "experiment"} <= set(groups())
    assert group_options("policy") == ["dtensor", "dtensor_v2", "megatron"]
    assert {"token_level", "sequence_level"} <= set(group_options("loss"))
    assert group_options("generation") == ["hf", "vllm"]


@pytest.mark.parametrize(("group", "option"), ALL, ids=[f"{g}={o}" for g, o in ALL])
def test_every_option_composes(group: str, option: str) -> None:
    _, cfg = load_master_config([f"{group}={option}", *COMPANIONS.get((group, option), [])])
    assert isinstance(cfg, (MasterConfig, SupervisedMasterConfig))


def test_default_is_typed() -> None:
    _, cfg = load_master_config([])
    assert isinstance(cfg.policy.generation, VllmConfig)
    assert isinstance(cfg.loss_fn, ClippedPGLossConfig)
    assert isinstance(cfg.env["synthetic"], SyntheticEnvConfig)
    assert isinstance(cfg.policy, DTensorPolicyConfig)  # the policy group is polymorphic, like generation
    assert cfg.policy.model_name == cfg.model.path and cfg.policy.tokenizer.name == cfg.model.path
    assert cfg.loss_fn.token_level_loss is True


@pytest.mark.parametrize("backend", ["dtensor", "dtensor_v2", "megatron"])
def test_one_lr_path_for_every_backend(backend: str) -> None:
    # what `rlpost train -m policy=<backend> policy.optimizer.kwargs.lr=1e-3,2e-3` composes for each job
    for lr in (1e-3, 2e-3):
        _, cfg = load_master_config([f"policy={backend}", f"policy.optimizer.kwargs.lr={lr}"])
        assert cfg.policy.optimizer.kwargs["lr"] == lr
        if isinstance(cfg.policy, MegatronPolicyConfig):  # what the Megatron worker's optimizer is built with
            mo, ms = cfg.policy.megatron_cfg.optimizer, cfg.policy.megatron_cfg.scheduler
            assert mo.lr == mo.min_lr == ms.lr_warmup_init == lr


def test_megatron_refuses_a_second_lr() -> None:
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.optimizer\.lr=.*policy\.optimizer\.kwargs\.lr"):
        load_master_config(["policy=megatron", "policy.megatron_cfg.optimizer.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"policy\.optimizer\.kwargs.*only policy\.optimizer\.kwargs\.lr is read"):
        load_master_config(["policy=megatron", "+policy.optimizer.kwargs.weight_decay=0.1"])


def test_backend_and_polymorphic_options_switch_types() -> None:
    _, cfg = load_master_config(["policy=megatron", "generation=hf", "loss=sequence_level"])
    assert cfg.policy._target_.endswith("MegatronPolicyWorker")
    assert isinstance(cfg.policy, MegatronPolicyConfig) and not hasattr(cfg.policy, "dtensor_cfg")
    assert cfg.policy.megatron_cfg.optimizer.lr == cfg.policy.optimizer.kwargs["lr"]
    assert isinstance(cfg.policy.generation, HFGenerationConfig)
    assert cfg.loss_fn.token_level_loss is False
    _, cfg = load_master_config(["algo=sft", "loss=nll"])
    assert isinstance(cfg.loss_fn, NLLLossConfig)
    with pytest.raises(ConfigError, match="loss_fn._target_"):  # GRPO trains on its rollouts, not on rows
        load_master_config(["loss=nll"])
    _, cfg = load_master_config(["data=math_jsonl", "env=math", "data.train_data_path=x.jsonl"])
    assert isinstance(cfg.env["math"], MathEnvConfig) and "synthetic" not in cfg.env


def test_nemo_rl_overrides_carry_over() -> None:
    _, cfg = load_master_config([
        "grpo.num_prompts_per_step=16",
        "policy.train_global_batch_size=128",
        "loss_fn.ratio_clip_max=0.28",
        "policy.optimizer.kwargs.lr=1e-4",
        "policy.generation.temperature=0.7",
        "cluster.gpus_per_node=2",
    ])
    assert cfg.grpo.num_prompts_per_step == 16
    assert cfg.policy.train_global_batch_size == 128
    assert cfg.loss_fn.ratio_clip_max == pytest.approx(0.28)
    assert cfg.policy.optimizer is not None and cfg.policy.optimizer.kwargs["lr"] == pytest.approx(1e-4)
    assert cfg.policy.generation.temperature == pytest.approx(0.7)
    assert cfg.cluster.gpus_per_node == 2


def test_add_and_delete_overrides() -> None:
    _, cfg = load_master_config(["+policy.hf_config_overrides.rope_theta=10000", "~policy.optimizer.kwargs.fused"])
    assert cfg.policy.hf_config_overrides == {"rope_theta": 10000}
    assert cfg.policy.optimizer is not None and "fused" not in cfg.policy.optimizer.kwargs


def test_experiment_applies_last() -> None:
    _, cfg = load_master_config(["experiment=tiny_megatron"])
    assert cfg.policy._target_.endswith("MegatronPolicyWorker")
    _, cfg = load_master_config(["experiment=qwen2_5_1_5b_math", "data.train_data_path=t.jsonl"])
    assert cfg.policy.precision == "bfloat16" and cfg.grpo.num_generations_per_prompt == 16
    assert cfg.model.tiny is None and cfg.policy.sequence_packing.enabled
