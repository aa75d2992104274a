"""A stop asked for by a signal (rlpost.runner.StopOnSignal), seen by the waits that could outlast it.

The first SIGINT or SIGTERM during the steps lets the step finish and then stops. A step waiting on slow reward
functions would hold that stop for as long as its batch deadline (`env.*.batch_timeout_s`, minutes): a scheduler's
grace period (Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds) would end in SIGKILL first. Once a stop
is asked for, the verifier pool gives its batch GRACE_S more; what is unfinished then scores 0 and counts as a
timeout, exactly as at the batch deadline, and the step ends and is saved.
"""

from __future__ import annotations

import threading
import time

STOP = threading.Event()
"""Set by the first signal of a run's steps; cleared when the run's signal handling ends."""

GRACE_S = 5.0
"""How long a batch still being scored may go on after a stop is asked for."""

POLL_S = 0.5
"""How often a long wait looks at STOP."""


class BatchDeadline:
    """A batch's deadline that a stop request brings forward: once STOP is seen, at most GRACE_S from then."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        """The deadline (time.monotonic)."""
        self._stopping = False

    def passed(self) -> bool:
        """Whether the deadline has passed (a stop asked for since the last look moves it first)."""
        if STOP.is_set() and not self._stopping:
            self._stopping = True
            self.at = min(self.at, time.monotonic() + GRACE_S)
        return time.monotonic() >= self.at

    def wait_s(self, until: float | None = None) -> float:
        """How long a wait may block: to the deadline (or `until`, when sooner), and at most POLL_S, so that it wakes
        to see a stop."""
        return min(max(min(self.at, until if until is not None else self.at) - time.monotonic(), 0.0), POLL_S)
