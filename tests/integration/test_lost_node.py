"""rlpost.distributed.worker_groups on a real two-node Ray cluster on this machine: when a peer's node is lost, the
error a surviving rank raises (its collective sees the connection close, often before Ray reports the peer dead) is
named as the lost node and what it held, not as that rank's own failure."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlpost.distributed.ports import free_port
from rlpost.distributed.worker_groups import ActorGroup, WorkerGroupError
from tests.integration.ray_nodes import RayNode, head, wait_for, wait_nodes, worker

pytestmark = pytest.mark.slow


@ray.remote(num_cpus=0)
class Rank:
    def node(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def collective(self) -> None:
        raise RuntimeError("Connection closed by peer")  # what gloo raises on a rank whose peer is gone


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_peer_rank_failing_after_a_node_is_lost_names_the_node(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    port = free_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    nodes: list[RayNode] = [head(port, env, tmp_path / "head.log")]
    try:
        nodes.append(worker(address, "127.0.0.2", env, tmp_path / "node2.log"))
        wait_nodes(address, 2, env)
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address=address, logging_level="WARNING")
        ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        second = ids["127.0.0.2"]
        first = next(node for ip, node in ids.items() if ip != "127.0.0.2")
        ranks = [Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                 for node in (first, second)]
        group = ActorGroup(ranks, "rank", timeout_s=60)
        pids = []
        for i, rank in enumerate(ranks):
            node, pid = group.get([rank.node.remote()], indices=[i])[0]
            assert node == (first, second)[i]
            group.place(i, node)
            pids.append(pid)

        with pytest.raises(WorkerGroupError) as alive:  # both nodes live: the rank's own error is the cause
            group.get([ranks[0].collective.remote()], indices=[0])
        assert str(alive.value).splitlines()[0] == "rank 0 raised RuntimeError: Connection closed by peer"

        nodes[1].kill_raylet()
        # rank 1's process ends with its raylet; what rank 0's collective then raises is the case to name
        wait_for(lambda: _ended(pids[1]), 60, "rank 1's process to end with its node")
        with pytest.raises(WorkerGroupError) as lost:
            group.get([ranks[0].collective.remote()], indices=[0])
        line = str(lost.value).splitlines()[0]
        assert line.startswith("node 127.0.0.2 (") and line.endswith("was lost; it held rank 1"), line
        assert group.workers == [] and group.failure is not None  # the group was shut down
    finally:
        ray.shutdown()
        for node in reversed(nodes):
            node.stop()
