"""Run a reward function in killable worker processes, each call bounded by a timeout.

A call that runs past `timeout_s` has its worker killed and replaced; the sample gets reward 0
and is counted, and the batch goes on. A call that raises gets reward 0 and is counted too.
Workers are spawned (not forked: the driver runs Ray's threads), so the reward function must be
an importable top-level function.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, List, Optional, Tuple

RewardFn = Callable[..., float]


def _worker_loop(fn: RewardFn, conn: Connection) -> None:
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        idx, args = msg
        try:
            conn.send((idx, float(fn(*args)), None))
        except Exception as exc:  # noqa: BLE001 - reported to the driver as an error
            conn.send((idx, 0.0, f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, ctx: Any, fn: RewardFn) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_loop, args=(fn, child), daemon=True)
        self.proc.start()
        child.close()
        self.busy: Optional[Tuple[int, float]] = None  # (sample index, deadline)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class VerifierPool:
    """`num_workers` processes computing `fn(*args)` per sample."""

    def __init__(self, fn: RewardFn, num_workers: int = 1, timeout_s: float = 10.0) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, fn) for _ in range(num_workers)]

    def map(self, args_list: List[Tuple[Any, ...]]) -> Tuple[List[float], int, int]:
        """(rewards, timeouts, errors) for each args tuple, in order."""
        results: List[float] = [0.0] * len(args_list)
        todo = list(range(len(args_list)))
        timeouts = errors = 0
        done = 0
        while done < len(args_list):
            for w in self._workers:
                if w.busy is None and todo:
                    i = todo.pop(0)
                    w.conn.send((i, args_list[i]))
                    w.busy = (i, time.monotonic() + self.timeout_s)
            busy = [w for w in self._workers if w.busy is not None]
            next_deadline = min(w.busy[1] for w in busy)  # type: ignore[index]
            ready = wait([w.conn for w in busy], timeout=max(next_deadline - time.monotonic(), 0.0))
            for w in busy:
                if w.conn in ready:
                    try:
                        idx, value, err = w.conn.recv()
                    except EOFError:  # the worker died (e.g. killed by the OS)
                        idx, value, err = w.busy[0], 0.0, "worker died"  # type: ignore[index]
                        self._replace(w)
                    results[idx] = value
                    errors += err is not None
                    w.busy = None
                    done += 1
                elif w.busy is not None and time.monotonic() >= w.busy[1]:
                    results[w.busy[0]] = 0.0
                    timeouts += 1
                    done += 1
                    self._replace(w)
        return results, timeouts, errors

    def _replace(self, w: _Worker) -> None:
        i = self._workers.index(w)
        w.kill()
        self._workers[i] = _Worker(self._ctx, self.fn)

    def shutdown(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except Exception:  # noqa: BLE001
                pass
            w.kill()
        self._workers = []
