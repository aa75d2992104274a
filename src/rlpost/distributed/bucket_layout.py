"""The flat-buffer layout of a refit bucket: tensors one after the other, each 64-byte aligned, described by records
(name, byte offset, shape, dtype). Shared-memory buckets (rlpost.distributed.shm_buckets) and CUDA IPC buckets
(rlpost.distributed.cuda_ipc_buckets) both write it with `fill_bucket`, and the engines read it with `bucket_views`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias, TypedDict, final

import torch

if TYPE_CHECKING:
    import ray

    from rlpost.distributed.weight_buckets import BucketRecord

BucketEntry = tuple[str, int, tuple[int, ...], str]
"""One tensor of a flat bucket buffer: (HF name, byte offset, shape, torch dtype name)."""


@final
class ShmBucket(TypedDict):
    """A bucket in a shared-memory segment (rlpost.distributed.shm_buckets)."""

    shm: str
    """The segment's name."""
    records: list[BucketEntry]


@final
class CudaIpcBucket(TypedDict):
    """A bucket in the policy's device buffer, opened over CUDA IPC (rlpost.distributed.cuda_ipc_buckets)."""

    cuda_ipc: tuple[Callable[..., torch.Tensor], tuple[object, ...]]
    """torch's reduce_tensor of the buffer: (rebuild, its arguments)."""
    device_uuid: str
    records: list[BucketEntry]


@final
class PerDeviceBuckets(TypedDict):
    """One bucket as every policy rank wrote it into its own IPC buffer (a colocated refit on one node). Entry r is
    policy rank r's, on the device of worker slot r, where the engine worker of slot r reads it: each engine gets
    its weights from the device it shares with the policy."""

    per_rank: list[ShmBucket | CudaIpcBucket]


RefitBucket: TypeAlias = "PerDeviceBuckets | ShmBucket | CudaIpcBucket | list[ray.ObjectRef[list[BucketRecord]]]"
"""A bucket as the driver forwards it unread: one IPC descriptor per policy rank, a single shared-memory or CUDA
IPC descriptor, or [object ref] (the object store; in a list so Ray does not fetch it)."""


def is_per_device(box: object) -> bool:
    return isinstance(box, dict) and "per_rank" in box


def slots_of(box: PerDeviceBuckets, first: int, count: int) -> PerDeviceBuckets:
    """The descriptors of worker slots first .. first + count - 1 (the slots one engine replica spans)."""
    return {"per_rank": box["per_rank"][first : first + count]}


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64  # 64-byte aligned views


def bucket_bytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Bytes a bucket of `named` takes in a flat buffer (each tensor 64-byte aligned)."""
    return sum(_aligned(t.numel() * t.element_size()) for _, t in named)


def fill_bucket(buf: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]]) -> list[BucketEntry]:
    """Copy `named` into the flat uint8 buffer `buf` (at least `bucket_bytes` long, on any device), one tensor after
    the other, 64-byte aligned; their records for `bucket_views`."""
    records, off = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        records.append((name, off, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch.")))
        off += _aligned(n)
    return records


def bucket_views(buf: torch.Tensor, records: Sequence[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """The tensors `fill_bucket` wrote into `buf`, as views of it (read-only by contract: loaders copy out)."""
    out = []
    for name, off, shape, dtype in records:
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * dt.itemsize
        out.append((name, buf[off : off + n].view(dt).reshape(shape)))
    return out
