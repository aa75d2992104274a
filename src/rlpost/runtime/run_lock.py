"""One run per directory: an OS lock on `<dir>/.rlpost.lock`, held from before a run writes anything until it has
released its resources.

The lock is `fcntl.flock` on the lock file, so the kernel drops it when the holder dies, however it dies: a
lock left by a killed run (kill -9) is simply taken, with one warning naming the process that held it. The file
holds the holder's pid, host and start time, for the message a second run exits 2 with. It stays in the
directory (empty once released: removing a flock'd file races with the next run that opened it); its name
matches nothing that lists a run directory (step_N checkpoints, numbered multirun jobs).

The pid is never checked against live processes: a holder on another host sharing the filesystem cannot be seen
that way, and a pid may have been reused. The kernel's lock decides. On local filesystems and on NFS (where
Linux maps flock to a byte-range lock) it protects across hosts too; on a filesystem without locks the run goes
on with one warning that it is not protected.

Within one process the lock is re-entrant: `rlpost train` takes the run directory before Hydra writes into it,
and the job takes it again (and each multirun job its own directory) when it starts.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from rlpost.config.errors import ConfigError

LOCK_FILE = ".rlpost.lock"
"""The lock file's name in a locked directory."""


@dataclass
class _Held:
    fd: int | None  # None: the filesystem has no locks; the run goes on unprotected
    count: int


_held: dict[str, _Held] = {}
"""Directories this process holds (realpath -> its lock), for re-entry."""


class RunLock:
    """This process's hold on one directory; `release` (or leaving the `with` block) gives it back once."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = directory
        self.key = key
        self._real = os.path.realpath(directory)
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        held = _held.get(self._real)
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        del _held[self._real]
        if held.fd is None:
            return
        try:
            os.ftruncate(held.fd, 0)  # a clean release leaves no holder behind: the next run takes it silently
            fcntl.flock(held.fd, fcntl.LOCK_UN)
        finally:
            os.close(held.fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def _read(fd: int) -> dict[str, object]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe_holder(info: dict[str, object]) -> str:
    """'pid 1234 on host h (started 12:00:01)' from a lock file's contents."""
    if "pid" not in info:
        return "another run (it has not written its pid yet)"
    started = info.get("started")
    when = ""
    if isinstance(started, (int, float)):
        fmt = "%H:%M:%S" if time.localtime(started)[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M:%S"
        when = f" (started {time.strftime(fmt, time.localtime(started))})"
    return f"pid {info['pid']} on host {info.get('host', '?')}{when}"


def acquire(directory: Path, key: str) -> RunLock:
    """Lock `directory` (created if missing) for this process, or raise ConfigError(key, directory) naming the
    holder. `key` is the setting that chose the directory (hydra.run.dir, checkpointing.checkpoint_dir)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(key, str(directory), f"cannot create the directory ({exc.strerror})") from None
    lock = RunLock(directory, key)
    held = _held.get(lock._real)
    if held is not None:
        held.count += 1
        return lock
    try:
        fd = os.open(Path(lock._real) / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(key, str(directory), f"cannot write the directory ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            _warn(f"{key}={str(directory)!r}: cannot lock it ({exc.strerror}); a second run on the same "
                  "directory would not be refused")
            _held[lock._real] = _Held(None, 1)
            return lock
        holder = describe_holder(_read(fd))
        os.close(fd)
        raise ConfigError(key, str(directory), f"in use by {holder}; wait for it or choose another {key}") from None
    previous = _read(fd)
    if previous:
        _warn(f"{key}={str(directory)!r}: taking over the lock of {describe_holder(previous)}, which ended "
              "without releasing it")
    me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, me, 0)
    _held[lock._real] = _Held(fd, 1)
    return lock


def _warn(msg: str) -> None:
    # printed, not logged: before Hydra configures logging, a warning record would reach stderr a second time
    print(f"rlpost: warning: {msg}", file=sys.stderr, flush=True)
