"""The global-batch training loop both worker families share.

A worker's shard of the rollout batch is cut into local global batches (train_global_batch_size / DP rows
each). For each, the valid sequence and token counts are all-reduced over the data-parallel group (the loss
divides by these GLOBAL counts), then the backend runs its own forward/backward/optimizer step on it. The
result dict is what `Policy.train` merges across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.collective_device import all_reduce
from rlpost.models.policy.interfaces import GlobalBatchesResult, WorkerTrainResult
from rlpost.models.policy.weight_export import params_finite

StepFn = Callable[[BatchedDataDict, torch.Tensor, torch.Tensor], tuple[float, float, list[dict[str, float]]]]
"""(global batch, valid sequences Gs, valid tokens Gt) -> (its loss, grad norm, per-micro-batch metrics)."""


def global_valid_counts(batch: BatchedDataDict, device: torch.device,
                        group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Gs, Gt): valid sequences (sum of sample_mask) and valid tokens (token_mask[:, 1:] of valid samples)
    of the global batch, summed over the data-parallel group."""
    counts = all_reduce(local_valid_counts(batch).to(device), group)
    return counts[0], counts[1]


def local_valid_counts(batch: BatchedDataDict) -> torch.Tensor:
    """[2]: this rank's valid sequences and valid tokens of `batch` (what global_valid_counts sums over DP)."""
    sample_mask = batch["sample_mask"].float()
    token_mask = batch["token_mask"][:, 1:].float()
    return torch.stack([sample_mask.sum(), (token_mask * sample_mask[:, None]).sum()])


def train_global_batches(data: BatchedDataDict, local_gbs: int, device: torch.device,
                         dp_group: dist.ProcessGroup | None, step: StepFn) -> GlobalBatchesResult:
    """Run `step` on every local global batch of `data`; the loss, grad norm (means over global batches),
    the number of global batches and every micro-batch's metrics. The caller adds lr and params_finite."""
    n_global = data.size // local_gbs if local_gbs else 0
    losses, grad_norms = [], []
    mb_metrics: dict[str, list[float]] = {}
    for g in range(n_global):
        batch = data.get_batch(g, local_gbs)
        gs, gt = global_valid_counts(batch, device, dp_group)
        loss, grad_norm, recorded = step(batch, gs, gt)
        add_mb_metrics(mb_metrics, recorded)
        losses.append(loss)
        grad_norms.append(grad_norm)
    return {
        "loss": sum(losses) / max(len(losses), 1),
        "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
        "num_global_batches": n_global,
        "all_mb_metrics": mb_metrics,
    }


def add_mb_metrics(into: dict[str, list[float]], recorded: Iterable[Mapping[str, float]],
                   scales: dict[str, float] | None = None) -> None:
    """Append each micro-batch's metrics to `into` (name -> values), metric k multiplied by scales[k] if given."""
    for metrics in recorded:
        for k, v in metrics.items():
            into.setdefault(k, []).append(float(v) * scales.get(k, 1.0) if scales else float(v))


def finish_result(result: GlobalBatchesResult, lr: float, parameters: Iterable[torch.Tensor]) -> WorkerTrainResult:
    """The train result with the optimizer's lr and whether every weight is still finite."""
    return {**result, "lr": float(lr), "params_finite": params_finite(parameters)}
