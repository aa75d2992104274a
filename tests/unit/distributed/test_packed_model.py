"""Packing never mixes sequences: a tiny Qwen2 on a packed row (restarting position ids + block-diagonal causal
4D mask) gives the same logprobs as running each sequence alone."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlpost.data.packing import pack_sequences, packed_attention_mask
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.ops.logprobs import logprobs_from_logits

LENGTHS = [5, 9, 3, 7]


def tiny_qwen2(attn: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_unpacked(attn: str) -> None:
    model = tiny_qwen2(attn)
    g = torch.Generator().manual_seed(1)
    rows = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        rows[i, :n] = torch.randint(1, 128, (n,), generator=g)
    packed = pack_sequences(rows, LENGTHS, pad_to_multiple_of=4, total_round=8)
    with torch.no_grad():
        logits = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=packed.attention_mask(torch.float32),
        ).logits  # [1, T, V]
        naive = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=packed_attention_mask(packed.cu_seqlens_padded[[0, -1]], packed.total_len, torch.float32),
        ).logits  # one causal block over the whole row: sequences see each other
        worst_naive = 0.0
        for i, n in enumerate(LENGTHS):
            start = int(packed.cu_seqlens_padded[i])
            ids = rows[i : i + 1, :n]
            alone = logprobs_from_logits(model(input_ids=ids).logits, ids)  # [1, n]
            in_pack = logprobs_from_logits(logits[:, start : start + n], ids)
            torch.testing.assert_close(in_pack, alone, atol=1e-5, rtol=0)
            mixed = logprobs_from_logits(naive[:, start : start + n], ids)
            worst_naive = max(worst_naive, float((mixed - alone).abs().max()))
    assert worst_naive > 1e-3  # without the block mask the test would fail


def test_packed_microbatches_from_sharding_run_through_the_model() -> None:
    model = tiny_qwen2("sdpa")
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([4, 11, 6, 3, 9, 5, 12, 2])
    ids = torch.randint(1, 128, (8, 12), generator=g) * (torch.arange(12) < lengths.unsqueeze(1))
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, sample_mask=torch.ones(8))
    shards, original = data.shard_by_batch_size(
        2, sequence_packing_args={"max_tokens_per_microbatch": 20, "sequence_length_pad_multiple": 2}
    )
    outputs = []
    with torch.no_grad():
        for shard in shards:
            lps = []
            for mb in shard.make_microbatch_iterator_for_packable_sequences():
                p = mb.packed
                logits = model(
                    input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=p.attention_mask()
                ).logits
                lp_packed = logprobs_from_logits(logits, p.input_ids)  # [1, T]; sequence starts hold garbage
                lp_rows = mb.unpack(lp_packed.unsqueeze(-1)).squeeze(-1)  # [N, seq_len]
                lp_rows[:, 0] = 0.0  # position 0 of every sequence (it was predicted across the boundary)
                if not mb.is_padding:
                    lps.append(BatchedDataDict(logprobs=lp_rows))
            outputs.append(BatchedDataDict.from_batches(lps))
        result = BatchedDataDict.from_batches(outputs).restore_order(original)["logprobs"]  # [8, <=12]
        for i, n in enumerate(lengths.tolist()):
            want = logprobs_from_logits(model(input_ids=ids[i : i + 1, :n]).logits, ids[i : i + 1, :n])
            torch.testing.assert_close(result[i : i + 1, :n], want, atol=1e-5, rtol=0)
