"""One global batch trained in parts, before its global counts are known: both worker families' `train_part` /
`finish_parts` (synchronous GRPO with generation and training overlapped, rlpost.algorithms.overlap).

Each part runs forward and backward with both loss normalisers 1, so its loss and metrics are sums and its
gradients accumulate. `finish_parts` sums the parts' valid counts over data-parallel ranks and hands them to the
backend's `_step_parts`, which scales gradients, loss and metrics into the loss's global means
(`loss_fn.accumulated_scales`), then clips and steps once: the step `train` takes on the whole batch.

The policy actors run two default-group calls at once and Ray does not promise a threaded actor's order (a part
whose shard went through the object store may start after a later one). Every rank must train the parts in the
same order: with tensor or pipeline parallelism a part's forward exchanges activations between ranks, so two ranks
on different parts would mix them. So a call only hands its part in; whichever call finds the next part in line
trains it and every later one already there, one at a time, in index order. No call waits for another, so no
order of arrival can hold both threads. A failed part never reaches the optimizer: the call that trained it
raises, and `finish_parts` refuses the batch.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
import torch.distributed as dist

from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.collective_device import all_reduce
from rlpost.losses.interface import LossFunction
from rlpost.models.policy.global_batches import add_mb_metrics, local_valid_counts
from rlpost.models.policy.interfaces import GlobalBatchesResult, WorkerTrainResult


class PartsLoss(LossFunction, Protocol):
    """A loss a batch can be trained with in parts: it turns the parts' sums into its global means."""

    def accumulated_scales(self, global_valid_seqs: float, global_valid_toks: float) -> tuple[float, dict[str, float]]:
        """(the loss's and its gradients' factor, each metric's factor; a metric absent: unchanged)."""


class Parts:
    """What the parts of one batch accumulate until `finish_parts`: loss sum, per-micro-batch metrics, local counts;
    and the parts handed in but not trained yet."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.counts = torch.zeros(2, device=device)
        """This rank's valid sequences and valid tokens so far (`local_valid_counts`)."""
        self.metrics: list[dict[str, float]] = []
        self.done = 0
        """Parts trained (they are trained in index order: the next one is part `done`)."""
        self.failed = False
        self.waiting: dict[int, tuple[BatchedDataDict, LossFunction]] = {}
        """Parts handed in ahead of their turn: index -> (data, loss_fn)."""
        self.training = False
        """A call is training parts now."""

    def global_scales(self, loss_fn: PartsLoss, dp_group: dist.ProcessGroup | None) -> tuple[float, dict[str, float]]:
        """Once every part is trained: the counts summed over the data-parallel group (in place), and what turns the
        parts' sums into the loss's global means (`loss_fn.accumulated_scales`: the loss's and gradients' factor,
        each metric's)."""
        self.counts = all_reduce(self.counts, dp_group)
        scale, metric_scales = loss_fn.accumulated_scales(float(self.counts[0]), float(self.counts[1]))
        return float(scale), metric_scales

    def result(self, loss: float, grad_norm: float, metric_scales: dict[str, float]) -> GlobalBatchesResult:
        """`train`'s result for the batch (one global batch; the metrics scaled), before `finish_result`."""
        mb_metrics: dict[str, list[float]] = {}
        add_mb_metrics(mb_metrics, self.metrics, metric_scales)
        return {"loss": loss, "grad_norm": grad_norm, "num_global_batches": 1, "all_mb_metrics": mb_metrics}


class TrainPartsMixin:
    """`train_part` / `finish_parts` for a worker that implements `_begin_parts`, `_accumulate_part` and
    `_step_parts`. Call `_init_parts` in the constructor."""

    device: torch.device

    def _init_parts(self) -> None:
        self._parts: Parts | None = None
        self._parts_done = threading.Condition()

    # ---- the backend's part ------------------------------------------------------------------------------
    def _begin_parts(self) -> None:
        """Before the first part: no optimizer raises; the gradients are zeroed."""
        raise NotImplementedError

    def _accumulate_part(self, parts: Parts, data: BatchedDataDict, loss_fn: LossFunction) -> None:
        """Forward and backward over `data`'s micro-batches with both normalisers 1, gradients accumulating; adds
        the loss into parts.loss and each micro-batch's metrics to parts.metrics."""
        raise NotImplementedError

    def _step_parts(self, parts: Parts, loss_fn: PartsLoss) -> WorkerTrainResult:
        """Every part is trained: scale (`parts.global_scales`), clip, step; `train`'s result (`parts.result`)."""
        raise NotImplementedError

    # ---- the calls ---------------------------------------------------------------------------------------
    def train_part(self, data: BatchedDataDict, loss_fn: LossFunction, index: int = 0) -> int:
        """Hand in part `index` of the step's single global batch; it is trained (forward and backward) in index
        order, by this call or by the one training the parts before it (module docstring). The rows handed in."""
        with self._parts_done:
            if self._parts is None:
                self._begin_parts()
                self._parts = Parts(self.device)
            parts = self._parts
            if parts.failed:
                raise RuntimeError(f"train_part {index}: an earlier part of this batch failed")
            parts.waiting[index] = (data, loss_fn)
            if parts.training or parts.done not in parts.waiting:
                return data.size  # not its turn yet, or another call trains it
            parts.training = True
        try:
            while True:
                with self._parts_done:
                    item = parts.waiting.pop(parts.done, None)
                    if item is None:
                        parts.training = False
                        return data.size
                part, fn = item
                self._accumulate_part(parts, part, fn)
                with self._parts_done:
                    parts.counts += local_valid_counts(part).to(self.device)
                    parts.done += 1
                    self._parts_done.notify_all()
        except BaseException:
            with self._parts_done:
                parts.failed = True  # this batch never reaches the optimizer
                parts.training = False
                parts.waiting.clear()
                self._parts_done.notify_all()
            raise

    def finish_parts(self, loss_fn: PartsLoss, num_parts: int) -> WorkerTrainResult:
        """Once `num_parts` parts are trained: one optimizer step over all of them (`_step_parts`)."""
        with self._parts_done:
            self._parts_done.wait_for(lambda: self._parts is not None and (self._parts.failed
                                                                          or self._parts.done >= num_parts))
            parts, self._parts = self._parts, None
            assert parts is not None
            if parts.failed or parts.done != num_parts:
                raise RuntimeError(f"finish_parts: {parts.done} of {num_parts} parts trained (a part failed)")
            return self._step_parts(parts, loss_fn)
