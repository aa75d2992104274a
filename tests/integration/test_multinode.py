"""GRPO on a real two-node Ray cluster on this machine (a head at 127.0.0.1 and a second raylet at 127.0.0.2, one
CPU each): the plan and the run name which node holds which worker, the policy's ranks and the engines land on both
nodes, killing the second node's raylet ends the run with exit 3 naming the node and what it held, and once the node
is back the run resumes from its last checkpoint, submitted as a Ray job (`rlpost launch ray`) to the same cluster."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from rlpost.distributed.ports import free_port
from tests.integration import cli_runs
from tests.integration.ray_nodes import RayNode, head, wait_for, wait_nodes, worker

pytestmark = pytest.mark.slow

STEPS = 200
"""Long enough that the run is still going when Ray declares the killed node dead (the tiny steps take 0.3 s)."""
RESUMED_STEPS = 15
"""Where the resumed run stops, a few steps past the checkpoint it resumes from (a step budget may change on
resume)."""


def _rows(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return cli_runs.metrics(run) if f.is_file() else []


def test_grpo_spans_two_nodes_and_a_lost_node_ends_it_with_exit_3_then_it_resumes(cache: Path, tmp_path: Path
                                                                                  ) -> None:
    port, dashboard = free_port("127.0.0.1"), free_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    bindir = str(Path(cli_runs.RLPOST).parent)  # the head's PATH has rlpost, as where the venv is activated
    env = {**cli_runs.env(cache), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
           "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    nodes: list[RayNode] = [head(port, env, tmp_path / "ray-head.log", "--include-dashboard=true",
                                 "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}")]
    run = tmp_path / "run"
    job = ["cluster.gpus_per_node=1", "cluster.num_nodes=2", f"grpo.max_num_steps={STEPS}",
           "checkpointing.save_period=5", "grpo.val_period=100"]
    overrides = [f"hydra.run.dir={run}", "cluster=ray", f"cluster.address={address}", *job]
    try:
        nodes.append(worker(address, "127.0.0.2", env, tmp_path / "ray-node2.log"))
        wait_nodes(address, 2, env)
        plan = subprocess.run([cli_runs.RLPOST, "plan", *overrides[1:]], env={**env, "COLUMNS": "300"},
                              capture_output=True, text=True, timeout=120)
        assert plan.returncode == 0, plan.stderr
        flat = " ".join(plan.stdout.replace("│", " ").split())
        assert "node 0: policy rank 0, engine replica 0; node 1: policy rank 1, engine replica 1" in flat, flat

        console = tmp_path / "console.txt"
        with console.open("w") as out:
            proc = subprocess.Popen([cli_runs.RLPOST, "train", *overrides], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                saved = run / "checkpoints" / "step_5" / "training_info.json"
                wait_for(lambda: saved.is_file() or proc.poll() is not None, 600, "the checkpoint of step 5")
                assert proc.poll() is None, console.read_text()[-3000:]
                text = console.read_text()
                placed = next((ln for ln in text.splitlines() if "placement:" in ln), "")
                # `ray start` gives the head this machine's address for 127.0.0.1; the second node keeps 127.0.0.2.
                where = dict(part.strip().split(": ", 1) for part in placed.split("placement:", 1)[1].split(";"))
                assert len(where) == 2 and any(k.startswith("127.0.0.2 ") for k in where), placed
                assert all("policy rank" in v and "vLLM replica" in v for v in where.values()), placed
                nodes[1].kill_raylet()
                lost_at = time.monotonic()
                proc.wait(timeout=120)
                took = time.monotonic() - lost_at
            finally:
                if proc.poll() is None:
                    proc.kill()
        text = console.read_text()
        assert proc.returncode == 3, text[-3000:]
        assert took < 60, f"the run took {took:.0f}s to end after the node was lost"
        error = [ln for ln in text.splitlines() if ln.startswith("rlpost: error:")]
        assert error and "node 127.0.0.2" in error[-1] and "was lost" in error[-1], text[-3000:]
        held = next(v for k, v in where.items() if k.startswith("127.0.0.2 "))
        assert error[-1].endswith(f"was lost; it held {held}"), (error[-1], held)  # what the plan line put there
        assert "Traceback" not in text and "(raylet)" not in text, text[-3000:]  # Ray's own lines: in train.log
        done = max(r["step"] for r in _rows(run))
        # every step's row has the second node's actors too, sampled by the probe on that node; the step in flight
        # when the node went may have finished after its actors' processes did, so its row is left out
        rows = [r for r in _rows(run) if "train/reward" in r][:-1]
        assert rows and all(r.get("resources/policy-1/rss_gib", 0) > 0 and r.get("resources/vllm-replica1/rss_gib", 0)
                            > 0 for r in rows), [(r["step"], r.get("resources/vllm-replica1/rss_gib")) for r in rows]

        nodes[1].stop()
        nodes[1] = worker(address, "127.0.0.2", env, tmp_path / "ray-node2-again.log")
        wait_nodes(address, 2, env)
        again = subprocess.run([cli_runs.RLPOST, "launch", "ray", "--address", f"http://127.0.0.1:{dashboard}",
                                "--run-dir", str(run), "--wait", "--", "train",
                                *[o for o in job if not o.startswith("grpo.max_num_steps=")],
                                f"grpo.max_num_steps={RESUMED_STEPS}"],
                               env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "SUCCEEDED" in again.stdout, again.stdout
        assert "resuming from step" in (run / "train.log").read_text()
        steps = [r["step"] for r in _rows(run) if "train/reward" in r]
        assert done < RESUMED_STEPS and steps == list(range(1, RESUMED_STEPS + 1)), (done, steps)
    finally:
        for node in reversed(nodes):
            node.stop()
