"""The GPU path end to end, as `rlpost train` runs it on CUDA: an engine woken from sleep with no refit due, the async
engine's CUDA IPC refit, the start-up order at a model that fills a GPU, and on two GPUs the per-GPU colocated refit,
vLLM TP=2 beside the policy, FSDP2 over NCCL and the split engine's NCCL refit. Each run is bounded by its call
timeouts, so a hang fails in minutes. `bash scripts/gpu_check.sh` runs these on a device machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]
pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
BOUNDED = ["cluster.device=cuda", "cluster.call_timeout_s=300", "cluster.min_call_timeout_s=120",
           "checkpointing=disabled"]
"""Every run here: CUDA, and a call that hangs (a sleeping engine, an unschedulable worker) fails within minutes."""


def _train(tmp_path: Path, *overrides: str, timeout: float = 420) -> list[dict[str, float]]:
    """Run `rlpost train` on CUDA; its metrics rows (the run must succeed)."""
    pytest.importorskip("vllm")
    rlpost = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
    env = {**os.environ, "RLPOST_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([rlpost, "train", f"hydra.run.dir={tmp_path}/run", *BOUNDED, *overrides], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def _steps(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [m for m in rows if "train/token_mult_prob_error" in m]


@pytest.mark.gpu
def test_a_validated_engine_is_woken_for_the_next_step(tmp_path: Path) -> None:
    """F1: validation at steps 0 and 2 leaves the colocated engine asleep with no refit due for steps 1 and 3; it is
    woken all the same (dynamic sampling's further batches too), and stays on policy."""
    rows = _train(tmp_path, "grpo.max_num_steps=4", "grpo.val_period=2", "grpo.val_at_start=true",
                  "grpo.use_dynamic_sampling=true")
    steps = _steps(rows)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(m["train/token_mult_prob_error"] <= 1.01 for m in steps), steps
    assert [m["step"] for m in rows if "validation/accuracy" in m] == [0, 2, 4]


@pytest.mark.gpu
def test_the_async_engine_refits_over_cuda_ipc(tmp_path: Path) -> None:
    """F7: AsyncLLM's RPC carries each bucket's CUDA IPC descriptor to its engine core (several buckets: a small
    refit buffer)."""
    steps = _steps(_train(tmp_path, "policy.generation.vllm_cfg.async_engine=true", "grpo.max_num_steps=3",
                          "grpo.val_period=2", "policy.refit_buffer_size_gb=0.0005"))
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["train/token_mult_prob_error"] <= 1.01 for m in steps), steps


@pytest.mark.gpu
def test_a_model_that_fills_the_gpu_starts_engine_first(tmp_path: Path) -> None:
    """F2: a random-init model of 1.5B parameters (Qwen2 shape) with AdamW in bf16 beside a colocated vLLM taking
    half the GPU: the engine starts and sleeps before the policy allocates, so both fit, and the KV cache is sized
    from an empty GPU."""
    shape = ["model.tiny.hidden_size=2048", "model.tiny.num_layers=24", "model.tiny.num_attention_heads=16",
             "model.tiny.num_key_value_heads=4", "model.tiny.intermediate_size=8192",
             "policy.generation.vllm_cfg.gpu_memory_utilization=0.5"]
    steps = _steps(_train(tmp_path, *shape, "grpo.max_num_steps=2", "grpo.val_period=0", "logger.monitor_gpus=true",
                          timeout=580))
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["train/token_mult_prob_error"] <= 1.05 for m in steps), steps


@pytest.mark.gpu2
@pytest.mark.parametrize("layout", [
    # DP=2 over NCCL (FSDP2), two colocated replicas: each reads the refit buffer of the policy rank on its own GPU
    ["cluster.gpus_per_node=2"],
    # F5: one vLLM TP=2 replica whose Ray workers take the engine's share of both GPUs beside the policy
    ["cluster.gpus_per_node=2", "policy.generation.vllm_cfg.tensor_parallel_size=2"],
    # the split engine: the NCCL refit group between the policy's rank 0 and the engine
    ["cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
     "policy.generation.colocated.resources.gpus_per_node=1"],
], ids=["per-gpu-refit", "vllm-tp2-colocated", "split-nccl-refit"])
def test_two_gpu_layouts_train_on_policy(tmp_path: Path, layout: list[str]) -> None:
    steps = _steps(_train(tmp_path, *layout, "grpo.max_num_steps=3", "grpo.val_period=2"))
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["train/token_mult_prob_error"] <= 1.01 for m in steps), steps
