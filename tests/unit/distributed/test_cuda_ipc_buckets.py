"""CUDA IPC refit buckets: the flat-buffer layout they share with shared-memory buckets, where they apply, and how a
descriptor is read. The IPC handle itself needs a GPU: tests/integration/test_gpu.py opens one in another process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlpost.config.layout import IPC_BUFFERS, REFIT_TRANSPORTS, cuda_ipc_refit
from rlpost.config.load import load_master_config
from rlpost.distributed.bucket_layout import bucket_bytes, bucket_views, fill_bucket
from rlpost.distributed.cuda_ipc_buckets import (
    CUDA_IPC_KEY,
    CudaIpcBucketWriter,
    is_cuda_ipc,
    local_device_index,
)
from rlpost.distributed.shm_buckets import ShmBucketWriter, read_bucket
from rlpost.models.policy.weight_export import WeightExportMixin
from rlpost.plan import plan_rows


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.arange(6).reshape(2, 3)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.empty(0, 4)),
        ("t", torch.randn(4, 3, generator=g).t()),  # not contiguous
    ]


def test_a_bucket_written_into_a_flat_buffer_reads_back_bit_for_bit() -> None:
    named = _named()
    buf = torch.full((bucket_bytes(named),), 255, dtype=torch.uint8)
    records = fill_bucket(buf, named)
    assert [r[1] % 64 for r in records] == [0] * len(named)  # aligned views
    assert bucket_bytes(named) == 64 * 5  # 60 B, 14 B, 48 B, 4 B, 0 B and 48 B: five 64-byte slots
    back = bucket_views(buf, records)
    for (name, t), (name2, v) in zip(named, back, strict=True):
        assert name == name2 and v.dtype == t.dtype and v.shape == t.shape
        assert torch.equal(v, t)
        assert v.numel() == 0 or v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view


def test_views_follow_the_buffer_that_is_rewritten() -> None:
    """Loaders read the views once per refit: the next bucket written into the same buffer is what they see."""
    first = [("w", torch.zeros(8))]
    buf = torch.empty(bucket_bytes(first), dtype=torch.uint8)
    (_, view), = bucket_views(buf, fill_bucket(buf, first))
    fill_bucket(buf, [("w", torch.ones(8))])
    assert torch.equal(view, torch.ones(8))


def test_the_shared_memory_writer_keeps_the_layout() -> None:
    named = _named()
    writer = ShmBucketWriter()
    try:
        back = read_bucket(writer.write(named))
        assert [n for n, _ in back] == [n for n, _ in named]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, back, strict=True))
    finally:
        writer.close()


@pytest.mark.parametrize(("device", "expected"), [("cuda", True), ("cpu", False)])
def test_cuda_ipc_applies_on_every_gpu(device: str, expected: bool) -> None:
    assert cuda_ipc_refit(device) is expected


class _Rank(WeightExportMixin):
    def __init__(self, device: str, world_size: int, rank: int) -> None:
        self.rank, self.world_size, self.device, self._export = rank, world_size, torch.device(device), []


@pytest.mark.parametrize(("device", "world", "kind"), [("cuda", 1, CudaIpcBucketWriter), ("cuda", 2, CudaIpcBucketWriter),
                                                       ("cpu", 1, ShmBucketWriter), ("cpu", 2, ShmBucketWriter)])
def test_each_rank_shares_its_buckets_the_way_the_rule_says(device: str, world: int, kind: type) -> None:
    """On a GPU every rank hands the engine on its device a device buffer, however many GPUs; on a CPU a host segment
    (writers are created lazily, so this needs no GPU: nothing is allocated until a bucket is written)."""
    rank0 = _Rank(device, world, world - 1)
    try:
        assert type(rank0._shm_writer(0)) is kind
        assert rank0._shm_writer(0) is rank0._shm_writer(0) and rank0._shm_writer(1) is not rank0._shm_writer(0)
        # After the refit (offload_after_refit) the device buffers go, so the engine has that memory; segments stay.
        rank0.release_device_buffers()
        assert sorted(rank0._shm or {}) == ([] if kind is CudaIpcBucketWriter else [0, 1])
    finally:
        rank0.close_export_buffers()


def test_a_cuda_ipc_descriptor_is_opened_on_the_gpu_it_names_or_refused() -> None:
    """The descriptor names its GPU by UUID; a process that cannot see that GPU says so, before touching the handle
    (read_bucket routes the descriptor to the CUDA IPC reader, not to the object store)."""
    opened: list[Any] = []
    desc = {CUDA_IPC_KEY: (lambda *args: opened.append(args), tuple(range(15))), "device_uuid": "GPU-not-here",
            "records": []}
    assert is_cuda_ipc(desc) and not is_cuda_ipc({"shm": "x", "records": []}) and not is_cuda_ipc([object()])
    with pytest.raises(RuntimeError, match="GPU-not-here, which this process does not see"):
        read_bucket(desc)
    with pytest.raises(RuntimeError, match="each engine worker on a GPU of the policy"):
        local_device_index("GPU-not-here")
    assert opened == []


def test_the_plan_names_the_refit_transport() -> None:
    def refit(*overrides: str) -> str:
        return dict(plan_rows(load_master_config(list(overrides))[1]))["refit"]

    assert refit("cluster.device=cpu") == f"ipc: {REFIT_TRANSPORTS['ipc']} ({IPC_BUFFERS['cpu']})"
    assert refit("cluster.device=cuda") == f"ipc: {REFIT_TRANSPORTS['ipc']} ({IPC_BUFFERS['cuda']})"
    assert refit("cluster.device=cuda", "cluster.gpus_per_node=2").endswith("each engine reads the policy rank on its "
                                                                            "own GPU)")
    assert refit("cluster.num_nodes=2").startswith("object_store: ")
    assert refit("cluster.device=cpu", "cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
                 "policy.generation.colocated.resources.gpus_per_node=1").startswith("collective: a broadcast")
