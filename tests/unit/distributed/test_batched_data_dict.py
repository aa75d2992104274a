"""BatchedDataDict: construction, row operations, sharding, dynamic batching and packing plans."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlpost.distributed.batched_data_dict import BatchedDataDict


def numbered(n: int, seq: int = 6) -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.arange(n * seq).view(n, seq),
        sample_mask=torch.ones(n),
        idx=torch.arange(n),
        text=[f"s{i}" for i in range(n)],
    )


def test_from_batches_pads_dim1() -> None:
    a = BatchedDataDict(
        input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]),
        token_mask=torch.ones(2, 3),
        logits=torch.ones(2, 3, 2),
        sample_mask=torch.tensor([1.0, 0.0]),
        text=["a", "b"],
    )
    b = BatchedDataDict(
        input_ids=torch.tensor([[7, 8, 9, 10, 11]]),
        token_mask=torch.ones(1, 5),
        logits=torch.ones(1, 5, 2),
        sample_mask=torch.tensor([1.0]),
        text=["c"],
    )
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"input_ids": -1})
    assert isinstance(out, BatchedDataDict) and out.size == 3
    assert out["input_ids"].tolist() == [[1, 2, 3, -1, -1], [4, 5, 6, -1, -1], [7, 8, 9, 10, 11]]
    assert out["token_mask"].tolist()[0] == [1, 1, 1, 0, 0]
    assert out["logits"].shape == (3, 5, 2) and float(out["logits"][0, 3:].abs().sum()) == 0
    assert out["sample_mask"].tolist() == [1.0, 0.0, 1.0]
    assert out["text"] == ["a", "b", "c"]


def test_row_operations() -> None:
    d = numbered(5)
    assert d.size == 5
    sel = d.select_indices([3, 0])
    assert sel["idx"].tolist() == [3, 0] and sel["text"] == ["s3", "s0"]
    assert torch.equal(sel["input_ids"][0], d["input_ids"][3])
    assert d.slice(1, 3)["text"] == ["s1", "s2"]
    rep = d.slice(0, 2).repeat_interleave(3)
    assert rep["idx"].tolist() == [0, 0, 0, 1, 1, 1] and rep["text"] == ["s0"] * 3 + ["s1"] * 3
    perm = [4, 2, 0, 1, 3]
    shuffled = d.reorder(perm)
    assert shuffled["idx"].tolist() == perm
    assert shuffled.restore_order(perm)["idx"].tolist() == [0, 1, 2, 3, 4]
    assert d.to("cpu")["idx"].tolist() == d["idx"].tolist()
    back = pickle.loads(pickle.dumps(shuffled))
    assert isinstance(back, BatchedDataDict) and back["text"] == shuffled["text"]
    with pytest.raises(ValueError):
        _ = BatchedDataDict(a=torch.zeros(2), b=[1]).size


def test_shard_by_batch_size_plain() -> None:
    d = numbered(8)
    shards = d.shard_by_batch_size(2, batch_size=4)
    assert [s["idx"].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert shards[0].get_batch(1, 2)["idx"].tolist() == [4, 5]
    assert [s["idx"].tolist() for s in d.shard_by_batch_size(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    uneven = numbered(5).shard_by_batch_size(2, allow_uneven_shards=True)
    assert [s["idx"].tolist() for s in uneven] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError):
        numbered(5).shard_by_batch_size(2)
    with pytest.raises(ValueError):
        d.shard_by_batch_size(2, batch_size=3)
    mbs = list(shards[1].make_microbatch_iterator(3))
    assert [m["idx"].tolist() for m in mbs] == [[2, 3, 6], [7]]


def variable_length(n: int, seq: int, seed: int) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (n,), generator=g)
    ids = torch.randint(1, 100, (n, seq), generator=g) * (torch.arange(seq) < lengths.unsqueeze(1))
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=(ids > 0).float(),
        sample_mask=torch.ones(n),
        idx=torch.arange(n),
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_dynamic_batching_plan_and_order_restoration(seed: int) -> None:
    n, seq, budget, rnd = 24, 32, 64, 8
    d = variable_length(n, seq, seed)
    shards, original = d.shard_by_batch_size(
        3, batch_size=12, dynamic_batching_args={"max_tokens_per_microbatch": budget, "sequence_length_round": rnd}
    )
    assert sorted(original) == list(range(n))
    counts = []
    outputs = []
    for shard in shards:
        per_gb = []
        for gb in range(2):
            batch = shard.get_batch(gb, 4)
            assert all(gb * 12 <= i < (gb + 1) * 12 for i in batch["idx"].tolist())
            mbs = list(batch.make_microbatch_iterator_with_dynamic_shapes())
            per_gb.append(len(mbs))
            for mb in mbs:
                width = mb["input_ids"].shape[1]
                longest = int(mb["input_lengths"].max())
                assert width == min(-(-longest // rnd) * rnd, seq)  # own longest, rounded up
                assert mb.size * width <= budget or mb.size == 1
                assert mb["token_mask"].shape[1] == width and mb["sample_mask"].shape == (mb.size,)
                assert not mb.is_padding
        counts.append(per_gb)
        # a "model output" per row, computed micro-batch by micro-batch on trimmed rows
        rows = [BatchedDataDict(out=mb["input_ids"] * 2) for mb in shard.make_microbatch_iterator_with_dynamic_shapes()]
        assert shard.get_microbatch_iterator_dynamic_shapes_len() == len(rows)
        outputs.append(BatchedDataDict.from_batches(rows))
    assert all(c == counts[0] for c in counts)  # equal micro-batch counts on every DP rank
    assert max(max(c) for c in counts) > 1
    restored = BatchedDataDict.from_batches(outputs, pad_value_dict={"out": 0}).restore_order(original)
    width = restored["out"].shape[1]
    assert torch.equal(restored["out"], d["input_ids"][:, :width] * 2)
    assert torch.all(d["input_ids"][:, width:] == 0)


def test_sequence_packing_equal_counts_with_zero_weight_padding() -> None:
    # one global batch of 4 rows over 2 shards: dealt by decreasing length -> shard0 gets (10, 6), shard1 (8, 2)
    lengths = torch.tensor([10, 8, 6, 2])
    ids = torch.arange(1, 41).view(4, 10) * (torch.arange(10) < lengths.unsqueeze(1))
    d = BatchedDataDict(input_ids=ids, input_lengths=lengths, sample_mask=torch.ones(4), idx=torch.arange(4))
    shards, original = d.shard_by_batch_size(
        2, sequence_packing_args={"max_tokens_per_microbatch": 12, "algorithm": "first_fit_decreasing"}
    )
    assert original == [0, 2, 1, 3]
    shards = [pickle.loads(pickle.dumps(s)) for s in shards]  # the plan travels with the shard (Ray pickles)
    mb0 = list(shards[0].make_microbatch_iterator_for_packable_sequences())
    mb1 = list(shards[1].make_microbatch_iterator_for_packable_sequences())
    assert len(mb0) == len(mb1) == 2  # shard0 needs 2 bins (10 | 6), shard1 packs 8 + 2 into one, plus a filler
    assert [m.is_padding for m in mb0] == [False, False]
    assert [m.is_padding for m in mb1] == [False, True]
    assert float(mb1[1].data["sample_mask"].sum()) == 0.0
    assert mb1[0].data["idx"].tolist() == [1, 3]
    p = mb1[0].packed
    assert p.cu_seqlens.tolist() == [0, 8, 10]
    assert p.position_ids.tolist() == [list(range(8)) + [0, 1]]
    assert p.input_ids[0].tolist() == ids[1, :8].tolist() + ids[3, :2].tolist()
    assert torch.equal(mb1[0].unpack(p.input_ids), ids[[1, 3], :8])
    assert shards[1].get_microbatch_iterator_for_packable_sequences_len() == 2


@pytest.mark.parametrize("algorithm", ["modified_first_fit_decreasing", "first_fit_shuffle", "concatenative"])
def test_sequence_packing_plan_properties(algorithm: str) -> None:
    d = variable_length(32, 24, seed=5)
    budget = 40
    shards, original = d.shard_by_batch_size(
        4,
        batch_size=16,
        sequence_packing_args={
            "max_tokens_per_microbatch": budget,
            "algorithm": algorithm,
            "sequence_length_pad_multiple": 4,
            "sequence_length_round": 16,
        },
    )
    assert sorted(original) == list(range(32))
    counts = set()
    seen: list[int] = []
    for shard in shards:
        n = 0
        for mb in shard.make_microbatch_iterator_for_packable_sequences():
            n += 1
            p = mb.packed
            assert p.total_len % 16 == 0
            assert int(p.cu_seqlens_padded[-1]) <= budget
            assert torch.all(p.cu_seqlens_padded % 4 == 0)
            real = (p.cu_seqlens[1:] - p.cu_seqlens[:-1]).tolist()
            assert real == mb.data["input_lengths"].tolist()
            if not mb.is_padding:
                seen += mb.data["idx"].tolist()
            else:
                assert float(mb.data["sample_mask"].sum()) == 0.0
        counts.add(n)
    assert len(counts) == 1
    assert sorted(seen) == list(range(32))


def test_iterators_require_a_plan() -> None:
    with pytest.raises(ValueError):
        list(numbered(4).make_microbatch_iterator_with_dynamic_shapes())
    with pytest.raises(ValueError):
        variable_length(4, 8, 0).shard_by_batch_size(
            2,
            dynamic_batching_args={"max_tokens_per_microbatch": 8},
            sequence_packing_args={"max_tokens_per_microbatch": 8},
        )
