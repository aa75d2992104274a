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

A pool of one worker sends it the whole batch in one message, and the worker answers in a few messages (whenever FLUSH_S
has passed since its last one, and at the end), so a cheap reward function does not pay a pipe round trip per sample,
which would cost more than the reward itself. Timeouts stay per sample and exact: before each call the worker writes
which sample it starts and when into a small shared-memory slot, so the driver knows which call is running, kills the
worker when that call passes `timeout_s`, and charges only it. The samples after it go to the replacement, and so do
those finished but not yet reported: a reward is a pure function of its arguments, so running it again is safe. A pool
of several workers sends one sample at a time to whichever is free, so a hung call never holds up samples another worker
could take.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from typing import Protocol

from rlpost.config.schema.env import EnvConfig
from rlpost.runtime import stop_request

RewardFn = Callable[..., float]
WarmupFn = Callable[[], None]



class _Slot(Protocol):
    """A worker's shared progress slot: two doubles (multiprocessing's RawArray('d', 2))."""

    def __getitem__(self, i: int) -> float: ...

    def __setitem__(self, i: int, value: float) -> None: ...


_READY = -1  # sample index of the message a worker sends once it is warm
FLUSH_S = 0.05
"""A worker running a batch reports the results it has whenever this long has passed since its last report (and at
the end): a slow reward function's progress stays visible and a kill loses at most this much finished work."""


def _worker_loop(fn: RewardFn, warmup: WarmupFn | None, conn: Connection, progress: _Slot) -> None:
    # A terminal's Ctrl-C reaches the whole process group; the driver decides, the verifier keeps quiet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    err: str | None = None
    if warmup is not None:
        try:
            warmup()
        except Exception as exc:  # noqa: BLE001 - the calls themselves will report their errors
            err = f"{type(exc).__name__}: {exc}"
    conn.send([(_READY, 0.0, err)])
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        out: list[tuple[int, float, str | None]] = []
        reported = time.monotonic()
        for idx, args in batch:
            _Progress.start(progress, idx)
            try:
                out.append((idx, float(fn(*args)), None))
            except Exception as exc:  # noqa: BLE001 - reported to the driver as an error
                out.append((idx, 0.0, f"{type(exc).__name__}: {exc}"))
            _Progress.stop(progress)
            if time.monotonic() - reported >= FLUSH_S:
                conn.send(out)
                out, reported = [], time.monotonic()
        if out:
            conn.send(out)


class _Progress:
    """A worker's shared slot [running sample index (-1: none), its start on the monotonic clock]. The writer sets
    the index to -1 before the start time and the new index after it, so a reader that sees the same index before
    and after reading the time has that sample's start time."""

    @staticmethod
    def start(slot: _Slot, idx: int) -> None:
        slot[0] = -1.0
        slot[1] = time.monotonic()
        slot[0] = float(idx)

    @staticmethod
    def stop(slot: _Slot) -> None:
        slot[0] = -1.0

    @staticmethod
    def read(slot: _Slot) -> tuple[int, float] | None:
        """(index, start) of the sample the worker is running, or None between samples."""
        while True:
            first, started, again = slot[0], slot[1], slot[0]
            if first == again:
                return None if first < 0 else (int(first), started)


class _Worker:
    def __init__(self, ctx: SpawnContext, fn: RewardFn, warmup: WarmupFn | None, warmup_timeout_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.progress = ctx.RawArray("d", [-1.0, 0.0])
        self.proc = ctx.Process(target=_worker_loop, args=(fn, warmup, child, self.progress), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.ready_by = time.monotonic() + warmup_timeout_s
        self.busy: list[int] = []  # sample indices sent and not yet answered

    def running(self) -> tuple[int, float] | None:
        """(sample, start) of the call running now, if it is one of ours."""
        now = _Progress.read(self.progress)
        return now if now is not None and now[0] in self.busy else None

    def deadline(self, timeout_s: float) -> float:
        """When the running call times out; between calls (a moment), soon: look again then."""
        now = self.running()
        return now[1] + timeout_s if now is not None else time.monotonic() + FLUSH_S

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
    messages: int = 0
    """Messages of results the driver read for this batch (each one a pipe read and a wake-up of the driver)."""


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

    def map(self, args_list: Sequence[tuple[object, ...]]) -> tuple[list[float], int, int]:
        """(rewards, timeouts, errors) for each args tuple, in order."""
        r = self.run(args_list)
        return r.rewards, r.timeouts, r.errors

    def run(self, args_list: Sequence[tuple[object, ...]]) -> PoolResult:
        """Score every args tuple; returns once all are done or the batch deadline has passed."""
        self._await_ready()
        t0 = time.monotonic()
        batch_deadline = stop_request.BatchDeadline(self.batch_timeout_s)  # a stop asked for: GRACE_S more
        res = PoolResult([0.0] * len(args_list), status=["unfinished"] * len(args_list))
        todo: deque[int] = deque(range(len(args_list)))
        whole = len(self._workers) == 1
        done = 0
        while done < len(args_list):
            if batch_deadline.passed():
                for w in [w for w in self._workers if w.busy]:
                    self._replace(w)
                res.unfinished = len(args_list) - done
                res.timeouts += res.unfinished
                break
            for w in self._workers:
                if w.ready and not w.busy and todo:
                    take = list(todo) if whole else [todo[0]]
                    try:  # an idle worker is at its recv, so even a large batch goes straight through
                        w.conn.send([(i, args_list[i]) for i in take])
                    except OSError:  # it died while idle: nothing of this batch was charged, the replacement takes it
                        self._replace(w)
                        continue
                    for _ in take:
                        todo.popleft()
                    w.busy = take
            waiting = [w for w in self._workers if w.busy or not w.ready]
            deadlines = [w.deadline(self.timeout_s) if w.busy else w.ready_by for w in waiting]
            ready = wait([w.conn for w in waiting], timeout=batch_deadline.wait_s(min(deadlines, default=None)))
            now = time.monotonic()
            for w in waiting:
                if w.conn in ready:
                    done += self._receive(w, res, todo)
                elif w.busy and (running := w.running()) is not None and now >= running[1] + self.timeout_s:
                    res.timeouts += 1
                    res.status[running[0]] = "timeout"
                    done += 1
                    self._requeue(w, todo, running[0])
                    self._replace(w)
                elif not w.ready and now >= w.ready_by:
                    raise self._not_ready_error()
        res.seconds = time.monotonic() - t0
        return res

    @staticmethod
    def _requeue(w: _Worker, todo: deque[int], culprit: int | None) -> None:
        """Put `w`'s unanswered samples but the culprit back at the front of the queue, in order."""
        todo.extendleft(reversed([i for i in w.busy if i != culprit]))
        w.busy = []

    def _receive(self, w: _Worker, res: PoolResult, todo: deque[int]) -> int:
        """Handle one message from `w`; the samples it finished. A dead worker charges the sample it was running
        (the first unanswered one when it died between calls) and its other samples go back to `todo`."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker died (e.g. killed by the OS)
            if not w.busy:
                raise RuntimeError(f"a verifier worker for {self._fn_name()} died while warming up") from None
            running = w.running()
            culprit = running[0] if running is not None else w.busy[0]
            res.errors += 1
            res.status[culprit] = "error: the worker died"
            self._requeue(w, todo, culprit)
            self._replace(w)
            return 1
        finished = 0
        res.messages += 1
        for idx, value, err in msg:
            if idx == _READY:
                w.ready = True
                continue
            res.rewards[idx] = value
            res.errors += err is not None
            res.status[idx] = "ok" if err is None else f"error: {err}"
            w.busy.remove(idx)
            finished += 1
        return finished

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
                    self._receive(w, PoolResult([]), deque())
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
