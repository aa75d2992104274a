"""The overlapped step's bookkeeping (rlpost.algorithms.overlap): chunk bounds and the batch's rollout metrics."""

from __future__ import annotations

import pytest
import torch

from rlpost.algorithms.overlap import chunk_spans, merge_rollout_metrics
from rlpost.algorithms.rollouts import RolloutBatch
from rlpost.distributed.batched_data_dict import BatchedDataDict


def _part(n: int, metrics: dict[str, float]) -> RolloutBatch:
    return RolloutBatch(rows=[{}] * n, group_ids=torch.zeros(n, dtype=torch.long), gen=BatchedDataDict(),
                        input_lengths=torch.ones(n, dtype=torch.long), responses=[""] * n, rewards=torch.zeros(n),
                        metrics=metrics)


def test_chunk_spans_cover_the_batch_in_order() -> None:
    assert chunk_spans(256, 64) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert chunk_spans(40, 16) == [(0, 16), (16, 32), (32, 40)]


def test_merged_metrics_add_counts_and_weigh_means_by_chunk_size() -> None:
    parts = [_part(8, {"reward_errors": 1.0, "rollout/mean_turns": 2.0, "rollout/budget_truncated": 0.0}),
             _part(24, {"reward_errors": 2.0, "rollout/mean_turns": 1.0, "rollout/budget_truncated": 3.0})]
    merged = merge_rollout_metrics(parts)
    assert merged["reward_errors"] == 3.0 and merged["rollout/budget_truncated"] == 3.0
    assert merged["rollout/mean_turns"] == pytest.approx((8 * 2.0 + 24 * 1.0) / 32)


def test_the_generating_threads_error_is_raised_in_the_driver() -> None:
    import queue
    import threading

    from rlpost.algorithms.overlap import _next_chunk

    ready: queue.Queue = queue.Queue()
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    ready.put(ValueError("engine replica 0 died"))
    with pytest.raises(ValueError, match="replica 0 died"):
        _next_chunk(ready, done)
    with pytest.raises(RuntimeError, match="ended before every chunk"):  # a thread gone without a word
        _next_chunk(ready, done)
    part = _part(2, {})
    ready.put(part)
    assert _next_chunk(ready, done) is part
