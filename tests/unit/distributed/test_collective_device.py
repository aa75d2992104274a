"""The device of a collective's tensors follows the process group's backend (rlpost.distributed.collective_device):
real gloo groups here; the backend-name rule for NCCL and per-device groups as a pure function; real NCCL over two
GPUs under `gpu2`."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rlpost.distributed.collective_device import (
    all_reduce,
    all_reduce_floats,
    collective_device,
    device_type_for_backend,
)


@pytest.fixture
def world_of_one(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[None]:
    """A real one-rank process group (backend from the test's parameter, default gloo) over a FileStore."""
    backend = getattr(request, "param", "gloo")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("backend", "cuda", "expected"),
    [
        ("nccl", True, "cuda"),
        ("nccl", False, "cuda"),  # NCCL serves CUDA tensors only; without CUDA the collective cannot run at all
        ("gloo", True, "cpu"),
        ("gloo", False, "cpu"),
        ("GLOO", False, "cpu"),
        ("mpi", True, "cpu"),
        ("cpu:gloo,cuda:nccl", True, "cuda"),
        ("cpu:gloo,cuda:nccl", False, "cpu"),
        ("cuda:nccl,cpu:gloo", True, "cuda"),
        ("cpu:gloo", True, "cpu"),
    ],
)
def test_backend_name_decides_the_device_type(backend: str, cuda: bool, expected: str) -> None:
    assert device_type_for_backend(backend, cuda_available=cuda) == expected


@pytest.mark.parametrize("backend", ["xccl", "no-such-backend", "cuda:nccl"])
def test_a_backend_serving_neither_cpu_nor_an_available_cuda_is_refused(backend: str) -> None:
    with pytest.raises(ValueError, match=backend):
        device_type_for_backend(backend, cuda_available=False)


def test_gloo_default_group_and_subgroup_collect_on_the_cpu(world_of_one: None) -> None:
    assert collective_device() == torch.device("cpu")
    assert collective_device(dist.group.WORLD) == torch.device("cpu")
    sub = dist.new_group([0], backend="gloo")
    assert collective_device(sub) == torch.device("cpu")


@pytest.mark.parametrize("world_of_one", ["cpu:gloo"], indirect=True)
def test_a_per_device_group_is_read_from_torch_distributed(world_of_one: None) -> None:
    assert dist.get_backend() == "cpu:gloo"
    assert collective_device() == torch.device("cpu")


def test_all_reduce_returns_on_the_tensors_device(world_of_one: None) -> None:
    t = torch.tensor([1.5, -2.0], dtype=torch.float64)
    out = all_reduce(t, op=dist.ReduceOp.MAX)
    assert out.device == t.device and out.tolist() == [1.5, -2.0]
    assert all_reduce_floats([0.25, 3.0]) == [0.25, 3.0]


def _nccl_rank(rank: int, init_file: str, results: Any) -> None:
    """One rank of a real NCCL group: the helper's device, a CPU tensor reduced through it, floats summed."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cpu = all_reduce(torch.tensor([float(rank + 1)]))
        results.put((rank, str(collective_device()), cpu.device.type, float(cpu[0]),
                     all_reduce_floats([rank, 10.0])))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu2
@pytest.mark.slow
def test_nccl_group_collects_on_the_current_cuda_device(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, str(tmp_path / "init"), results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        seen = sorted(results.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
    assert seen == [(0, "cuda:0", "cpu", 3.0, [1.0, 20.0]), (1, "cuda:1", "cpu", 3.0, [1.0, 20.0])]
    assert all(p.exitcode == 0 for p in procs)
