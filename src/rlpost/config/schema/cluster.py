"""Cluster config (`cluster=local|ray`): how many workers, on which nodes, through which Ray."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import require
from rlpost.config.fields import POSITIVE, POSITIVE_OR_NONE, Block, checked, options

RAY_MIN_OBJECT_STORE_MB = 75
"""The smallest object store Ray starts with (ray._private.ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)."""


@dataclass
class ClusterConfig(Block):
    """Workers per node and Ray connection."""

    gpus_per_node: int = checked(1, POSITIVE)
    """Worker slots per node: GPUs, or CPU worker processes on a machine without GPUs."""
    num_nodes: int = checked(1, POSITIVE)
    """Nodes used."""
    device: str = checked("auto", options("auto", "cpu", "cuda"))
    """'auto' (cuda if available, else cpu), 'cpu' (gloo) or 'cuda' (nccl)."""
    address: str | None = None
    """Ray address to join ('auto' or host:port); None starts a local Ray cluster."""
    num_cpus: float | None = checked(None, POSITIVE_OR_NONE)
    """CPUs a local Ray cluster advertises; None = all cores."""
    object_store_memory_mb: int = checked(512, POSITIVE)
    """Object store size of a local Ray cluster, in MiB (Ray starts none smaller than 75)."""
    worker_num_cpus: float = checked(0.25, POSITIVE)
    """Ray num_cpus of one worker actor on CPU (fractional so colocated groups fit)."""
    placement_timeout_s: float = checked(60.0, POSITIVE)
    """Fail with a clear message if the placement group is not ready by then."""
    call_timeout_s: float = checked(900.0, POSITIVE)
    """Bound on every remote call until the first step is measured (start-up, first step, compiles)."""
    step_timeout_factor: float = checked(10.0, POSITIVE)
    """After each step, a call's bound becomes this times the slowest step so far (within
    min_call_timeout_s .. call_timeout_s), so a hung worker is noticed in minutes, not 15."""
    min_call_timeout_s: float = checked(120.0, POSITIVE)
    """Lower bound of the step-derived call bound."""
    gpu_memory_gb: float | None = checked(None, POSITIVE_OR_NONE)
    """Memory of one GPU in GiB for the memory plan (rlpost.config.memory); None: NVML's, or the RAM on a CPU run.
    Plans for a GPU this machine lacks: `rlpost plan cluster.device=cuda cluster.gpu_memory_gb=80`."""
    skip_memory_check: bool = False
    """Start a run the memory plan says cannot fit (the pre-flight refuses it otherwise)."""

    def check(self, path: str) -> None:
        super().check(path)
        require(self.min_call_timeout_s <= self.call_timeout_s, f"{path}.min_call_timeout_s", self.min_call_timeout_s,
                f"must be <= {path}.call_timeout_s ({self.call_timeout_s}): the bound derived from the step lies "
                "between the two")
        if self.address is None:
            require(self.object_store_memory_mb >= RAY_MIN_OBJECT_STORE_MB, f"{path}.object_store_memory_mb",
                    self.object_store_memory_mb,
                    f"must be >= {RAY_MIN_OBJECT_STORE_MB}: Ray starts no object store smaller than "
                    f"{RAY_MIN_OBJECT_STORE_MB} MiB")
