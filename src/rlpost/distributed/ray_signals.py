"""SIGINT and SIGTERM stay the driver's while Ray runs.

Ray's core worker installs a C++ failure-signal handler in every process that connects to it, the driver included:
on SIGTERM it prints a stack dump and ends the process, so the Python handler that finishes the step and saves
(rlpost.runner.StopOnSignal) would never run. And a local head's processes (GCS, raylet, and through the raylet
every worker) start in the driver's process group, so a SIGTERM sent to the group (`timeout`, `kill -- -PGID`,
a terminal closing) ends them under the step that should finish.

Here:
- `skip_failure_handler()`: the driver connects without the failure handler (RAY_DISABLE_FAILURE_SIGNAL_HANDLER);
  workers keep theirs (`WORKER_SIGNAL_ENV`): a crash in a worker still dumps its stack to its log.
- `keep_driver_handlers()`: while `ray.init` runs, the two signals are only noted and Ray's own SIGTERM handler
  (it would `sys.exit(15)`) is not installed; after it, the driver's Python handlers are back and a signal noted
  meanwhile is raised again, for them.
- `head_in_own_process_group()`: the local head's processes start in a process group of their own; the driver
  stops them itself (`ray.shutdown()`) once the step is saved.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType, ModuleType

FAILURE_HANDLER_ENV = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"
"""Ray reads it when a process connects: "1" leaves that process's signal handlers alone."""

WORKER_SIGNAL_ENV = {FAILURE_HANDLER_ENV: "0"}
"""For the workers' runtime env: they keep Ray's handler, whatever the driver's environment says."""

_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def skip_failure_handler() -> None:
    """Before the driver connects to Ray: no C++ failure-signal handler in this process."""
    os.environ[FAILURE_HANDLER_ENV] = "1"


@contextlib.contextmanager
def keep_driver_handlers() -> Iterator[None]:
    """Inside the block (Ray connecting), SIGINT and SIGTERM are noted, not handled, and what Ray would install for
    SIGTERM is not installed; on leaving, this process's Python handlers are back and a signal noted meanwhile is
    handled by them (after the block: Ray is then either started or failed, never half-way)."""
    saved = {sig: signal.getsignal(sig) for sig in _HELD}
    noted: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        noted.append(signum)

    ray_utils: ModuleType | None
    try:
        from ray._private import utils as ray_utils
    except ImportError:  # pragma: no cover - another Ray layout
        ray_utils = None
    setter = getattr(ray_utils, "set_sigterm_handler", None)
    for sig in _HELD:
        signal.signal(sig, note)
    if setter is not None:
        setattr(ray_utils, "set_sigterm_handler", lambda handler: None)  # noqa: B010 - Ray's setter, for the block
    try:
        yield
    finally:
        if setter is not None:
            setattr(ray_utils, "set_sigterm_handler", setter)  # noqa: B010
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if noted:  # one is enough: the handler decides what a first signal means
            signal.raise_signal(noted[0])


@contextlib.contextmanager
def head_in_own_process_group() -> Iterator[None]:
    """Start the local head's processes (through Ray's process launcher) in a new process group inside the block.
    Where this Ray launches them otherwise, they start as Ray would."""
    try:
        from ray._private import services
    except ImportError:  # pragma: no cover - another Ray layout
        yield
        return
    popen = getattr(services, "ConsolePopen", None)
    if popen is None:  # pragma: no cover - another Ray layout
        yield
        return

    class OwnGroupPopen(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    setattr(services, "ConsolePopen", OwnGroupPopen)  # noqa: B010 - Ray's launcher, patched for the block
    try:
        yield
    finally:
        setattr(services, "ConsolePopen", popen)  # noqa: B010
