"""Light Ray actors for the scheduling tests on logical GPUs (`ray start --num-gpus=N` on a CPU machine): each says
what Ray gave it. `ExecutorLeader` asks for its workers exactly what vLLM's Ray executor asks for."""

from __future__ import annotations

import os
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class GpuProbe:
    """A worker-group or engine actor that only reports its placement."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def seen(self) -> dict[str, Any]:
        """Ray's GPU ids and resources for this actor, and the environment a worker reads at start."""
        ctx = ray.get_runtime_context()
        return {
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "resources": ctx.get_assigned_resources(),
            "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "local_rank": os.environ.get("LOCAL_RANK"),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "node": ctx.get_node_id(),
        }


class ExecutorLeader(GpuProbe):
    """A replica leader that starts its TP workers as vLLM's Ray executor does (vllm/v1/executor/ray_executor.py
    `_init_workers_ray`, CUDA platform): one actor per bundle of VLLM_RAY_BUNDLE_INDICES, in the leader's placement
    group (`ray.util.get_current_placement_group()`, as `initialize_ray_cluster` finds it), each with num_cpus=0,
    num_gpus=VLLM_RAY_PER_WORKER_GPUS and RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1. The variables are read with
    vLLM's own parser (`vllm.envs`)."""

    def start_workers(self, timeout_s: float) -> dict[str, Any]:
        import vllm.envs as envs

        num_gpus = envs.VLLM_RAY_PER_WORKER_GPUS
        bundles = list(map(int, envs.VLLM_RAY_BUNDLE_INDICES.split(",")))
        pg = ray.util.get_current_placement_group()
        assert pg is not None, "the leader must run in its placement group, capturing child tasks"
        self.workers: list[Any] = [
            ray.remote(
                num_cpus=0,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=b
                ),
                runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            )(GpuProbe).remote()
            for b in bundles
        ]
        futures = [w.seen.remote() for w in self.workers]
        ready, _ = ray.wait(futures, num_returns=len(futures), timeout=timeout_s)
        return {
            "per_worker_gpus": num_gpus,
            "bundles": bundles,
            "scheduled": len(ready),
            "workers": ray.get(futures, timeout=1) if len(ready) == len(futures) else [],
        }

    def stop_workers(self) -> None:
        for w in getattr(self, "workers", []):
            ray.kill(w, no_restart=True)
        self.workers = []
