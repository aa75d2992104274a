"""A bad config exits with status 2 and one message naming the key, the value and the rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlpost.cli import main
from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config

# (overrides, key that must be named, words of the rule that must appear)
SPLIT = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
         "policy.generation.colocated.resources.gpus_per_node=1"]

BAD = [
    (["grpo.seed=99999999999999999999"], "grpo.seed", "[0, 2**32 - 1]"),
    (["policy.generation.vllm_cfg.seed=-1"], "policy.generation.vllm_cfg.seed", "[0, 2**32 - 1]"),
    (["algo=sft", "sft.seed=-1"], "sft.seed", "[0, 2**32 - 1]"),
    (["policy=megatorn"], "policy", "did you mean 'megatron'"),
    (["generation=vlm"], "generation", "did you mean 'vllm'"),
    (["grpo.num_prompts_per_step=abc"], "grpo.num_prompts_per_step", "type Integer"),
    (["policy.foo=1"], "policy.foo", "unknown config key"),
    (["policy.dtensor_cfg.enabled=false"], "policy.dtensor_cfg.enabled", "policy=dtensor|dtensor_v2|megatron"),
    (["policy.train_global_batch_size=96"], "policy.train_global_batch_size", "must be a multiple of it"),
    (["policy.train_micro_batch_size=3"], "policy.train_global_batch_size", "divisible by train_micro_batch_size"),
    (["cluster.gpus_per_node=3", "policy.dtensor_cfg.tensor_parallel_size=2"],
     "policy.dtensor_cfg.tensor_parallel_size", "DP x TP x PP x CP"),
    (["policy.sequence_packing.enabled=true", "policy.dynamic_batching.enabled=true"],
     "policy.sequence_packing.enabled", "mutually exclusive"),
    (["loss=gspo", "loss_fn.token_level_loss=true"], "loss_fn.sequence_level_importance_ratios",
     "require token_level_loss=false"),
    (["loss_fn.truncated_importance_sampling_ratio=2.0"], "loss_fn.truncated_importance_sampling_ratio",
     "requires use_importance_sampling_correction"),
    (["cluster.gpus_per_node=4", "policy.dtensor_cfg.tensor_parallel_size=4"],
     "policy.dtensor_cfg.tensor_parallel_size", "attention heads"),
    (["cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2", "model.tiny.num_key_value_heads=1"],
     "policy.dtensor_cfg.tensor_parallel_size", "key/value heads"),
    (["policy.generation.colocated.enabled=false"], "policy.generation.colocated.resources.gpus_per_node",
     "non-colocated engine needs resources"),
    (["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
      "policy.generation.colocated.resources.gpus_per_node=2"],
     "policy.generation.colocated.resources.gpus_per_node", "leaving the rest to training"),
    (["loss_fn.ratio_clip_c=0.5"], "loss_fn.ratio_clip_c", "c > 1"),
    (["loss_fn.reference_policy_kl_type=k4"], "loss_fn.reference_policy_kl_type", "must be one of"),
    (["policy.precision=fp8"], "policy.precision", "must be one of"),
    (["policy.generation.temperature=0"], "policy.generation.temperature", "must be > 0"),
    (["policy.generation.top_p=1.5"], "policy.generation.top_p", "(0, 1]"),
    (["policy._target_=os.system"], "policy._target_", "allow-list"),
    (["policy.optimizer.name=builtins.eval"], "policy.optimizer.name", "allow-list"),
    (["grpo.async_grpo.enabled=true"], "grpo.async_grpo.enabled", "needs the engine on its own workers"),
    (["grpo.async_grpo.enabled=true", *SPLIT], "loss_fn.use_importance_sampling_correction",
     "importance-sampling correction must be on"),
    (["grpo.async_grpo.enabled=true", *SPLIT, "loss_fn.use_importance_sampling_correction=true",
      "grpo.use_dynamic_sampling=true"], "grpo.use_dynamic_sampling", "not supported with async GRPO"),
    (["grpo.async_grpo.max_trajectory_age_steps=0"], "grpo.async_grpo.max_trajectory_age_steps", "must be > 0"),
    (["grpo.max_rollout_turns=0"], "grpo.max_rollout_turns", "must be > 0"),
    (["policy.dtensor_cfg.context_parallel_size=2", "cluster.gpus_per_node=2", "policy.sequence_packing.enabled=true"],
     "policy.dtensor_cfg.context_parallel_size", "does not work with sequence packing"),
    (["policy.dtensor_cfg.context_parallel_size=2", "cluster.gpus_per_node=2", "policy=dtensor_v2"],
     "policy.dtensor_cfg.context_parallel_size", "runs on policy=dtensor"),
    (["logger.swanlab_enabled=true"], "logger.swanlab_enabled", "not bundled"),
    (["logger.wandb.mode=sometimes"], "logger.wandb.mode", "online, offline, disabled or null"),
    (["checkpointing.metric_name=accuracy"], "checkpointing.metric_name", "'val:' or 'train:'"),
    (["policy.dtensor_cfg.sequence_parallel=true"], "policy.dtensor_cfg.sequence_parallel", "tensor_parallel_size > 1"),
    (["policy.generation.max_new_tokens=1000"], "policy.generation.max_new_tokens", "max_total_sequence_length"),
    (["data.env_name=math"], "data.env_name", "configured environment"),
    (["model.tiny.hidden_size=48"], "model.tiny.hidden_size", "head_dim"),
    (["model.tiny.num_experts=4"], "model.tiny.num_experts", "mixture-of-experts families"),
    (["model.tiny.architecture=mixtral", "model.tiny.num_experts_per_tok=5"], "model.tiny.num_experts_per_tok",
     "at most num_experts (4)"),
    (["model.tiny.architecture=qwen3_moe", "model.tiny.num_experts=0"], "model.tiny.num_experts", ">= 1"),
    (["model.tiny.sliding_window=4"], "model.tiny.sliding_window", "applies to gemma2 and gemma3_text"),
    (["model.tiny.architecture=gemma2", "model.tiny.sliding_window=0"], "model.tiny.sliding_window", ">= 1"),
    (["policy.scheduler=[{name:torch.optim.lr_scheduler.LinearLR},{name:torch.optim.lr_scheduler.ConstantLR}]"],
     "policy.scheduler", "milestones"),
    (["data=math_jsonl", "env=math"], "data.train_data_path", "needs a local train_data_path"),
    (["grpo.val_period=0"], "checkpointing.metric_name", "needs validation"),
    (["grpo.val_period=0", "grpo.val_at_start=true"], "checkpointing.metric_name", "needs validation during training"),
    (["grpo.num_generations_per_prompt=1"], "grpo.num_generations_per_prompt",
     "must be >= 2: the group baseline needs at least two samples per prompt"),
    (["policy.max_grad_norm=-1"], "policy.max_grad_norm", "must be > 0"),
    (["cluster.device=tpu"], "cluster.device", "must be one of"),
    (["cluster.object_store_memory_mb=1"], "cluster.object_store_memory_mb", "must be >= 75"),
    (["policy.optimizer.kwargs.lr=inf"], "policy.optimizer.kwargs.lr=inf", "must be a finite number"),
    (["policy.optimizer.kwargs.lr=nan"], "policy.optimizer.kwargs.lr=nan", "must be a finite number"),
    (["policy.optimizer.kwargs.lr=-1e-5"], "policy.optimizer.kwargs.lr=-1e-05", "must be a finite number > 0"),
    (["policy.optimizer.kwargs.eps=inf"], "policy.optimizer.kwargs.eps=inf", "must be a finite number"),
    (["policy=megatron", "policy.optimizer.kwargs.lr=inf"], "policy.optimizer.kwargs.lr=inf", "must be a finite"),
    (["policy=megatron", "policy.megatron_cfg.sequence_parallel=true"],
     "policy.megatron_cfg.sequence_parallel", "tensor_model_parallel_size > 1"),
    (["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=0"],
     "policy.dtensor_cfg.lora_cfg.dim", "must be > 0"),
    (["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
      "policy.dtensor_cfg.lora_cfg.target_modules=[q_prj]"],
     "policy.dtensor_cfg.lora_cfg.target_modules", "did you mean 'q_proj'"),
    (["policy.dtensor_cfg.lora_cfg.enabled=true",
      "policy.dtensor_cfg.lora_cfg.exclude_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"],
     "policy.dtensor_cfg.lora_cfg.exclude_modules", "leaves no linear layer to adapt"),
    (["algo=rm", "policy.dtensor_cfg.lora_cfg.enabled=true"], "policy.dtensor_cfg.lora_cfg.enabled",
     "not supported for a reward model"),
    (["policy=dtensor_v2", "cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2",
      "policy.dtensor_cfg.lora_cfg.enabled=true"], "policy.dtensor_cfg.lora_cfg.enabled", "policy=dtensor for LoRA"),
    (["policy=megatron", "policy.megatron_cfg.peft.enabled=true", "policy.megatron_cfg.peft.refit=adapter",
      "generation=hf"], "policy.megatron_cfg.peft.refit", "needs the vLLM engine"),
    (["policy=megatron", "policy.megatron_cfg.peft.enabled=true", "policy.megatron_cfg.peft.match_all_linear=false",
      "policy.megatron_cfg.peft.target_modules=[q_proj]"], "policy.megatron_cfg.peft.target_modules",
     "its linear layers are linear_qkv, linear_proj, linear_fc1, linear_fc2"),
    (["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.refit=fused"],
     "policy.dtensor_cfg.lora_cfg.refit", "must be one of merged, adapter"),
    (["generation=hf", "policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.refit=adapter"],
     "policy.dtensor_cfg.lora_cfg.refit", "needs the vLLM engine"),
    (["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.refit=adapter",
      "policy.dtensor_cfg.lora_cfg.dim=1024"], "policy.dtensor_cfg.lora_cfg.dim", "rank <= 512"),
    (["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.modules_to_save=[norm]"],
     "policy.dtensor_cfg.lora_cfg.modules_to_save", "the modules that can train in full are embed_tokens, lm_head"),
    (["experiment=tiny_lora", "policy.dtensor_cfg.lora_cfg.refit=adapter"],
     "policy.dtensor_cfg.lora_cfg.modules_to_save", "needs lora_cfg.refit=merged"),
    (["policy=megatron", "policy.megatron_cfg.converter_type=nope"], "policy.megatron_cfg.converter_type",
     "must be one of ['auto', 'Qwen2ForCausalLM'"),
    (["policy=megatron", "policy.megatron_cfg.peft.enabled=true", "policy.megatron_cfg.peft.modules_to_save=[wte]"],
     "policy.megatron_cfg.peft.modules_to_save", "the modules that can train in full are embed_tokens, lm_head"),
]


@pytest.mark.parametrize(("overrides", "key", "rule"), BAD, ids=[" ".join(b[0])[:60] for b in BAD])
def test_bad_config_exits_2_naming_key_and_rule(
    overrides: list[str], key: str, rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlpost: config error")
    assert key in err, err
    assert rule in err, err
    assert "Traceback" not in err


def test_at_least_twenty_distinct_bad_configs() -> None:
    assert len({b[1] + b[2] for b in BAD}) >= 20


def test_bad_multirun_job_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "-m", "policy.train_global_batch_size=256,96"]) == 2
    err = capsys.readouterr().err
    assert "policy.train_global_batch_size=96" in err and "must be a multiple" in err


def test_plan_rejects_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "policy.precision=fp8"]) == 2
    assert "policy.precision" in capsys.readouterr().err


def test_plan_reports_what_the_megatron_worker_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    # device-independent (validation) and CPU-only (the backend's device check) limits, both before any worker
    cp_pp = ["policy.megatron_cfg.context_parallel_size=2", "policy.megatron_cfg.pipeline_model_parallel_size=2"]
    assert main(["plan", "policy=megatron", "cluster.gpus_per_node=4", *cp_pp]) == 2
    assert ("policy.megatron_cfg.pipeline_model_parallel_size=2: is not supported with "
            "policy.megatron_cfg.context_parallel_size=2") in capsys.readouterr().err
    moe = ["model.tiny.architecture=qwen3_moe", "policy.megatron_cfg.context_parallel_size=2", "cluster.gpus_per_node=2"]
    assert main(["plan", "policy=megatron", *moe]) == 2
    assert "context parallelism on Megatron is for dense models" in capsys.readouterr().err
    gemma_cp = ["model.tiny.architecture=gemma2", "policy.megatron_cfg.context_parallel_size=2", "cluster.gpus_per_node=2"]
    assert main(["plan", "policy=megatron", *gemma_cp]) == 2
    assert ("policy.megatron_cfg.context_parallel_size=2: Gemma's attention on Megatron (soft-capped scores, sliding "
            "windows, RoPE per layer) reads whole sequences") in capsys.readouterr().err
    fsdp = "policy.megatron_cfg.distributed_data_parallel_config.use_custom_fsdp"
    assert main(["plan", "policy=megatron", "cluster.device=cpu", f"{fsdp}=true"]) == 2
    assert f"{fsdp}=True: megatron FSDP is GPU-only" in capsys.readouterr().err


def test_plan_of_the_default_job_imports_nothing_heavy() -> None:
    # the device is resolved (torch imported) only when a check depends on it
    code = ("import sys; from rlpost.cli import main; rc = main(['plan']);"
            "print(rc, sorted(m for m in ('torch', 'ray', 'vllm', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout + out.stderr


def test_bad_config_starts_nothing_heavy() -> None:
    code = (
        "import sys; from rlpost.cli import main; rc = main(['train', 'policy.train_global_batch_size=96']);"
        "print(rc, sorted(m for m in ('torch', 'ray', 'vllm', 'megatron', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert "Traceback" not in out.stderr


def _refusal(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_master_config(list(overrides))
    return e.value


@pytest.mark.parametrize(("override", "shown"), [
    ("grpo.max_num_stepz=5", "'5'"),
    ("+grpo.max_num_stepz=5", "5"),
    ("policy.dtensor_cfg.enabled=false", "'false'"),
])
def test_an_unknown_key_is_shown_with_the_value_typed(override: str, shown: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", override]) == 2
    key = override.lstrip("+").split("=")[0]
    assert f"rlpost: config error: {key}={shown}: unknown config key" in capsys.readouterr().err


@pytest.mark.parametrize(("override", "key", "rule"), [
    ("policy.max_total_sequence_length=${nope}", "policy.max_total_sequence_length",
     "interpolation ${nope} does not resolve: Interpolation key 'nope' not found"),
    ("model.path=${nope}/x", "model.path", "interpolation ${nope} does not resolve"),  # not the keys that refer to it
    ("grpo.seed=${oc.env:RLPOST_TEST_UNSET_VARIABLE}", "grpo.seed",
     "interpolation ${oc.env:RLPOST_TEST_UNSET_VARIABLE} does not resolve: \"Environment variable"),
    ("grpo.seed=${foo:1}", "grpo.seed", "interpolation ${foo:1} does not resolve: Unsupported interpolation type foo"),
])
def test_an_interpolation_that_does_not_resolve_is_one_line_naming_the_users_key(
    override: str, key: str, rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refusal(override)
    assert (err.key, err.value) == (key, override.split("=", 1)[1]) and err.rule.startswith(rule), str(err)
    assert main(["plan", override]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlpost: config error: {key}="), lines


def test_an_override_that_does_not_parse_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "policy.max_total_sequence_length=${nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlpost: config error: policy.max_total_sequence_length='${nope': cannot be parsed"), err


@pytest.mark.parametrize(("override", "key", "rule"), [
    ("policy.max_total_sequence_length=1024", "policy.max_total_sequence_length", "max_position_embeddings=256"),
    ("model.tiny.max_position_embeddings=8", "policy.max_total_sequence_length", "max_position_embeddings=8"),
    ("policy.generation.vllm_cfg.max_model_len=4", "policy.generation.vllm_cfg.max_model_len", "shorter than"),
    ("policy.generation.stop_token_ids=[999999]", "policy.generation.stop_token_ids", "outside the model's vocab"),
    ("cluster.min_call_timeout_s=5000", "cluster.min_call_timeout_s", "must be <= cluster.call_timeout_s"),
])
def test_what_the_model_and_the_timeouts_bound_is_refused_by_the_plan(override: str, key: str, rule: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by `rlpost plan` (and so before start-up): these failed only once the engine or the model started."""
    assert main(["plan", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlpost: config error: {key}=") and rule in err, err


@pytest.mark.parametrize(("overrides", "key"), [
    (["policy.megatron_cfg.pipeline_model_parallel_size=4", "cluster.gpus_per_node=4"],
     "policy.megatron_cfg.pipeline_model_parallel_size"),
    (["policy.megatron_cfg.pipeline_model_parallel_size=2", "cluster.gpus_per_node=2",
      "policy.megatron_cfg.num_layers_in_first_pipeline_stage=2"], "policy.megatron_cfg.num_layers_in_first_pipeline_stage"),
    (["model.tiny.num_layers=5", "policy.megatron_cfg.pipeline_model_parallel_size=2", "cluster.gpus_per_node=2"],
     "policy.megatron_cfg.pipeline_model_parallel_size"),
    (["model.tiny.num_layers=6", "policy.megatron_cfg.pipeline_model_parallel_size=3", "cluster.gpus_per_node=3",
      "policy.megatron_cfg.num_layers_in_first_pipeline_stage=1"], "policy.megatron_cfg.num_layers_in_first_pipeline_stage"),
])
def test_pipeline_stages_must_split_the_models_layers(overrides: list[str], key: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """These hung or failed inside megatron-core at start-up; the plan refuses them."""
    assert main(["plan", "policy=megatron", *overrides]) == 2
    assert capsys.readouterr().err.startswith(f"rlpost: config error: {key}=")
    assert main(["plan", "policy=megatron", "model.tiny.num_layers=6", "policy.megatron_cfg.pipeline_model_parallel_size=3",
                 "cluster.gpus_per_node=3", "policy.megatron_cfg.num_layers_in_first_pipeline_stage=2"]) == 0


def test_a_checkpoint_moved_aside_as_corrupt_is_not_evaluated(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "eval.checkpoint=/runs/r/checkpoints/corrupt_step_2"]) == 2
    assert "was moved aside as corrupt" in capsys.readouterr().err


def test_eval_samples_are_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "eval.num_samples=1000000"]) == 2
    assert "eval.num_samples=1000000: must be in [1, 1024]" in capsys.readouterr().err


@pytest.mark.parametrize(("override", "line"), [
    ("polcy.x=1", "polcy.x='1': unknown config key"),
    ("policy.dtensor_cfg.activation_checkpointing=maybe",
     "policy.dtensor_cfg.activation_checkpointing='maybe': must be true or false"),
    ("policy.generation.stop_token_ids=abc", "policy.generation.stop_token_ids='abc': must be a list, e.g. [1, 2]"),
    ("~policy.max_total_sequence_length", "policy.max_total_sequence_length=None: is a key of the schema: it cannot "
                                         "be removed with ~, only set"),
])
def test_omegaconfs_errors_read_as_one_rule(override: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Were `polcy=None`, or four lines of OmegaConf's (full_key, reference_type, object_type)."""
    assert main(["plan", override]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"rlpost: config error: {line}", err
    assert "full_key" not in err and "reference_type" not in err
