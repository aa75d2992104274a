"""Dynamic batching by default: on where it trains the same step as fixed micro-batches (the DTensor workers under
GRPO, RLOO, distillation and SFT), off where it cannot (Megatron, DPO / RM pairs, PPO, sequence packing), its token
budgets the most a fixed micro-batch holds, and its micro-batches the longest rows first."""

from __future__ import annotations

import pytest
import torch

from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.plan import plan_rows


@pytest.mark.parametrize(("overrides", "on"), [
    ([], True),
    (["algo=rloo"], True),
    (["algo=sft"], True),
    (["policy=dtensor_v2"], True),
    (["policy=megatron"], False),
    (["algo=dpo"], False),
    (["algo=rm"], False),
    (["algo=ppo"], False),
    (["policy.sequence_packing.enabled=true"], False),
    (["policy.dynamic_batching.enabled=false"], False),
], ids=["grpo", "rloo", "sft", "dtensor_v2", "megatron", "dpo", "rm", "ppo", "packing", "off"])
def test_the_default_is_on_where_it_trains_the_same_step(overrides: list[str], on: bool) -> None:
    _, cfg = load_master_config(overrides)
    p = cfg.policy
    assert p.dynamic_batching.enabled is on
    # the budgets: the most tokens a fixed micro-batch of the same run holds
    assert p.dynamic_batching.train_mb_tokens == p.max_total_sequence_length * p.train_micro_batch_size
    assert p.dynamic_batching.logprob_mb_tokens == p.max_total_sequence_length * p.logprob_batch_size
    rows = dict(plan_rows(cfg))
    shown = rows.get("micro-batches per optimizer step") or rows["batching"]
    assert ("dynamic" in shown) is on


def test_a_budget_the_user_gives_is_kept_and_a_megatron_run_asking_for_it_is_refused() -> None:
    _, cfg = load_master_config(["policy.dynamic_batching.train_mb_tokens=300"])
    assert cfg.policy.dynamic_batching.train_mb_tokens == 300
    assert cfg.policy.dynamic_batching.logprob_mb_tokens == 64 * 64
    with pytest.raises(ConfigError, match="policy.dynamic_batching.enabled"):
        load_master_config(["policy=megatron", "policy.dynamic_batching.enabled=true"])
    with pytest.raises(ConfigError, match="policy.dynamic_batching.enabled"):
        load_master_config(["algo=dpo", "policy.dynamic_batching.enabled=true"])


def test_each_rank_starts_with_its_longest_rows() -> None:
    """The step's peak comes at its first micro-batch: each rank's micro-batches go longest rows first."""
    g = torch.Generator().manual_seed(3)
    n, width = 16, 40
    lengths = torch.randint(2, width + 1, (n,), generator=g)
    data = BatchedDataDict(input_ids=torch.ones(n, width, dtype=torch.long), input_lengths=lengths,
                           sample_mask=torch.ones(n))
    shards, _ = data.shard_by_batch_size(2, batch_size=8, dynamic_batching_args={"max_tokens_per_microbatch": 80,
                                                                                "sequence_length_round": 4})
    for shard in shards:
        for gb in range(2):
            batch = shard.get_batch(gb, 4)
            widths = [mb["input_ids"].shape[1] for mb in batch.make_microbatch_iterator_with_dynamic_shapes()]
            assert len(widths) > 1 and widths == sorted(widths, reverse=True)
            assert widths[0] >= int(batch["input_lengths"].max())
