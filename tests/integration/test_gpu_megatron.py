"""Megatron on GPUs with the CUDA defaults (bf16 from policy.precision, the distributed optimizer when DP > 1): the
memory phases around a colocated engine, a bf16 PPO critic, and NCCL data / tensor parallelism. Marked `gpu` (one
GPU) or `gpu2` (two) and `slow`: skipped without them; `bash scripts/gpu_check.sh` runs them on a device machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow]
pytest.importorskip("ray")  # the workers run as Ray actors

from tests.integration.test_gpu import _policy  # noqa: E402

N, S = 16, 12


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model wide enough (about 10M parameters) that its weights, gradients and Adam state dwarf the CUDA
    context's own allocations (cuBLAS workspaces)."""
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.models.tiny import ensure_tiny_model

    cfg = TinyModelConfig(hidden_size=512, num_layers=4, num_attention_heads=8, num_key_value_heads=8,
                          intermediate_size=1024)
    return ensure_tiny_model(cfg, tmp_path_factory.mktemp("models") / "wider")


def _batch(seed: int = 0) -> object:
    from rlpost.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    return BatchedDataDict(input_ids=torch.randint(3, 300, (N, S), generator=g), input_lengths=torch.full((N,), S),
                           token_mask=torch.ones(N, S), sample_mask=torch.ones(N),
                           advantages=torch.randn(N, 1, generator=g).expand(N, S).clone(),
                           generation_logprobs=torch.zeros(N, S))


def _pg_loss() -> object:
    from rlpost.config.schema.loss import ClippedPGLossConfig
    from rlpost.losses.clipped_pg import ClippedPGLossFn

    return ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))


@pytest.mark.gpu
def test_megatron_offload_after_refit_frees_the_gpu_and_restores_it(ray_local: None, wider_model_dir: Path) -> None:
    """After a step, offload_before_refit + offload_after_refit (what runs while a colocated vLLM generates) leave
    under a quarter of the trained rank's allocation on the GPU: parameters, the fp32 gradient buffer, the fp32 main
    params and Adam's state all went to the host. The next logprob pass brings the model back with the same
    numbers, and the next step trains."""
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.policy.lm_policy import Policy

    cluster = RayVirtualCluster("gpu-mg-mem", 1, use_gpus=True, cpus_per_bundle=1.0)
    policy = Policy(cluster, _policy(wider_model_dir, "policy=megatron"), device="cuda")
    try:
        data = _batch()
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
        policy.train(data, _pg_loss())
        before = policy.get_logprobs(data)["logprobs"]
        trained = policy.gpu_memory_metrics()["gpu/rank0/memory_allocated_gb"]
        policy.offload_before_refit()
        policy.offload_after_refit()
        offloaded = policy.gpu_memory_metrics()["gpu/rank0/memory_allocated_gb"]
        assert offloaded < 0.25 * trained, (offloaded, trained)
        torch.testing.assert_close(policy.get_logprobs(data)["logprobs"], before)
        policy.prepare_for_training()
        out = policy.train(data, _pg_loss())
        assert torch.isfinite(torch.tensor(out.loss)) and out.grad_norm > 0
    finally:
        policy.shutdown()
        cluster.shutdown()


@pytest.mark.gpu
def test_bf16_megatron_critic_learns(ray_local: None, tiny_model_dir: Path) -> None:
    """PPO's critic on Megatron in bf16 (Float16Module, the mixed-precision optimizer): the value head reads the bf16
    hidden states, and a few steps fit fixed returns."""
    from rlpost.algorithms.side_groups import with_lr
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.losses.value import ClippedValueLossFn
    from rlpost.models.policy.lm_policy import Policy

    cfg = dataclasses.replace(_policy(tiny_model_dir, "policy=megatron", "policy.precision=bfloat16"),
                              value_head=True, generation=None)
    cluster = RayVirtualCluster("gpu-mg-critic", 1, use_gpus=True, cpus_per_bundle=1.0)
    critic = Policy(cluster, with_lr(cfg, 1e-3), device="cuda", init_reference_model=False)
    try:
        data = _batch(1)
        values = critic.get_values(data)["values"]
        assert values.shape == (N, S) and torch.isfinite(values).all()
        data["values"] = values
        data["returns"] = torch.rand(N, generator=torch.Generator().manual_seed(2))[:, None].expand(N, S).clone()
        losses = [critic.train(data, ClippedValueLossFn(None)).loss for _ in range(10)]
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        critic.shutdown()
        cluster.shutdown()


@pytest.mark.gpu2
@pytest.mark.parametrize(("model", "layout"), [
    ("tiny_model_dir", ["policy.megatron_cfg.tensor_model_parallel_size=1"]),
    ("tiny_model_dir", ["policy.megatron_cfg.tensor_model_parallel_size=2"]),
    ("moe_model_dir", ["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=true"]),
    ("moe_model_dir", ["policy.megatron_cfg.expert_model_parallel_size=2"]),
    ("tiny_model_dir", ["policy.megatron_cfg.context_parallel_size=2"]),
], ids=["dp2", "tp2", "moe_tp2_sp", "moe_ep2", "cp2"])
def test_megatron_trains_over_two_gpus(ray_local: None, request: pytest.FixtureRequest, model: str,
                                       layout: list[str]) -> None:
    """Two ranks over NCCL with the CUDA defaults: DP=2 (the distributed optimizer; the loss, metrics and counts are
    all-reduced over the NCCL data-parallel group), TP=2 (vocabulary-parallel logprobs), and a mixture of experts at
    TP=2 with sequence parallelism (what megatron-core needs to train experts under TP, and what the CPU's local
    layer spec cannot run) and at EP=2, and CP=2 (rlpost's context-parallel attention in Transformer Engine's layer
    spec, its gathers over NCCL). A step and an eval pass finish, and the step changes the logprobs."""
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.policy.lm_policy import Policy

    cluster = RayVirtualCluster("gpu2-mg", 2, use_gpus=True, cpus_per_bundle=1.0)
    policy = Policy(cluster, _policy(request.getfixturevalue(model), "policy=megatron", "cluster.gpus_per_node=2",
                                     *layout), device="cuda")
    try:
        data = _batch(3)
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
        evaluated = policy.train(data, _pg_loss(), eval_mode=True)
        out = policy.train(data, _pg_loss())
        assert torch.isfinite(torch.tensor([out.loss, evaluated.loss])).all() and out.grad_norm > 0
        after = policy.get_logprobs(data)["logprobs"]
        assert torch.isfinite(after).all() and not torch.equal(after, data["prev_logprobs"])
    finally:
        policy.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE (four experts, two per token)."""
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.models.tiny import ensure_tiny_model

    return ensure_tiny_model(TinyModelConfig(architecture="qwen3_moe"), tmp_path_factory.mktemp("models") / "moe")

