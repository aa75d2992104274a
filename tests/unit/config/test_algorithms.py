"""algo=grpo|sft|dpo|rm: each composes only the blocks its algorithm reads, and a key of another algorithm's block
is refused naming the key and the algorithm it belongs to."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.config.schema.loss import DPOLossConfig, NLLLossConfig, PreferenceLossConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.supervised import PreferenceDataConfig, SFTDataConfig
from rlpost.config.schema.supervised_master import (
    DPOMasterConfig,
    RMMasterConfig,
    SFTMasterConfig,
    SupervisedMasterConfig,
)
from rlpost.plan import plan_rows


def refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_master_config(list(overrides))
    return err.value


@pytest.mark.parametrize("algo,cls,loss,data", [
    ("sft", SFTMasterConfig, NLLLossConfig, SFTDataConfig),
    ("dpo", DPOMasterConfig, DPOLossConfig, PreferenceDataConfig),
    ("rm", RMMasterConfig, PreferenceLossConfig, PreferenceDataConfig),
])
def test_each_algorithm_composes_only_what_it_reads(algo: str, cls: type, loss: type, data: type) -> None:
    _, m = load_master_config([f"algo={algo}"])
    assert type(m) is cls and type(m.loss_fn) is loss and type(m.data) is data
    assert isinstance(m, SupervisedMasterConfig)
    assert m.policy.generation is None and m.policy.reward_model_cfg.enabled == (algo == "rm")
    written = OmegaConf.to_container(OmegaConf.structured(m))
    assert isinstance(written, dict)
    assert algo in written and not {"grpo", "env", "eval"} & set(written)  # the run's resolved_config.yaml
    rows = dict(plan_rows(m))
    assert rows["loss"] == m.loss_fn._target_.rsplit(".", 1)[-1] and "algorithm" in rows


def test_grpo_keeps_its_engine_and_environments() -> None:
    _, m = load_master_config([])
    assert isinstance(m, MasterConfig) and m.policy.generation is not None and m.env
    assert m.policy.generation.max_new_tokens == 1 and m.policy.train_global_batch_size == 256


@pytest.mark.parametrize("overrides,key,belongs", [
    (["algo=sft", "grpo.max_num_steps=3"], "grpo.max_num_steps", "algo=grpo"),
    (["algo=dpo", "generation=hf"], "generation", "algo=grpo"),
    (["algo=rm", "env=math"], "env", "algo=grpo"),
    (["algo=sft", "policy.generation.temperature=0.5"], "policy.generation.temperature", "algo=grpo"),
    (["sft.max_num_steps=3"], "sft.max_num_steps", "algo=sft"),
    (["algo=rm", "dpo.seed=1"], "dpo.seed", "algo=dpo"),
])
def test_a_key_of_another_algorithm_is_refused(overrides: list[str], key: str, belongs: str) -> None:
    err = refused(*overrides)
    assert err.key == key and belongs in err.rule


@pytest.mark.parametrize("overrides,key,needle", [
    (["algo=sft", "data=synthetic"], "data", "SFTDataConfig"),
    (["algo=dpo", "data=sft_synthetic"], "data", "PreferenceDataConfig"),
    (["algo=sft", "loss=token_level"], "loss_fn._target_", "NLLLossConfig"),
    (["algo=dpo", "policy.train_micro_batch_size=3"], "policy.train_micro_batch_size", "even"),
    (["algo=dpo", "cluster.gpus_per_node=2", "policy.train_global_batch_size=34"],
     "policy.train_global_batch_size", "multiple of 4"),
    (["algo=rm", "policy.sequence_packing.enabled=true"], "policy.sequence_packing.enabled", "split pairs"),
    (["algo=rm", "policy=megatron"], "policy._target_", "DTensor"),
    (["algo=rm", "cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2"],
     "policy.dtensor_cfg.tensor_parallel_size", "model parallelism"),
    (["algo=sft", "policy.reward_model_cfg.enabled=true"], "policy.reward_model_cfg.enabled", "algo=rm"),
    (["algo=sft", "sft.val_period=0"], "checkpointing.metric_name", "val_period"),
    (["algo=sft", "logger.num_val_samples_to_print=2"], "logger.num_val_samples_to_print", "GRPO only"),
])
def test_supervised_rules(overrides: list[str], key: str, needle: str) -> None:
    err = refused(*overrides)
    assert err.key == key and needle in err.rule, err


def test_sft_packs_sequences_like_grpo() -> None:
    _, m = load_master_config(["algo=sft", "policy.sequence_packing.enabled=true"])
    assert m.policy.sequence_packing.enabled


def test_checkpoint_metric_must_be_one_the_algorithm_logs() -> None:
    from rlpost.checks import run_checks

    with pytest.raises(ConfigError) as err:  # a schema rule: refused as the config is composed
        load_master_config(["algo=sft", "checkpointing.metric_name=val:accuracy"])
    assert err.value.key == "checkpointing.metric_name" and err.value.hint == "did you mean 'val:token_accuracy'?"
    for algo, name in (("sft", "val:loss"), ("dpo", "train:reward_margin"), ("rm", "val:accuracy")):
        _, m = load_master_config([f"algo={algo}", f"checkpointing.metric_name={name}"])
        run_checks(m, None)


def test_validation_needs_validation_rows() -> None:
    # conf/'s default validation goes off without validation rows (checkpoints ranked by train:loss) ...
    files = ["algo=sft", "data=sft_jsonl", "data.train_data_path=/tmp/t.jsonl"]
    _, m = load_master_config(files)
    assert (m.loop.val_period, m.loop.val_at_start, m.checkpointing.metric_name) == (0, False, "train:loss")
    # ... validation asked for on the command line is refused
    err = refused(*files, "sft.val_period=5")
    assert err.key == "data.val_data_paths" and "sft.val_period=5" in err.rule
    _, m = load_master_config([*files, "sft.val_period=0", "sft.val_at_start=false", "checkpointing.metric_name=train:loss"])
    assert m.loop.val_period == 0


def test_ppo_composes_grpo_with_a_critic_and_no_overlap() -> None:
    from rlpost.algorithms.critic import CriticGroup
    from rlpost.config.layout import layout_of

    _, m = load_master_config(["algo=ppo", "critic.lr=3e-4", "policy.generation.colocated.enabled=false",
                               "cluster.gpus_per_node=2", "policy.generation.colocated.resources.gpus_per_node=1"])
    assert isinstance(m, MasterConfig) and m.ppo is not None and m.critic is not None
    assert m.grpo.num_generations_per_prompt == 4 and m.critic.lr == 3e-4
    assert "critic" in layout_of(m).overlap_reason  # a split engine would overlap GRPO's steps; not PPO's
    assert m.critic is not None
    c = CriticGroup(m, m.critic).config()
    assert c.value_head and c.generation is None and c.optimizer.kwargs["lr"] == 3e-4
    assert c.model_name == m.policy.model_name and not m.policy.value_head
    rows = dict(plan_rows(m))
    assert "value head, lr 0.0003, on the policy's" in rows["critic"] and "GAE (gamma 1.0" in rows["advantages"]
    _, g = load_master_config([])
    assert isinstance(g, MasterConfig) and g.ppo is None and g.critic is None


@pytest.mark.parametrize("overrides,key", [
    (["algo=ppo", "critic=null"], "critic"),
    (["algo=ppo", "policy=megatron", "policy.megatron_cfg.tensor_model_parallel_size=2", "cluster.gpus_per_node=2"],
     "policy.megatron_cfg.tensor_model_parallel_size"),
    (["algo=ppo", "policy=dtensor", "policy.dtensor_cfg.tensor_parallel_size=2", "cluster.gpus_per_node=2"],
     "policy.dtensor_cfg.tensor_parallel_size"),
    (["algo=ppo", "grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false",
      "cluster.gpus_per_node=2", "policy.generation.colocated.resources.gpus_per_node=1",
      "loss_fn.use_importance_sampling_correction=true"], "grpo.async_grpo.enabled"),
    (["algo=ppo", "ppo.lam=1.5"], "ppo.lam"),
    (["algo=ppo", "ppo.kl_in_reward=0.1", "loss_fn.reference_policy_kl_penalty=0.01"], "ppo.kl_in_reward"),
    (["algo=ppo", "critic.num_workers=2"], "critic.num_workers"),
    (["algo=ppo", "policy.value_head=true"], "policy.value_head"),
    (["algo=sft", "+critic.lr=1"], "critic.lr"),
])
def test_bad_ppo_combinations_name_the_key(overrides: list[str], key: str) -> None:
    assert refused(*overrides).key == key


def test_distillation_composes_grpo_with_a_teacher(tmp_path: Path) -> None:
    from rlpost.checks import run_checks
    from rlpost.config.schema.loss import ClippedPGLossConfig, DistillationLossConfig

    _, m = load_master_config(["algo=distillation", f"distillation.teacher.model_path={tmp_path}"])
    assert isinstance(m, MasterConfig) and isinstance(m.loss_fn, DistillationLossConfig)
    assert m.distillation is not None and m.distillation.topk_logits_k == 64 and m.grpo.num_generations_per_prompt == 1
    assert "reverse KL over its top 64 tokens per position is the loss" in dict(plan_rows(m))["teacher"]
    with pytest.raises(ConfigError) as err:  # an empty directory: neither an HF model nor a checkpoint
        run_checks(m, tmp_path / "run")
    assert err.value.key == "distillation.teacher.model_path" and "config.json" in err.value.rule
    (tmp_path / "policy" / "weights" / "hf").mkdir(parents=True)
    (tmp_path / "policy" / "weights" / "hf" / "config.json").write_text("{}")
    assert m.distillation.teacher.model_dir() == tmp_path / "policy" / "weights" / "hf"  # an rlpost checkpoint
    _, g = load_master_config(["distillation=teacher", f"distillation.teacher.model_path={tmp_path}",
                               "loss_fn.distillation_kl_coef=0.1"])
    assert isinstance(g, MasterConfig) and isinstance(g.loss_fn, ClippedPGLossConfig) and g.distillation is not None
    assert "0.1 x the KL added to the policy-gradient loss" in dict(plan_rows(g))["teacher"]


@pytest.mark.parametrize("overrides,key", [
    (["algo=distillation"], "distillation.teacher.model_path"),
    (["loss_fn.distillation_kl_coef=0.1"], "loss_fn.distillation_kl_coef"),
    (["distillation=teacher", "distillation.teacher.model_path=/x"], "distillation"),
    (["algo=distillation", "distillation.teacher.model_path=/x", "policy=megatron",
      "policy.megatron_cfg.tensor_model_parallel_size=2", "cluster.gpus_per_node=2"],
     "policy.megatron_cfg.tensor_model_parallel_size"),
    (["algo=distillation", "distillation.teacher.model_path=/x", "distillation.teacher.num_workers=2"],
     "distillation.teacher.num_workers"),
    (["algo=distillation", "distillation.teacher.model_path=/x", "loss_fn.kl_type=jensen"], "loss_fn.kl_type"),
    (["algo=sft", "distillation.topk_logits_k=3"], "distillation.topk_logits_k"),
])
def test_bad_distillation_combinations_name_the_key(overrides: list[str], key: str) -> None:
    assert refused(*overrides).key == key
