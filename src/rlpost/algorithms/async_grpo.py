"""Async GRPO (grpo.async_grpo.enabled=true): the engine keeps generating while the trainer trains.

The engine and the trainer sit on separate worker slots (policy.generation.colocated.enabled=false). A
collector thread in the driver pulls prompt batches from the dataloader, generates and scores them with the
weights the engine holds (policy version g) and pushes each batch, tagged with g, into the ReplayBuffer (a
Ray actor). The driver thread trains: it takes batches in generation order, drops the ones older than
grpo.async_grpo.max_trajectory_age_steps (counted, never trained on), computes the trainer's logprobs of the
batch (the data is off-policy, so the prev-logprobs pass always runs and importance-sampling correction is
required), updates the policy, and refits the engine. A refit waits for the engine's current batch to finish
(the collector pauses at batch boundaries; in-flight weight updates are not implemented and refused), then
generation goes on with the new weights while the next update trains. Steady state: a step costs about
max(generation, training) + refit, where the synchronous loop pays generation + training.

Checkpoints hold the dataloader position right after the last *trained* batch: on resume, batches that were
buffered but not trained are generated again, with the checkpoint's weights (the buffer is not saved).

Metrics: async/trajectory_age (versions between generation and update), async/buffer_size,
async/dropped_stale (batches dropped as too old, so far), async/trainer_wait_s (time the trainer waited for a
batch), async/generation_s (engine time of the batch trained on).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from rlpost.algorithms.collect import rollout_rows, sample_seeds
from rlpost.algorithms.deadline import SaveDeadline
from rlpost.algorithms.grpo import (
    _EngineWeights,
    _step_metrics,
    _throughput,
    _tighten_call_timeouts,
    logprobs,
    prepare,
    record,
    save_checkpoint,
    train,
    validate,
)
from rlpost.algorithms.grpo_setup import GRPOComponents
from rlpost.algorithms.multi_turn import run_rollouts, turn_settings
from rlpost.algorithms.replay_buffer import ReplayBuffer, Trajectories
from rlpost.config.schema.grpo import GRPOSaveState
from rlpost.runtime import console as say
from rlpost.runtime.timer import Timer

_POLL_S = 0.01


class Collector:
    """The generation side: a thread that fills the replay buffer, pausing at batch boundaries for refits."""

    def __init__(self, components: GRPOComponents, buffer: Any, first_index: int, call_timeout_s: float) -> None:
        self.components, self.buffer, self.index = components, buffer, first_index
        self.call_timeout_s = call_timeout_s
        self.engine_lock = threading.Lock()
        self.pause = threading.Event()  # set by the trainer while it waits to refit
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.version = 0  # policy version of the weights the engine holds
        self.thread = threading.Thread(target=self._run, name="rlpost-async-collector", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        c = self.components
        try:
            while not self.stop.is_set() and c.dataloader.epochs_done() < c.cfg.grpo.max_num_epochs:
                # Generate only what the buffer can take: a batch made early would wait and age out.
                while not self.stop.is_set() and (
                        self.pause.is_set() or not ray.get(self.buffer.has_room.remote(), timeout=self.call_timeout_s)):
                    time.sleep(_POLL_S)
                with self.engine_lock:
                    if self.stop.is_set():
                        return
                    entry = self._generate()
                while not self.stop.is_set():
                    if ray.get(self.buffer.push.remote(entry), timeout=self.call_timeout_s):
                        break
                    time.sleep(_POLL_S)  # full: generation is far enough ahead of training
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which stops the run with it
            self.error = exc

    def _generate(self) -> Trajectories:
        c, g = self.components, self.components.cfg.grpo
        rows = c.dataloader.next_batch()
        t0 = time.perf_counter()
        repeated, group_ids = rollout_rows(c, rows)
        batch = run_rollouts(repeated, group_ids, c.generation, c.tokenizer, c.envs, turn_settings(c.cfg),
                             c.cfg.policy.generation.async_rollouts(), seeds=sample_seeds(g.seed, self.index,
                                                                                          len(repeated)),
                             label=f"generation batch {self.index}")
        entry = Trajectories(batch, self.version, self.index, c.dataloader.state_dict(), time.perf_counter() - t0)
        self.index += 1
        return entry

    def check(self) -> None:
        """Raise the collector's failure (e.g. a dead engine actor, named) in the trainer."""
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=self.call_timeout_s)


def async_grpo_train(
    components: GRPOComponents, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> GRPOSaveState:
    """Run async GRPO until grpo.max_num_steps, the data runs out, or checkpoint_must_save_by; the save state."""
    cfg, g, save_state = components.cfg, components.cfg.grpo, components.save_state
    max_age = g.async_grpo.max_trajectory_age_steps
    timer = Timer()
    weights = _EngineWeights(components, timer)
    weights.policy_version = save_state.total_steps
    weights.refit()  # the engine starts from what the trainer holds (a resumed run: the checkpoint's weights)
    if g.val_at_start and save_state.total_steps == 0:
        components.logger.log(validate(components, 0), 0)
    # Capacity max_age: with one more batch in the making, nothing generated ages out before it is trained on.
    buffer: Any = ray.remote(ReplayBuffer).options(num_cpus=0).remote(max_age)
    collector = Collector(components, buffer, save_state.total_steps + 1, cfg.cluster.call_timeout_s)
    collector.version = weights.policy_version
    deadline = SaveDeadline(cfg.checkpointing.checkpoint_must_save_by, components.started_at)
    slowest = 0.0
    collector.start()
    try:
        while save_state.total_steps < g.max_num_steps:
            step = save_state.total_steps + 1
            timer.reset()
            step_t0 = time.perf_counter()
            with timer.time("total_step_time"):
                entry = _next_batch(collector, buffer, weights.policy_version - max_age, timer)
                if entry is None:  # the data ran out
                    break
                age = weights.policy_version - entry.version
                if not 0 <= age <= max_age:  # the buffer's take() makes this impossible; never train on it
                    raise RuntimeError(f"batch {entry.index} is {age} versions old (max {max_age})")
                batch = entry.batch
                train_data, advantages = prepare(components, batch, timer)
                logprobs(components, train_data, timer)
                results = train(components, train_data, weights, timer)
                metrics = {"train/reward": float(batch.rewards.mean()),
                           **_step_metrics(batch, train_data, advantages, results, None)}
                _refit(collector, weights, timer)
                last = step >= g.max_num_steps
                deadline.step_took(time.perf_counter() - step_t0)
                out_of_time = deadline.due() and not last
                if g.val_period > 0 and (step % g.val_period == 0 or last or out_of_time):
                    with _engine(collector):
                        metrics.update(validate(components, step))
                    save_state.val_reward = metrics.get("validation/accuracy", save_state.val_reward)
                record(components, step, train_data, metrics, (entry.loader_state["epoch"], entry.loader_state["index"]),
                       same_weights=age == 0)
                components.extras["loader_state"] = entry.loader_state  # what an interrupt's checkpoint resumes from
                deadline.step_took(time.perf_counter() - step_t0)
                if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or last or out_of_time):
                    with timer.time("checkpointing"):
                        save_checkpoint(components, step, metrics, loader_state=entry.loader_state)
                stats = ray.get(buffer.stats.remote(), timeout=cfg.cluster.call_timeout_s)
                metrics.update({"async/trajectory_age": float(age), "async/buffer_size": stats["size"],
                                "async/dropped_stale": stats["dropped_stale"],
                                "async/generation_s": entry.generation_s})
            metrics.update(_throughput(timer, train_data, batch))
            metrics["async/trainer_wait_s"] = timer.times.get("trainer_wait", 0.0)
            metrics.pop("timing/train/trainer_wait", None)
            components.logger.log(metrics, step)
            slowest = max(slowest, timer.times["total_step_time"])
            _tighten_call_timeouts(components, slowest)
            if on_step is not None:
                on_step(step, metrics)
            if out_of_time:
                say.info(deadline.message(step))
                break
    finally:
        collector.close()
        ray.kill(buffer)
    return save_state


def _next_batch(collector: Collector, buffer: Any, min_version: int, timer: Timer) -> Trajectories | None:
    """The next trainable batch (waiting for the collector), or None when the data ran out."""
    with timer.time("trainer_wait"):
        while True:
            collector.check()
            entry: Trajectories | None = ray.get(buffer.take.remote(min_version), timeout=collector.call_timeout_s)
            if entry is not None:
                return entry
            if not collector.thread.is_alive():
                collector.check()
                return None
            time.sleep(_POLL_S)


class _engine:
    """Hold the engine between two of the collector's batches (refit, validation)."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def __enter__(self) -> None:
        self.collector.pause.set()
        while not self.collector.engine_lock.acquire(timeout=_POLL_S):
            self.collector.check()

    def __exit__(self, *exc: object) -> None:
        self.collector.engine_lock.release()
        self.collector.pause.clear()


def _refit(collector: Collector, weights: _EngineWeights, timer: Timer) -> None:
    """New weights into the engine once its current batch is done; later batches are generated with them."""
    t0 = time.perf_counter()
    with _engine(collector):
        timer.times["refit_wait"] = timer.times.get("refit_wait", 0.0) + time.perf_counter() - t0
        with timer.time("refit"):
            weights.refit()
        collector.version = weights.engine_version
