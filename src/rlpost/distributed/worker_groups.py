"""RayWorkerGroup: one Ray actor per rank, data-parallel dispatch, and calls that never hang.

Ranks are laid out tp-fastest, then cp, then dp, then pp (Megatron's order):
    rank = ((pp * DP + dp) * CP + cp) * TP + tp
Sharded calls send shard `dp` to every rank with that dp coordinate (replicated over tp/cp/pp) and
keep one result per dp shard (from tp=0, cp=0 and the last pipeline stage), so nothing is
duplicated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, NoReturn, ParamSpec, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rlpost.distributed import placement
from rlpost.distributed.virtual_cluster import WORKER_ENV, RayVirtualCluster

_T = TypeVar("_T")
_P = ParamSpec("_P")
_S = TypeVar("_S")

Method = Callable[Concatenate[Any, _P], _T]
"""A worker method, named by the class or protocol that declares it (`PolicyWorker.train`): the call is checked
against its signature and its result typed, and the actor is called by the method's name."""


class WorkerGroupError(RuntimeError):
    """A worker died or a call did not finish in time; the message names the worker."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the rank grid."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        return {
            "tp": rank % self.tp,
            "cp": (rank // self.tp) % self.cp,
            "dp": (rank // (self.tp * self.cp)) % self.dp,
            "pp": rank // (self.tp * self.cp * self.dp),
        }

    def is_output_rank(self, rank: int) -> bool:
        c = self.coords(rank)
        return c["tp"] == 0 and c["cp"] == 0 and c["pp"] == self.pp - 1


ALIVE_TIMEOUT_S = 30.0
"""Bound of a liveness check (a live actor answers a cheap call at once)."""


class ActorGroup:
    """Ray actors called together: every call bounded by a timeout, a dead or failing actor named in one line
    (WorkerGroupError; the group is killed on a timeout or a death), shutdown graceful first, then kill."""

    def __init__(self, workers: list[Any], name_prefix: str, timeout_s: float) -> None:
        self.workers = workers
        self.name_prefix = name_prefix
        self.timeout_s = timeout_s
        self.failure: str | None = None
        """What shut the group down (a dead or hung actor), once one did."""
        self.nodes: dict[int, str] = {}
        """The Ray node of each actor placed with `place` (by index)."""

    def describe(self, index: int) -> str:
        return f"{self.name_prefix} {index}"

    def place(self, index: int, node_id: str) -> None:
        """Record that actor `index` runs on `node_id` (rlpost.distributed.placement): a lost node then names it."""
        self.nodes[index] = node_id
        placement.place(node_id, self._label(index))

    def _label(self, index: int) -> str:
        return f"{self.name_prefix} {index}"

    def get(self, futures: Sequence[ray.ObjectRef[_T]], timeout_s: float | None = None, indices: list[int] | None = None
            ) -> list[_T]:
        """ray.get with a timeout; `indices[i]` is the actor of futures[i] (default: the i-th actor)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        who = indices if indices is not None else list(range(len(futures)))
        if len(futures) == 1:  # one call (one engine, one policy rank): one wait on the core worker, not three
            try:
                return [ray.get(futures[0], timeout=timeout)]
            except GetTimeoutError:
                self._fail(f"call did not finish within {timeout:.0f}s on {self.describe(who[0])}")
            except (RayActorError, RayTaskError) as exc:
                self._raise_for(exc, who[0])
        deadline = time.monotonic() + timeout
        pending = list(futures)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                late = [who[futures.index(f)] for f in pending]
                self._fail(f"call did not finish within {timeout:.0f}s on " + ", ".join(self.describe(r) for r in late))
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
            for f in done:
                try:
                    ray.get(f, timeout=0)
                except (RayActorError, RayTaskError) as exc:
                    self._raise_for(exc, who[futures.index(f)])
                except GetTimeoutError:  # pragma: no cover - done futures don't time out
                    pass
        return ray.get(list(futures), timeout=max(deadline - time.monotonic(), 1.0))

    async def get_async(self, future: Awaitable[_T], index: int) -> _T:
        """`get` of one future of actor `index`, awaited from a coroutine (per-sample rollouts): the same
        timeout and the same one-line errors."""

        async def result() -> _T:
            return await future

        try:
            return await asyncio.wait_for(result(), timeout=self.timeout_s)
        except TimeoutError:
            self._fail(f"call did not finish within {self.timeout_s:.0f}s on {self.describe(index)}")
        except (RayActorError, RayTaskError) as exc:
            self._raise_for(exc, index)

    def next_of(self, stream: ray.ObjectRefGenerator, index: int, timeout_s: float | None = None) -> Any:
        """The next value of a streaming call (a Ray generator method) on actor `index`, within the timeout; a hang,
        an error or a dead actor is named as `get` names them."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        ready, _ = ray.wait([stream], timeout=timeout)
        if not ready:
            self._fail(f"streaming call yielded nothing within {timeout:.0f}s on {self.describe(index)}")
        try:
            ref = next(stream)
        except StopIteration:
            self._fail(f"streaming call on {self.describe(index)} ended early")
        return self.get([ref], timeout, [index])[0]

    def _raise_for(self, exc: Exception, index: int) -> NoReturn:
        if isinstance(exc, RayActorError) and getattr(exc, "_actor_init_failed", False):
            # Ray's text: "... error raised in its creation task, <the remote traceback>"; its last line is the error
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            name, sep, msg = lines[-1].partition(": ") if lines else ("", "", "")
            head = f"{name.rsplit('.', 1)[-1]}: {msg}" if sep else (lines[-1] if lines else "an unknown error")
            self._fail(f"{self.describe(index)} failed to start: {head}\n{exc}")
        # A node of the group died (this actor's, or a peer's whose loss this rank's collective saw first): name the
        # node and everything it took down.
        lost = placement.lost_among([self.nodes.get(index, ""), *self.nodes.values()])
        if lost is not None:
            self._fail(f"{lost}\n{exc}")
        if isinstance(exc, RayActorError):
            self._fail(f"{self.describe(index)} died: {str(exc).splitlines()[0]}")
        cause = getattr(exc, "cause", None)
        head = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}" \
            if cause is not None else str(exc).splitlines()[0]
        # One line first (what the console shows), then the remote traceback for train.log.
        raise WorkerGroupError(f"{self.describe(index)} raised {head}\n{exc}") from None

    def call_all(self, method: Method[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> list[_T]:
        """Call `method` on every actor with the same arguments; results in actor order."""
        return self.get(self.call_async(method, *args, **kwargs))

    def call_async(self, method: Method[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> list[ray.ObjectRef[_T]]:
        """`call_all` without waiting: one future per actor (actor order), for `get`."""
        return [getattr(w, method.__name__).remote(*args, **kwargs) for w in self.workers]

    def submit(self, index: int, method: Method[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> ray.ObjectRef[_T]:
        """Call `method` on actor `index` without waiting (one actor's own arguments); `get` the future."""
        return getattr(self.workers[index], method.__name__).remote(*args, **kwargs)

    def _fail(self, msg: str) -> NoReturn:
        self.failure = msg
        self.shutdown()
        raise WorkerGroupError(msg)

    def check_alive(self, method: Callable[[Any], object], timeout_s: float) -> None:
        """Call the cheap `method` on every actor: a dead one is named (WorkerGroupError). A group already shut down
        by a failure another call saw first raises that failure (it has no actors left to ask)."""
        if self.failure is not None:
            raise WorkerGroupError(self.failure)
        self.get([getattr(w, method.__name__).remote() for w in self.workers], timeout_s=timeout_s)

    def shutdown(self, graceful_method: Callable[[Any], object] | None = None, timeout_s: float = 30.0) -> None:
        """Optionally call `graceful_method` on every rank (bounded), then kill the actors."""
        if graceful_method and self.workers:
            try:
                ray.wait(
                    [getattr(w, graceful_method.__name__).remote() for w in self.workers],
                    num_returns=len(self.workers),
                    timeout=timeout_s,
                )
            except Exception:  # noqa: BLE001 - best effort
                pass
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.workers = []
        placement.forget([self._label(i) for i in self.nodes])
        self.nodes = {}


class RayWorkerGroup(ActorGroup):
    """Actors of `actor_cls` (a plain class; wrapped with ray.remote here), one per rank."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        actor_cls: type,
        *args: object,
        dims: ParallelDims | None = None,
        name_prefix: str = "worker",
        env_vars: dict[str, str] | None = None,
        timeout_s: float = 900.0,
        concurrency_groups: dict[str, int] | None = None,
        max_concurrency: int = 2,
        **kwargs: object,
    ) -> None:
        """`concurrency_groups`: Ray concurrency groups of the actors (name -> threads), beside the default one.
        `max_concurrency`: threads of the default group (2 lets a `ping` through while a long call runs; 1 runs
        every call on the actor's main thread, in the order sent)."""
        self.cluster = cluster
        self.dims = dims or ParallelDims(dp=cluster.world_size)
        if self.dims.world_size != cluster.world_size:
            raise ValueError(
                f"{name_prefix}: parallel dims {self.dims} need {self.dims.world_size} workers, "
                f"the cluster has {cluster.world_size}"
            )
        super().__init__([], name_prefix, timeout_s)
        addr, port = cluster.get_master_address_and_port()
        # Ray takes concurrency groups only at ray.remote, not in .options()
        remote: Any = ray.remote  # its typed overloads omit concurrency_groups
        remote_cls: Any = (remote(concurrency_groups=dict(concurrency_groups))(actor_cls) if concurrency_groups
                           else remote(actor_cls))
        for rank in range(self.dims.world_size):
            env = {
                **WORKER_ENV,
                **cluster.thread_env(rank),
                **(env_vars or {}),
                "RANK": str(rank),
                "LOCAL_RANK": str(cluster.local_rank(rank)),
                "WORLD_SIZE": str(self.dims.world_size),
                "MASTER_ADDR": addr,
                "MASTER_PORT": str(port),
            }
            opts = cluster.scheduling(rank)
            opts["runtime_env"] = {"env_vars": env}
            opts["name"] = f"{name_prefix}-{rank}-{id(self):x}"
            if max_concurrency > 1:
                opts["max_concurrency"] = max_concurrency
            self.workers.append(remote_cls.options(**opts).remote(*args, **kwargs))
            self.place(rank, cluster.bundle_for_rank(rank).node_id)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def describe(self, rank: int) -> str:
        return f"{self.name_prefix} rank {rank} on node {self.cluster.node_of_rank(rank)}"

    def _label(self, index: int) -> str:
        return f"{self.name_prefix} rank {index}"

    # ---- dispatch -------------------------------------------------------------------------
    def run_all(self, method: Method[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> list[_T]:
        """Call `method` on every rank with the same arguments; results in rank order."""
        return self.call_all(method, *args, **kwargs)

    def run_rank0(self, method: Method[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return self.get([self.submit(0, method, *args, **kwargs)])[0]

    def run_sharded(self, method: Callable[Concatenate[Any, _S, _P], _T], shards: Sequence[_S], *args: _P.args,
                    **kwargs: _P.kwargs) -> list[_T]:
        """Send `shards[dp]` to every rank of data-parallel index dp (the method's first argument); one result per
        shard (dp order)."""
        return self.collect_sharded(self.submit_sharded(method, shards, *args, **kwargs))

    def submit_sharded(self, method: Callable[Concatenate[Any, _S, _P], _T], shards: Sequence[_S], *args: _P.args,
                       **kwargs: _P.kwargs) -> list[ray.ObjectRef[_T]]:
        """`run_sharded` without waiting: one future per rank (rank order), for `collect_sharded`."""
        if len(shards) != self.dims.dp:
            raise ValueError(f"{len(shards)} shards for data-parallel size {self.dims.dp}")
        dps = [self.dims.coords(r)["dp"] for r in range(len(self.workers))]
        # A shard several ranks read (TP/PP peers) is stored once; one that a single rank reads goes in its call.
        refs = [ray.put(s) if dps.count(dp) > 1 else s for dp, s in enumerate(shards)]
        return [getattr(w, method.__name__).remote(refs[dps[r]], *args, **kwargs) for r, w in enumerate(self.workers)]

    def collect_sharded(self, futures: Sequence[ray.ObjectRef[_T]], output_only: bool = True) -> list[_T]:
        """The results of `submit_sharded`: one per shard (dp order), or every rank's with output_only=False."""
        results = self.get(futures)
        return self.by_shard(results) if output_only else results

    def by_shard(self, results: list[_T]) -> list[_T]:
        """Every rank's results (rank order) -> the output ranks' ones, one per shard (dp order)."""
        out = {self.dims.coords(r)["dp"]: res for r, res in enumerate(results) if self.dims.is_output_rank(r)}
        return [out[dp] for dp in range(self.dims.dp)]  # each dp index has exactly one output rank

