"""Known failures of a real `rlpost train` end with one line, a documented exit status, the traceback
in train.log, nothing left running, and no broken step saved: Ctrl-C and SIGTERM (with save_on_interrupt), a
second signal, a signal during start-up, re-running a finished job, and a call past its bound (an lr that breaks
the model: the diverging sweep job of test_grpo.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlpost.failures import SIGNAL_CODES
from tests.fault_table import Record

pytestmark = [pytest.mark.slow, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
RLPOST = shutil.which("rlpost") or str(REPO / ".venv" / "bin" / "rlpost")
FAST = ["generation=hf", "grpo.val_period=0", "checkpointing.metric_name=train:reward"]
VLLM = ["generation=vllm", *FAST[1:]]
"""The default engine: its start-up is the longest."""


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "RLPOST_CACHE_DIR": str(cache), "RAY_AUTH_MODE": "disabled"}


def _rows(run: Path) -> list[dict[str, float]]:
    p = run / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _session_alive(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,comm="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[1] == str(sid)]


def _start(run: Path, cache: Path, *overrides: str, base: list[str] = FAST) -> subprocess.Popen[str]:
    """`rlpost train` in a session of its own: a signal to its group is what a terminal, `timeout` or Slurm sends."""
    return subprocess.Popen([RLPOST, "train", f"hydra.run.dir={run}", *base, *overrides], env=env(cache),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_rows(proc: subprocess.Popen[str], run: Path, n: int) -> None:
    deadline = time.monotonic() + 300
    while len(_rows(run)) < n and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert len(_rows(run)) >= n, f"the run did not reach step {n}"


def _nothing_left(sid: int) -> None:
    for _ in range(60):
        if not _session_alive(sid):
            return
        time.sleep(0.5)
    assert not _session_alive(sid), "processes left behind"


def test_a_signal_stops_after_the_step_saves_it_and_leaves_nothing(tmp_path: Path, cache: Path,
                                                                   fault: Record) -> None:
    """SIGHUP (the terminal closed: to the whole group), handled as SIGTERM (`timeout`, Slurm, Kubernetes) and Ctrl-C
    are (a first SIGINT: the test below; SIGTERM: the start-up test and tests/integration/test_slurm.py): the step
    in flight finishes and is saved (save_on_interrupt), exit 129 with one line, run_status.json says how far it
    got."""
    sig = signal.SIGHUP
    run = tmp_path / "run"
    budget = ["grpo.max_num_steps=500", "checkpointing.save_period=1000", "checkpointing.save_on_interrupt=true"]
    proc = _start(run, cache, *budget)
    _wait_rows(proc, run, 2)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=180)
    last = max(r["step"] for r in _rows(run))
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    steps = [r["step"] for r in _rows(run)]
    fault(f"{sig.name} to the run's process group", proc.returncode, out + err,
          data_lost=ckpts != [f"step_{last}"] or steps != list(range(1, last + 1)))
    assert proc.returncode == 129, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out and "SIGTERM received" not in err
    assert json.loads((run / "run_status.json").read_text()) == {
        "state": "stopped", "exit_status": 129, "steps": last,
        "error": f"rlpost: error: interrupted by {sig.name}; re-run the same command to resume from the last checkpoint"}
    assert err.strip().splitlines()[-1] == (f"rlpost: error: interrupted by {sig.name}; re-run the same command "
                                            "to resume from the last checkpoint")
    assert ckpts == [f"step_{last}"]  # the step in flight finished and was saved (save_period is 1000)
    assert steps == list(range(1, last + 1))
    assert "Traceback" in (run / "train.log").read_text()
    _nothing_left(proc.pid)

    # Re-running the finished job (max_num_steps = the saved step) says so and starts nothing.
    again = subprocess.run([RLPOST, "train", f"hydra.run.dir={run}", *FAST, f"grpo.max_num_steps={last}"],
                           env=env(cache), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run already complete: {last} steps" in again.stderr
    assert "nan" not in again.stderr.lower()


def test_a_second_signal_abandons_the_step_with_one_line(tmp_path: Path, cache: Path, fault: Record) -> None:
    """Ctrl-C, then SIGTERM: the second abandons the step in flight (or, when the step ended between them, the
    first already stopped the run); either way one line naming the signal that ended it, exit 143 / 130, no step
    saved half-done, nothing left."""
    run = tmp_path / "run"
    proc = _start(run, cache, "grpo.max_num_steps=500", "checkpointing.save_period=1")
    _wait_rows(proc, run, 2)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    steps = [r["step"] for r in _rows(run)]
    saved = sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
    fault("SIGINT then SIGTERM to the run's process group", proc.returncode, out + err,
          data_lost=steps != list(range(1, len(steps) + 1)) or saved[-1] != steps[-1])
    assert "Traceback" not in err + out
    line = err.strip().splitlines()[-1]
    assert (proc.returncode, line) in (
        (143, "rlpost: error: interrupted by SIGTERM (a second signal: the step in flight was abandoned); "
              "re-run the same command to resume from the last checkpoint"),
        (130, "rlpost: error: interrupted by SIGINT; re-run the same command to resume from the last checkpoint"),
    ), (proc.returncode, line, err[-3000:])
    assert steps == list(range(1, len(steps) + 1)) and saved[-1] == steps[-1]  # save_period=1: every logged step
    _nothing_left(proc.pid)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_ends_the_run_at_once(sig: signal.Signals, tmp_path: Path, cache: Path,
                                                       fault: Record) -> None:
    """A signal while Ray, the workers and the engines start: the run ends within seconds (start-up is not waited
    out), one line saying when, exit 130 / 143, nothing saved, nothing left."""
    run = tmp_path / "run"
    proc = _start(run, cache, "grpo.max_num_steps=5", base=VLLM)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not (run / "train.log").is_file():
        time.sleep(0.05)
    time.sleep(3)  # inside start-up: the job began (its log exists), Ray and the actors are starting
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    fault(f"{sig.name} during start-up", proc.returncode, out + err,
          data_lost=bool(_rows(run) or list(run.glob("checkpoints/step_*"))))
    assert proc.returncode == SIGNAL_CODES[sig], err[-3000:]
    assert "Traceback" not in err + out and "SIGTERM received" not in err
    assert err.strip().splitlines()[-1] == (f"rlpost: error: interrupted by {sig.name} (during start-up); re-run "
                                            "the same command to resume from the last checkpoint")
    assert not _rows(run) and not list(run.glob("checkpoints/step_*"))
    _nothing_left(proc.pid)


def test_a_call_past_its_bound_ends_the_run_with_one_line_and_leaves_nothing(tmp_path: Path, cache: Path,
                                                                              fault: Record) -> None:
    """cluster.call_timeout_s=5: the engine's start-up call outlives it. The run ends with exit 3 naming the call and
    the actor; the workers (one still busy in that call) are killed, not asked to stop, and nothing is left."""
    run = tmp_path / "run"
    proc = _start(run, cache, "cluster.call_timeout_s=5", "cluster.min_call_timeout_s=1", base=VLLM)
    out, err = proc.communicate(timeout=300)
    fault("a call past cluster.call_timeout_s", proc.returncode, out + err, data_lost=bool(_rows(run)))
    assert proc.returncode == 3, err[-3000:]
    assert "Traceback" not in err + out
    assert err.strip().splitlines()[-1].startswith("rlpost: error: call did not finish within 5s on "), err[-2000:]
    _nothing_left(proc.pid)


