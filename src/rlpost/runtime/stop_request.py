"""A stop asked for by a signal (rlpost.runner.StopOnSignal), seen by the waits that could outlast it.

The first SIGINT or SIGTERM during the steps lets the step finish and then stops. A step waiting on slow reward
functions would hold that stop for as long as its batch deadline (`env.*.batch_timeout_s`, minutes): a scheduler's
grace period (Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds) would end in SIGKILL first. Once a stop
is asked for, the verifier pool gives its batch GRACE_S more; what is unfinished then scores 0 and counts as a
timeout, exactly as at the batch deadline, and the step ends and is saved.
"""

from __future__ import annotations

import threading

STOP = threading.Event()
"""Set by the first signal of a run's steps; cleared when the run's signal handling ends."""

GRACE_S = 5.0
"""How long a batch still being scored may go on after a stop is asked for."""

POLL_S = 0.5
"""How often a long wait looks at STOP."""
