"""Known failures of a real `rlpost train` end with one line, a documented exit status, the traceback
in train.log, nothing left running, and no broken step saved: Ctrl-C (with save_on_interrupt),
re-running a finished job, and an lr that breaks the model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
FAST = ["generation=hf", "grpo.val_period=0", "checkpointing.metric_name=train:reward"]


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "RLPOST_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled"}


def _rows(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _session_alive(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,comm="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[1] == str(sid)]


def test_ctrl_c_stops_after_the_step_saves_it_and_leaves_nothing(tmp_path: Path) -> None:
    run, cache = tmp_path / "run", tmp_path / "cache"
    cmd = [RLPOST, "train", f"hydra.run.dir={run}", *FAST, "grpo.max_num_steps=500",
           "checkpointing.save_period=1000", "checkpointing.save_on_interrupt=true"]
    proc = subprocess.Popen(cmd, env=env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while len(_rows(run)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert len(_rows(run)) >= 2, "the run did not reach step 2"
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out
    assert err.strip().splitlines()[-1].startswith("rlpost: error: interrupted by SIGINT")
    last = max(r["step"] for r in _rows(run))
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f"step_{last}"]  # the step in flight finished and was saved (save_period is 1000)
    assert "Traceback" in (run / "train.log").read_text()
    for _ in range(60):
        if not _session_alive(proc.pid):
            break
        time.sleep(0.5)
    assert not _session_alive(proc.pid), "processes left behind"

    # Re-running the finished job (max_num_steps = the saved step) says so and starts nothing.
    again = subprocess.run([*cmd[:-3], f"grpo.max_num_steps={last}"], env=env(cache), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run already complete: {last} steps" in again.stderr
    assert "nan" not in again.stderr.lower()


def test_an_lr_that_breaks_the_model_ends_with_one_line(tmp_path: Path) -> None:
    """lr=1e30 leaves finite but huge weights after step 1; step 2 then breaks (the HF engine refuses
    non-finite probabilities, or the gate stops non-finite loss / grad norm / weights). Either way:
    exit 3, one line naming the part, the traceback in train.log, and no step after the break saved."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    out = subprocess.run([RLPOST, "train", f"hydra.run.dir={run}", *FAST, "grpo.max_num_steps=4",
                          "checkpointing.save_period=1", "policy.optimizer.kwargs.lr=1e30"],
                         env=env(cache), capture_output=True, text=True, timeout=300)
    assert out.returncode == 3, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("rlpost: error: ") and ("rank 0" in last or "not finite" in last), last
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_1"]
    assert "Traceback" in (run / "train.log").read_text()
