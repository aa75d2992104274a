"""The sleep/wake state machine of a rollout engine, the same on every device.

A colocated engine shares its device with the policy, so it sleeps whenever the policy works: after each
generation phase it releases its weights and KV cache (`sleep`), and before the next generation it takes them back
(`wake`, all at once or weights first for a refit, then the KV cache). Two parts can be awake or asleep:

    weights   the model's parameters (asleep on a GPU: offloaded to host memory)
    kv_cache  the KV-cache blocks (asleep on a GPU: freed)

An engine generates only when both are awake. `require_awake` is called at the top of every generate call, so a
sleeping engine fails at once with a line naming it and its state; on a GPU vLLM would queue the requests of a
paused engine and wait forever. What a sleep or a wake does to memory is the engine's business (vLLM's sleep mode on
a GPU; nothing on a CPU): the states and their rules are the same everywhere, which is what lets the CPU suite catch
a generation on a sleeping engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PARTS = ("weights", "kv_cache")
"""What an engine can put to sleep and wake, in the order a refit wakes them."""


class EngineAsleep(RuntimeError):
    """Generation was asked of an engine that is not fully awake."""


@dataclass
class SleepState:
    """Which parts of one engine are awake. An engine starts awake (it was just built)."""

    weights: bool = True
    """The model's weights are on the engine's device."""
    kv_cache: bool = True
    """The KV cache is allocated."""

    @property
    def awake(self) -> bool:
        return self.weights and self.kv_cache

    @property
    def asleep(self) -> bool:
        """Weights and KV cache are both asleep."""
        return not (self.weights or self.kv_cache)

    @property
    def name(self) -> str:
        """The state in words: "awake", "asleep", or which part is awake."""
        if self.awake:
            return "awake"
        if self.asleep:
            return "asleep"
        return "weights awake, KV cache asleep" if self.weights else "KV cache awake, weights asleep"

    def to_wake(self, tags: Iterable[str] | None) -> list[str]:
        """The parts a wake of `tags` (None: all) would wake, in PARTS order; those already awake left out."""
        wanted = PARTS if tags is None else tuple(tags)
        unknown = sorted(set(wanted) - set(PARTS))
        if unknown:
            raise ValueError(f"cannot wake {unknown}: an engine's parts are {list(PARTS)}")
        return [p for p in PARTS if p in wanted and not getattr(self, p)]

    def woke(self, parts: Iterable[str]) -> None:
        for part in parts:
            setattr(self, part, True)

    def slept(self) -> None:
        self.weights = self.kv_cache = False

    def require_awake(self, engine: str) -> None:
        """Raise EngineAsleep naming `engine` and its state unless it can generate."""
        if not self.awake:
            raise EngineAsleep(
                f"{engine} is {self.name}: generation was asked of a sleeping engine (wake it with "
                "prepare_for_generation before generating)"
            )
