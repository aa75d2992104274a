"""Ray nodes on this machine for the cluster tests: a head and further raylets started with `ray start`, each with
its own CPUs and its own node IP (127.0.0.1, 127.0.0.2, ...: loopback addresses the other nodes reach)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from rlpost.distributed.ports import free_port

RAY = shutil.which("ray") or str(Path(sys.executable).parent / "ray")


class RayNode:
    """One `ray start --block` (its own process group), stopped with `stop`; `kill_raylet` kills its raylet alone
    (a lost machine: the node's actors die with it)."""

    def __init__(self, ip: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.ip = ip
        self.log = log
        with log.open("ab") as out:
            # the dashboard agent's HTTP port (the Jobs API's way in) drawn free: its default 52365 is taken by any other
            # Ray on this machine, and an agent that cannot bind leaves the cluster with no job agent
            self.proc = subprocess.Popen(
                [RAY, "start", "--block", f"--node-ip-address={ip}", "--disable-usage-stats",
                 f"--dashboard-agent-listen-port={free_port()}", *args],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def raylet(self) -> psutil.Process | None:
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "raylet" in p.name() or any("/raylet" in a for a in p.cmdline()[:1]):
                    return p
            except psutil.NoSuchProcess:
                continue
        return None

    def kill_raylet(self) -> None:
        raylet = self.raylet()
        assert raylet is not None, f"no raylet under the node started at {self.ip}"
        raylet.kill()

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=5)  # a test's node: what has not stopped by then is killed
                return
            except subprocess.TimeoutExpired:
                continue


def wait_nodes(address: str, nodes: int, env: dict[str, str], timeout_s: float = 120) -> None:
    out = subprocess.run([sys.executable, "-m", "rlpost.launch.nodes", "wait", address, str(nodes), str(timeout_s)],
                         env=env, capture_output=True, text=True, timeout=timeout_s + 60)
    assert out.returncode == 0, out.stdout + out.stderr


def head(port: int, env: dict[str, str], log: Path, *extra: str) -> RayNode:
    return RayNode("127.0.0.1", ["--head", f"--port={port}", "--num-cpus=1", "--object-store-memory=200000000",
                                 *extra], env, log)


def worker(address: str, ip: str, env: dict[str, str], log: Path) -> RayNode:
    return RayNode(ip, [f"--address={address}", "--num-cpus=1", "--object-store-memory=200000000"], env, log)


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
