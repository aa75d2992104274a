"""Where third-party output goes: the run's train.log, never the console.

The driver's own Python logging already goes to train.log (Hydra's job logging, file handler only);
`capture_driver_output` adds Python warnings. Ray worker processes (policy workers, engines,
everything they spawn) run `redirect_worker_output` as Ray's `worker_process_setup_hook`: their
stdout and stderr, C libraries included, are appended to the same file, and Ray does not forward
worker output to the driver. The console keeps what rlpost prints: the plan, one progress bar,
`rlpost:` lines and the summary.

Known noise that lands there: vLLM's layerwise reload logs `RotaryEmbedding: Failed to load
weights` at each refit. It is harmless: the rotary cos/sin cache is computed, not a checkpoint
weight, so no refit carries it and vLLM puts its own cache back (reload/layerwise.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

ENV_VAR = "RLPOST_RUN_LOG"
SETUP_HOOK = "rlpost.runtime.run_log.redirect_worker_output"


def capture_driver_output(log_file: Path | None) -> None:
    """Route the driver's Python warnings to logging (train.log) and tell workers where the log is."""
    logging.captureWarnings(True)
    if log_file is not None:
        os.environ[ENV_VAR] = str(log_file)


def ray_errors_to_log() -> None:
    """In a run, the errors Ray's control plane publishes to drivers (a raylet that died, a worker the OOM killer
    took) go to train.log as warnings: Ray's driver prints them to the console from a thread of its own
    (`ray._private.worker.listen_error_messages`, through the module's `print_to_stdstream`, replaced here before
    `ray.init` starts that thread). What they mean reaches the console as rlpost's own one line."""
    if not run_log():
        return
    import ray._private.worker as ray_worker

    ray_log = logging.getLogger("rlpost.ray")  # not "ray": Ray gives that logger a console handler of its own

    def to_log(data: dict[str, object], ignore_prefix: bool) -> None:
        lines = data.get("lines")
        for line in lines if isinstance(lines, list) else []:
            ray_log.warning("(%s) %s", data.get("pid"), line)

    ray_worker.print_to_stdstream = to_log


def run_log() -> str | None:
    """The run's train.log, when a run set it."""
    return os.environ.get(ENV_VAR) or None


def redirect_worker_output() -> None:
    """In a Ray worker process: append stdout and stderr (file descriptors 1 and 2) to the run log."""
    path = run_log()
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:  # another node of a multi-node cluster: keep Ray's own log files there
        return
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.captureWarnings(True)
