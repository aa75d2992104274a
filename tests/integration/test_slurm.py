"""`rlpost launch slurm` and `rlpost train -m hydra/launcher=submitit_slurm` on a real Slurm: Debian's slurmctld,
slurmd and munge started on this machine with a one-node configuration (tests/integration/slurm_cluster.py).

- A launched GRPO run starts Ray on the job's node, trains there and learns; a SIGTERM to the batch script (what
  `--signal=B:TERM@120` sends before a time limit, and a preemption) makes the run save and the job requeue
  itself; the second start resumes from that checkpoint and finishes with one metrics row per step.
- A sweep of three learning rates runs as three Slurm jobs side by side; the diverging one fails alone, and the
  summary lists every job and names the best learning rate.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import cli_runs
from tests.integration.slurm_cluster import LocalSlurm, SlurmUnavailable, ensure_installed

pytestmark = pytest.mark.slow

STEPS = 80
"""The default job's schedule: it learns the task (train reward from about 0.01 to 0.98 here)."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    try:
        ensure_installed()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _job(slurm: LocalSlurm, job_id: str) -> dict[str, str]:
    out = slurm.run("scontrol", "show", "job", "-o", job_id)
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _wait(what: str, timeout_s: float, check: object, poll_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _logs(run: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run / "logs").glob("*.*")))


def _steps(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [r["step"] for r in cli_runs.metrics(run) if "train/reward" in r] if f.is_file() else []


def test_a_launched_run_learns_is_requeued_on_sigterm_and_resumes(slurm: LocalSlurm, cache: Path, tmp_path: Path
                                                                  ) -> None:
    run = tmp_path / "run"
    env = {**cli_runs.env(cache), **slurm.env, "HYDRA_FULL_ERROR": "0"}
    out = subprocess.run(
        [cli_runs.RLPOST, "launch", "slurm", "--run-dir", str(run), "--max-requeues", "1", "--job-name=rlpost-test",
         "--", "train", "cluster.gpus_per_node=1", "checkpointing.save_period=5",
         "checkpointing.save_on_interrupt=true"],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"Slurm job (\d+) (\w+); run directory (\S+)", out.stdout)
    assert found and Path(found.group(3)) == run, out.stdout
    job_id = found.group(1)
    script = (run / "logs" / "ray_on_slurm.sh").read_text()
    assert "ray\" start --head" in script.replace("'", '"') or "start --head" in script

    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    _wait("four steps", 600, lambda: len(_steps(run)) >= 4 or _job(slurm, job_id)["JobState"] in ended, 0.3)
    assert _job(slurm, job_id)["JobState"] == "RUNNING", _logs(run)
    slurm.run("scancel", "--batch", "--signal=TERM", job_id)  # what --signal=B:TERM@120 does before the time limit
    _wait("the requeue", 300, lambda: _job(slurm, job_id).get("Restarts") == "1")
    requeued_at = time.time()
    # Slurm holds a requeued job for two minutes before it may start again; let it start now. Not within the second
    # of the requeue, though: slurmd refuses a launch whose credential is not newer, to the second, than the old
    # instance's kill ("already killed, do not launch batch job"), and the job would end FAILED.
    _wait("the pending requeued job", 120, lambda: _job(slurm, job_id)["JobState"] == "PENDING")
    time.sleep(max(0.0, int(requeued_at) + 2 - time.time()))
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    _wait("the job's end", 900, lambda: _job(slurm, job_id)["JobState"] in ended)
    job = _job(slurm, job_id)
    driver = (run / "logs" / "driver.log").read_text()
    batch = (run / "logs" / f"slurm-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (
        f"{job}\n{batch[-3000:]}{driver[-3000:]}\n{slurm.log_tail()}")
    assert "interrupted by SIGTERM" in driver and "resuming from step" in driver, driver[-3000:]
    assert "requeueing job" in batch and f"job {job_id} (restart 1)" in batch, batch
    assert any(p.name.startswith("ray-") for p in (run / "logs").iterdir())  # each node's Ray log
    assert _steps(run) == list(range(1, STEPS + 1))  # one row per step across both starts
    status = json.loads((run / "run_status.json").read_text())
    assert status["state"] == "finished" and status["steps"] == STEPS
    rewards = [r["train/reward"] for r in cli_runs.metrics(run) if "train/reward" in r]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.5, rewards  # it learns on Slurm as it does here


def test_a_sweep_runs_as_slurm_jobs_and_the_summary_names_the_best_rate(slurm: LocalSlurm, cache: Path,
                                                                        tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    env = {**cli_runs.env(cache), **slurm.env, "HYDRA_FULL_ERROR": "0"}
    out = subprocess.run(
        [cli_runs.RLPOST, "train", "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=20",
         "policy.optimizer.kwargs.lr=1e-3,1e-2,1e9", "grpo.max_num_steps=4", "grpo.val_period=4",
         f"hydra.sweep.dir={sweep}"],
        env=env, capture_output=True, text=True, timeout=1200, cwd=tmp_path,
    )
    assert (sweep / "sweep_summary.json").is_file(), out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    jobs = {float(r["overrides"]["policy.optimizer.kwargs.lr"]): r for r in summary["jobs"]}
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]  # the diverging job's status
    assert jobs[1e9]["exit_status"] == 3 and jobs[1e9]["error"].startswith("rlpost: error: step 2: train/loss=nan")
    assert jobs[1e-3]["exit_status"] == 0 and jobs[1e-2]["exit_status"] == 0  # the others ran to the end
    best = max((1e-3, 1e-2), key=lambda lr: (jobs[lr]["val_accuracy"], lr == 1e-3))
    assert float(summary["best"]["swept"]["policy.optimizer.kwargs.lr"]) == best
    assert summary["best"]["metric"] == "validation/accuracy"
    assert f"best: policy.optimizer.kwargs.lr={summary['best']['swept']['policy.optimizer.kwargs.lr']}" in out.stdout
    # Each job was a Slurm job of its own (one submitit folder per array task), and they ran side by side.
    assert len([p for p in (sweep / ".submitit").iterdir() if p.is_dir() and "_" in p.name]) == 3  # <array>_<task>
    spans = [((sweep / str(j) / ".hydra" / "config.yaml").stat().st_mtime,
              (sweep / str(j) / "run_status.json").stat().st_mtime) for j in range(3)]
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans  # all three were running at once
