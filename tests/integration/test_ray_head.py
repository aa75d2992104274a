"""The local Ray head a run starts holds only what a one-machine run uses: no autoscaler monitor, no API server,
and no log monitor when worker output goes to the run's train.log (each variant in a fresh process: one Ray per
process). Actors, the object store and placement still work there (the default job's tests use the same head)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import json, os, psutil, ray
from rlpost.config.schema.cluster import ClusterConfig
from rlpost.distributed.virtual_cluster import init_ray
init_ray(ClusterConfig(num_cpus=1))
assert ray.get(ray.remote(lambda: 7).options(num_cpus=0.1).remote(), timeout=120) == 7
assert ray.get(ray.get(ray.put([ray.put(3)]), timeout=60)[0], timeout=60) == 3
names = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
ray.shutdown()
print("RESULT " + json.dumps(names))
"""


def _head_processes(env: dict[str, str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled", **env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_run_starts_ray_without_the_monitors(tmp_path: Path) -> None:
    from rlpost.runtime.run_log import ENV_VAR

    run = _head_processes({ENV_VAR: str(tmp_path / "train.log")})
    assert any("gcs_server" in n for n in run) and any("raylet" in n for n in run)  # the listing sees the head
    assert not any("autoscaler" in n and "monitor.py" in n for n in run), run
    assert not any("log_monitor.py" in n for n in run), run
    assert not any("dashboard/dashboard.py" in n for n in run), run
    console = _head_processes({ENV_VAR: ""})  # no run log: worker output goes to the console, through the log monitor
    assert any("log_monitor.py" in n for n in console), console
    assert not any("autoscaler" in n and "monitor.py" in n for n in console), console
    assert not any("dashboard/dashboard.py" in n for n in console), console


SIGNAL_SCRIPT = """
import json, os, signal, time, psutil, ray
from rlpost.config.schema.cluster import ClusterConfig
from rlpost.distributed.virtual_cluster import init_ray
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
init_ray(ClusterConfig(num_cpus=1))
env = ray.get(ray.remote(lambda: os.environ.get("RAY_DISABLE_FAILURE_SIGNAL_HANDLER")).options(num_cpus=0.1).remote(),
              timeout=120)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
groups = {" ".join(p.cmdline())[:80]: os.getpgid(p.pid) for p in psutil.Process().children(recursive=True)}
ray.shutdown()
print("RESULT " + json.dumps({"got": got, "own": os.getpgid(0), "groups": groups, "worker_env": env}))
"""


def test_sigterm_reaches_the_drivers_handler_and_not_the_head() -> None:
    """After Ray starts, SIGTERM runs the driver's Python handler (Ray's failure handler would dump a stack and end
    the process); the head's processes are in their own process group (a group SIGTERM leaves them to the driver's
    shutdown), and the workers keep Ray's handler."""
    proc = subprocess.run([sys.executable, "-c", SIGNAL_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert "SIGTERM received" not in proc.stderr
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["got"] == [15]
    head = {name: group for name, group in result["groups"].items() if "gcs_server" in name or "raylet" in name}
    assert head and result["own"] not in head.values(), result["groups"]
    assert result["worker_env"] == "0"
