"""One global batch trained in parts, before its global counts are known: both worker families' `train_part` /
`finish_parts` (synchronous GRPO with generation and training overlapped, rlpost.algorithms.overlap).

Each part runs forward and backward with both loss normalisers 1, so its loss and metrics are sums and its
gradients accumulate. `finish_parts` sums the parts' valid counts over data-parallel ranks and hands them to the
backend's `_step_parts`, which scales gradients, loss and metrics into the loss's global means
(`loss_fn.accumulated_scales`), then clips and steps once: the step `train` takes on the whole batch.

The policy actors run two default-group calls at once and Ray does not promise a threaded actor's order (a part
whose shard went through the object store may start before an earlier one), so parts run one at a time under a
lock, part `index` after part index - 1 (the same sums in the same order, run after run). A part that waited
PART_ORDER_WAIT_S goes on out of order rather than risk two parts holding both threads while the one they wait for
is queued: the sum is the same to float rounding. A failed part never reaches the optimizer.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.models.policy.global_batches import local_valid_counts

PART_ORDER_WAIT_S = 10.0
"""How long `train_part` waits for the part before it (see the module docstring)."""


class Parts:
    """What `train_part` calls accumulate until `finish_parts`: loss sum, per-micro-batch metrics, local counts."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), device=device)
        self.counts = torch.zeros(2, device=device)
        """This rank's valid sequences and valid tokens so far (`local_valid_counts`)."""
        self.metrics: list[dict[str, Any]] = []
        self.done = 0
        """Parts trained."""
        self.failed = False


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

    def _accumulate_part(self, parts: Parts, data: BatchedDataDict, loss_fn: Any) -> None:
        """Forward and backward over `data`'s micro-batches with both normalisers 1, gradients accumulating; adds
        the loss into parts.loss and each micro-batch's metrics to parts.metrics."""
        raise NotImplementedError

    def _step_parts(self, parts: Parts, loss_fn: Any) -> dict[str, Any]:
        """parts.counts are global now: scale, clip, step; `train`'s result."""
        raise NotImplementedError

    # ---- the calls ---------------------------------------------------------------------------------------
    def train_part(self, data: BatchedDataDict, loss_fn: Any, index: int = 0) -> int:
        """Forward and backward over one part of the step's single global batch (see the module docstring);
        the rows trained."""
        with self._parts_done:
            self._parts_done.wait_for(lambda: (self._parts.done if self._parts else 0) >= index
                                      or (self._parts is not None and self._parts.failed), timeout=PART_ORDER_WAIT_S)
            if self._parts is None:
                self._begin_parts()
                self._parts = Parts(self.device)
            parts = self._parts
            try:
                self._accumulate_part(parts, data, loss_fn)
                parts.counts += local_valid_counts(data).to(self.device)
                parts.done += 1
            except BaseException:
                parts.failed = True  # this batch never reaches the optimizer
                raise
            finally:
                self._parts_done.notify_all()
        return data.size

    def finish_parts(self, loss_fn: Any, num_parts: int) -> dict[str, Any]:
        """Once `num_parts` `train_part` calls are through: one optimizer step over all of them (`_step_parts`)."""
        with self._parts_done:
            self._parts_done.wait_for(lambda: self._parts is not None and (self._parts.failed
                                                                          or self._parts.done >= num_parts))
            parts, self._parts = self._parts, None
            assert parts is not None
            if parts.failed or parts.done != num_parts:
                raise RuntimeError(f"finish_parts: {parts.done} of {num_parts} parts trained (a part failed)")
            return self._step_parts(parts, loss_fn)
