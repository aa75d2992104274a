"""GPU paths (nccl, bf16, Megatron's mixed-precision/distributed optimizer, CUDA vLLM, the colocated refit over
CUDA IPC). Marked `gpu`: skipped without an NVIDIA GPU; `bash scripts/gpu_check.sh` runs every GPU check on a
device machine."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
pytest.importorskip("ray")  # every check here runs the workers as Ray actors (scripts/gpu_check.sh skips them)

REPO = Path(__file__).resolve().parents[2]


def _policy(model_dir: Path, *overrides: str):  # noqa: ANN202
    from rlpost.config.load import load_master_config

    _, cfg = load_master_config(["grpo.num_prompts_per_step=2", "policy.train_global_batch_size=16",
                                 "policy.train_micro_batch_size=8", "cluster.device=cuda", *overrides])
    p = dataclasses.replace(cfg.policy, model_name=str(model_dir))
    p.tokenizer.name = str(model_dir)
    return p


def random_batch(n: int = 16, s: int = 12):  # noqa: ANN201
    """A training batch of `n` random sequences of `s` tokens with random advantages."""
    from rlpost.distributed.batched_data_dict import BatchedDataDict

    return BatchedDataDict(input_ids=torch.randint(3, 300, (n, s)), input_lengths=torch.full((n,), s),
                           token_mask=torch.ones(n, s), sample_mask=torch.ones(n),
                           advantages=torch.randn(n, 1).expand(n, s).clone(), generation_logprobs=torch.zeros(n, s))


def train_one_step(policy) -> None:  # noqa: ANN001
    """A logprob pass and one clipped-PG step on a random batch; the loss is finite and gradients flowed."""
    from rlpost.config.schema.loss import ClippedPGLossConfig
    from rlpost.losses.clipped_pg import ClippedPGLossFn

    data = random_batch()
    data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    out = policy.train(data, ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)))
    assert torch.isfinite(torch.tensor(out.loss)) and out.grad_norm > 0


@pytest.mark.parametrize("backend", ["dtensor", "megatron", "dtensor-lora", "megatron-lora"])
def test_bf16_training_step_on_gpu(ray_local: None, tiny_model_dir: Path, backend: str) -> None:
    """A bf16 step on each backend; with LoRA the adapters are bf16 beside the frozen base (megatron: in its
    Float16Module and distributed optimizer, which then hold the adapters alone)."""
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.policy.lm_policy import Policy

    extra = ["policy.precision=bfloat16"]
    if backend.startswith("megatron"):
        extra += ["policy=megatron", "policy.megatron_cfg.optimizer.bf16=true",
                  "policy.megatron_cfg.optimizer.use_distributed_optimizer=true"]
    if backend.endswith("lora"):
        extra += ["policy.megatron_cfg.peft.enabled=true" if backend.startswith("megatron")
                  else "policy.dtensor_cfg.lora_cfg.enabled=true"]
    cluster = RayVirtualCluster("gpu", 1, use_gpus=True, cpus_per_bundle=1.0)
    policy = Policy(cluster, _policy(tiny_model_dir, *extra), device="cuda")
    try:
        train_one_step(policy)
    finally:
        policy.shutdown()
        cluster.shutdown()


@pytest.mark.parametrize("lora", [[], ["policy.dtensor_cfg.lora_cfg.enabled=true",
                                        "policy.dtensor_cfg.lora_cfg.refit=adapter"]], ids=["full", "lora-adapter"])
def test_grpo_on_gpu_with_cuda_vllm(tmp_path: Path, lora: list[str]) -> None:
    """The default job on CUDA vLLM; with LoRA the engine serves the adapter (CUDA IPC carries its bytes)."""
    pytest.importorskip("vllm")
    rlpost = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
    env = {**os.environ, "RLPOST_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([rlpost, "train", f"hydra.run.dir={tmp_path}/run", "cluster.device=cuda",
                          "grpo.max_num_steps=3", "grpo.val_period=0", "checkpointing=disabled", *lora],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(m["train/token_mult_prob_error"] <= 1.001 for m in lines)


def test_dtensor_memory_phases_free_the_gpu_and_restore_it(ray_local: None, tiny_model_dir: Path) -> None:
    """offload_before_refit / offload_after_refit move the optimizer state and then the model off the GPU; the
    next logprob pass and training step bring them back with the same numbers (issue #11 §4)."""
    from rlpost.config.schema.loss import ClippedPGLossConfig
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.losses.clipped_pg import ClippedPGLossFn
    from rlpost.models.policy.lm_policy import Policy

    cluster = RayVirtualCluster("gpu-mem", 1, use_gpus=True, cpus_per_bundle=1.0)
    policy = Policy(cluster, _policy(tiny_model_dir, "policy.offload_optimizer_for_logprob=true"), device="cuda")
    try:
        data = random_batch()
        loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
        policy.train(data, loss_fn)
        before = policy.get_logprobs(data)["logprobs"]
        trained = policy.gpu_memory_metrics()["gpu/rank0/memory_allocated_gb"]
        policy.offload_before_refit()
        policy.offload_after_refit()
        offloaded = policy.gpu_memory_metrics()["gpu/rank0/memory_allocated_gb"]
        assert offloaded < trained, (offloaded, trained)
        policy.prepare_for_lp_inference()
        torch.testing.assert_close(policy.get_logprobs(data)["logprobs"], before)
        policy.prepare_for_training()
        out = policy.train(data, loss_fn)
        assert torch.isfinite(torch.tensor(out.loss))
    finally:
        policy.shutdown()
        cluster.shutdown()


def test_the_memory_plan_is_within_15_percent_of_cuda_max_memory_allocated(ray_local: None, tmp_path: Path) -> None:
    """The plan's policy estimate (its peak phase, less the CUDA context, which the allocator does not count) against
    torch.cuda.max_memory_allocated after a logprob pass and two bf16 AdamW steps (the optimizer's states exist
    from the first) on a 0.1B-parameter model, every row of the full length the plan counts."""
    from rlpost.config.load import load_master_config
    from rlpost.config.memory.estimate import estimate, worker_peak
    from rlpost.config.memory.workers import GIB
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.policy.lm_policy import Policy
    from rlpost.models.tiny import ensure_tiny_model

    _, cfg = load_master_config([
        "cluster.device=cuda", "cluster.gpus_per_node=1", f"model.cache_dir={tmp_path}", "model.tiny.hidden_size=768",
        "model.tiny.num_layers=12", "model.tiny.num_attention_heads=12", "model.tiny.num_key_value_heads=4",
        "model.tiny.intermediate_size=2048", "model.tiny.vocab_size=32000", "model.tiny.max_position_embeddings=512",
        "policy.max_total_sequence_length=512", "policy.dynamic_batching.enabled=false",
        "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=4", "policy.logprob_batch_size=4"])
    assert cfg.model.tiny is not None
    ensure_tiny_model(cfg.model.tiny, cfg.model.path)
    est = estimate(cfg)
    assert est is not None
    phase, items = worker_peak(next(w for w in est.workers if w.group == "policy"))
    expected = (sum(items.values()) - items["runtime"]) / GIB
    cluster = RayVirtualCluster("gpu-plan", 1, use_gpus=True, cpus_per_bundle=1.0)
    policy = Policy(cluster, cfg.policy, device="cuda")
    try:
        from rlpost.config.schema.loss import ClippedPGLossConfig
        from rlpost.losses.clipped_pg import ClippedPGLossFn

        data = random_batch(16, 512)
        data["input_ids"] = torch.randint(3, 400, (16, 512))
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
        loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
        for _ in range(2):
            policy.train(data, loss_fn)
        measured = policy.gpu_memory_metrics()["gpu/rank0/max_memory_allocated_gb"]
    finally:
        policy.shutdown()
        cluster.shutdown()
    print(f"memory plan ({phase}) {expected:.3f} GiB, max_memory_allocated {measured:.3f} GiB, "
          f"ratio {expected / measured:.3f}")
    assert 0.85 <= expected / measured <= 1.15, (phase, items, measured)
