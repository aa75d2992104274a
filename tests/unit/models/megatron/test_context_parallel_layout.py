"""The load-balanced layout of Megatron context parallelism (rlpost.models.megatron.context_parallel): which
positions each rank holds, and the order that puts the gathered chunks back into sequence order."""

from __future__ import annotations

import pytest
import torch

from rlpost.models.megatron.context_parallel import gathered_positions, local_positions, padded_length


@pytest.mark.parametrize(("length", "size", "padded"), [(12, 2, 12), (19, 2, 20), (5, 4, 8), (1, 3, 6)])
def test_sequences_are_padded_to_two_chunks_per_rank(length: int, size: int, padded: int) -> None:
    assert padded_length(length, size) == padded


def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r() -> None:
    # 16 positions over 2 ranks: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (as megatron's RoPE)
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_ranks_chunks_cover_the_sequence_once_and_balance_the_causal_work(size: int) -> None:
    length = 4 * size * 3
    gathered = gathered_positions(length, size)
    assert sorted(gathered.tolist()) == list(range(length))
    seq = torch.arange(100, 100 + length)
    assert torch.equal(seq[gathered][torch.argsort(gathered)], seq)  # gather's reordering puts it back
    work = [int((local_positions(length, size, r) + 1).sum()) for r in range(size)]  # keys each rank's queries see
    assert len(set(work)) == 1
