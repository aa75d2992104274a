"""Derived numbers (`rlpost plan`) and the cross-field rules behind them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpost.config.errors import ConfigError
from rlpost.config.layout import compute_layout
from rlpost.config.load import load_master_config
from rlpost.plan import plan_rows


def test_default_layout() -> None:
    _, cfg = load_master_config([])
    lay = compute_layout(cfg)
    assert (lay.dp, lay.tp, lay.pp, lay.cp) == (1, 1, 1, 1)
    assert lay.completions_per_step == 256
    assert lay.optimizer_steps_per_grpo_step == 1
    assert lay.micro_batches_per_optimizer_step == 4
    assert lay.colocated and lay.train_world == 1 and lay.gen_world == 1


def test_layout_with_tp_dp_and_split() -> None:
    _, cfg = load_master_config([
        "cluster.gpus_per_node=8",
        "policy.dtensor_cfg.tensor_parallel_size=2",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.gpus_per_node=4",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=8",
    ])
    lay = compute_layout(cfg)
    assert lay.train_world == 4 and lay.gen_world == 4
    assert (lay.dp, lay.tp) == (2, 2)
    assert lay.optimizer_steps_per_grpo_step == 8  # 256 completions / global batch 32
    assert lay.micro_batches_per_optimizer_step == 2
    assert not lay.colocated
    rows = dict(plan_rows(cfg))
    assert rows["training layout"] == "DP=2 TP=2 PP=1 CP=1 (4 workers); FSDP2"
    assert "split" in rows["placement"]
    assert rows["generation and training"].startswith("one after the other")


ASYNC = ["grpo.async_grpo.enabled=true", "cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
         "policy.generation.colocated.resources.gpus_per_node=1", "loss_fn.use_importance_sampling_correction=true"]


def test_plan_explains_async_grpo() -> None:
    _, cfg = load_master_config([*ASYNC, "grpo.async_grpo.max_trajectory_age_steps=2"])
    rows = dict(plan_rows(cfg))
    assert rows["generation and training"] == ("overlapped (async GRPO): batches at most 2 policy version(s) old; "
                                               "refit at the engine's next batch boundary, from a copy staged after "
                                               "each update (the trainer does not wait)")
    assert rows["prev-logprobs pass"].startswith("skipped: one optimizer step per batch")
    _, two_steps = load_master_config([*ASYNC, "policy.train_global_batch_size=128"])
    assert dict(plan_rows(two_steps))["prev-logprobs pass"].startswith("computed: several optimizer steps")


def test_megatron_pp_layout() -> None:
    _, cfg = load_master_config([
        "policy=megatron",
        "cluster.gpus_per_node=4",
        "policy.megatron_cfg.pipeline_model_parallel_size=2",
        "policy.train_micro_batch_size=16",
    ])
    lay = compute_layout(cfg)
    assert (lay.dp, lay.tp, lay.pp) == (2, 1, 2)
    assert lay.micro_batches_per_optimizer_step == 8  # 256 / (16 x DP 2)


@pytest.mark.parametrize(
    ("text", "rule"),
    [('{"model_type": "qwen2",\n  "num_attention_heads": 2,,\n}', "config.json: not valid JSON at line 2 column 28"),
     ("[1, 2]", "config.json: expected a JSON object, got list")],
    ids=["garbage", "list"],
)
def test_unreadable_model_config_json_names_the_file(tmp_path: Path, text: str, rule: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_master_config(["model.tiny=null", f"model.path={tmp_path}"])
    assert e.value.key == "model.path" and f"{tmp_path}/{rule}" in e.value.rule, str(e.value)


def test_plan_says_when_one_rank_trains_without_fsdp() -> None:
    """One fp32 rank trains unwrapped (rlpost.config.layout.fsdp_needed); bf16 compute or a second rank keep FSDP2;
    Megatron has no such row."""
    rows = dict(plan_rows(load_master_config([])[1]))
    assert rows["training layout"] == "DP=1 TP=1 PP=1 CP=1 (1 workers); one fp32 rank: trained unwrapped, no FSDP2"
    bf16 = dict(plan_rows(load_master_config(["policy.precision=bfloat16", "cluster.device=cuda"])[1]))
    assert bf16["training layout"].endswith("; FSDP2")
    two = dict(plan_rows(load_master_config(["cluster.gpus_per_node=2", "policy.train_micro_batch_size=8"])[1]))
    assert two["training layout"] == "DP=2 TP=1 PP=1 CP=1 (2 workers); FSDP2"
    meg = dict(plan_rows(load_master_config(["policy=megatron"])[1]))
    assert meg["training layout"] == "DP=1 TP=1 PP=1 CP=1 (1 workers)"


SPLIT = ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
         "policy.generation.colocated.resources.gpus_per_node=1"]


def test_a_split_engine_overlaps_generation_and_training_in_chunks_of_whole_groups() -> None:
    _, cfg = load_master_config(SPLIT)
    lay = compute_layout(cfg)
    assert (lay.overlap_chunk, lay.overlap_reason) == (64, "")  # lcm(16 per group, micro-batch 64 x DP 1)
    assert dict(plan_rows(cfg))["generation and training"].startswith("overlapped within the step: the policy")
    _, dp2 = load_master_config(["cluster.gpus_per_node=4", "policy.generation.colocated.enabled=false",
                                 "policy.generation.colocated.resources.gpus_per_node=2",
                                 "policy.train_micro_batch_size=48", "policy.train_global_batch_size=384",
                                 "grpo.num_prompts_per_step=24"])
    assert compute_layout(dp2).overlap_chunk == 96  # lcm(16, 48 x 2): whole groups, one micro-batch per rank
    _, megatron = load_master_config([*SPLIT, "policy=megatron"])
    assert compute_layout(megatron).overlap_chunk == 64  # the Megatron workers train in parts too


def test_a_colocated_engine_never_overlaps_and_asking_for_it_is_refused() -> None:
    _, cfg = load_master_config([])
    lay = compute_layout(cfg)
    assert lay.overlap_chunk == 0 and "the engine is colocated" in lay.overlap_reason
    assert "the engine is colocated" in dict(plan_rows(cfg))["generation and training"]
    with pytest.raises(ConfigError) as err:
        load_master_config(["grpo.overlap_generation_and_training=true"])
    assert err.value.key == "grpo.overlap_generation_and_training" and "the engine is colocated" in str(err.value)


@pytest.mark.parametrize(("overrides", "why"), [
    (["grpo.overlap_generation_and_training=false"], "grpo.overlap_generation_and_training=false"),
    (ASYNC, "async GRPO overlaps whole batches"),
    (["policy=megatron", "policy.megatron_cfg.distributed_data_parallel_config.overlap_grad_reduce=true"],
     "Megatron's overlapped gradient reduce"),
    (["policy.train_global_batch_size=128"], "is 2 optimizer steps"),
    (["loss_fn.force_on_policy_ratio=false", "loss_fn.reference_policy_kl_penalty=0.01"],
     "the reference-logprobs pass"),
    (["grpo.use_dynamic_sampling=true"], "dynamic sampling"),
    (["policy.train_micro_batch_size=256"], "not two or more chunks"),
])
def test_overlap_applies_only_where_it_is_exact(overrides: list[str], why: str) -> None:
    _, cfg = load_master_config([*SPLIT, *overrides] if overrides != ASYNC else ASYNC)
    lay = compute_layout(cfg)
    assert lay.overlap_chunk == 0 and why in lay.overlap_reason
    if not cfg.grpo.async_grpo.enabled:  # async GRPO's row describes its own overlap
        assert why in dict(plan_rows(cfg))["generation and training"]


def test_overlap_forced_on_where_it_does_not_apply_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_master_config([*SPLIT, "grpo.overlap_generation_and_training=true", "grpo.use_dynamic_sampling=true"])
    assert err.value.key == "grpo.overlap_generation_and_training"
    assert "dynamic sampling" in str(err.value)


@pytest.mark.parametrize(("overrides", "transport"), [
    ([], "ipc"),
    (["cluster.num_nodes=2"], "object_store"),
    (SPLIT, "collective"),
    (ASYNC, "collective"),
])
def test_the_layout_names_one_of_three_refit_transports(overrides: list[str], transport: str) -> None:
    _, cfg = load_master_config(overrides)
    assert compute_layout(cfg).refit == transport
    assert dict(plan_rows(cfg))["refit"].startswith(f"{transport}: ")


def test_no_plan_row_describes_two_designs() -> None:
    """The plan describes the run as one design: no row says what happens on a CPU and, differently, on a GPU."""
    for overrides in ([], SPLIT, ASYNC, ["cluster.device=cpu"], ["cluster.device=cuda"]):
        _, cfg = load_master_config(overrides)
        for label, value in plan_rows(cfg):
            assert not ("on CPU" in value and "on a GPU" in value), (overrides, label, value)
            assert "on the CPU" not in value and "(on CPU)" not in value, (overrides, label, value)


@pytest.mark.parametrize("override", ["policy.generation.colocated.same_process=false",
                                      "grpo.prefetch_generation=true"])
def test_a_removed_key_is_refused_naming_what_replaces_it(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_master_config([override])
    assert err.value.key == key and "was removed" in err.value.rule
    assert ("async_grpo" in err.value.rule) if "prefetch" in key else ("docs/backends.md" in err.value.rule)


def test_the_plan_says_whether_a_run_is_reproducible() -> None:
    rows = dict(plan_rows(load_master_config([])[1]))
    assert rows["reproducible"].startswith("yes: the same command (seed 42)")
    async_grpo = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                  "cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
                  "policy.generation.colocated.resources.gpus_per_node=1"]
    assert dict(plan_rows(load_master_config(async_grpo)[1]))["reproducible"].startswith("no: ")
    cuda = ["cluster.device=cuda", "policy.precision=float32"]
    assert dict(plan_rows(load_master_config(cuda)[1]))["reproducible"].startswith("not bit for bit on CUDA")
