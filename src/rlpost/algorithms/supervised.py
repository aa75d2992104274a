"""SFT, DPO and reward-model training (`algo=sft|dpo|rm`): one loop over fixed rows on the GRPO machinery (the
Policy workers, global-batch normalisation, checkpoints, metrics.jsonl / TensorBoard, resume).

Each step takes policy.train_global_batch_size rows (DPO / RM: half as many pairs, chosen and rejected side by
side), builds the [B, S] tensors (input_ids, token_mask = the trained tokens, sample_mask), adds what the loss
reads (DPO: the reference policy's logprobs, computed for this batch by the policy with its starting weights
swapped in) and runs one optimizer step. Validation runs the same loss with eval_mode (no update) over the
validation rows. The only algorithm-specific parts are the loss and how a row becomes sequences
(rlpost.data.supervised_rows).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from omegaconf import OmegaConf

from rlpost.algorithms.advisories import RunHealth
from rlpost.algorithms.checkpoint_io import (
    record_checkpoint_metric,
    restore_loader_and_rng,
    resume_info,
    saved_metrics_row,
    write_checkpoint,
)
from rlpost.algorithms.grpo_setup import close_all, set_seed
from rlpost.algorithms.loop import LoopParts, Schedule, StepLoop, StepResult
from rlpost.config.schema.supervised import SupervisedSaveState
from rlpost.config.schema.supervised_master import SupervisedMasterConfig
from rlpost.data.dataloader import PromptLoader
from rlpost.data.datasets import DataError
from rlpost.data.prompts import load_tokenizer
from rlpost.data.supervised_rows import ConversationTokenizer, Tokenized, load_supervised_rows, tokenize_rows
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.virtual_cluster import RayVirtualCluster, init_ray, resolve_device
from rlpost.losses.interface import LossFunction
from rlpost.models.policy.interfaces import ColocatablePolicyInterface, TrainResult
from rlpost.runtime import console as say
from rlpost.runtime.build import build
from rlpost.runtime.checkpointing import CheckpointManager, model_fingerprint
from rlpost.runtime.metrics_logger import MetricsLogger
from rlpost.runtime.timer import Timer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Row = list[Tokenized]
"""A training row: its sequences (SFT: one; a preference pair: chosen, rejected)."""


@dataclass
class SupervisedComponents:
    """What `supervised_loop` runs on."""

    cfg: SupervisedMasterConfig
    run_dir: Path
    policy: ColocatablePolicyInterface
    cluster: RayVirtualCluster
    loader: PromptLoader[Row]
    val_rows: list[Row]
    loss_fn: LossFunction
    logger: MetricsLogger
    checkpointer: CheckpointManager
    save_state: SupervisedSaveState
    pad_id: int
    model_fp: str
    config_dict: dict[str, object]
    data_metrics: dict[str, float] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    """time.monotonic() when setup began: checkpointing.checkpoint_must_save_by counts from here."""
    closed: bool = False

    def close(self, graceful: bool = True) -> None:
        """Release the workers, the cluster and the logger (idempotent); `graceful=False` (a failed or abandoned
        run) kills the workers without asking them first."""
        if not self.closed:
            self.closed = True
            close_all([lambda: self.policy.shutdown(graceful), self.cluster.shutdown, self.logger.close])


def rows_per_step(cfg: SupervisedMasterConfig) -> int:
    """Dataset rows one step takes: the global batch's sequences, two per pair."""
    return cfg.policy.train_global_batch_size // (2 if cfg.pairs else 1)


def load_rows(cfg: SupervisedMasterConfig, tokenizer: PreTrainedTokenizerBase
              ) -> tuple[list[Row], list[Row], dict[str, float]]:
    """Tokenized training and validation rows (over-length ones skipped and counted); DataError when too few
    training rows are left for one step."""
    conv = ConversationTokenizer(tokenizer, cfg.rows.add_eos, cfg.policy.tokenizer.chat_template_kwargs)
    limit = cfg.policy.max_total_sequence_length
    train, skipped = tokenize_rows(load_supervised_rows(cfg.rows, "train"), conv, limit)
    val, val_skipped = tokenize_rows(load_supervised_rows(cfg.rows, "val"), conv, limit)
    if skipped or val_skipped:
        say.warn(f"skipped {skipped} training and {val_skipped} validation rows longer than "
                 f"policy.max_total_sequence_length={limit} tokens (data/skipped_too_long)")
    need = rows_per_step(cfg)
    if len(train) < need:
        raise DataError(f"one step takes {need} rows but only {len(train)} training rows are usable "
                        f"({skipped} longer than policy.max_total_sequence_length={limit}); lower "
                        "policy.train_global_batch_size or use more rows")
    return train, val, {"data/skipped_too_long": float(skipped), "data/val_skipped_too_long": float(val_skipped),
                        "data/train_rows": float(len(train)), "data/val_rows": float(len(val))}


def batch_tensors(rows: list[Row], pad_id: int, multiple: int = 1, masked: int = 0) -> BatchedDataDict:
    """[B, S] input_ids (right-padded with pad_id), token_mask (trained tokens), input_lengths, sample_mask; a
    row's sequences stay adjacent (pairs: chosen at 2k, rejected at 2k + 1). The last `masked` rows are padding
    (sample_mask 0)."""
    seqs = [s for row in rows for s in row]
    width = max(len(s.ids) for s in seqs)
    width = -(-width // multiple) * multiple
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        mask[i, : len(s.mask)] = torch.tensor(s.mask, dtype=torch.float32)
    sample_mask = torch.ones(len(seqs))
    per_row = len(seqs) // max(len(rows), 1)
    if masked:
        sample_mask[len(seqs) - masked * per_row:] = 0.0
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(s.ids) for s in seqs]), token_mask=mask,
                           sample_mask=sample_mask)


def setup(cfg: SupervisedMasterConfig, run_dir: Path) -> SupervisedComponents:
    """Seeds, logger, checkpoints (and resume), rows, the cluster and the policy."""
    started_at = time.monotonic()
    loop = cfg.loop
    set_seed(loop.seed)
    if cfg.model.tiny is not None:
        from rlpost.models.tiny import ensure_tiny_model

        ensure_tiny_model(cfg.model.tiny, cfg.model.path)
    logger = MetricsLogger(cfg.logger, run_dir)
    config_dict = cast(dict[str, object], OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    logger.log_hyperparams(OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True))
    checkpointer = CheckpointManager(cfg.checkpointing, run_dir)
    model_fp = model_fingerprint(cfg.policy.model_name)
    last = checkpointer.latest_verified() if cfg.checkpointing.enabled else None
    save_state = SupervisedSaveState()
    if last is not None:
        save_state = SupervisedSaveState.from_dict(resume_info(checkpointer, last, model_fp, config_dict))
    logger.truncate_after(save_state.total_steps)
    if last is not None:  # killed between the checkpoint and its metrics line: put the line back
        logger.restore_row(save_state.total_steps, saved_metrics_row(last))
    tokenizer = load_tokenizer(cfg.policy.tokenizer, cfg.policy.trust_remote_code)
    train_rows, val_rows, data_metrics = load_rows(cfg, tokenizer)
    loader = PromptLoader(train_rows, rows_per_step(cfg), cfg.rows.shuffle, cfg.rows.seed)
    if last is not None:
        restore_loader_and_rng(last, loader)
    init_ray(cfg.cluster)
    device = resolve_device(cfg.cluster)
    cl = cfg.cluster
    cluster = RayVirtualCluster(f"{cfg.algo}_cluster", cl.gpus_per_node, cl.num_nodes, device == "cuda",
                                cl.worker_num_cpus, 1, cl.placement_timeout_s)
    opened: list[Callable[[], object]] = [cluster.shutdown, logger.close]
    try:
        from rlpost.models.policy.lm_policy import Policy

        loss_fn: LossFunction = build(cfg.loss_fn, key="loss_fn._target_")
        weights = optim = None
        if last is not None:
            weights, optim = str(last / "policy" / "weights"), str(last / "policy" / "optimizer")
        policy = Policy(cluster, cfg.policy, weights_path=weights, optimizer_path=optim,
                        init_reference_model=loss_fn.needs_reference_logprobs, device=device,
                        timeout_s=cl.call_timeout_s)
    except BaseException:
        close_all(opened)
        raise
    return SupervisedComponents(cfg=cfg, run_dir=run_dir, policy=policy, cluster=cluster, loader=loader,
                                val_rows=val_rows, loss_fn=loss_fn, logger=logger, checkpointer=checkpointer,
                                save_state=save_state, pad_id=int(tokenizer.pad_token_id), model_fp=model_fp,
                                config_dict=config_dict, data_metrics=data_metrics, started_at=started_at)


def _prepare(comps: SupervisedComponents, data: BatchedDataDict) -> None:
    """What the loss reads besides the batch: DPO's reference logprobs."""
    if comps.loss_fn.needs_reference_logprobs:
        comps.policy.prepare_for_lp_inference()
        data["reference_policy_logprobs"] = comps.policy.get_reference_policy_logprobs(data)["reference_logprobs"]


def _metrics(prefix: str, results: TrainResult) -> dict[str, float]:
    m = {f"{prefix}/{k}": float(v) for k, v in results.metrics.items()}
    m[f"{prefix}/loss"] = float(results.loss)
    return m


def validate(comps: SupervisedComponents) -> dict[str, float]:
    """The loss and its metrics on the validation rows (eval_mode: no update), averaged over batches."""
    loop, cfg = comps.cfg.loop, comps.cfg
    rows = comps.val_rows
    per_batch = loop.val_global_batch_size // (2 if cfg.pairs else 1)
    if loop.val_batches:
        rows = rows[: loop.val_batches * per_batch]
    if not rows:
        return {}
    t0 = time.perf_counter()
    sums: dict[str, float] = {}
    weight = 0
    for start in range(0, len(rows), per_batch):
        part = rows[start : start + per_batch]
        pad = per_batch - len(part)
        data = batch_tensors(part + [part[-1]] * pad, comps.pad_id, cfg.policy.make_sequence_length_divisible_by,
                             masked=pad)
        _prepare(comps, data)
        results = comps.policy.train(data, comps.loss_fn, gbs=loop.val_global_batch_size, eval_mode=True)
        for k, v in _metrics("validation", results).items():
            sums[k] = sums.get(k, 0.0) + v * len(part)
        weight += len(part)
    out = {k: v / weight for k, v in sums.items()}
    out.pop("validation/num_valid_samples", None)
    out.pop("validation/num_unmasked_tokens", None)
    out["timing/validation/total_validation_time"] = time.perf_counter() - t0
    return out


def save_checkpoint(comps: SupervisedComponents, step: int, metrics: dict[str, float],
                    metrics_row: dict[str, float] | None = None) -> None:
    """Write step_N (weights + optimizer, loader position, RNG, config, the step's metrics row so far: `metrics_row`,
    else `metrics`) atomically."""
    ck = comps.cfg.checkpointing
    record_checkpoint_metric(comps.save_state, ck.metric_name, metrics)
    write_checkpoint(comps.checkpointer, comps.policy, step, comps.save_state, comps.loader.state_dict(),
                     comps.config_dict, comps.model_fp, ck.save_consolidated,
                     metrics_row if metrics_row is not None else metrics)


class Supervised:
    """SFT / DPO / RM as the step loop's algorithm: one optimizer step on the next rows."""

    def __init__(self, comps: SupervisedComponents) -> None:
        self.comps = comps
        loop = comps.cfg.loop
        self.schedule = Schedule(loop.max_num_steps, loop.max_num_epochs, loop.val_period, loop.val_at_start)
        self._rows = 0

    def has_data(self) -> bool:
        return self.comps.loader.epochs_done() < self.schedule.max_num_epochs

    def step(self, step: int, timer: Timer) -> StepResult:
        loader = self.comps.loader
        rows = loader.next_batch()
        self._rows = len(rows)
        metrics = _train_step(self.comps, rows, timer)
        last = step >= self.schedule.max_num_steps or loader.epochs_done() >= self.schedule.max_num_epochs
        return StepResult(metrics, loader.state_dict(), last, trained_tokens=metrics["train/num_tokens"])

    def validate(self, step: int, timer: Timer) -> dict[str, float]:
        return {**validate(self.comps), **(self.comps.data_metrics if step == 0 else {})}

    def advance(self, step: int, result: StepResult) -> None:
        st = self.comps.save_state
        st.total_steps, st.current_epoch, st.current_step = step, result.position["epoch"], result.position["index"]
        st.consumed_samples += self._rows

    def save(self, step: int, metrics: dict[str, float], metrics_row: dict[str, float],
             position: dict[str, int]) -> None:
        save_checkpoint(self.comps, step, metrics, metrics_row)


@contextmanager
def supervised_loop(comps: SupervisedComponents) -> Iterator[StepLoop]:
    """The step loop of an SFT / DPO / RM run."""
    cfg = comps.cfg
    yield StepLoop(Supervised(comps), LoopParts(
        logger=comps.logger, checkpointing=cfg.checkpointing, cluster=cfg.cluster, started_at=comps.started_at,
        total_steps=lambda: comps.save_state.total_steps,
        lr=cfg.policy.optimizer.kwargs.get("lr", "?") if cfg.policy.optimizer is not None else "?",
        timeouts=[comps.policy], gpu_memory=comps.policy if cfg.logger.monitor_gpus else None,
        health=RunHealth(cfg.logger.advisories, multi_token=False)))


def _train_step(comps: SupervisedComponents, rows: list[Row], timer: Timer) -> dict[str, float]:
    """One optimizer step on `rows`: the batch, what the loss reads besides it, the update; its metrics."""
    with timer.time("data_processing"):
        data = batch_tensors(rows, comps.pad_id, comps.cfg.policy.make_sequence_length_divisible_by)
    if comps.loss_fn.needs_reference_logprobs:
        with timer.time("reference_logprobs"):
            _prepare(comps, data)
    with timer.time("policy_training"):  # `train` onloads and sets train mode itself (see grpo.train)
        results = comps.policy.train(data, comps.loss_fn)
    metrics = _metrics("train", results)
    metrics["train/grad_norm"] = float(results.grad_norm)
    metrics["train/lr"] = float(results.lr)
    metrics["train/num_tokens"] = float(data["input_lengths"].sum())
    metrics["train/params_finite"] = float(results.params_finite)
    return metrics
