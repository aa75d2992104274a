"""A real one-node Slurm on this machine for the launch tests: Debian's slurmctld, slurmd and munge (installed
with apt-get when missing and the tests run as root), started with a configuration of their own in a temporary
directory (ports drawn free, state and logs there), stopped afterwards. Clients reach it through SLURM_CONF."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from rlpost.distributed.ports import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
CPUS = 4
"""CPUs the node advertises (slurmd takes the configured count, SlurmdParameters=config_overrides): jobs of one
CPU each run side by side on this 2-core machine, as a sweep's would on a cluster."""

CONF = """\
ClusterName=rlpost-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=2
ReturnToService=2
MpiDefault=none
MinJobAge=3600
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here."""


def ensure_installed() -> None:
    """Install Debian's Slurm and munge when a daemon is missing (as root, with apt-get)."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable("slurmctld/slurmd/munge are not installed (apt-get install "
                               + " ".join(PACKAGES) + " as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=900)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-500:]}")


class LocalSlurm:
    """munged + slurmctld + slurmd with their configuration in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.host = socket.gethostname().split(".")[0]
        self.conf = directory / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        d = self.dir
        (d / "state").mkdir(parents=True, exist_ok=True)
        (d / "spool").mkdir(exist_ok=True)
        self.conf.write_text(CONF.format(host=self.host, dir=d, ctld_port=free_port("127.0.0.1"),
                                         slurmd_port=free_port("127.0.0.1"), cpus=CPUS))
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._run(["munged", f"--socket={d}/munge.socket", f"--key-file={key}", f"--pid-file={d}/munged.pid",
                   f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed", "--force"])
        self._run(["slurmctld", "-f", str(self.conf)])
        self._run(["slurmd", "-f", str(self.conf)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True,
                                   timeout=30).stdout.strip()
            if state == "idle":
                return
            time.sleep(1)
        raise SlurmUnavailable(f"the Slurm node did not become idle (sinfo: {state!r}); logs in {d}")

    def _run(self, cmd: list[str]) -> None:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise SlurmUnavailable(f"{cmd[0]} did not start: {done.stderr.strip()[-500:]}")

    def run(self, *cmd: str, timeout: float = 60) -> str:
        """A Slurm client command's output (it must succeed)."""
        done = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
        return done.stdout

    def log_tail(self, chars: int = 3000) -> str:
        """The end of slurmctld's and slurmd's logs, for a failing test's message."""
        return "\n".join(f"--- {name}\n{(self.dir / name).read_text(errors='replace')[-chars:]}"
                         for name in ("slurmctld.log", "slurmd.log") if (self.dir / name).is_file())

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
        time.sleep(1)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.dir / f"{name}.pid"
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.2)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
