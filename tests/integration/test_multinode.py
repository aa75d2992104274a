"""A real 2-node Ray cluster on localhost (`ray start --head` + `ray start --address`, 1 CPU each)
runs a 2-rank DTensor worker group spanning both nodes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpost.distributed.ports import free_port

pytestmark = pytest.mark.slow

DRIVER = r"""
import sys, torch
from rlpost.config.load import load_master_config
from rlpost.distributed.virtual_cluster import init_ray, RayVirtualCluster
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.models.policy.lm_policy import Policy
import dataclasses, ray
addr, model = sys.argv[1], sys.argv[2]
_, cfg = load_master_config(["cluster=ray", f"cluster.address={addr}", "cluster.gpus_per_node=1", "cluster.num_nodes=2",
                             "policy.train_micro_batch_size=8"])
pcfg = dataclasses.replace(cfg.policy, model_name=model)
pcfg.tokenizer.name = model
init_ray(cfg.cluster)
import time
deadline = time.time() + 90
while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
    time.sleep(1)
print("ALIVE", len([n for n in ray.nodes() if n["Alive"]]))
cl = RayVirtualCluster("two-nodes", workers_per_node=1, num_nodes=2, cpus_per_bundle=0.5, placement_timeout_s=60)
pol = Policy(cl, pcfg)
ids = torch.randint(3, 300, (4, 10))
lp = pol.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=torch.full((4,), 10)))["logprobs"]
nodes = {cl.bundle_for_rank(r).node_id for r in range(2)}
print("NODES", len(nodes), "LPSHAPE", tuple(lp.shape), "FINITE", bool(torch.isfinite(lp).all()))
pol.shutdown(); cl.shutdown(); ray.shutdown()
"""


def _start(args: list[str], env: dict[str, str], log: object = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    return subprocess.Popen(
        [ray_bin, "start", "--block", "--num-cpus=1", "--node-ip-address=127.0.0.1", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def test_worker_group_spans_two_localhost_nodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    head = _start(["--head", f"--port={port}", "--include-dashboard=false", "--object-store-memory=200000000"], env)
    worker = None
    try:
        time.sleep(5)
        worker = _start([f"--address=127.0.0.1:{port}", "--object-store-memory=200000000"], env)
        out = subprocess.run(
            [sys.executable, "-c", DRIVER, f"127.0.0.1:{port}", str(tiny_model_dir)],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert "ALIVE 2" in out.stdout and "NODES 2 LPSHAPE (4, 10) FINITE True" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        if worker is not None:
            _stop(worker)
        _stop(head)
