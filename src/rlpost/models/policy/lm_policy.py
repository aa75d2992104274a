"""`Policy`: the driver-side facade over a worker group of any backend.

It builds the worker class named by `policy._target_` (through the allow-listed builder; it names
no backend itself), shards BatchedDataDicts over data-parallel ranks (honouring dynamic batching
and sequence packing), and aggregates results: per-micro-batch loss metrics are summed (each is
already globally normalised, as in NeMo RL) and the rest averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from rlpost.config.schema.policy import PolicyConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.microbatching import DynamicBatchingArgs, SequencePackingArgs
from rlpost.distributed.start_gate import StartGate
from rlpost.distributed.virtual_cluster import RayVirtualCluster
from rlpost.distributed.worker_groups import ParallelDims, RayWorkerGroup
from rlpost.losses.interface import LossFunction
from rlpost.models.policy.interfaces import (
    ColocatablePolicyInterface,
    PolicyWorker,
    TrainResult,
    WeightBuckets,
    WorkerTrainResult,
)
from rlpost.runtime.build import resolve

if TYPE_CHECKING:
    import ray

REFIT_GROUP = "refit"
"""The workers' Ray concurrency group for `broadcast_staged`: a thread of its own beside training."""

# Metrics that are averaged, not summed, over micro-batches.
MEAN_METRICS = {"lr", "wd", "reward", "global_valid_seqs", "global_valid_toks", "mean_prompt_length",
                "moe_aux_loss", "moe_load_cv"}


class Policy(ColocatablePolicyInterface):
    """Driver facade: one call here = one call on every worker rank."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        cfg: PolicyConfig,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        device: str = "cpu",
        timeout_s: float = 900.0,
        name: str = "policy",
        start_after: StartGate | None = None,
    ) -> None:
        """`name`: what the workers are called in errors and the placement line ("policy", "critic"). `start_after`:
        each worker builds its model once these are ready (rlpost.distributed.start_gate: colocated engines asleep)."""
        self.cfg = cfg
        self.device = device
        self.single_node = cluster.num_nodes == 1
        self._parts: list[ray.ObjectRef[int]] = []
        """Pending `train_part` calls (every rank's), until `finish_parts`."""
        sizes = cfg.parallel_sizes()
        mp = sizes["tp"] * sizes["pp"] * sizes["cp"]
        self.dims = ParallelDims(dp=cluster.world_size // mp, tp=sizes["tp"], pp=sizes["pp"], cp=sizes["cp"])
        worker_cls = resolve(cfg._target_, key="policy._target_")
        env = {"RLPOST_DEVICE": device}
        env.update(cfg.worker_env())
        self.worker_group = RayWorkerGroup(
            cluster,
            worker_cls,
            cfg,
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
            start_after=start_after,
            dims=self.dims,
            name_prefix=name,
            env_vars=env,
            timeout_s=timeout_s,
            concurrency_groups={REFIT_GROUP: 1},
            max_concurrency=2,
        )

    def set_call_timeout(self, timeout_s: float) -> None:
        """Bound every later call on the workers by `timeout_s`."""
        self.worker_group.timeout_s = timeout_s

    # ---- sharding --------------------------------------------------------------------------
    def _shard(self, data: BatchedDataDict, batch_size: int | None, for_training: bool
               ) -> tuple[list[BatchedDataDict], list[int] | None]:
        dp = self.dims.dp
        c = self.cfg
        if c.sequence_packing.enabled:
            packing = SequencePackingArgs(
                max_tokens_per_microbatch=c.sequence_packing.train_mb_tokens if for_training else c.sequence_packing.logprob_mb_tokens,
                algorithm=c.sequence_packing.algorithm,
                sequence_length_pad_multiple=max(self.dims.tp * self.dims.cp, 1),
                sequence_length_round=c.sequence_packing.sequence_length_round,
            )
            planned = data.shard_by_batch_size(dp, batch_size=batch_size, sequence_packing_args=packing)
            assert isinstance(planned, tuple)  # (shards, original order) when batching is planned
            return list(planned[0]), planned[1]
        if c.dynamic_batching.enabled:
            dynamic = DynamicBatchingArgs(
                max_tokens_per_microbatch=c.dynamic_batching.tokens(for_training),
                sequence_length_round=c.dynamic_batching.sequence_length_round,
            )
            planned = data.shard_by_batch_size(dp, batch_size=batch_size, dynamic_batching_args=dynamic)
            assert isinstance(planned, tuple)  # (shards, original order) when batching is planned
            return list(planned[0]), planned[1]
        if batch_size is None and data.size % dp != 0:
            raise ValueError(f"{data.size} rows cannot be split evenly over {dp} data-parallel ranks")
        return data.shard_by_batch_size(dp, batch_size=batch_size), None  # type: ignore[return-value]

    def _logprob_call(self, method: Callable[[Any, BatchedDataDict], BatchedDataDict], key: str,
                      data: BatchedDataDict) -> BatchedDataDict:
        shards, order = self._shard(data, None, for_training=False)
        results = self.worker_group.run_sharded(method, shards)
        out = BatchedDataDict({key: torch.cat([r[key] for r in results], dim=0)})
        return out.restore_order(order) if order is not None else out

    # ---- PolicyInterface ----------------------------------------------------------------------
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        return self._logprob_call(PolicyWorker.get_logprobs, "logprobs", data)

    def get_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """A value model's values [B, S] (policy.value_head: PPO's critic), aligned like logprobs."""
        return self._logprob_call(PolicyWorker.get_values, "values", data)

    def get_topk_logits(self, data: BatchedDataDict, k: int | None) -> BatchedDataDict:
        """A teacher's top-k indices and logprobs [B, S, k] per position (rlpost.algorithms.distillation)."""
        shards, order = self._shard(data, None, for_training=False)
        results = self.worker_group.run_sharded(PolicyWorker.get_topk_logits, shards, k)
        out = BatchedDataDict({key: torch.cat([r[key] for r in results], dim=0)
                               for key in ("teacher_topk_indices", "teacher_topk_logprobs")})
        return out.restore_order(order) if order is not None else out

    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        return self._logprob_call(PolicyWorker.get_reference_policy_logprobs, "reference_logprobs", data)

    def train(self, data: BatchedDataDict, loss_fn: LossFunction, gbs: int | None = None,
              eval_mode: bool = False) -> TrainResult:
        gbs = gbs or self.cfg.train_global_batch_size
        shards, _ = self._shard(data, gbs, for_training=True)
        return _aggregate(self.worker_group.run_sharded(PolicyWorker.train, shards, loss_fn, gbs, eval_mode))

    def train_part(self, data: BatchedDataDict, loss_fn: LossFunction) -> None:
        """Send one part of the step's single global batch (whole groups) to be trained, without waiting: each
        rank runs forward and backward over its shard and accumulates gradients (rlpost.algorithms.overlap).
        `finish_parts` steps the optimizer once every part is sent."""
        shards, _ = self._shard(data, data.size, for_training=True)
        index = len(self._parts) // self.worker_group.world_size
        self._parts.extend(self.worker_group.submit_sharded(PolicyWorker.train_part, shards, loss_fn, index))

    def finish_parts(self, loss_fn: LossFunction) -> TrainResult:
        """After the last `train_part`: one optimizer step over every part, as `train` on the whole batch would
        take it; the same result."""
        pending, self._parts = self._parts, []
        if not pending:
            raise RuntimeError("finish_parts without a train_part before it")
        world = self.worker_group.world_size
        num_parts = len(pending) // world
        futures = self.worker_group.call_async(PolicyWorker.finish_parts, loss_fn, num_parts)
        self.worker_group.get(pending, indices=list(range(world)) * num_parts)  # a failed part raises here, named
        return _aggregate(self.worker_group.collect_sharded(futures))

    def prepare_for_training(self) -> None:
        self.worker_group.run_all(PolicyWorker.prepare_for_training)

    def prepare_for_lp_inference(self) -> None:
        self.worker_group.run_all(PolicyWorker.prepare_for_lp_inference)

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None, hf_export: bool = True) -> None:
        self.worker_group.run_all(PolicyWorker.save_checkpoint, weights_path, optimizer_path, hf_export)

    def gpu_memory_metrics(self) -> dict[str, float]:
        """`logger.monitor_gpus`: each rank's CUDA memory (and utilisation when NVML is there) as gpu/rank<r>/<name>."""
        per_rank = self.worker_group.run_all(PolicyWorker.gpu_memory_stats)
        return {f"gpu/rank{r}/{k}": float(v) for r, stats in enumerate(per_rank) for k, v in stats.items()}

    def shutdown(self, graceful: bool = True) -> None:
        self.worker_group.shutdown(graceful_method=PolicyWorker.shutdown if graceful else None)

    # ---- refit -----------------------------------------------------------------------------
    def prepare_refit_info(self, dtype: str = "float32") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        info = self.worker_group.run_all(PolicyWorker.prepare_weights_for_export, dtype)[0]
        self.worker_group.run_all(PolicyWorker.clear_export)
        return info

    def export_weight_buckets(self, dtype: str, max_bucket_bytes: int = 256 * 2**20) -> WeightBuckets:
        # One node (a colocated engine shares the policy's devices): every rank writes the buckets into its own
        # reusable IPC buffers (shared memory, or CUDA IPC on its GPU) for the engine on its device; across nodes
        # rank 0's go through the object store.
        return _ExportBuckets(self.worker_group, dtype, max_bucket_bytes, per_device=self.single_node)

    def init_refit_collective_async(self, host: str, port: int, world_size: int) -> list[ray.ObjectRef[bool]]:
        """Start rank 0 joining the refit group (it blocks until the engines join too)."""
        return self.worker_group.call_async(PolicyWorker.init_refit_collective, host, port, world_size)

    def broadcast_weights_collective_async(self, dtype: str) -> list[ray.ObjectRef[str]]:
        """Start the broadcast of full weights from rank 0 (engines must receive concurrently)."""
        return self.worker_group.call_async(PolicyWorker.broadcast_weights_collective, dtype)

    def init_refit_collective(self, host: str, port: int, world_size: int) -> None:
        self.worker_group.get(self.init_refit_collective_async(host, port, world_size))

    def broadcast_weights_collective(self, dtype: str) -> str:
        return str(self.worker_group.get(self.broadcast_weights_collective_async(dtype))[0])

    def stage_weights(self, dtype: str) -> str:
        fingerprint: str = self.worker_group.run_all(PolicyWorker.stage_weights, dtype)[0]  # rank 0's
        return fingerprint

    def broadcast_staged_async(self) -> list[ray.ObjectRef[str]]:
        # rank 0 sends; its own concurrency group, so it runs beside a train() call on the same actor
        return [self.worker_group.workers[0].broadcast_staged.options(concurrency_group=REFIT_GROUP).remote()]

    def wait_broadcast(self, futures: list[ray.ObjectRef[str]]) -> str:
        return str(self.worker_group.get(futures)[0])

    def offload_before_refit(self) -> None:
        if self.device != "cpu":  # on CPU there is nothing to move (memory_phases): no round trip for nothing
            self.worker_group.run_all(PolicyWorker.offload_before_refit)

    def offload_after_refit(self) -> None:
        if self.device != "cpu":
            self.worker_group.run_all(PolicyWorker.offload_after_refit)


def _aggregate(results: list[WorkerTrainResult]) -> TrainResult:
    """One training call's answer from every rank's: per-micro-batch metrics summed per rank (each is globally
    normalised already) or averaged (MEAN_METRICS); loss, grad norm and lr are rank 0's."""
    first = results[0]
    metrics: dict[str, float] = {}
    for k in first["all_mb_metrics"]:
        vals = [v for r in results for v in r["all_mb_metrics"][k]]
        per_rank_sum = sum(vals) / max(first["num_global_batches"], 1)
        metrics[k] = (sum(vals) / len(vals)) if k in MEAN_METRICS else per_rank_sum
    return TrainResult(
        loss=first["loss"],
        grad_norm=first["grad_norm"],
        lr=first["lr"],
        params_finite=all(r.get("params_finite", True) for r in results),
        all_mb_metrics={k: [v for r in results for v in r["all_mb_metrics"][k]] for k in first["all_mb_metrics"]},
        metrics=metrics,
    )


class _ExportBuckets(WeightBuckets):
    """The export, one bucket ahead of the engines; the driver only forwards the boxes. `per_device`: every rank
    writes each bucket into its own two IPC buffers and a box holds every rank's descriptor (PerDeviceBuckets: the
    engine worker of slot r reads rank r's, on its own device); otherwise rank 0 puts each bucket in the object
    store. The first step of the iteration stages the export on every rank (`stage_export`); a model that fits one
    bucket comes back from it already written."""

    def __init__(self, group: RayWorkerGroup, dtype: str, max_bytes: int, per_device: bool = False) -> None:
        self.group = group
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.per_device = per_device
        self._fp: str | None = None
        self._count = 0
        self.planned: int | None = None
        """Buckets the export was split into (known once the iteration started)."""

    def _writers(self) -> list[Any]:
        return self.group.workers if self.per_device else self.group.workers[:1]

    def _box(self, parts: list[object]) -> object:
        return {"per_rank": parts} if self.per_device else parts[0]

    def __iter__(self) -> Iterator[object]:
        staged = self.group.run_all(PolicyWorker.stage_export, self.dtype, self.max_bytes, self.per_device)
        head = staged[0]
        assert head is not None  # rank 0 always stages
        writers = self._writers()
        plan = head.plan
        self.planned = len(plan)
        try:
            if head.first is not None:  # already written, and the ranks cleared their export
                yield self._box([s.first for s in staged[: len(writers)] if s is not None])
                self._count = 1
            else:
                # One bucket ahead: the ranks write bucket k + 1 (into their other IPC buffer) while the engines load
                # bucket k. Resuming here means the consumer is done with bucket k - 1, whose buffer k + 1 reuses.
                ahead = [self.group.submit(i, PolicyWorker.put_export_bucket, plan[0], self.per_device, 0)
                         for i in range(len(writers))]
                for k in range(len(plan)):
                    box = self._box(self.group.get(ahead, indices=list(range(len(writers)))))
                    if k + 1 < len(plan):
                        ahead = [self.group.submit(i, PolicyWorker.put_export_bucket, plan[k + 1], self.per_device,
                                                   (k + 1) % 2) for i in range(len(writers))]
                    yield box
                    self._count += 1
            self._fp = head.fingerprint
        finally:
            if head.first is None:
                self.group.run_all(PolicyWorker.clear_export)

    @property
    def fingerprint(self) -> str:
        if self._fp is None:
            raise RuntimeError("the weight buckets have not been consumed yet")
        return self._fp

    @property
    def count(self) -> int:
        return self._count
