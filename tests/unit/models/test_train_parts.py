"""TrainPartsMixin: parts handed in out of order are trained in index order, by whichever call holds the next one,
and no call waits for another (rlpost.models.policy.train_parts)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.models.policy.train_parts import Parts, TrainPartsMixin


class Recorder(TrainPartsMixin):
    """A backend that records the order it trains parts in; part `fail` raises."""

    def __init__(self, fail: int | None = None) -> None:
        self.device = torch.device("cpu")
        self.order: list[int] = []
        self.fail = fail
        self.began = 0
        self._init_parts()

    def _begin_parts(self) -> None:
        self.began += 1

    def _accumulate_part(self, parts: Parts, data: BatchedDataDict, loss_fn: Any) -> None:
        index = int(data["input_ids"][0, 0])
        if index == self.fail:
            raise ValueError(f"part {index}")
        self.order.append(index)
        parts.loss += float(data.size)

    def _step_parts(self, parts: Parts, loss_fn: Any) -> dict[str, Any]:
        return {"order": list(self.order), "loss": float(parts.loss), "counts": parts.counts.tolist()}


def part(index: int, rows: int = 2) -> BatchedDataDict:
    return BatchedDataDict(input_ids=torch.full((rows, 3), index), token_mask=torch.ones(rows, 3),
                           sample_mask=torch.ones(rows))


def test_parts_handed_in_out_of_order_train_in_index_order_without_waiting() -> None:
    w = Recorder()
    assert w.train_part(part(2), None, 2) == 2  # returns at once: not its turn
    assert w.train_part(part(1), None, 1) == 2
    assert w.order == []
    w.train_part(part(0), None, 0)  # trains 0, then 1 and 2, which were waiting
    assert w.order == [0, 1, 2]
    w.train_part(part(3), None, 3)
    out = w.finish_parts(None, 4)
    assert out == {"order": [0, 1, 2, 3], "loss": 8.0, "counts": [8.0, 16.0]}  # 8 rows, 2 valid tokens after the 1st
    assert w.began == 1 and w._parts is None  # the next batch starts afresh


def test_concurrent_calls_in_any_order_train_every_part_once_in_order() -> None:
    for order in ([3, 1, 0, 2], [1, 2, 3, 0], [0, 1, 2, 3]):
        w = Recorder()
        threads = [threading.Thread(target=w.train_part, args=(part(i), None, i)) for i in order]
        for t in threads:
            t.start()
        out = w.finish_parts(None, 4)
        for t in threads:
            t.join(timeout=10)
        assert out["order"] == [0, 1, 2, 3], order


def test_a_failed_part_fails_the_batch_and_the_parts_after_it() -> None:
    w = Recorder(fail=1)
    w.train_part(part(2), None, 2)
    w.train_part(part(0), None, 0)
    with pytest.raises(ValueError, match="part 1"):
        w.train_part(part(1), None, 1)  # its own call trains it: 0 is done, 2 waits behind it
    assert w.order == [0]  # part 2 was never trained
    with pytest.raises(RuntimeError, match="an earlier part of this batch failed"):
        w.train_part(part(3), None, 3)
    with pytest.raises(RuntimeError, match="1 of 4 parts trained"):
        w.finish_parts(None, 4)
    w.fail = None  # the next batch starts afresh
    w.train_part(part(0), None, 0)
    assert w.finish_parts(None, 1)["loss"] == 2.0
