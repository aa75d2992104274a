"""Helpers of the tests that run the installed `rlpost train` in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
TIMING = ("timing/", "performance/", "resources/")
"""Metric prefixes that measure the machine, not the run: left out where two runs are compared."""
RESUMED_SKIPS = (*TIMING, "advisories/")
"""What a resumed run need not repeat of the straight run: the machine's measures, and the run-health advisories
(a stall is judged by the steps' wall times)."""
AC = "policy.dtensor_cfg.activation_checkpointing=true"
"""Activation checkpointing on: an algorithm's test run trains through layers recomputed in backward."""


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "RLPOST_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}


def train(run_dir: Path, cache: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([RLPOST, "train", f"hydra.run.dir={run_dir}", *overrides], env=env(cache),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def kill_9_after_checkpoint(run_dir: Path, cache: Path, *overrides: str, step: int = 2, timeout: float = 400) -> None:
    """Start `rlpost train` and kill -9 the driver alone once checkpoint step_<step> is written (a later one may have
    landed first, never the last), as a user's `kill -9 PID` would: every process the run started (Ray's head, its
    agents, the workers) must be gone within 10 s (rlpost.distributed.head_reaper)."""
    import psutil

    proc = subprocess.Popen([RLPOST, "train", f"hydra.run.dir={run_dir}", *overrides], env=env(cache),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = run_dir / "checkpoints" / f"step_{step}" / "training_info.json"
    deadline = time.monotonic() + timeout
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert marker.exists(), f"the first run never wrote step_{step}"
    started = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(started, timeout=10)
    left = []
    for p in alive:  # named, then killed: the test's own clean-up, whatever the assertion below says
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.name()}")
            p.kill()
    assert not left, f"processes of the killed run outlived it: {left}"
