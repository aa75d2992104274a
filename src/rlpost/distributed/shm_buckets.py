"""Refit buckets through one reusable shared-memory segment (colocated, one node, CPU): the CPU's IPC buffer, in the
flat-buffer layout it shares with CUDA IPC buckets (rlpost.distributed.bucket_layout).

The object store allocates every bucket afresh, while copying into a segment whose pages are already mapped does not.
So when the engines share a node with the policy's rank 0, rank 0 keeps one segment per slot (as large as the largest
bucket: `policy.refit_buffer_size_gb` still bounds it), copies each bucket into it and hands out a small descriptor
(segment name, offsets, shapes); the engines map the segment once and load straight from views of it. The driver
forwards the descriptor only.

Python registers a segment with the resource tracker of every process that opens it, and that tracker unlinks it
when its process exits; the engines unregister their attachment (unless they read it in the owner's own process), so
only the owner's exit (or `close`) removes it, a kill -9 of the owner included (its tracker outlives it). When the
tracker died too (a kill of the whole process group), the next writer on the machine unlinks the segment: its name
carries the owner's pid.

A segment lives in /dev/shm (tmpfs), whose pages are taken when written: a segment larger than the room left there is
created without complaint and its owner dies of SIGBUS while filling it (Docker's default /dev/shm is 64 MiB). So a
writer checks the room before it creates a segment and fails with one line naming the sizes and the fix.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Final, cast

import torch

from rlpost.distributed.bucket_layout import (
    CudaIpcBucket,
    RefitBucket,
    ShmBucket,
    bucket_bytes,
    bucket_views,
    fill_bucket,
)

PREFIX = "rlpost-refit-"
"""Segment names: PREFIX + owner pid + '-' + a random part."""
SHM_KEY: Final = "shm"
"""Key of a descriptor (a dict); an object-store bucket is a one-element list [ref]."""
SHM_ROOT: Final = "/dev/shm"
"""Where POSIX shared-memory segments live on Linux."""


class ShmTooSmall(RuntimeError):
    """/dev/shm has no room for the refit's shared-memory buffer."""


def shm_shortfall(free: int, needed: int, root: str = SHM_ROOT) -> str | None:
    """The one-line error when `needed` bytes do not fit in the `free` bytes of `root`; None when they do."""
    if needed <= free:
        return None
    mib = 2**20
    return (f"{root} has {free / mib:.0f} MiB free, the colocated refit's shared-memory buffer needs "
            f"{needed / mib:.0f} MiB: give it more room (Docker: `--shm-size=<bytes>` or `--ipc=host`) or lower "
            "policy.refit_buffer_size_gb (two buffers of half of it take turns)")


def check_shm_room(needed: int, root: str = SHM_ROOT) -> None:
    """ShmTooSmall unless `root` has `needed` bytes free (a segment's pages are taken as they are written)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:  # no such mount (not Linux): shared_memory says what is wrong
        return
    if (line := shm_shortfall(free, needed, root)) is not None:
        raise ShmTooSmall(line)


class ShmBucketWriter:
    """The owner's side: one segment, grown (replaced) only when a bucket does not fit."""

    def __init__(self, root: str = SHM_ROOT) -> None:
        self.segment: shared_memory.SharedMemory | None = None
        self.root = root
        """The mount the segments take their pages from (checked for room before each is created)."""

    def write(self, named: Sequence[tuple[str, torch.Tensor]]) -> ShmBucket:
        """Copy `named` (CPU or device tensors) into the segment; the descriptor the engines load from."""
        total = bucket_bytes(named)
        self._ensure(max(total, 1))
        assert self.segment is not None
        buf = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=max(total, 1))
        return {SHM_KEY: self.segment.name, "records": fill_bucket(buf, named)}

    def _ensure(self, nbytes: int) -> None:
        if self.segment is not None and self.segment.size >= nbytes:
            return
        self.close()
        sweep_orphans()
        check_shm_room(nbytes, self.root)
        self.segment = shared_memory.SharedMemory(name=f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}", create=True,
                                                  size=nbytes)

    def close(self) -> None:
        if self.segment is not None:
            self.segment.unlink()
            try:
                self.segment.close()
            except BufferError:  # a view of it is still alive: the mapping goes with it
                pass
            self.segment = None


def sweep_orphans(root: str = "/dev/shm") -> list[str]:
    """Unlink segments whose owner process is gone (killed with its resource tracker, e.g. a kill -9 of the whole
    process group); the names removed."""
    removed = []
    for path in Path(root).glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


_ATTACHED: dict[str, shared_memory.SharedMemory] = {}
"""The engine side's mappings, by segment name (one per owner; a replaced segment is dropped)."""


def read_shm_bucket(desc: ShmBucket) -> list[tuple[str, torch.Tensor]]:
    """Tensors viewing the owner's segment (read-only by contract: loaders copy out of them)."""
    name = desc[SHM_KEY]
    seg = _ATTACHED.get(name)
    if seg is None:
        for old in list(_ATTACHED):  # the owner replaced its segment: this one is gone for good
            try:
                _ATTACHED.pop(old).close()
            except BufferError:  # a view of it is still alive: the mapping goes with it
                pass
        seg = shared_memory.SharedMemory(name=name)
        if not name.startswith(f"{PREFIX}{os.getpid()}-"):  # the owner's to unlink (a reader in the owner's own
            # process shares its tracker, whose one registration the owner's unlink removes)
            resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
        _ATTACHED[name] = seg
    return bucket_views(torch.frombuffer(seg.buf, dtype=torch.uint8), desc["records"])


def read_bucket(box: RefitBucket) -> list[tuple[str, torch.Tensor]]:
    """A bucket whichever way it travels: a shared-memory descriptor, a CUDA IPC descriptor (views of the policy's
    device buffer, on this process's view of that GPU), or [object ref] (object store)."""
    if isinstance(box, dict):
        if SHM_KEY in box:
            return read_shm_bucket(cast(ShmBucket, box))
        from rlpost.distributed.cuda_ipc_buckets import is_cuda_ipc, read_cuda_ipc_bucket

        if not is_cuda_ipc(box):
            raise TypeError("a per-device refit bucket is read by each engine worker from its own slot's entry")
        return read_cuda_ipc_bucket(cast(CudaIpcBucket, box))
    import ray

    from rlpost.distributed.weight_buckets import decode

    records = ray.get(box[0])
    return decode(records)
