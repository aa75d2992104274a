"""GRPO at NeMo RL's path (`nemo_rl.algorithms.grpo`).

Public names: GRPOConfig, GRPOSaveState, GRPOLoggerConfig, MasterConfig (typed dataclasses),
setup, grpo_train, validate, refit_policy_generation, _should_use_async_rollouts.

`grpo_step` is one step of docs/architecture.md, read top to bottom: collect_batch (refit when stale, generate,
score, dynamic sampling) -> prepare (advantages, train data) -> logprobs -> train. `GRPO` runs it in the shared step
loop (rlpost.algorithms.loop), which validates, gates, checkpoints and logs; with generation and training overlapped
(`GRPOComponents.overlap`, decided at setup) the step is rlpost.algorithms.overlap's instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from rlpost.algorithms.advisories import RunHealth
from rlpost.algorithms.checkpoint_io import record_checkpoint_metric, write_checkpoint
from rlpost.algorithms.collect import TrainedBatch, collect_batch, validation_seeds
from rlpost.algorithms.dynamic_sampling import DynamicSampler
from rlpost.algorithms.engine_weights import EngineWeights
from rlpost.algorithms.grpo_setup import GRPOComponents, setup
from rlpost.algorithms.loop import DriftLimits, HealthCheckError, LoopParts, Schedule, StepLoop, StepResult
from rlpost.algorithms.multi_turn import run_rollouts, turn_settings
from rlpost.algorithms.overlap import overlapped_step
from rlpost.algorithms.prepare import prepare
from rlpost.algorithms.refit import refit_policy_generation
from rlpost.algorithms.rollouts import RolloutBatch
from rlpost.config.schema.grpo import GRPOConfig, GRPOSaveState, _default_grpo_save_state
from rlpost.config.schema.logger import GRPOLoggerConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.data.rows import PromptRow
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.models.policy.interfaces import TrainResult
from rlpost.runtime import console as say
from rlpost.runtime.timer import Timer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "GRPOConfig",
    "GRPOSaveState",
    "GRPOLoggerConfig",
    "HealthCheckError",
    "MasterConfig",
    "_default_grpo_save_state",
    "_should_use_async_rollouts",
    "grpo_train",
    "refit_policy_generation",
    "save_checkpoint",
    "setup",
    "validate",
]


def _should_use_async_rollouts(master_config: MasterConfig) -> bool:
    """Async rollouts (vLLM's async engine inside the synchronous, on-policy loop) iff the engine is
    vLLM and `vllm_cfg.async_engine` is on."""
    return master_config.generation.async_rollouts()


def validate(components: GRPOComponents, step: int) -> dict[str, float]:
    """Accuracy (share of samples with reward 1) and mean generated length on the validation rows."""
    grpo_cfg = components.cfg.grpo
    rows = components.val_rows[: grpo_cfg.max_val_samples]
    if not rows:
        return {}
    t0 = time.perf_counter()
    rewards, lengths = [], []
    to_print = components.cfg.logger.num_val_samples_to_print
    for start in range(0, len(rows), grpo_cfg.val_batch_size):
        part = components.processor.batch(rows[start : start + grpo_cfg.val_batch_size])
        seeds = validation_seeds(grpo_cfg.seed, step, start, len(part))
        batch = run_rollouts(part, torch.arange(len(part)), components.generation, components.tokenizer,
                             components.envs, turn_settings(components.cfg), _should_use_async_rollouts(components.cfg),
                             seeds=seeds, label=f"validation at step {step}")
        rewards.append(batch.rewards)
        lengths.append(batch.gen["generation_lengths"].float())
        for i in range(min(batch.size, max(to_print - start, 0))):  # logger.num_val_samples_to_print
            say.info(val_sample_line(components.tokenizer, batch, i, step, start + i + 1, min(to_print, len(rows))))
    r = torch.cat(rewards)
    components.generation.finish_generation()
    return {
        "validation/accuracy": float((r == 1.0).float().mean()),
        "validation/avg_length": float(torch.cat(lengths).mean()),
        "validation/reward": float(r.mean()),
        "timing/validation/total_validation_time": time.perf_counter() - t0,
    }


def val_sample_line(tokenizer: PreTrainedTokenizerBase, batch: RolloutBatch, i: int, step: int, k: int, n: int,
                    width: int = 200) -> str:
    """One console line for validation sample i: prompt -> response, reward (each part shortened to fit `width`)."""

    def short(text: str, limit: int) -> str:
        text = repr(text)[1:-1]  # newlines and tabs escaped: one line
        return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."

    prompt = str(tokenizer.decode(batch.rows[i]["prompt_ids"], skip_special_tokens=True))
    head = f"validation sample {k}/{n} at step {step}: "
    tail = f" (reward {float(batch.rewards[i]):.3f})"
    room = max(width - len(head) - len(tail) - len(" -> "), 20)
    return f"{head}{short(prompt, room // 2)} -> {short(batch.responses[i], room - room // 2)}{tail}"


def save_checkpoint(components: GRPOComponents, step: int, metrics: dict[str, float],
                    loader_state: dict[str, int] | None = None, metrics_row: dict[str, float] | None = None) -> None:
    """Write step_N (policy weights + optimizer, dataloader, RNG, config, the step's metrics row so far:
    `metrics_row`, else `metrics`) atomically. `loader_state` (async GRPO: the position after the last trained
    batch) replaces the dataloader's own position."""
    ck = components.cfg.checkpointing
    record_checkpoint_metric(components.save_state, ck.metric_name, metrics)
    others = {s.spec.checkpoint_dir: s.group for s in components.sides if s.spec.checkpoint_dir is not None}
    write_checkpoint(components.checkpointer, components.policy, step, components.save_state,
                     loader_state or components.dataloader.state_dict(), components.config_dict, components.model_fp,
                     ck.save_consolidated, metrics_row if metrics_row is not None else metrics, others)


def loop_parts(components: GRPOComponents) -> LoopParts:
    """What the shared step loop uses of a GRPO run (sync or async)."""
    cfg = components.cfg
    g = cfg.grpo
    return LoopParts(
        logger=components.logger, checkpointing=cfg.checkpointing, cluster=cfg.cluster,
        started_at=components.started_at, total_steps=lambda: components.save_state.total_steps,
        lr=cfg.policy.optimizer.kwargs.get("lr", "?") if cfg.policy.optimizer is not None else "?",
        timeouts=[components.policy, components.generation, *[s.group for s in components.sides]],
        gpu_memory=components.policy if cfg.logger.monitor_gpus else None,
        drift=DriftLimits(g.token_mult_prob_error_warn_threshold, g.token_mult_prob_error_abort_threshold),
        health=RunHealth(cfg.logger.advisories, multi_token=cfg.generation.max_new_tokens > 1),
    )


def schedule(grpo_cfg: GRPOConfig) -> Schedule:
    return Schedule(grpo_cfg.max_num_steps, grpo_cfg.max_num_epochs, grpo_cfg.val_period, grpo_cfg.val_at_start)


# ---- the phases of one step (docs/architecture.md) -----------------------------------------------------------


def grpo_step(components: GRPOComponents, rows: list[PromptRow], step: int, timer: Timer,
              weights: EngineWeights) -> TrainedBatch:
    """One synchronous GRPO step on the prompts `rows`: refit -> collect -> prepare -> logprobs -> train."""
    weights.sync(timer)  # the engine takes the policy's weights (a wake when it has them)
    collected = collect_batch(components, rows, components.dataloader.next_batch, step, timer)
    train_data, advantages = prepare(components, collected.batch, timer)
    logprobs(components, train_data, timer)
    results = train(components, train_data, weights, timer)
    return TrainedBatch(collected, train_data, advantages, results)


def logprobs(components: GRPOComponents, train_data: BatchedDataDict, timer: Timer) -> None:
    """What the side groups put in first (a distillation teacher's top-k), then the trainer's own prev / reference
    logprobs, only those the loss reads."""
    loss_fn, policy = components.loss_fn, components.policy
    for side in components.sides:
        side.spec.score(side.group, train_data, timer)
    if not (loss_fn.needs_prev_logprobs or loss_fn.needs_reference_logprobs):
        return
    with timer.time("policy_and_reference_logprobs"):
        policy.prepare_for_lp_inference()
        if loss_fn.needs_prev_logprobs:
            train_data["prev_logprobs"] = policy.get_logprobs(train_data)["logprobs"]
        if loss_fn.needs_reference_logprobs:
            train_data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(train_data)[
                "reference_logprobs"]


def train(components: GRPOComponents, train_data: BatchedDataDict, weights: EngineWeights,
          timer: Timer) -> TrainResult:
    """Optimizer steps over the batch; the engine's weights are now behind the policy's. (Each backend's `train`
    brings the optimizer back and sets train mode itself: no separate `prepare_for_training` call.)"""
    with timer.time("policy_training"):
        results = components.policy.train(train_data, components.loss_fn)
        weights.policy_updated()
    return results


def step_result(components: GRPOComponents, done: TrainedBatch, position: dict[str, int], last: bool,
                same_weights: bool = True) -> StepResult:
    """The loop's view of a trained GRPO batch: its metrics row so far, the loader position, its token counts."""
    batch = done.collected.batch
    metrics = {"train/reward": float(done.collected.generated_rewards.mean()),  # every sample generated
               **_step_metrics(batch, done.train_data, done.advantages, done.results, done.collected.sampler)}
    return StepResult(metrics, position, last, trained_tokens=float(done.train_data["input_lengths"].sum()),
                      generated_tokens=float(batch.gen["generation_lengths"].sum()), same_weights=same_weights)


def advance(components: GRPOComponents, step: int, train_data: BatchedDataDict, position: dict[str, int]) -> None:
    """Move the save state to `step`, whose batch `train_data` was trained, the loader now at `position`."""
    save_state = components.save_state
    save_state.current_epoch, save_state.current_step = position["epoch"], position["index"]
    save_state.total_steps = step
    save_state.consumed_samples += components.cfg.grpo.num_prompts_per_step
    save_state.total_valid_tokens += int(valid_response_tokens(train_data).sum())


class GRPO:
    """Synchronous GRPO as the step loop's algorithm: the engine serves the policy's current weights at every step
    (on-policy), refit before it generates."""

    def __init__(self, components: GRPOComponents) -> None:
        self.components = components
        self.schedule = schedule(components.cfg.grpo)
        self.weights = EngineWeights(components)
        self.run_step = overlapped_step if components.overlap else grpo_step  # the strategy chosen at setup
        self._trained: BatchedDataDict | None = None

    def has_data(self) -> bool:
        return self.components.dataloader.epochs_done() < self.schedule.max_num_epochs

    def step(self, step: int, timer: Timer) -> StepResult:
        loader = self.components.dataloader
        done = self.run_step(self.components, loader.next_batch(), step, timer, self.weights)
        self._trained = done.train_data
        last = step >= self.schedule.max_num_steps or loader.epochs_done() >= self.schedule.max_num_epochs
        return step_result(self.components, done, loader.state_dict(), last)

    def validate(self, step: int, timer: Timer) -> dict[str, float]:
        """Validation of what the engine serves: refit first (checked by fingerprint)."""
        if step == 0:
            took = self.weights.refit()
            return {**validate(self.components, 0), "timing/validation/refit": took}
        self.weights.sync(timer)
        return validate(self.components, step)

    def advance(self, step: int, result: StepResult) -> None:
        assert self._trained is not None  # set by the step
        advance(self.components, step, self._trained, result.position)
        self.components.save_state.val_reward = result.metrics.get("validation/accuracy",
                                                                   self.components.save_state.val_reward)

    def save(self, step: int, metrics: dict[str, float], metrics_row: dict[str, float],
             position: dict[str, int]) -> None:
        save_checkpoint(self.components, step, metrics, loader_state=position, metrics_row=metrics_row)


@contextmanager
def grpo_loop(components: GRPOComponents) -> Iterator[StepLoop]:
    """The step loop of a synchronous GRPO run."""
    yield StepLoop(GRPO(components), loop_parts(components))


def grpo_train(
    components: GRPOComponents, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> GRPOSaveState:
    """Run GRPO until grpo.max_num_steps or grpo.max_num_epochs (or, with checkpointing.checkpoint_must_save_by,
    until the next step would pass the wall-clock budget: then it saves and returns); the final save state."""
    with grpo_loop(components) as loop:
        loop.run(on_step)
    return components.save_state


def zero_variance_share(group_ids: torch.Tensor, rewards: torch.Tensor) -> float:
    """The share of prompt groups whose samples all got the same reward: their advantages are zero."""
    groups = group_ids.unique()
    flat = sum(1 for g in groups if rewards[group_ids == g].unique().numel() == 1)
    return flat / max(len(groups), 1)


def valid_response_tokens(train_data: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[B] trained tokens per sample: the token mask where the sample is not masked out (sample_mask)."""
    return (train_data["token_mask"] * train_data["sample_mask"][:, None]).sum(-1)


def _step_metrics(
    batch: RolloutBatch, train_data: Mapping[str, torch.Tensor], adv: torch.Tensor, results: TrainResult,
    sampler: DynamicSampler | None,
) -> dict[str, float]:
    m: dict[str, float] = {f"train/{k}": float(v) for k, v in results.metrics.items()}
    m["train/loss"] = float(results.loss)
    m["train/grad_norm"] = float(results.grad_norm)
    m["train/lr"] = float(results.lr)
    m["train/params_finite"] = float(results.params_finite)
    resp = valid_response_tokens(train_data)
    m["train/mean_gen_length"] = float(batch.gen["generation_lengths"].float().mean())
    m["train/mean_prompt_length"] = float(batch.input_lengths.float().mean())
    m["train/total_num_tokens"] = float(train_data["input_lengths"].sum())
    m["train/advantages/mean"] = float(adv.mean())
    m["train/advantages/max"] = float(adv.max())
    m["train/advantages/min"] = float(adv.min())
    m["train/num_too_long_prompts"] = float(sum(1 for r in batch.rows if r.get("too_long")))
    m["train/truncated_fraction"] = float(batch.gen["truncated"].float().mean())
    m["train/zero_variance_groups"] = zero_variance_share(batch.group_ids, batch.rewards)
    m["train/filtered_reward"] = float(batch.rewards.mean())
    m["train/valid_response_tokens"] = float(resp.sum())
    for k, v in batch.metrics.items():
        m[f"train/{k}"] = v
    if sampler is not None:
        m["train/dynamic_sampling_num_discarded_valid_samples"] = float(sampler.discarded)
        m["train/dynamic_sampling_num_gen_batches"] = float(sampler.gen_batches)
    return m
