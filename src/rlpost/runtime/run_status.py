"""`<run dir>/run_status.json`: how the run's last attempt ended, for whatever starts it again.

A batch script (rlpost.launch: Slurm, Ray jobs) reads it to decide whether to requeue: a run that stopped early
(a signal, `checkpointing.checkpoint_must_save_by`) or lost a worker or node resumes from its last checkpoint when
started again; a finished run, or one refused for bad input, does not.

    {"state": "finished" | "stopped" | "failed", "exit_status": 0, "steps": 20, "error": null}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, TypedDict

STATUS_FILE = "run_status.json"

State = Literal["finished", "stopped", "failed"]


class RunStatus(TypedDict):
    """How an attempt ended: its state, exit status, the steps done (None when unknown) and its one-line error."""

    state: State
    exit_status: int
    steps: int | None
    error: str | None


def write_status(run_dir: Path, state: State, exit_status: int, steps: int | None = None,
                 error: str | None = None) -> None:
    """Replace the run's status atomically; an unwritable run directory is left alone (the exit status still says
    how the run ended)."""
    status: RunStatus = {"state": state, "exit_status": exit_status, "steps": steps, "error": error}
    tmp = run_dir / f".{STATUS_FILE}.tmp"
    try:
        tmp.write_text(json.dumps(status) + "\n")
        os.replace(tmp, run_dir / STATUS_FILE)
    except OSError:
        pass


def steps_done(run_dir: Path) -> int | None:
    """The last step the run's metrics.jsonl records (None when it has none): how far a run that ended early got."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # a partial last line of a killed run
    return None


def read_status(run_dir: Path) -> RunStatus | None:
    """The last attempt's status, or None when no attempt wrote one (or it is unreadable)."""
    try:
        data = json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("state") not in ("finished", "stopped", "failed"):
        return None
    return RunStatus(state=data["state"], exit_status=int(data.get("exit_status", 0)), steps=data.get("steps"),
                     error=data.get("error"))


def resumable(status: RunStatus | None) -> bool:
    """Whether starting the run again continues it: it stopped early (a signal, the wall-clock budget), or a worker,
    an engine or a node was lost (exit 3). Not after bad input (2), a bug (1), or a finished run."""
    if status is None:
        return False
    return status["state"] == "stopped" or (status["state"] == "failed" and status["exit_status"] == 3)
