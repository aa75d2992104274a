"""How a run ends when something goes wrong: one line on the console, a documented exit status,
and the full traceback in the run's train.log.

| status | meaning |
|---|---|
| 2   | bad input: config, data, model directory, checkpoint |
| 3   | run-time failure: a worker or engine died or hung, the health gate, Ray unreachable |
| 130 | interrupted (Ctrl-C); 143 for SIGTERM, 129 for SIGHUP (the terminal closed) |
| 1   | an unexpected error (a bug): the line says where the traceback is |
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

EXIT_INPUT = 2
EXIT_RUNTIME = 3
EXIT_INTERRUPT = 130
EXIT_TERMINATED = 143
EXIT_HANGUP = 129
EXIT_INTERNAL = 1

SIGNAL_CODES = {signal.SIGINT: EXIT_INTERRUPT, signal.SIGTERM: EXIT_TERMINATED, signal.SIGHUP: EXIT_HANGUP}
"""The signals a run stops on, and the exit status each one ends it with (SIGHUP: the terminal closed, which a run
treats as SIGTERM)."""
STOPPED = frozenset(SIGNAL_CODES.values())
"""Exit statuses of a run a signal stopped."""

_log = logging.getLogger("rlpost")


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (Ctrl-C or SIGTERM); carries the exit status and, when the stop was not at a
    step boundary, `when` ("during start-up", "a second signal: ..."). A KeyboardInterrupt: no `except Exception` on
    the way out (a retry, a best-effort close) swallows it, and a wait inside Ray (`ray.get`) ends on it at once, as
    on Ctrl-C (Ray then raises a plain KeyboardInterrupt: the runner knows which signal it was)."""

    def __init__(self, signame: str, code: int, when: str = "") -> None:
        super().__init__(signame, code, when)
        self.signame = signame
        self.code = code
        self.when = when

    def __str__(self) -> str:
        return f"{self.signame} ({self.when})" if self.when else self.signame


def _input_errors() -> tuple[type[BaseException], ...]:
    from rlpost.config.errors import ConfigError
    from rlpost.data.datasets import DataError
    from rlpost.models.tiny import TinyTargetError
    from rlpost.runtime.checkpointing import CheckpointMismatch

    found: list[type[BaseException]] = [ConfigError, DataError, CheckpointMismatch, TinyTargetError]
    try:
        from rlpost.runtime.checkpointing import CheckpointError

        found.append(CheckpointError)
    except ImportError:
        pass
    return tuple(found)


def _runtime_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions

    from rlpost.algorithms.dynamic_sampling import DynamicSamplingExhausted
    from rlpost.algorithms.loop import HealthCheckError
    from rlpost.distributed.virtual_cluster import ClusterResourceError, ClusterUnavailable
    from rlpost.distributed.worker_groups import WorkerGroupError
    from rlpost.models.fingerprint import FingerprintMismatch

    return (
        HealthCheckError, DynamicSamplingExhausted, ClusterResourceError, ClusterUnavailable, FingerprintMismatch,
        WorkerGroupError, ray.exceptions.RayError,
    )


def exit_status(exc: BaseException) -> int:
    """The documented exit status for `exc`."""
    if isinstance(exc, Interrupted):
        return exc.code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPT
    if isinstance(exc, _input_errors()):
        return EXIT_INPUT
    if isinstance(exc, _runtime_errors()):
        return EXIT_RUNTIME
    return EXIT_INTERNAL


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(exc: BaseException, log_file: Path | None, resumes: bool = True) -> str:
    """The one line a person reads for `exc`; `resumes`: the command continues where it stopped when run again (a
    training run), so an interrupt says so."""
    where = f" (traceback in {log_file})" if log_file is not None else ""
    code = exit_status(exc)
    if code in STOPPED:
        name = str(exc) if isinstance(exc, Interrupted) else "SIGINT"
        if not resumes:
            return f"interrupted by {name}"
        return f"interrupted by {name}; re-run the same command to resume from the last checkpoint"
    if code == EXIT_INTERNAL:
        return f"unexpected {type(exc).__name__}: {_first_line(exc)}{where}"
    return _first_line(exc)


def log_traceback(exc: BaseException) -> None:
    """The full traceback goes to train.log (Hydra's file handler), never to the console."""
    _log.error("run ended with %s", type(exc).__name__, exc_info=(type(exc), exc, exc.__traceback__))
