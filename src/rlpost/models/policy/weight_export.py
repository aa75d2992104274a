"""The worker side of refit, shared by every policy backend.

A worker fills `self._export` (full HF-named tensors, cast to the engine's dtype) in its own
`prepare_weights_for_export`: on rank 0, or on every rank when the engines share the policy's node. This mixin serves
it in bounded buckets: on one node every rank writes them into its own IPC buffers (a reusable shared-memory segment
on a CPU, a device buffer opened over CUDA IPC on a GPU), and the engine worker on each rank's device reads that
rank's; across nodes rank 0 puts them in the object store. It fingerprints the export; stages a private copy for
async GRPO; and broadcasts it over the refit group for an engine on its own workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from rlpost.models.policy.interfaces import StagedExport

if TYPE_CHECKING:
    from rlpost.distributed.bucket_layout import RefitBucket
    from rlpost.distributed.collective import StatelessGroup
    from rlpost.distributed.cuda_ipc_buckets import CudaIpcBucketWriter
    from rlpost.distributed.shm_buckets import ShmBucketWriter


def params_finite(params: Iterable[torch.Tensor]) -> bool:
    """True when every (local shard of every) parameter is finite: a huge lr breaks this before the loss does.

    One fused norm over all of them first (a finite norm means finite elements; torch's grouped foreach norm
    costs a fraction of an isfinite pass per tensor, and this check runs after every training step); only a
    non-finite norm (or one that overflowed) is checked element by element."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    local = [t.detach() for t in local if t.is_floating_point() and t.numel()]
    if not local:
        return True
    if bool(torch.isfinite(torch.nn.utils.get_total_norm(local, 2.0))):
        return True
    return all(bool(torch.isfinite(t).all()) for t in local)


class WeightExportMixin:
    """Needs `self.rank`, `self.device` and a `self._export` list of (name, tensor)."""

    rank: int
    world_size: int
    device: torch.device
    _export: list[tuple[str, torch.Tensor]]
    _refit_group: StatelessGroup | None = None
    _shm: dict[int, ShmBucketWriter | CudaIpcBucketWriter] | None = None
    """This rank's reusable IPC buffers (ShmBucketWriter or CudaIpcBucketWriter) for colocated refit buckets, per
    slot (0, 1), once written."""
    _staged: tuple[list[tuple[str, torch.Tensor]], str] | None = None
    """(weights, fingerprint) of the last `stage_weights` (rank 0): what `broadcast_staged` sends."""

    def plan_export_buckets(self, max_bytes: int) -> list[list[int]]:
        """The prepared export split into layer-aligned buckets of at most max_bytes ([] where nothing is kept)."""
        from rlpost.distributed.weight_buckets import plan_buckets

        return plan_buckets(self._export, max_bytes) if self._export else []

    def put_export_bucket(self, indices: list[int], ipc: bool = False, slot: int = 0) -> RefitBucket:
        """One bucket for the engines, forwarded unread by the caller: into this rank's reusable IPC buffer number
        `slot` (`ipc`: every rank, for the engine on its device; a descriptor comes back; the caller writes bucket
        k + 1 into the other slot while the engines load bucket k), or from rank 0 into the object store ([ref])."""
        named = [self._export[i] for i in indices]
        if ipc:
            return self._shm_writer(slot).write(named)
        import ray

        from rlpost.distributed.weight_buckets import encode

        return [ray.put(encode(named))]

    def stage_export(self, dtype: str, max_bytes: int, ipc: bool = False) -> StagedExport | None:
        """All ranks: gather the full weights (a collective). Rank 0 (with `ipc`, every rank: each serves the engine
        on its own device) answers with the bucket plan and, on rank 0, the export's fingerprint (None elsewhere);
        when the whole export fits one bucket it is already out (`first`, see put_export_bucket) and the export is
        cleared, so a small model's refit takes one call here.

        Through IPC buffers a model larger than `max_bytes` goes in buckets of half of it, one per slot, so a rank
        writes the next while the engines load the current and the two slots together stay within `max_bytes`
        (`policy.refit_buffer_size_gb`)."""
        self.prepare_weights_for_export(dtype, every_rank=ipc)  # type: ignore[attr-defined]
        if self.rank != 0 and not ipc:
            return None
        plan = self.plan_export_buckets(max_bytes)
        if ipc and len(plan) > 1:
            plan = self.plan_export_buckets(max(1, max_bytes // 2))
        fingerprint = self.export_fingerprint() if self.rank == 0 else ""
        if len(plan) != 1:
            return StagedExport(plan, fingerprint)
        first = self.put_export_bucket(plan[0], ipc)
        self.clear_export()
        return StagedExport(plan, fingerprint, first)

    def _shm_writer(self, slot: int) -> ShmBucketWriter | CudaIpcBucketWriter:
        """This rank's reusable buffer `slot` shared with the engine on its device, created on first use: a
        shared-memory segment (ShmBucketWriter) on a CPU, or on a GPU a device buffer the colocated engine opens
        over CUDA IPC (CudaIpcBucketWriter: the bucket goes from device to device)."""
        if self._shm is None:
            self._shm = {}
        if slot not in self._shm:
            from rlpost.config.layout import cuda_ipc_refit

            if cuda_ipc_refit(self.device.type):
                from rlpost.distributed.cuda_ipc_buckets import CudaIpcBucketWriter

                self._shm[slot] = CudaIpcBucketWriter(self.device)
            else:
                from rlpost.distributed.shm_buckets import ShmBucketWriter

                self._shm[slot] = ShmBucketWriter()
        return self._shm[slot]

    def release_device_buffers(self) -> None:
        """Free the CUDA IPC refit buffers once the refit is over (`offload_after_refit`), so the colocated engine
        has that GPU memory while it generates; the next refit allocates them again. Host segments stay (reused)."""
        from rlpost.distributed.cuda_ipc_buckets import CudaIpcBucketWriter

        for slot, writer in list((self._shm or {}).items()):
            if isinstance(writer, CudaIpcBucketWriter):
                writer.close()
                del self._shm[slot]  # type: ignore[union-attr]

    def close_export_buffers(self) -> None:
        """Unlink the shared-memory segments, free the CUDA IPC buffers (at shutdown)."""
        for writer in (self._shm or {}).values():
            writer.close()
        self._shm = None

    def export_fingerprint(self) -> str:
        from rlpost.models.fingerprint import weight_fingerprint

        return weight_fingerprint(self._export)

    def clear_export(self) -> None:
        self._export = []

    def stage_weights(self, dtype: str) -> str:
        """All ranks: gather the full weights (a collective); rank 0 keeps a private copy, cast to `dtype`, and
        answers its fingerprint ('' elsewhere). Async GRPO stages after every update, so the
        engine's refit (`broadcast_staged`) can run while the next update trains: the copy is never written by
        training. On a GPU it is one more copy of the model in rank 0's device memory, in the engine's dtype."""
        self.prepare_weights_for_export(dtype)  # type: ignore[attr-defined]
        fp = ""
        if self.rank == 0:
            fp = self.export_fingerprint()
            staged = [(n, t.detach().clone()) for n, t in self._export]  # never a view of a live parameter
            self._staged = (staged, fp)  # one assignment: a broadcast in flight keeps the copy it started with
        self.clear_export()
        return fp

    def broadcast_staged(self) -> str:
        """Rank 0: broadcast the staged copy over the refit group (the engines receive concurrently); its
        fingerprint. Runs in the actor's 'refit' concurrency group, beside a `train` call."""
        if self.rank != 0:
            return ""
        staged = self._staged
        if staged is None:
            raise RuntimeError("broadcast_staged before stage_weights")
        self._joined_group().broadcast_tensors(staged[0], src=0)
        return staged[1]

    def _join_refit_group(self, host: str, port: int, world_size: int) -> None:
        """Rank 0 joins the refit group as its rank 0 (the engine workers take the other ranks)."""
        if self.rank == 0:
            from rlpost.distributed.collective import StatelessGroup

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self._refit_group = StatelessGroup(host, port, 0, world_size, backend=backend)

    def _joined_group(self) -> StatelessGroup:
        """Rank 0's refit group (joined by `_join_refit_group`)."""
        if self._refit_group is None:
            raise RuntimeError("no refit group: init_refit_collective first")
        return self._refit_group

    def _broadcast_export(self) -> str:
        """Rank 0 broadcasts the prepared export; returns its fingerprint ('' on other ranks) and clears it."""
        fp = ""
        if self.rank == 0:
            self._joined_group().broadcast_tensors(self._export, src=0)
            fp = self.export_fingerprint()
        self.clear_export()
        return fp
