"""Global normalisation: the sum of micro-batch losses has the gradient of the whole-batch loss, however the
batch is split (fixed micro-batches, data-parallel shards, dynamic batching, sequence packing via the wrapper)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.data.packing import pack_tensor
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.clipped_pg import ClippedPGLossFn, NLLLoss
from rlpost.losses.packed import SequencePackingLossWrapper

B, S, V = 8, 14, 11

LOSSES: dict[str, Callable[[], object]] = {
    "token": lambda: ClippedPGLossFn(
        ClippedPGLossConfig(reference_policy_kl_penalty=0.05, use_importance_sampling_correction=True, ratio_clip_c=3.0)
    ),
    "token_k1_onpolicy": lambda: ClippedPGLossFn(
        ClippedPGLossConfig(reference_policy_kl_type="k1", use_on_policy_kl_approximation=True)
    ),
    "sequence": lambda: ClippedPGLossFn(ClippedPGLossConfig(token_level_loss=False, reference_policy_kl_penalty=0.1)),
    "gspo": lambda: ClippedPGLossFn(
        ClippedPGLossConfig(
            token_level_loss=False,
            sequence_level_importance_ratios=True,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_ratio=2.0,
        )
    ),
    "reinforce": lambda: ClippedPGLossFn(ClippedPGLossConfig(disable_ppo_ratio=True)),
    "nll": lambda: NLLLoss(),
}


def make_batch(dtype: torch.dtype = torch.float64, seed: int = 0) -> tuple[torch.Tensor, BatchedDataDict]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g, dtype=dtype)
    lengths = torch.randint(4, S + 1, (B,), generator=g)  # [B]
    prompt = torch.randint(1, 3, (B,), generator=g)  # [B]
    pos = torch.arange(S).unsqueeze(0)  # [1, S]
    input_ids = torch.randint(1, V, (B, S), generator=g) * (pos < lengths.unsqueeze(1))  # pad = 0
    token_mask = ((pos >= prompt.unsqueeze(1)) & (pos < lengths.unsqueeze(1))).to(dtype)  # [B, S]
    sample_mask = torch.ones(B, dtype=dtype)
    sample_mask[3] = 0.0
    true_lp = torch.zeros(B, S, dtype=dtype)
    true_lp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    noise = lambda: 0.3 * torch.randn(B, S, generator=g, dtype=dtype) * token_mask  # noqa: E731
    adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, S).clone() * token_mask
    data = BatchedDataDict(
        input_ids=input_ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=sample_mask,
        advantages=adv,
        prev_logprobs=true_lp + noise(),
        generation_logprobs=true_lp + noise(),
        reference_policy_logprobs=true_lp + noise(),
        row_idx=torch.arange(B),
    )
    return logits.requires_grad_(True), data


def global_counts(data: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor]:
    gs = data["sample_mask"].sum()
    gt = (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).sum()
    return gs, gt


def whole(loss_fn, logits: torch.Tensor, data: BatchedDataDict) -> tuple[torch.Tensor, dict, torch.Tensor]:
    gs, gt = global_counts(data)
    loss, metrics = loss_fn(logits, data, gs, gt)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), metrics, grad


def check(total: torch.Tensor, metrics: list[dict], logits: torch.Tensor, ref: tuple) -> None:
    ref_loss, ref_metrics, ref_grad = ref
    (grad,) = torch.autograd.grad(total, logits)
    assert float(ref_grad.abs().max()) > 1e-3  # the comparison is not vacuous
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    assert float(total) == pytest.approx(float(ref_loss), abs=1e-6)
    for key, val in ref_metrics.items():
        assert sum(m[key] for m in metrics) == pytest.approx(val, abs=1e-6), key


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("mbs", [1, 3, 8])
def test_fixed_microbatches(loss_name: str, mbs: int) -> None:
    logits, data = make_batch()
    loss_fn = LOSSES[loss_name]()
    ref = whole(loss_fn, logits, data)
    gs, gt = global_counts(data)
    total, metrics = torch.zeros((), dtype=logits.dtype), []
    for start in range(0, B, mbs):
        loss, m = loss_fn(logits[start : start + mbs], data.slice(start, start + mbs), gs, gt)
        total, metrics = total + loss, metrics + [m]
    check(total, metrics, logits, ref)


@pytest.mark.parametrize("loss_name", ["token", "sequence"])
def test_data_parallel_shards_float32(loss_name: str) -> None:
    logits, data = make_batch(torch.float32, seed=1)
    loss_fn = LOSSES[loss_name]()
    ref = whole(loss_fn, logits, data)
    gs, gt = global_counts(data)  # what the all-reduce over DP ranks yields
    total, metrics = torch.zeros(()), []
    for shard in data.shard_by_batch_size(2, batch_size=4):
        for gb in range(2):
            for mb in shard.get_batch(gb, 2).make_microbatch_iterator(1):
                loss, m = loss_fn(logits[mb["row_idx"]], mb, gs, gt)
                total, metrics = total + loss, metrics + [m]
    check(total, metrics, logits, ref)


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("budget", [16, 40])
def test_dynamic_batching(loss_name: str, budget: int) -> None:
    logits, data = make_batch(seed=2)
    loss_fn = LOSSES[loss_name]()
    ref = whole(loss_fn, logits, data)
    gs, gt = global_counts(data)
    shards, _ = data.shard_by_batch_size(
        2, batch_size=B, dynamic_batching_args={"max_tokens_per_microbatch": budget, "sequence_length_round": 4}
    )
    total, metrics, trimmed = torch.zeros((), dtype=logits.dtype), [], False
    for shard in shards:
        for mb in shard.make_microbatch_iterator_with_dynamic_shapes():
            seq_len = mb["input_ids"].shape[1]
            trimmed |= seq_len < S
            loss, m = loss_fn(logits[mb["row_idx"]][:, :seq_len], mb, gs, gt)
            total, metrics = total + loss, metrics + [m]
    assert trimmed  # some micro-batch really was shorter than the padded batch
    check(total, metrics, logits, ref)


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("algorithm", ["modified_first_fit_decreasing", "first_fit_decreasing", "concatenative"])
def test_sequence_packing_wrapper(loss_name: str, algorithm: str) -> None:
    logits, data = make_batch(seed=3)
    loss_fn = LOSSES[loss_name]()
    ref = whole(loss_fn, logits, data)
    gs, gt = global_counts(data)
    shards, _ = data.shard_by_batch_size(
        2,
        batch_size=B,
        sequence_packing_args={
            "max_tokens_per_microbatch": 24,
            "algorithm": algorithm,
            "sequence_length_pad_multiple": 2,
            "sequence_length_round": 8,
        },
    )
    total, metrics, multi = torch.zeros((), dtype=logits.dtype), [], False
    for shard in shards:
        for pmb in shard.make_microbatch_iterator_for_packable_sequences():
            rows = pmb.data["row_idx"]
            multi |= len(rows) > 1
            packed = pmb.packed
            packed_logits = pack_tensor(
                logits[rows][:, : pmb.seq_len], packed.cu_seqlens, packed.cu_seqlens_padded, packed.total_len
            )  # [1, T, V]
            wrapper = SequencePackingLossWrapper(loss_fn, packed.cu_seqlens, packed.cu_seqlens_padded)
            assert wrapper.loss_type == loss_fn.loss_type
            loss, m = wrapper(packed_logits, pmb.data, gs, gt)
            if pmb.is_padding:
                assert float(loss) == 0.0
            total, metrics = total + loss, metrics + [m]
    assert multi  # at least one micro-batch packed several sequences
    check(total, metrics, logits, ref)
