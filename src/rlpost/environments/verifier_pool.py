"""Run a reward function in killable worker processes, each call bounded by a timeout.

A call that runs past `timeout_s` has its worker killed and replaced; the sample gets reward 0
and is counted, and the batch goes on. A call that raises gets reward 0 and is counted too.
The whole batch is bounded by `batch_timeout_s`: what is unfinished then gets reward 0 and counts
as a timeout. Up to `num_workers` calls run at once.

Every worker is warmed before any clock starts: it imports the reward function's module, runs the
optional `warmup` hook (e.g. one dummy verification) and reports ready; only then does it get a
call. A replaced worker warms up the same way before its next call, so a slow import never counts
against `timeout_s`. Warm-up has its own bound, `warmup_timeout_s`.

Workers are spawned (not forked: the driver runs Ray's threads), so the reward function and the
warm-up hook must be importable top-level functions.

A pool of one worker queues up to MAX_IN_FLIGHT samples in its pipe at once (at most MAX_QUEUED_BYTES of them,
the running one counted, though a sample alone always goes), so a cheap reward function does not pay one pipe round trip per sample (256
exact-match rewards: 16.7 ms one by one, 3.3 ms queued, in a driver with Ray running). The worker runs them in order; the next one's timeout clock starts when the
previous result arrives; when the worker is killed (timeout) or dies, the samples queued behind the culprit go
back to the queue and only the culprit is charged. That is what one worker did sample by sample anyway. A pool
of several workers sends one sample at a time to whichever is free, so a hung call never holds up samples
another worker could take.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from rlpost.config.schema.env import EnvConfig

RewardFn = Callable[..., float]
WarmupFn = Callable[[], None]

_READY = -1  # sample index of the message a worker sends once it is warm
MAX_IN_FLIGHT = 16
"""Most samples queued in a single worker's pipe."""
MAX_QUEUED_BYTES = 16 * 1024
"""Most bytes of samples sent to one worker and not yet answered (the running one counted; a sample alone always
goes): a pipe holds 64 KiB, and a send into the full pipe of a hung worker would block the driver past every
timeout."""


def _worker_loop(fn: RewardFn, warmup: WarmupFn | None, conn: Connection) -> None:
    # A terminal's Ctrl-C reaches the whole process group; the driver decides, the verifier keeps quiet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    err: str | None = None
    if warmup is not None:
        try:
            warmup()
        except Exception as exc:  # noqa: BLE001 - the calls themselves will report their errors
            err = f"{type(exc).__name__}: {exc}"
    conn.send((_READY, 0.0, err))
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
    def __init__(self, ctx: Any, fn: RewardFn, warmup: WarmupFn | None, warmup_timeout_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_loop, args=(fn, warmup, child), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.ready_by = time.monotonic() + warmup_timeout_s
        self.busy: deque[int] = deque()  # sample indices sent, in order; the first one is running
        self.queued_bytes: dict[int, int] = {}  # pickled size of each sent sample's message
        self.deadline = 0.0  # when the running one times out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


@dataclass
class PoolResult:
    """Rewards of one batch and what went wrong."""

    rewards: list[float]
    """One reward per args tuple, in order (0 for a timeout or an error)."""
    timeouts: int = 0
    """Calls killed after timeout_s, plus samples unfinished at the batch deadline."""
    errors: int = 0
    """Calls that raised, or whose worker died."""
    unfinished: int = 0
    """Of the timeouts, samples still queued or running when batch_timeout_s ran out."""
    seconds: float = 0.0
    """Wall time of the batch, warm-up excluded."""
    status: list[str] = field(default_factory=list)
    """Per args tuple: 'ok', 'timeout' (killed after timeout_s), 'unfinished' (batch deadline) or 'error: ...'."""


class VerifierPool:
    """`num_workers` warmed processes computing `fn(*args)` per sample, in parallel."""

    def __init__(
        self,
        fn: RewardFn,
        num_workers: int = 1,
        timeout_s: float = 10.0,
        batch_timeout_s: float = 300.0,
        warmup: WarmupFn | None = None,
        warmup_timeout_s: float = 120.0,
    ) -> None:
        self.fn = fn
        self.warmup = warmup
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers = [self._spawn() for _ in range(num_workers)]

    @classmethod
    def from_config(cls, fn: RewardFn, cfg: EnvConfig, warmup: WarmupFn | None = None) -> VerifierPool:
        """A pool sized and bounded by an environment config."""
        return cls(fn, cfg.num_workers, cfg.timeout_s, cfg.batch_timeout_s, warmup)

    def map(self, args_list: list[tuple[Any, ...]]) -> tuple[list[float], int, int]:
        """(rewards, timeouts, errors) for each args tuple, in order."""
        r = self.run(args_list)
        return r.rewards, r.timeouts, r.errors

    def run(self, args_list: list[tuple[Any, ...]]) -> PoolResult:
        """Score every args tuple; returns once all are done or the batch deadline has passed."""
        self._await_ready()
        t0 = time.monotonic()
        batch_deadline = t0 + self.batch_timeout_s
        res = PoolResult([0.0] * len(args_list), status=["unfinished"] * len(args_list))
        todo: deque[int] = deque(range(len(args_list)))
        depth = MAX_IN_FLIGHT if len(self._workers) == 1 else 1
        done = 0
        while done < len(args_list):
            if time.monotonic() >= batch_deadline:
                for w in [w for w in self._workers if w.busy]:
                    self._replace(w)
                res.unfinished = len(args_list) - done
                res.timeouts += res.unfinished
                break
            for w in self._workers:
                while w.ready and len(w.busy) < depth and todo:
                    msg = ForkingPickler.dumps((todo[0], args_list[todo[0]]))
                    if w.busy and sum(w.queued_bytes.values()) + len(msg) > MAX_QUEUED_BYTES:
                        break
                    i = todo.popleft()
                    w.conn.send_bytes(msg)  # what conn.send does, with the size known first
                    if not w.busy:
                        w.deadline = time.monotonic() + self.timeout_s
                    w.busy.append(i)
                    w.queued_bytes[i] = len(msg)
            waiting = [w for w in self._workers if w.busy or not w.ready]
            deadlines = [w.deadline if w.busy else w.ready_by for w in waiting]
            until = min(deadlines + [batch_deadline])
            ready = wait([w.conn for w in waiting], timeout=max(until - time.monotonic(), 0.0))
            now = time.monotonic()
            for w in waiting:
                if w.conn in ready:
                    done += self._receive(w, res, todo)
                elif w.busy and now >= w.deadline:
                    res.timeouts += 1
                    res.status[w.busy[0]] = "timeout"
                    done += 1
                    todo.extendleft(reversed(list(w.busy)[1:]))  # queued behind the hung one: not its fault
                    self._replace(w)
                elif not w.ready and now >= w.ready_by:
                    raise self._not_ready_error()
        res.seconds = time.monotonic() - t0
        return res

    def _receive(self, w: _Worker, res: PoolResult, todo: deque[int] | None = None) -> int:
        """Handle one message from `w`; 1 when it finished a sample. A dead worker's queued samples go back to
        `todo`."""
        try:
            idx, value, err = w.conn.recv()
        except (EOFError, OSError):  # the worker died (e.g. killed by the OS)
            if not w.busy:
                raise RuntimeError(f"a verifier worker for {self._fn_name()} died while warming up") from None
            res.errors += 1
            res.status[w.busy[0]] = "error: the worker died"
            if todo is not None:
                todo.extendleft(reversed(list(w.busy)[1:]))
            self._replace(w)
            return 1
        if idx == _READY:
            w.ready = True
            return 0
        res.rewards[idx] = value
        res.errors += err is not None
        res.status[idx] = "ok" if err is None else f"error: {err}"
        w.busy.popleft()
        w.queued_bytes.pop(idx, None)
        if w.busy:  # the worker starts the next queued sample now
            w.deadline = time.monotonic() + self.timeout_s
        return 1

    def _await_ready(self) -> None:
        """Block until every worker has warmed up (each within warmup_timeout_s of its start)."""
        while True:
            cold = [w for w in self._workers if not w.ready]
            if not cold:
                return
            until = min(w.ready_by for w in cold)
            ready = wait([w.conn for w in cold], timeout=max(until - time.monotonic(), 0.0))
            for w in cold:
                if w.conn in ready:
                    self._receive(w, PoolResult([]))
                elif time.monotonic() >= w.ready_by:
                    raise self._not_ready_error()

    def _not_ready_error(self) -> RuntimeError:
        return RuntimeError(
            f"a verifier worker for {self._fn_name()} was not ready within {self.warmup_timeout_s:g} s "
            "(importing the reward function and its warm-up call)"
        )

    def _fn_name(self) -> str:
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', '?')}"

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.fn, self.warmup, self.warmup_timeout_s)

    def _replace(self, w: _Worker) -> None:
        i = self._workers.index(w)
        w.kill()
        self._workers[i] = self._spawn()

    def shutdown(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except Exception:  # noqa: BLE001
                pass
            w.kill()
        self._workers = []
