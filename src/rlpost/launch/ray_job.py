"""`rlpost launch ray --address URL [options] -- train [overrides]`: `rlpost train` as a Ray job on a running
Ray cluster (the Jobs API of its dashboard, what `ray job submit` uses). The driver runs on the head node and joins
the cluster (cluster.address=auto); the run directory is an absolute path the head node writes (a shared file
system on a real cluster); `--working-dir` uploads a directory (data, prompts) as the job's working directory.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKING_DIR_EXCLUDES = [".git", ".venv", "outputs", "multirun", "__pycache__", "*.safetensors"]
"""Left out of an uploaded working directory: environments, earlier runs and weights (models come from paths)."""
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
AGENT_WAIT_S = 60.0
"""How long a submission waits for the head's job agent: the dashboard answers "No available agent" while the
agent (re)starts, as after a node joins or a driver dies."""


@dataclass(frozen=True)
class RayJob:
    """What the Ray job is made from."""

    address: str
    """The dashboard's address, http://HEAD:8265."""
    train_args: list[str]
    run_dir: Path
    working_dir: Path | None = None
    rlpost_bin: str = "rlpost"
    """The `rlpost` command on the head node (on its PATH by default)."""
    env_vars: dict[str, str] = field(default_factory=dict)

    def entrypoint(self) -> str:
        args = [self.rlpost_bin, "train", *self.train_args, "cluster.address=auto", f"hydra.run.dir={self.run_dir}"]
        return " ".join(shlex.quote(a) for a in args)

    def runtime_env(self) -> dict[str, object]:
        env: dict[str, object] = {"env_vars": {"PYTHONUNBUFFERED": "1", **self.env_vars}}
        if self.working_dir is not None:
            env["working_dir"] = str(self.working_dir)
            env["excludes"] = list(WORKING_DIR_EXCLUDES)
        return env


def submit(job: RayJob, agent_wait_s: float = AGENT_WAIT_S) -> str:
    """Submit the job; its submission id. While the dashboard has no job agent yet, it asks again every 2 s, for
    up to `agent_wait_s`."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(job.address)
    submission_id = f"rlpost-{time.strftime('%Y%m%d-%H%M%S')}-{job.run_dir.name}"
    deadline = time.monotonic() + agent_wait_s
    while True:
        try:
            return client.submit_job(entrypoint=job.entrypoint(), runtime_env=job.runtime_env(),
                                     submission_id=submission_id, metadata={"run_dir": str(job.run_dir)})
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def wait_for(address: str, job_id: str, poll_s: float = 2.0) -> int:
    """Follow the job to its end, one line per change of status; the driver's exit status (1 when Ray does not
    report one for a failed job)."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)
    last = ""
    while True:
        info = client.get_job_info(job_id)
        status = str(info.status.value if hasattr(info.status, "value") else info.status)
        if status != last:
            print(f"rlpost launch: Ray job {job_id} {status}", flush=True)
            last = status
        if status in TERMINAL:
            code = getattr(info, "driver_exit_code", None)
            if code is not None:
                return int(code)
            return 0 if status == "SUCCEEDED" else 1
        time.sleep(poll_s)
