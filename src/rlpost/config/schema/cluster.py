"""Cluster config (`cluster=local|ray`): how many workers, on which nodes, through which Ray."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import one_of, positive, require

RAY_MIN_OBJECT_STORE_MB = 75
"""The smallest object store Ray starts with (ray._private.ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)."""


@dataclass
class ClusterConfig:
    """Workers per node and Ray connection."""

    gpus_per_node: int = 1
    """Worker slots per node: GPUs, or CPU worker processes on a machine without GPUs."""
    num_nodes: int = 1
    """Nodes used."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu' (gloo) or 'cuda' (nccl)."""
    address: str | None = None
    """Ray address to join ('auto' or host:port); None starts a local Ray cluster."""
    num_cpus: float | None = None
    """CPUs a local Ray cluster advertises; None = all cores."""
    object_store_memory_mb: int = 512
    """Object store size of a local Ray cluster, in MiB (Ray starts none smaller than 75)."""
    worker_num_cpus: float = 0.25
    """Ray num_cpus of one worker actor on CPU (fractional so colocated groups fit)."""
    placement_timeout_s: float = 60.0
    """Fail with a clear message if the placement group is not ready by then."""
    call_timeout_s: float = 900.0
    """Bound on every remote call until the first step is measured (start-up, first step, compiles)."""
    step_timeout_factor: float = 10.0
    """After each step, a call's bound becomes this times the slowest step so far (within
    min_call_timeout_s .. call_timeout_s), so a hung worker is noticed in minutes, not 15."""
    min_call_timeout_s: float = 120.0
    """Lower bound of the step-derived call bound."""

    def check(self, path: str) -> None:
        positive(f"{path}.gpus_per_node", self.gpus_per_node)
        positive(f"{path}.num_nodes", self.num_nodes)
        one_of(f"{path}.device", self.device, ("auto", "cpu", "cuda"))
        positive(f"{path}.num_cpus", self.num_cpus, allow_none=True)
        positive(f"{path}.object_store_memory_mb", self.object_store_memory_mb)
        if self.address is None:
            require(self.object_store_memory_mb >= RAY_MIN_OBJECT_STORE_MB, f"{path}.object_store_memory_mb",
                    self.object_store_memory_mb,
                    f"must be >= {RAY_MIN_OBJECT_STORE_MB}: Ray starts no object store smaller than "
                    f"{RAY_MIN_OBJECT_STORE_MB} MiB")
        positive(f"{path}.worker_num_cpus", self.worker_num_cpus)
        positive(f"{path}.placement_timeout_s", self.placement_timeout_s)
        positive(f"{path}.call_timeout_s", self.call_timeout_s)
        positive(f"{path}.step_timeout_factor", self.step_timeout_factor)
        positive(f"{path}.min_call_timeout_s", self.min_call_timeout_s)
