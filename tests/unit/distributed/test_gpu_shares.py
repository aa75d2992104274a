"""The per-actor shares a RayVirtualCluster hands out: compute threads beside a GPU, and the device kept apart from
the GPU reservation."""

from __future__ import annotations

import pytest

from rlpost.distributed.virtual_cluster import RayVirtualCluster, thread_env, worker_threads


@pytest.mark.parametrize(("cpus", "slots", "colocated", "threads"), [
    (128, 8, 2, 8),   # an 8-GPU node, policy and engine on every GPU
    (128, 8, 1, 16),  # split placement: one actor a GPU
    (16, 1, 2, 8),    # one GPU, colocated
    (4, 8, 2, 1),     # fewer cores than actors: never below one
    (7.5, 2, 1, 3),   # a fractional CPU count rounds down
])
def test_actor_beside_a_gpu_gets_a_fair_share_of_the_node(cpus: float, slots: int, colocated: int,
                                                          threads: int) -> None:
    assert worker_threads(cpus, slots, colocated) == threads
    assert thread_env(threads) == {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def test_cpu_cluster_keeps_one_thread_a_process() -> None:
    """On CPU the cores are the compute, shared by every worker: WORKER_ENV's single thread stays (no override)."""
    assert RayVirtualCluster("cpu", 2).thread_env(0) == {}
    assert RayVirtualCluster("logical", 2, use_gpus=True, device="cpu").thread_env(1) == {}


def test_device_follows_the_gpu_reservation_unless_given() -> None:
    assert RayVirtualCluster("a", 1).device == "cpu"
    assert RayVirtualCluster("b", 1, use_gpus=True).device == "cuda"
    logical = RayVirtualCluster("c", 1, use_gpus=True, max_colocated_worker_groups=2, device="cpu")
    assert (logical.device, logical.bundle(), logical.gpu_share()) == ("cpu", {"CPU": 0.5, "GPU": 1.0}, 0.5)
    assert RayVirtualCluster("d", 1).gpu_share() == 0.0
    with pytest.raises(ValueError, match="a CUDA cluster reserves GPUs"):
        RayVirtualCluster("e", 1, device="cuda")
