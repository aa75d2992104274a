"""Synchronous GRPO: the next step's generation sent to the engine right behind its refit.

With a colocated vLLM engine on CPU, the training call of step N stages its update and the engines are told to load
it as the call is sent (rlpost.algorithms.engine_weights). Everything the engine needs for step N + 1 is then known
as soon as training returns: the next prompts, their seeds (from the step number) and the weights (the update being
loaded). So the driver sends step N + 1's generation at once, before it books step N (metrics, the metrics row,
validation, a checkpoint). Each replica's actor runs the calls the driver sent it in order, so the generation runs
after the load, with the new weights, while the driver does its bookkeeping; step N + 1 then waits for the load
(fingerprints checked as always) and for what is left of the generation. The samples, rewards and updates are
those of the unprefetched loop (`tests/integration/test_grpo.py::test_an_overlapped_step_equals_the_unoverlapped_one`
compares two steps each way).

Where it applies is a config rule (`rlpost.config.layout.prefetch_reason`, shown by `rlpost plan`); at run time a
step prefetches only when its training call did send the engines their load (a staged export).

With the engine hosted in the policy worker's process (rlpost.models.generation.hosted_engine) the training call
itself ends with the engine's load, and the hosting actor runs its calls one after the other in the order sent. So
the next generation is sent as soon as the training call is (`send_with_training`), not when it returns: the engine
starts it the moment the load is done, without a round trip through the driver in between.
"""

from __future__ import annotations

from typing import Any

from rlpost.algorithms.collect import send_step_generation
from rlpost.algorithms.engine_weights import EngineWeights
from rlpost.algorithms.grpo_setup import GRPOComponents
from rlpost.algorithms.rollouts import SentRollout
from rlpost.config.layout import layout_of
from rlpost.data.dataloader import PromptLoader


class NextGeneration:
    """Sends the next step's generation behind the refit when the config and the refit allow it."""

    def __init__(self, components: GRPOComponents, weights: EngineWeights) -> None:
        self.components, self.weights = components, weights
        self.applies = not layout_of(components.cfg).prefetch_reason
        self._early: tuple[list[dict[str, Any]], SentRollout] | None = None

    def send_with_training(self, loader: PromptLoader, step: int) -> None:
        """With a hosted engine: send step `step`'s generation right after the next training call is sent (it runs
        after that call's load); `send` then returns it. Elsewhere nothing happens here."""
        if not (self.applies and self.weights.hosted):
            return

        def send() -> None:
            rows = loader.next_batch()
            self._early = rows, send_step_generation(self.components, rows, step)

        self.components.policy.on_train_submitted = send  # type: ignore[attr-defined]

    def send(self, loader: PromptLoader, step: int) -> tuple[list[dict[str, Any]], SentRollout] | None:
        """Step `step`'s prompts taken from `loader` and their generation sent, or None (nothing taken) when the
        engine's load of the last update was not sent ahead of it."""
        early, self._early = self._early, None
        if early is not None:
            return early
        if not (self.applies and self.weights.load_sent()):
            return None
        rows = loader.next_batch()
        return rows, send_step_generation(self.components, rows, step)
