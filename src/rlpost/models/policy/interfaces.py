"""What the GRPO loop needs from a policy, and what refit needs on top. A leaf module."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

if TYPE_CHECKING:
    import ray
    import torch

    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.losses.interface import LossFunction


class GlobalBatchesResult(TypedDict):
    """A worker rank's training over its shard, before the optimizer's lr and the weight check are added."""

    loss: float
    """Mean over the global batches of their loss."""
    grad_norm: float
    """Mean over the global batches of the gradient norm (before clipping)."""
    num_global_batches: int
    all_mb_metrics: dict[str, list[float]]
    """Each loss metric's value per micro-batch (already globally normalised: they sum)."""


class WorkerTrainResult(GlobalBatchesResult):
    """What one worker rank's `train` / `finish_parts` answers (over Ray); `Policy` merges every rank's into a
    `TrainResult`."""

    lr: float
    """The optimizer's learning rate after the step."""
    params_finite: bool
    """Every weight (this rank's shards) is finite after the step."""


@dataclass(frozen=True)
class TrainResult:
    """One training call (`train`, or `finish_parts` after the parts) over every rank."""

    loss: float
    """Rank 0's loss: the mean over the global batches."""
    grad_norm: float
    """Rank 0's gradient norm, mean over the global batches."""
    lr: float
    """Rank 0's learning rate after the step."""
    params_finite: bool
    """Every rank's weights are finite after the step."""
    all_mb_metrics: dict[str, list[float]]
    """Each loss metric's value per micro-batch, every rank's."""
    metrics: dict[str, float]
    """Each loss metric over the batch: summed over micro-batches per global batch, or averaged (MEAN_METRICS)."""


@dataclass(frozen=True)
class StagedExport:
    """A serving rank's answer to `stage_export`: the export's buckets and (rank 0's) fingerprint."""

    plan: list[list[int]]
    """Weight indices of each bucket."""
    fingerprint: str
    """weight_fingerprint of the whole export."""
    first: object | None = None
    """When the export fits one bucket: that bucket, already out (as `put_export_bucket` returns it); the export
    is then cleared."""


class PolicyInterface(ABC):
    """A trainable policy: logprobs, reference logprobs, a training step, checkpoints."""

    @abstractmethod
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """{'logprobs': [B, S]}: next-token logprobs of `input_ids` (position 0 = 0), logits / temperature."""

    @abstractmethod
    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """{'reference_logprobs': [B, S]} under the frozen initial weights."""

    @abstractmethod
    def train(self, data: BatchedDataDict, loss_fn: LossFunction, gbs: int | None = None,
              eval_mode: bool = False) -> TrainResult:
        """Optimizer steps over `data` in global batches of `gbs` (default policy.train_global_batch_size); their
        loss, grad norm and metrics. eval_mode: the same losses and metrics, no update."""

    @abstractmethod
    def train_part(self, data: BatchedDataDict, loss_fn: LossFunction) -> None:
        """Send one part (whole groups) of a batch that is one optimizer step, without waiting: forward and
        backward, gradients accumulated (synchronous GRPO overlapped with generation, rlpost.algorithms.overlap)."""

    @abstractmethod
    def finish_parts(self, loss_fn: LossFunction) -> TrainResult:
        """After the last `train_part`: the optimizer step over all parts; `train`'s result for the whole batch."""

    @abstractmethod
    def prepare_for_training(self) -> None:
        """Model and optimizer onto the device, train mode."""

    @abstractmethod
    def prepare_for_lp_inference(self) -> None:
        """Eval mode for logprob passes (optimizer may be offloaded)."""

    @abstractmethod
    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None, hf_export: bool = True) -> None:
        """Sharded weights (and optimizer, scheduler) to disk, plus (hf_export) a consolidated HF export under
        weights_path/hf."""

    @abstractmethod
    def set_call_timeout(self, timeout_s: float) -> None:
        """Bound every later call on the workers by `timeout_s`."""

    @abstractmethod
    def gpu_memory_metrics(self) -> dict[str, float]:
        """Device memory of the workers (logger.monitor_gpus); {} on CPU."""

    @abstractmethod
    def shutdown(self, graceful: bool = True) -> None:
        """Release workers and process groups: `graceful` asks each worker to release its own first (bounded); a
        failed or abandoned run passes False and the workers are killed at once (one may be stuck in a call)."""


class ColocatablePolicyInterface(PolicyInterface):
    """A policy whose full weights can be handed to a rollout engine (refit)."""

    @abstractmethod
    def prepare_refit_info(self, dtype: str = "float32") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{hf_name: (shape, dtype)} of the weights refit will send."""

    @abstractmethod
    def export_weight_buckets(self, dtype: str, max_bucket_bytes: int) -> WeightBuckets:
        """Full weights under HF names, cast to `dtype`, in buckets of at most max_bucket_bytes (rank 0's IPC buffer
        on one node: shared memory, or CUDA IPC on the policy's only GPU; else the object store)."""

    @abstractmethod
    def init_refit_collective(self, host: str, port: int, world_size: int) -> None:
        """Non-colocated refit: rank 0 joins the group (rank 0 of `world_size`) whose other ranks are the engine's
        workers; blocks until they join (start the engine's side first)."""

    @abstractmethod
    def broadcast_weights_collective(self, dtype: str) -> str:
        """Broadcast the full weights (HF names, `dtype`) from rank 0 over the refit group; blocks until sent
        (start the engine's receive first); returns the fingerprint of what was sent."""

    @abstractmethod
    def stage_weights(self, dtype: str) -> str:
        """Keep a private copy of the full weights (HF names, `dtype`) on rank 0; returns its fingerprint. The copy
        outlives later updates: async GRPO broadcasts it (`broadcast_staged_async`) while training goes on."""

    @abstractmethod
    def broadcast_staged_async(self) -> list[ray.ObjectRef[str]]:
        """Start broadcasting the staged copy over the refit group (the engine must receive concurrently); it
        may run while `train` runs. Finish with `wait_broadcast(futures)`, which returns the fingerprint."""

    @abstractmethod
    def wait_broadcast(self, futures: list[ray.ObjectRef[str]]) -> str:
        """Wait for a broadcast started by `broadcast_staged_async`; the fingerprint of what was sent."""

    @abstractmethod
    def offload_before_refit(self) -> None:
        """Free optimizer state / grads from the device before the engine takes it."""

    @abstractmethod
    def offload_after_refit(self) -> None:
        """Move the model off the device so the engine has it (GPU); no-op on CPU."""


class WeightBuckets(ABC):
    """Iterates refit buckets as boxes the driver forwards unread (a shared-memory or CUDA IPC descriptor, or
    [object ref]); `fingerprint` and `count` once exhausted."""

    @abstractmethod
    def __iter__(self) -> Iterator[object]: ...

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """weight_fingerprint of everything exported (valid once the iteration is over)."""

    @property
    @abstractmethod
    def count(self) -> int:
        """Buckets sent."""

    planned: int | None = None
    """How many buckets the export was split into, once the iteration has started (None: not known): an engine
    folds its end-of-refit work into the last one's load call."""


class PolicyWorker(Protocol):
    """What the `Policy` facade calls on every worker rank (by name, through `RayWorkerGroup`): both worker
    families implement exactly these (tests/unit/models/test_policy_worker_contract.py checks the signatures
    and that the facade calls nothing else)."""

    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """{'logprobs': [b, S]} for this rank's shard."""

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        """{'reference_logprobs': [b, S]} under the frozen initial weights."""

    def get_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """{'values': [b, S]} of a value model (policy.value_head: PPO's critic), aligned like logprobs."""

    def get_topk_logits(self, data: BatchedDataDict, k: int | None) -> BatchedDataDict:
        """{'teacher_topk_indices', 'teacher_topk_logprobs': [b, S, k]} of a distillation teacher, aligned like
        logprobs (k None: the whole vocabulary)."""

    def train(self, data: BatchedDataDict, loss_fn: LossFunction, gbs: int | None = None,
              eval_mode: bool = False) -> WorkerTrainResult:
        """Optimizer steps over this rank's shard in global batches of `gbs` (all ranks); eval_mode: no update."""

    def train_part(self, data: BatchedDataDict, loss_fn: LossFunction, index: int = 0) -> int:
        """Forward and backward over this rank's shard of part `index` with both loss normalisers 1, after part
        index - 1; gradients accumulate until `finish_parts` (rlpost.models.policy.train_parts). The rows trained."""

    def finish_parts(self, loss_fn: LossFunction, num_parts: int) -> WorkerTrainResult:
        """All ranks, once `num_parts` parts are trained: the parts' global counts scale gradients, loss and
        metrics; clip, optimizer and scheduler steps; `train`'s result."""

    def prepare_for_training(self) -> None: ...

    def prepare_for_lp_inference(self) -> None: ...

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None, hf_export: bool = True) -> None:
        ...

    def gpu_memory_stats(self) -> dict[str, float]: ...

    def prepare_weights_for_export(self, dtype: str, every_rank: bool = False
                                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Gather full weights (collective); rank 0 keeps them for export (`every_rank`: every rank does, for the
        engine on its device). {name: (shape, dtype)} of what this rank keeps."""

    def clear_export(self) -> None: ...

    def stage_export(self, dtype: str, max_bytes: int, ipc: bool = False) -> StagedExport | None:
        """All ranks: prepare the export; rank 0 returns its buckets of at most `max_bytes` and fingerprint (and
        the first bucket already out when it is the only one); with `ipc` every rank does (each writes for the engine
        on its device), else the other ranks return None."""

    def put_export_bucket(self, indices: list[int], ipc: bool = False, slot: int = 0) -> object:
        """Rank 0: one bucket into its IPC buffer number `slot` (a descriptor) or the object store ([its ref])."""

    def init_refit_collective(self, host: str, port: int, world_size: int) -> bool: ...

    def broadcast_weights_collective(self, dtype: str) -> str: ...

    def stage_weights(self, dtype: str) -> str:
        """All ranks: gather the full weights; rank 0 keeps a private copy for `broadcast_staged` and answers its
        fingerprint; '' elsewhere."""

    def broadcast_staged(self) -> str:
        """Rank 0: broadcast the staged copy over the refit group (concurrency group 'refit', so it may run
        beside `train`); the copy's fingerprint."""

    def offload_before_refit(self) -> None: ...

    def offload_after_refit(self) -> None: ...

    def shutdown(self) -> bool: ...
