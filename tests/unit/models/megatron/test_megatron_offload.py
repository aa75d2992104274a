"""The storage round trip the Megatron memory phases use (rlpost.models.megatron.offload): a parameter's storage
emptied and refilled keeps the same tensor, its values and the hook megatron DDP hangs on its grad accumulator.
On CPU the "device" is the CPU itself; tests/integration/test_gpu_megatron.py measures the GPU."""

from __future__ import annotations

import torch

from rlpost.models.megatron.offload import offload_storages, onload_storages


def test_storage_round_trip_keeps_the_tensor_its_values_and_its_grad_hook() -> None:
    p = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    values = p.detach().clone()
    fired: list[int] = []
    acc = p.expand_as(p).grad_fn.next_functions[0][0]  # megatron DDP's hook point (its grad accumulator)
    acc.register_hook(lambda *_: fired.append(1))

    saved = offload_storages([p])
    assert p.untyped_storage().nbytes() == 0 and len(saved) == 1
    onload_storages(saved)

    assert torch.equal(p.detach(), values)
    (p * 2.0).sum().backward()
    assert fired == [1] and torch.equal(p.grad, torch.full((4, 3), 2.0))


def test_each_storage_travels_once_and_empty_ones_are_left_alone() -> None:
    base = torch.arange(12.0)
    first, second = base[:6].view(2, 3), base[6:].view(2, 3)  # two views of one storage (tied weights)
    empty = torch.zeros(5)
    empty.untyped_storage().resize_(0)  # already offloaded (a DDP buffer's view)
    saved = offload_storages([first, second, empty])
    assert len(saved) == 1 and base.untyped_storage().nbytes() == 0
    onload_storages(saved)
    assert torch.equal(base, torch.arange(12.0)) and torch.equal(second, torch.arange(6.0, 12.0).view(2, 3))
