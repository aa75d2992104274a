"""The local Ray head ends with its driver, even a driver killed with SIGKILL.

`kill -9` of a driver runs none of its clean-up (`ray.shutdown()`, atexit). Ray's own fate sharing then stops the
GCS and the raylet, but the processes the raylet launched (the dashboard and runtime-env agents, idle workers) keep
running. The reaper is this file run as a separate, small process beside the local head (it imports the standard
library only: `python -I -S` runs it without the venv's packages or its own directory on the path). It polls the
driver and, once the driver is gone, kills the head's process groups (the head starts each of its processes in a
group of its own: rlpost.distributed.ray_signals). It ends by itself once those groups are empty, which is how a
run that ends normally (`ray.shutdown()`) leaves it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
"""How often the reaper looks at the driver and the groups."""


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (the process's start time in clock ticks since boot), or None once the process
    is gone or a zombie: with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(driver: int, born: str, poll_s: float, groups: list[int]) -> None:
    """The reaper's loop: until the groups are empty, or until the driver is gone and they are killed."""
    while True:
        time.sleep(poll_s)
        groups = [g for g in groups if _group_alive(g)]
        if not groups:
            return
        if _start_time(driver) != born:
            for g in groups:
                with contextlib.suppress(OSError):
                    os.killpg(g, signal.SIGKILL)
            return


def head_groups() -> list[int]:
    """The process groups of the local head this driver started (never the driver's own group)."""
    from ray._private import worker

    processes = getattr(getattr(worker, "_global_node", None), "all_processes", None) or {}
    own = os.getpgid(0)
    groups: set[int] = set()
    for infos in processes.values():
        for info in infos:
            pid = getattr(getattr(info, "process", None), "pid", None)
            if pid is None:
                continue
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
    groups.discard(own)
    return sorted(groups)


_reaper: subprocess.Popen[bytes] | None = None
"""The reaper of this driver's latest local head (kept, so that it is waited for, not left a zombie)."""


def start_reaper() -> None:
    """Start the reaper for the local head just started (none where there is nothing to watch: no /proc, or no
    head process in a group of its own)."""
    global _reaper
    if _reaper is not None:
        _reaper.poll()  # the last head's reaper ended with it: reap it
    groups = head_groups()
    born = _start_time(os.getpid())
    if not groups or born is None:
        return
    _reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", __file__, str(os.getpid()), born, str(POLL_S), *map(str, groups)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
        start_new_session=True,  # not in the terminal's group: Ctrl-C and a closed terminal reach the driver only
    )


if __name__ == "__main__":  # the reaper process: python -S head_reaper.py DRIVER_PID START_TIME POLL_S PGID...
    reap(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), [int(g) for g in sys.argv[4:]])
