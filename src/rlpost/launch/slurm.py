"""`rlpost launch slurm [options] [sbatch options] -- train [overrides]`: a batch script that starts a Ray cluster on
the job's nodes (the head on the first, a worker on each other, with the CPUs and GPUs Slurm gave the job on that
node), waits for them, runs `rlpost train` against it, and stops Ray. A run that stops early (the signal before a
time limit or a preemption, `checkpointing.checkpoint_must_save_by`) or loses a node puts the job back in the queue
(`scontrol requeue`, at most --max-requeues times); the next start resumes from the run's last checkpoint.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

TEMPLATE = "ray_on_slurm.sh"
SUBMIT_TIMEOUT_S = 60.0
DEFAULT_SIGNAL = "B:TERM@120"
"""Two minutes' warning before the time limit, sent to the batch shell (which passes it to the driver): time to
finish the step and save (with checkpointing.save_on_interrupt=true)."""
_NODES = re.compile(r"^(?:-N|--nodes)(?:=|$)")


class LaunchError(RuntimeError):
    """Submission failed (sbatch missing or refusing the job); exit 3 with the line."""


@dataclass(frozen=True)
class SlurmJob:
    """What the batch script is made from."""

    train_args: list[str]
    """`rlpost train`'s overrides (the launcher adds cluster.address and hydra.run.dir)."""
    sbatch_args: list[str]
    """Options for sbatch itself (its command line, so sbatch checks them)."""
    run_dir: Path
    max_requeues: int
    job_name: str = "rlpost"
    nodes_timeout_s: float = 300.0
    workdir: Path = Path.cwd()


def node_count(sbatch_args: list[str]) -> int:
    """The fixed node count asked of sbatch (-N/--nodes; 1 when not given). A range (2-4) is refused: the run's
    cluster.num_nodes must be known before the job starts."""
    value = None
    for i, arg in enumerate(sbatch_args):
        if _NODES.match(arg):
            value = arg.split("=", 1)[1] if "=" in arg else (sbatch_args[i + 1] if i + 1 < len(sbatch_args) else "")
        elif arg.startswith("-N") and len(arg) > 2:
            value = arg[2:]
    if value is None:
        return 1
    from rlpost.config.errors import ConfigError

    if value.isdigit() and int(value) < 1:
        raise ConfigError("--nodes", value, "must be >= 1")
    if not value.isdigit():
        raise ConfigError("--nodes", value, "must be a fixed number of nodes (not a range): the run's "
                          "cluster.num_nodes is set from it")
    return int(value)


def gpus_per_node(sbatch_args: list[str]) -> int | None:
    """The GPUs per node asked of sbatch (--gpus-per-node=[type:]N), None when not given."""
    value = None
    for i, arg in enumerate(sbatch_args):
        if arg == "--gpus-per-node":
            value = sbatch_args[i + 1] if i + 1 < len(sbatch_args) else ""
        elif arg.startswith("--gpus-per-node="):
            value = arg.split("=", 1)[1]
    if value is None:
        return None
    count = value.rsplit(":", 1)[-1]
    if not count.isdigit() or int(count) < 1:
        from rlpost.config.errors import ConfigError

        raise ConfigError("--gpus-per-node", value, "must be a GPU count >= 1 ([type:]N): the run's "
                          "cluster.gpus_per_node is set from it")
    return int(count)


def render(job: SlurmJob) -> str:
    """The batch script."""
    text = resources.files("rlpost.launch").joinpath(TEMPLATE).read_text()
    bindir = Path(sys.executable).parent
    lines = [] if any(a.startswith("--signal") for a in job.sbatch_args) else [f"#SBATCH --signal={DEFAULT_SIGNAL}"]
    values = {
        "JOB_NAME": job.job_name,
        "LOGS": shlex.quote(str(job.run_dir / "logs")),
        "SBATCH_LINES": "\n".join(lines),
        "RUN_DIR": shlex.quote(str(job.run_dir)),
        "PYTHON": shlex.quote(sys.executable),
        "RAY": shlex.quote(str(bindir / "ray")),
        "RLPOST": shlex.quote(str(bindir / "rlpost")),
        "MAX_REQUEUES": str(job.max_requeues),
        "WORKDIR": shlex.quote(str(job.workdir)),
        "NODES_TIMEOUT_S": f"{job.nodes_timeout_s:g}",
        "TRAIN_ARGS": " ".join(shlex.quote(a) for a in job.train_args),
    }
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    if "{{" in text:
        raise AssertionError(f"{TEMPLATE}: a placeholder was left unfilled")
    return text


def submit(job: SlurmJob, script: str) -> str:
    """sbatch the script (written into the run's logs/); the job id."""
    logs = job.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / "ray_on_slurm.sh"
    path.write_text(script)
    try:
        done = subprocess.run(["sbatch", "--parsable", *job.sbatch_args, str(path)], capture_output=True, text=True,
                              timeout=SUBMIT_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise LaunchError("sbatch was not found: run `rlpost launch slurm` on a Slurm login node") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"sbatch did not answer within {SUBMIT_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        raise LaunchError(f"sbatch refused the job: {done.stderr.strip().splitlines()[-1] if done.stderr else ''}")
    return done.stdout.strip().split(";", 1)[0]


@dataclass(frozen=True)
class JobState:
    """A job as slurmctld knows it: its state ('UNKNOWN' once forgotten), the reason it waits, the batch script's
    exit status, and how many times it was requeued."""

    state: str
    reason: str
    exit_status: int | None
    restarts: int


def job_state(job_id: str) -> JobState:
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30,
                          check=False)
    fields = dict(f.split("=", 1) for f in done.stdout.split() if "=" in f)
    code = fields.get("ExitCode", "")
    return JobState(fields.get("JobState", "UNKNOWN"), fields.get("Reason", ""),
                    int(code.split(":")[0]) if code[:1].isdigit() else None, int(fields.get("Restarts", "0") or 0))


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED", "UNKNOWN")


def wait_for(job_id: str, poll_s: float = 3.0) -> JobState:
    """Follow the job until it ends, one line per change of state (a requeue shows as PENDING again)."""
    last = ""
    while True:
        now = job_state(job_id)
        if now.state != last:
            why = f" ({now.reason})" if now.reason and now.reason != "None" else ""
            again = f", restart {now.restarts}" if now.restarts else ""
            print(f"rlpost launch: job {job_id} {now.state}{why}{again}", flush=True)
            last = now.state
        if now.state in FINAL_STATES:
            return now
        time.sleep(poll_s)
