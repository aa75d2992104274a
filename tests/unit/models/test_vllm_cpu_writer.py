"""The CPU writer's fused-weight assembly: parts lying back to back in one buffer (a shared-memory refit
bucket) are read in place; anything else is concatenated. Either way the rows equal torch.cat's."""

from __future__ import annotations

import torch

from rlpost.models.generation.vllm_cpu_writer import _joined


def test_back_to_back_parts_in_one_buffer_are_viewed_not_copied() -> None:
    """As read from a shared-memory refit bucket: views of one buffer, in export order (q, k, v, o)."""
    flat = torch.randn(64 * 16, generator=torch.Generator().manual_seed(0))
    q, k, v, o = (t.view(-1, 16) for t in flat.split([32 * 16, 8 * 16, 8 * 16, 16 * 16]))
    fused = _joined([q, k, v])
    assert torch.equal(fused, torch.cat([q, k, v]))
    assert fused.data_ptr() == q.data_ptr()  # a view of the buffer
    out_of_order = _joined([q, v, k])
    assert torch.equal(out_of_order, torch.cat([q, v, k]))
    assert out_of_order.data_ptr() != q.data_ptr()  # not adjacent in that order: a copy
    gap = _joined([q, o])  # k and v lie between them
    assert torch.equal(gap, torch.cat([q, o])) and gap.data_ptr() != q.data_ptr()


def test_separate_tensors_are_concatenated() -> None:
    a, b = torch.arange(12.0).reshape(3, 4), torch.arange(8.0).reshape(2, 4)
    joined = _joined([a, b])
    assert torch.equal(joined, torch.cat([a, b]))
    assert _joined([a]) is a
