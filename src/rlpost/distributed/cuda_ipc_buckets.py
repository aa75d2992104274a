"""Refit buckets through CUDA IPC: a colocated engine loads straight from the device memory of the policy rank on its
own GPU.

Colocated engines share the policy's GPUs, one policy rank and one engine worker per GPU, so each rank serves the
engine worker on its GPU and the export never leaves the devices. Each policy rank keeps one flat device buffer per
slot (as large as the largest bucket, so
`policy.refit_buffer_size_gb` bounds it, two slots together as on the CPU), copies each bucket into it
(rlpost.distributed.bucket_layout), and hands out a small descriptor: the buffer's CUDA IPC handle
(`torch.multiprocessing.reductions.reduce_tensor`, which also records an event the opener waits on, so the copy
is complete before anyone reads it), the GPU's UUID and the tensors' records. The driver forwards the descriptor only.
The engine opens the handle on its view of the same GPU (found by UUID: each process numbers its visible devices
from 0), loads from views of the buffer, waits for its copies and drops the views; a slot's buffer is reused for the
refit's later buckets (torch caches the opened allocation) and freed when the refit is over (the policy's
`offload_after_refit`), so the engine has that memory while it generates.

This is NeMo RL's colocated CUDA IPC refit in rlpost's bucket interface; where it applies is
`rlpost.config.layout.cuda_ipc_refit`. A bucket reaches the engines as every rank's descriptor
(rlpost.distributed.bucket_layout.PerDeviceBuckets), and each engine worker opens the one on its GPU (`on_this_gpu`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from rlpost.distributed.bucket_layout import CudaIpcBucket, RefitBucket, bucket_bytes, bucket_views, fill_bucket

CUDA_IPC_KEY: Final = "cuda_ipc"
"""Key of a CUDA IPC descriptor (a dict, beside "device_uuid" and "records")."""
_DEVICE_ARG = 6
"""Position of the device index in reduce_tensor's rebuild arguments (torch.multiprocessing.reductions)."""


def is_cuda_ipc(box: RefitBucket) -> bool:
    return isinstance(box, dict) and CUDA_IPC_KEY in box


def device_uuid(device: torch.device | int) -> str:
    """The GPU's UUID, the same in every process whatever index that process gives it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_index(uuid: str) -> int:
    """This process's index of the GPU with UUID `uuid`; a clear error when this process cannot see it."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(count):
        if device_uuid(i) == uuid:
            return i
    raise RuntimeError(
        f"a CUDA IPC refit bucket lives on GPU {uuid}, which this process does not see ({count} visible GPU(s)): "
        "a CUDA IPC refit needs each engine worker on a GPU of the policy (colocated)"
    )


def on_this_gpu(descs: Sequence[CudaIpcBucket]) -> CudaIpcBucket:
    """Of the descriptors of the policy ranks on an engine replica's GPUs, the one on this process's current GPU (a
    single descriptor is taken as it is); a clear error when none is."""
    if len(descs) == 1:
        return descs[0]
    mine = device_uuid(torch.cuda.current_device())
    for desc in descs:
        if desc["device_uuid"] == mine:
            return desc
    raise RuntimeError(f"no refit bucket was written on this engine worker's GPU {mine} (written on "
                       f"{[d['device_uuid'] for d in descs]}): each colocated engine worker needs a policy rank on its GPU")


class CudaIpcBucketWriter:
    """A policy rank's side: one device buffer, grown (replaced) only when a bucket does not fit."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None

    def write(self, named: Sequence[tuple[str, torch.Tensor]]) -> CudaIpcBucket:
        """Copy `named` into the buffer; the descriptor the engine loads from."""
        from torch.multiprocessing.reductions import reduce_tensor

        total = max(bucket_bytes(named), 1)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = None  # the old allocation goes before the new one is made
            self.buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        records = fill_bucket(self.buffer, named)
        rebuild, args = reduce_tensor(self.buffer)  # records an event after the copies: openers wait on it
        return {CUDA_IPC_KEY: (rebuild, args), "device_uuid": device_uuid(self.device), "records": records}

    def close(self) -> None:
        self.buffer = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # allocations the engines have let go of are freed now


def read_cuda_ipc_bucket(desc: CudaIpcBucket) -> list[tuple[str, torch.Tensor]]:
    """Tensors viewing the policy's device buffer, opened on this process's index of its GPU (read-only by contract:
    loaders copy out of them)."""
    rebuild, args = desc[CUDA_IPC_KEY]
    args = (*args[:_DEVICE_ARG], local_device_index(desc["device_uuid"]), *args[_DEVICE_ARG + 1:])
    return bucket_views(rebuild(*args), desc["records"])
