"""Bin-packing algorithms, pack/unpack of token rows and the block-diagonal causal mask."""

from __future__ import annotations

import random

import pytest
import torch

from rlpost.data.packing import (
    PACKING_ALGORITHMS,
    concatenative,
    first_fit_decreasing,
    get_packing_algorithm,
    modified_first_fit_decreasing,
    pack_sequences,
    pack_tensor,
    packed_attention_mask,
    unpack_sequences,
)


@pytest.mark.parametrize("name", sorted(PACKING_ALGORITHMS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_item_once_and_bins_within_capacity(name: str, seed: int) -> None:
    rng = random.Random(seed)
    cap = 64
    lengths = [rng.randint(1, cap) for _ in range(50)]
    bins = get_packing_algorithm(name)(lengths, cap)
    assert sorted(i for b in bins for i in b) == list(range(50))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    assert all(b for b in bins)
    assert len(bins) >= -(-sum(lengths) // cap)


def test_first_fit_decreasing_trace() -> None:
    assert first_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 8) == [[0, 2], [1, 3, 6], [4, 5]]


def test_concatenative_keeps_order() -> None:
    assert concatenative([5, 4, 3, 3, 2, 2, 1], 8) == [[0], [1, 2], [3, 4, 5, 6]]


def test_mffd_trace() -> None:
    # cap 18: one large item (10); smalls 4, 4, 5, 6. Step 3 puts the two smallest smalls with the large item,
    # where FFD would put the 6 there instead.
    lengths = [10, 4, 4, 5, 6]
    assert modified_first_fit_decreasing(lengths, 18) == [[0, 2, 1], [4, 3]]
    assert first_fit_decreasing(lengths, 18) == [[0, 4], [3, 1, 2]]
    # cap 12: medium into the second large bin (step 2), a small and a tiny fill the first (step 4), FFD the rest
    assert modified_first_fit_decreasing([7, 8, 5, 5, 3, 3, 3, 2, 1], 12) == [[1, 4, 8], [0, 2], [3, 5, 6], [7]]


def test_item_longer_than_capacity_raises() -> None:
    for fn in PACKING_ALGORITHMS.values():
        with pytest.raises(ValueError):
            fn([3, 9], 8)
    with pytest.raises(ValueError):
        get_packing_algorithm("best_fit")


def test_pack_and_unpack_roundtrip() -> None:
    ids = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 0, 0, 0, 0]])
    p = pack_sequences(ids, [3, 5, 1], pad_to_multiple_of=2, total_round=8, pad_value=0)
    assert p.cu_seqlens.tolist() == [0, 3, 8, 9]
    assert p.cu_seqlens_padded.tolist() == [0, 4, 10, 12]
    assert p.total_len == 16
    assert p.input_ids.tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 9, 0, 0, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3]]
    back = unpack_sequences(p.input_ids, p.cu_seqlens, p.cu_seqlens_padded, max_len=5, pad_value=0)
    assert torch.equal(back, ids)
    vals = torch.arange(15, dtype=torch.float32).view(3, 5, 1)  # per-token vectors pack too
    packed_vals = pack_tensor(vals, p.cu_seqlens, p.cu_seqlens_padded, p.total_len, pad_value=-1.0)
    assert packed_vals.shape == (1, 16, 1)
    assert packed_vals[0, :, 0].tolist()[:5] == [0.0, 1.0, 2.0, -1.0, 5.0]
    unpacked = unpack_sequences(packed_vals, p.cu_seqlens, p.cu_seqlens_padded, max_len=5, pad_value=-1.0)
    assert unpacked[1, :, 0].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]
    assert unpacked[2, :, 0].tolist() == [10.0, -1.0, -1.0, -1.0, -1.0]


def test_packed_attention_mask_is_block_diagonal_causal() -> None:
    mask = packed_attention_mask(torch.tensor([0, 2, 5]), total_len=6, dtype=torch.float32)
    assert mask.shape == (1, 1, 6, 6)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # row padding attends to itself only
    ]
    assert float(mask.min()) == torch.finfo(torch.float32).min
    assert packed_attention_mask(torch.tensor([0, 3]), 3, torch.bfloat16).dtype == torch.bfloat16
