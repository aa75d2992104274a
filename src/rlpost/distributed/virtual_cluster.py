"""Ray start-up and placement: `init_ray` and `RayVirtualCluster`.

A RayVirtualCluster reserves one bundle per worker slot (a GPU, or a fraction of the CPUs on a
machine without GPUs) in one placement group. Worker groups place one actor per bundle; two groups
(the policy and the rollout engine) may share the bundles, each actor asking for
1/max_colocated_worker_groups of a bundle. If the bundles can't be reserved within the timeout it
fails with a message naming what was asked and what exists; it never hangs.

Two things are kept apart: `use_gpus` (each bundle reserves one Ray GPU, so Ray schedules the actors on GPUs and
sets CUDA_VISIBLE_DEVICES to the one GPU of their bundle) and `device` (where the actors compute: 'cuda' or 'cpu').
A run reserves GPUs exactly when it computes on CUDA; the scheduling tests reserve the logical GPUs of a
`ray start --num-gpus=N` head on a CPU machine and compute on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlpost.config.schema.cluster import ClusterConfig
from rlpost.distributed.head_reaper import start_reaper
from rlpost.distributed.ports import free_port
from rlpost.distributed.ray_signals import (
    WORKER_SIGNAL_ENV,
    head_in_own_process_group,
    keep_driver_handlers,
    skip_failure_handler,
)

# Environment every actor starts with: one compute thread per process (the cores are few), no hub.
WORKER_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    **WORKER_SIGNAL_ENV,
}


def worker_threads(node_cpus: float, slots_on_node: int, max_colocated: int) -> int:
    """Compute threads of one actor that works beside a GPU: a fair share of its node's cores among the actors the
    node holds (`slots_on_node` GPU slots, each shared by up to `max_colocated` actors), at least 1."""
    return max(1, int(node_cpus) // max(1, slots_on_node * max_colocated))


def thread_env(threads: int) -> dict[str, str]:
    """OMP_NUM_THREADS and MKL_NUM_THREADS of an actor (WORKER_ENV holds the CPU runs' 1)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


class ClusterResourceError(RuntimeError):
    """The requested bundles could not be reserved in time."""


class ClusterUnavailable(RuntimeError):
    """`cluster.address` names a Ray cluster that does not answer."""


def resolve_device(cfg: ClusterConfig) -> str:
    """'cuda' or 'cpu' for cluster.device; ConfigError when the GPU it names or finds cannot be used
    (rlpost.runtime.cuda_driver.usable_device, the pre-flight's check)."""
    from rlpost.runtime.cuda_driver import usable_device

    return usable_device(cfg.device)


def probe_head(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not after Ray's own 10-minute retry loop, when no head answers at `address`."""

    target = address
    if address == "auto":
        target = os.environ.get("RAY_ADDRESS", "")
        current = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
        if not target and current.is_file():
            target = current.read_text().strip()
        if not target:
            raise ClusterUnavailable(
                "cluster.address=auto: no Ray cluster is running on this machine; start one with "
                "`ray start --head`, or run here with cluster=local"
            )
    if target.startswith("ray://"):
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise ClusterUnavailable(
            f"cluster.address={address}: no Ray cluster answers at {target} ({exc}); start one with "
            "`ray start --head`, or run here with cluster=local"
        ) from None


def init_ray(cfg: ClusterConfig) -> None:
    """Join `cfg.address` or start a local Ray cluster (bounded object store, no dashboard). Idempotent."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from rlpost.runtime.run_log import ENV_VAR, SETUP_HOOK, ray_errors_to_log, run_log

    env_vars = dict(WORKER_ENV)
    runtime_env: dict[str, object] = {"env_vars": env_vars}
    log_file = run_log()
    if log_file:  # a run: worker output goes to its train.log, not through the driver to the console
        env_vars[ENV_VAR] = log_file
        runtime_env["worker_process_setup_hook"] = SETUP_HOOK
    to_console = log_file is None
    ray_errors_to_log()
    skip_failure_handler()  # SIGTERM and Ctrl-C stay the driver's (rlpost.distributed.ray_signals)
    if cfg.address:
        probe_head(cfg.address)
        try:
            with keep_driver_handlers():
                ray.init(address=cfg.address, runtime_env=runtime_env, log_to_driver=to_console,
                         configure_logging=to_console)
        except ConnectionError as exc:
            raise ClusterUnavailable(
                f"cluster.address={cfg.address}: no Ray cluster answers there ({str(exc).splitlines()[0]}); "
                "start one with `ray start --head`, or run on this machine with cluster=local"
            ) from None
        return
    with _lean_local_head(log_monitor=to_console), head_in_own_process_group(), keep_driver_handlers():
        _init_local(cfg, runtime_env, to_console)
    start_reaper()  # the head ends with this driver, even one killed with SIGKILL


@contextlib.contextmanager
def _lean_local_head(log_monitor: bool) -> Iterator[None]:
    """Start the local head without the processes a one-machine run never uses (their memory goes to the run): the
    autoscaler monitor (a local cluster has fixed resources: nothing to scale), the API server (`include_dashboard`
    is off, and it would still serve job submission and the state API, which a run does not use) and, when worker
    output goes to the run's train.log through the setup hook (`log_monitor=False`), the log monitor that would
    forward it to the driver.

    `ray.init` has no switch for these: they are fields of Ray's private `RayParams` (which `ray.init` builds by
    attribute lookup) and the head node's `start_api_server`. Where this Ray keeps either elsewhere, that part
    starts as Ray would (tests/integration/test_ray_head.py names what a run's head holds)."""
    try:
        from ray._private import node, parameter
    except ImportError:  # pragma: no cover - another Ray layout: start as Ray would
        yield
        return
    params = getattr(parameter, "RayParams", None)
    api_server = getattr(getattr(node, "Node", None), "start_api_server", None)
    patched: list[tuple[object, str, object]] = []
    if params is not None:

        class LeanRayParams(params):  # type: ignore[misc, valid-type]
            def __init__(self, *args: object, **kwargs: object) -> None:
                kwargs.setdefault("no_monitor", True)
                if not log_monitor:
                    kwargs.setdefault("include_log_monitor", False)
                super().__init__(*args, **kwargs)

        patched.append((parameter, "RayParams", params))
        setattr(parameter, "RayParams", LeanRayParams)  # noqa: B010 - a class attribute mypy won't let be assigned
    if api_server is not None:

        def start_api_server(self: node.Node, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
            if include_dashboard:
                api_server(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)
            else:
                self._webui_url = None

        patched.append((node.Node, "start_api_server", api_server))
        node.Node.start_api_server = start_api_server  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


def _init_local(cfg: ClusterConfig, runtime_env: dict[str, object], to_console: bool) -> None:
    ray.init(
        address="local",  # never attach silently to a cluster someone started with `ray start`
        num_cpus=cfg.num_cpus if cfg.num_cpus is not None else os.cpu_count(),  # type: ignore[arg-type]  # fractional is fine
        include_dashboard=False,
        object_store_memory=cfg.object_store_memory_mb * 2**20,
        runtime_env=runtime_env,
        log_to_driver=to_console,
        configure_logging=to_console,
        logging_level=logging.WARNING,
        # No idle worker processes started ahead of tasks: every rlpost actor has its own runtime env, so a
        # prestarted default worker (a whole process's memory, and a CPU's worth of imports at start) would never
        # be used.
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
    )



class ActorOptions(TypedDict):
    """Ray `.options()` of an actor (or task) on one worker slot: `RayVirtualCluster.scheduling`'s placement, and
    what its caller adds."""

    scheduling_strategy: PlacementGroupSchedulingStrategy
    num_cpus: float
    num_gpus: NotRequired[float]
    runtime_env: NotRequired[dict[str, dict[str, str]]]
    name: NotRequired[str]
    max_concurrency: NotRequired[int]

@dataclass(frozen=True)
class BundlePlacement:
    """Where one bundle landed."""

    index: int
    node_id: str


class RayVirtualCluster:
    """`workers_per_node` bundles on each of `num_nodes` nodes, in one placement group."""

    def __init__(
        self,
        name: str,
        workers_per_node: int,
        num_nodes: int = 1,
        use_gpus: bool = False,
        cpus_per_bundle: float = 0.5,
        max_colocated_worker_groups: int = 1,
        placement_timeout_s: float = 60.0,
        device: str | None = None,
    ) -> None:
        """`use_gpus`: each bundle reserves one Ray GPU. `device`: where the actors compute, 'cuda' or 'cpu' (None:
        'cuda' when the bundles hold GPUs); 'cpu' on GPU bundles places actors as a GPU run does (logical GPUs of a
        `ray start --num-gpus=N` head) while they compute on the CPU."""
        device = device if device is not None else ("cuda" if use_gpus else "cpu")
        if device not in ("cuda", "cpu") or (device == "cuda" and not use_gpus):
            raise ValueError(f"cluster '{name}': device={device!r} with use_gpus={use_gpus}: a CUDA cluster reserves "
                             "GPUs (use_gpus=True); device is 'cuda' or 'cpu'")
        self.name = name
        self.workers_per_node = workers_per_node
        self.num_nodes = num_nodes
        self.use_gpus = use_gpus
        self.device = device
        self.cpus_per_bundle = cpus_per_bundle
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.placement_timeout_s = placement_timeout_s
        self._pg: PlacementGroup | None = None
        self._order: list[BundlePlacement] = []

    @property
    def world_size(self) -> int:
        return self.workers_per_node * self.num_nodes

    def bundle(self) -> dict[str, float]:
        b: dict[str, float] = {"CPU": self.cpus_per_bundle}
        if self.use_gpus:
            b["GPU"] = 1.0
        return b

    def gpu_share(self, fraction: float | None = None) -> float:
        """The GPU an actor of one colocated group holds in its bundle: `fraction` (default 1/max_colocated) of the
        bundle's one GPU, or 0 when the bundles hold none."""
        if not self.use_gpus:
            return 0.0
        return fraction if fraction is not None else 1.0 / self.max_colocated_worker_groups

    def placement_group(self) -> PlacementGroup:
        """Reserve the bundles (once), or raise ClusterResourceError after the timeout."""
        if self._pg is not None:
            return self._pg
        bundles = [self.bundle() for _ in range(self.world_size)]
        if self.num_nodes == 1:
            strategy = "STRICT_PACK"
        else:
            strategy = "STRICT_SPREAD" if self.workers_per_node == 1 else "SPREAD"
        pg = placement_group(bundles, strategy=strategy, name=f"{self.name}-pg")
        ready, _ = ray.wait([pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise ClusterResourceError(
                f"cluster '{self.name}': could not reserve {len(bundles)} bundle(s) of {self.bundle()} "
                f"({strategy}) within {self.placement_timeout_s:.0f}s; the Ray cluster has "
                f"{_fmt(ray.cluster_resources())} in all, {_fmt(ray.available_resources())} free, on "
                f"{len([n for n in ray.nodes() if n.get('Alive')])} node(s). Lower cluster.gpus_per_node / "
                "cluster.worker_num_cpus or add nodes."
            )
        table = placement_group_table(pg)
        to_node = table.get("bundles_to_node_id", {})
        # Bundles sorted by node so consecutive ranks share a node.
        self._order = sorted(
            (BundlePlacement(i, str(to_node.get(i, ""))) for i in range(len(bundles))),
            key=lambda b: (b.node_id, b.index),
        )
        self._pg = pg
        return pg

    def bundle_for_rank(self, rank: int) -> BundlePlacement:
        self.placement_group()
        return self._order[rank]

    def scheduling(self, rank: int, fraction: float | None = None) -> ActorOptions:
        """Ray actor options placing rank `rank` on its bundle, taking 1/max_colocated of it."""
        frac = fraction if fraction is not None else 1.0 / self.max_colocated_worker_groups
        b = self.bundle_for_rank(rank)
        opts: ActorOptions = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group(), placement_group_bundle_index=b.index
            ),
            "num_cpus": self.cpus_per_bundle * frac,
        }
        if self.use_gpus:
            opts["num_gpus"] = self.gpu_share(frac)
        return opts

    def local_rank(self, rank: int) -> int:
        """LOCAL_RANK of rank `rank`: the index of its device among those it sees. An actor on a GPU bundle sees one
        GPU (Ray sets CUDA_VISIBLE_DEVICES to its bundle's GPU), so 0, what `torch.cuda.set_device(LOCAL_RANK)` (as
        transformers' tensor-parallel load calls it) accepts; on CPU bundles, the rank's index on its node."""
        if self.use_gpus:
            return 0
        node = self.bundle_for_rank(rank).node_id
        return sum(1 for b in self._order[:rank] if b.node_id == node)

    def thread_env(self, rank: int) -> dict[str, str]:
        """Thread-count environment of an actor on rank `rank`'s bundle: on CUDA a fair share of its node's cores
        (`worker_threads`: the casts, DCP and offloaded optimizer steps that run on the host), on CPU nothing
        (WORKER_ENV's one thread a process: the cores are the compute, shared by every worker)."""
        if self.device != "cuda":
            return {}
        node_id = self.bundle_for_rank(rank).node_id
        res: dict[str, float] = next((n.get("Resources", {}) for n in ray.nodes() if n.get("NodeID") == node_id), {})
        slots = max(int(res.get("GPU", 0)), self.workers_per_node)
        return thread_env(worker_threads(float(res.get("CPU", 1)), slots, self.max_colocated_worker_groups))

    def node_of_rank(self, rank: int) -> str:
        node_id = self.bundle_for_rank(rank).node_id
        for n in ray.nodes():
            if n.get("NodeID") == node_id:
                return f"{n.get('NodeManagerAddress', '?')} ({node_id[:8]})"
        return node_id[:8] or "?"

    def get_master_address_and_port(self) -> tuple[str, int]:
        """An address and a free port on the node of rank 0 (for torch.distributed rendezvous): found here when
        that node is the driver's, else by a task there (whose worker process then stays, idle)."""
        if self.bundle_for_rank(0).node_id == ray.get_runtime_context().get_node_id():
            return _free_port_here()
        opts = self.scheduling(0, fraction=0.001 / max(self.cpus_per_bundle, 1e-3))
        opts["num_cpus"] = 0
        ref = _free_port.options(**opts).remote()
        addr, port = ray.get(ref, timeout=self.placement_timeout_s)
        return addr, port

    def shutdown(self) -> None:
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - Ray may already be down
                pass
            self._pg = None


def _free_port_here() -> tuple[str, int]:
    return ray.util.get_node_ip_address(), free_port()


_free_port = ray.remote(num_cpus=0)(_free_port_here)


def _fmt(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if k in ("CPU", "GPU")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"
