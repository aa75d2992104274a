"""GRPO at NeMo RL's path (`nemo_rl.algorithms.grpo`).

Public names: GRPOConfig, GRPOSaveState, GRPOLoggerConfig, MasterConfig (typed dataclasses),
setup, grpo_train, validate, refit_policy_generation, _should_use_async_rollouts.
`grpo_train` reads as DESIGN §4, one named phase each: collect_batch (refit when stale, generate, score,
dynamic sampling) -> prepare (advantages, train data) -> logprobs -> train -> record (save state, health
gate) and checkpoint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from rlpost.algorithms.checkpoint_io import record_checkpoint_metric, write_checkpoint
from rlpost.algorithms.collect import collect_batch, validation_seeds
from rlpost.algorithms.deadline import SaveDeadline
from rlpost.algorithms.dynamic_sampling import DynamicSampler
from rlpost.algorithms.engine_weights import EngineWeights
from rlpost.algorithms.grpo_setup import GRPOComponents, setup
from rlpost.algorithms.multi_turn import run_rollouts, turn_settings
from rlpost.algorithms.overlap import overlapped_step
from rlpost.algorithms.prefetch import NextGeneration
from rlpost.algorithms.prepare import prepare
from rlpost.algorithms.refit import refit_policy_generation
from rlpost.algorithms.rollouts import RolloutBatch, SentRollout
from rlpost.config.schema.grpo import GRPOConfig, GRPOSaveState, _default_grpo_save_state
from rlpost.config.schema.logger import GRPOLoggerConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.runtime import console as say
from rlpost.runtime.timer import Timer

__all__ = [
    "GRPOConfig",
    "GRPOSaveState",
    "GRPOLoggerConfig",
    "MasterConfig",
    "_default_grpo_save_state",
    "_should_use_async_rollouts",
    "grpo_train",
    "refit_policy_generation",
    "save_checkpoint",
    "setup",
    "validate",
]


class HealthCheckError(RuntimeError):
    """The trainer and the engine disagree too much (token_mult_prob_error above the abort threshold)."""


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


def val_sample_line(tokenizer: Any, batch: RolloutBatch, i: int, step: int, k: int, n: int, width: int = 200) -> str:
    """One console line for validation sample i: prompt -> response, reward (each part shortened to fit `width`)."""

    def short(text: str, limit: int) -> str:
        text = repr(text)[1:-1]  # newlines and tabs escaped: one line
        return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."

    prompt = tokenizer.decode(batch.rows[i]["prompt_ids"], skip_special_tokens=True)
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
    write_checkpoint(components.checkpointer, components.policy, step, components.save_state,
                     loader_state or components.dataloader.state_dict(), components.config_dict, components.model_fp,
                     ck.save_consolidated, metrics_row if metrics_row is not None else metrics)


def _health_gate(components: GRPOComponents, metrics: dict[str, float], step: int, same_weights: bool = True) -> None:
    """Stop before a broken step is checkpointed: non-finite loss or grad norm, or engine/trainer drift (checked
    only when the engine generated the batch with the trainer's current weights)."""
    check_finite(metrics, step, components.cfg)
    err = metrics.get("train/token_mult_prob_error")
    if err is None or not same_weights:
        return
    grpo_cfg = components.cfg.grpo
    if err > grpo_cfg.token_mult_prob_error_abort_threshold:
        raise HealthCheckError(
            f"step {step}: train/token_mult_prob_error={err:.4f} > abort threshold "
            f"{grpo_cfg.token_mult_prob_error_abort_threshold} (grpo.token_mult_prob_error_abort_threshold): "
            "the engine's and the trainer's logprobs disagree; check refit and precision"
        )
    if err > grpo_cfg.token_mult_prob_error_warn_threshold:
        metrics["train/health_warnings"] = 1.0
        say.warn(
            f"step {step}: train/token_mult_prob_error={err:.4f} > warn threshold "
            f"{grpo_cfg.token_mult_prob_error_warn_threshold} (grpo.token_mult_prob_error_warn_threshold)"
        )


def check_finite(metrics: dict[str, float], step: int, cfg: Any) -> None:
    """HealthCheckError when the step's loss or grad norm is not finite, or the update left non-finite weights
    (the message names cfg.policy's lr)."""
    broken = [f"{key}={metrics[key]} is not finite" for key in ("train/loss", "train/grad_norm")
              if key in metrics and not math.isfinite(metrics[key])]
    if metrics.get("train/params_finite") == 0.0:
        broken.append("the policy's weights are no longer finite after the update")
    if broken:
        raise HealthCheckError(
            f"step {step}: {broken[0]}; the run stopped before saving this step "
            f"(policy.optimizer.kwargs.lr={cfg.policy.optimizer.kwargs.get('lr', '?')} may be too high; the last good "
            "checkpoint is kept)"
        )


def call_timeout_for(cluster_cfg: Any, slowest_step_s: float) -> float:
    """step_timeout_factor x the slowest step so far, within [min_call_timeout_s, call_timeout_s]."""
    bound = cluster_cfg.step_timeout_factor * slowest_step_s
    return min(max(bound, cluster_cfg.min_call_timeout_s), cluster_cfg.call_timeout_s)


def _tighten_call_timeouts(components: GRPOComponents, slowest_step_s: float) -> None:
    timeout = call_timeout_for(components.cfg.cluster, slowest_step_s)
    components.policy.set_call_timeout(timeout)
    components.generation.set_call_timeout(timeout)


# ---- the phases of one step (DESIGN §4) ------------------------------------------------------------------


def logprobs(components: GRPOComponents, train_data: BatchedDataDict, timer: Timer) -> None:
    """The trainer's own prev / reference logprobs, only those the loss reads."""
    loss_fn, policy = components.loss_fn, components.policy
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
          timer: Timer) -> dict[str, Any]:
    """Optimizer steps over the batch; the engine's weights are now behind the policy's. (No separate
    `prepare_for_training` call: each backend's `train` brings the optimizer back and sets train mode itself, and
    the call was a Ray round trip a step.)"""
    with timer.time("policy_training"):
        results = components.policy.train(train_data, components.loss_fn)
        weights.policy_updated()
    return results


def record(components: GRPOComponents, step: int, train_data: BatchedDataDict, metrics: dict[str, float],
           loader_position: tuple[int, int], same_weights: bool = True) -> None:
    """Advance the save state to this step and stop on a broken one (before it can be saved). `same_weights`:
    the batch was generated by the weights the trainer held (false for async GRPO's older batches, whose
    token_mult_prob_error measures the policy's drift, not a refit or precision fault)."""
    save_state, grpo_cfg = components.save_state, components.cfg.grpo
    save_state.current_epoch, save_state.current_step = loader_position
    save_state.total_steps = step
    save_state.consumed_samples += grpo_cfg.num_prompts_per_step
    save_state.total_valid_tokens += int(valid_response_tokens(train_data).sum())
    _health_gate(components, metrics, step, same_weights)


def grpo_train(
    components: GRPOComponents, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> GRPOSaveState:
    """Run GRPO until grpo.max_num_steps or grpo.max_num_epochs (or, with checkpointing.checkpoint_must_save_by,
    until the next step would pass the wall-clock budget: then it saves and returns); the final save state.

    Each step: collect a batch (refit when stale, dynamic sampling) -> prepare -> logprobs -> train ->
    validate (every val_period) -> record and checkpoint -> log."""
    cfg, grpo_cfg, save_state = components.cfg, components.cfg.grpo, components.save_state
    timer = Timer()
    slowest = 0.0
    deadline = SaveDeadline(cfg.checkpointing.checkpoint_must_save_by, components.started_at)
    weights = EngineWeights(components, timer)
    if grpo_cfg.val_at_start and save_state.total_steps == 0:
        # Validate what the engine really serves: refit (with its fingerprint check) first.
        took = weights.refit()
        components.logger.log({**validate(components, 0), "timing/validation/refit": took}, 0)
    loader = components.dataloader
    next_generation = NextGeneration(components, weights)
    sent: tuple[list[dict[str, Any]], SentRollout] | None = None  # this step's prompts, their generation under way
    while sent is not None or (loader.epochs_done() < grpo_cfg.max_num_epochs
                               and save_state.total_steps < grpo_cfg.max_num_steps):
        prompt_rows, sent_rollout = sent if sent is not None else (loader.next_batch(), None)
        sent = None
        step = save_state.total_steps + 1
        timer.reset()
        step_t0 = time.perf_counter()
        with timer.time("total_step_time"):
            if components.overlap:  # the same phases, with generation and training overlapped (overlap.py)
                done = overlapped_step(components, prompt_rows, step, timer, weights)
                collected, train_data, advantages, results = done.collected, done.train_data, done.advantages, \
                    done.results
                last, position = _is_last(step, grpo_cfg, loader), loader.state_dict()
            else:
                collected = collect_batch(components, prompt_rows, loader.next_batch, step, timer, weights.sync,
                                          sent_rollout)
                train_data, advantages = prepare(components, collected.batch, timer)
                logprobs(components, train_data, timer)
                # after this step's prompts, before a prefetch takes the next step's
                last, position = _is_last(step, grpo_cfg, loader), loader.state_dict()
                if not last:  # a hosted engine gets it behind the training call (prefetch.py)
                    next_generation.send_with_training(loader, step + 1)
                results = train(components, train_data, weights, timer)
            batch = collected.batch
            if not last:  # the next step's generation goes to the engine now, behind the refit (prefetch.py)
                sent = next_generation.send(loader, step + 1)
            metrics = {"train/reward": float(collected.generated_rewards.mean()),  # every sample generated
                       **_step_metrics(batch, train_data, advantages, results, collected.sampler)}
            if sent_rollout is not None:
                metrics["train/prefetched_generation"] = 1.0
            deadline.step_took(time.perf_counter() - step_t0)
            out_of_time = deadline.due() and not last
            # Every val_period steps, and at the run's final step (so its last checkpoint has a validation score).
            if on_schedule(grpo_cfg.val_period, step, last or out_of_time):
                weights.sync()
                val = validate(components, step)
                metrics.update(val)
                save_state.val_reward = val.get("validation/accuracy", save_state.val_reward)
            record(components, step, train_data, metrics, (position["epoch"], position["index"]))
            deadline.step_took(time.perf_counter() - step_t0)
            if cfg.checkpointing.enabled and on_schedule(cfg.checkpointing.save_period, step, last or out_of_time):
                save_step(components, step, metrics, timer, deadline, loader_state=position)
        slowest = log_step(components, step, metrics, timer, train_data, batch, slowest, on_step)
        if out_of_time:
            say.info(deadline.message(step))
            break
    weights.finish()
    return save_state


def _is_last(step: int, grpo_cfg: GRPOConfig, loader: Any) -> bool:
    """Whether `step`, whose prompts the loader has handed out, is the run's last (its step or epoch budget)."""
    return step >= grpo_cfg.max_num_steps or loader.epochs_done() >= grpo_cfg.max_num_epochs


def on_schedule(period: int, step: int, final: bool) -> bool:
    """Whether a periodic action (validation, checkpoint) runs at `step`: every `period` steps (0 = never) and at
    the run's final step."""
    return period > 0 and (step % period == 0 or final)


def save_step(components: GRPOComponents, step: int, metrics: dict[str, float], timer: Timer, deadline: SaveDeadline,
              loader_state: dict[str, int] | None = None) -> None:
    """Checkpoint the step (timed, and its duration told to the save deadline)."""
    save_t0 = time.perf_counter()
    with timer.time("checkpointing"):
        save_checkpoint(components, step, metrics, loader_state=loader_state,
                        metrics_row={**metrics, **timer.metrics("timing/train")})
    deadline.save_took(time.perf_counter() - save_t0)


def log_step(components: GRPOComponents, step: int, metrics: dict[str, float], timer: Timer,
             train_data: BatchedDataDict, batch: RolloutBatch, slowest: float,
             on_step: Callable[[int, dict[str, float]], None] | None) -> float:
    """Throughput, the step's metrics row, call timeouts tightened to the slowest step, the on_step hook;
    returns the slowest step time so far."""
    if components.cfg.logger.monitor_gpus:
        metrics.update(components.policy.gpu_memory_metrics())
    metrics.update(_throughput(timer, train_data, batch))
    components.logger.log(metrics, step)
    slowest = max(slowest, timer.times["total_step_time"])
    _tighten_call_timeouts(components, slowest)
    if on_step is not None:
        on_step(step, metrics)
    return slowest


def _throughput(timer: Timer, train_data: BatchedDataDict, batch: RolloutBatch) -> dict[str, float]:
    metrics = timer.metrics("timing/train")
    n_tok = float(train_data["input_lengths"].sum())
    metrics["performance/tokens_per_sec"] = n_tok / max(timer.times["total_step_time"], 1e-9)
    gen_tok = float(batch.gen["generation_lengths"].sum())
    metrics["performance/generation_tokens_per_sec"] = gen_tok / max(timer.times.get("generation", 0.0), 1e-9)
    return metrics


def valid_response_tokens(train_data: Any) -> torch.Tensor:
    """[B] trained tokens per sample: the token mask where the sample is not masked out (sample_mask)."""
    return (train_data["token_mask"] * train_data["sample_mask"][:, None]).sum(-1)


def _step_metrics(
    batch: RolloutBatch, train_data: Any, adv: torch.Tensor, results: dict[str, Any], sampler: DynamicSampler | None
) -> dict[str, float]:
    m: dict[str, float] = {f"train/{k}": float(v) for k, v in results["metrics"].items()}
    m["train/loss"] = float(results["loss"])
    m["train/grad_norm"] = float(results["grad_norm"])
    m["train/lr"] = float(results["lr"])
    m["train/params_finite"] = float(results.get("params_finite", True))
    resp = valid_response_tokens(train_data)
    m["train/mean_gen_length"] = float(batch.gen["generation_lengths"].float().mean())
    m["train/mean_prompt_length"] = float(batch.input_lengths.float().mean())
    m["train/total_num_tokens"] = float(train_data["input_lengths"].sum())
    m["train/advantages/mean"] = float(adv.mean())
    m["train/advantages/max"] = float(adv.max())
    m["train/advantages/min"] = float(adv.min())
    m["train/num_too_long_prompts"] = float(sum(1 for r in batch.rows if r.get("too_long")))
    m["train/truncated_fraction"] = float(batch.gen["truncated"].float().mean())
    m["train/filtered_reward"] = float(batch.rewards.mean())
    m["train/valid_response_tokens"] = float(resp.sum())
    for k, v in batch.metrics.items():
        m[f"train/{k}"] = v
    if sampler is not None:
        m["train/dynamic_sampling_num_discarded_valid_samples"] = float(sampler.discarded)
        m["train/dynamic_sampling_num_gen_batches"] = float(sampler.gen_batches)
    return m
