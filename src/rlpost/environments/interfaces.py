"""EnvironmentInterface: turn responses into rewards. A leaf module."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlpost.config.schema.env import EnvConfig


@dataclass
class EnvironmentReturn:
    """Rewards of one batch of responses, plus what went wrong while scoring them."""

    rewards: list[float]
    """One reward per response."""
    timeouts: int = 0
    """Verifications killed for running past the timeout, or unfinished at the batch deadline (reward 0)."""
    errors: int = 0
    """Verifications that raised (reward 0)."""
    unfinished: int = 0
    """Of the timeouts, samples still unscored when the batch deadline ran out."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Environment-specific metrics."""
    observations: list[str] | None = None
    """Multi-turn: per response, the environment's turn (e.g. a tool result) appended after it, tokenized as is and
    masked out of the loss; None = single-turn (every episode ends with this response)."""
    terminateds: list[bool] | None = None
    """Multi-turn: per response, True when its episode is over (None = all over)."""
    next_stop_strings: list[list[str] | None] | None = None
    """Multi-turn: stop strings of each episode's next turn, on top of policy.generation.stop_strings (None = none)."""
    next_metadata: list[dict[str, object]] | None = None
    """Multi-turn: each episode's metadata for its next turn (the environment's state); None keeps it."""


class EnvironmentInterface(ABC):
    """Scores responses against per-sample metadata (e.g. the ground truth) and, in multi-turn episodes,
    answers them (grpo.max_rollout_turns > 1)."""

    cfg: EnvConfig | None = None
    """The environment's config, when it has one: its worker count and time limits name the cause in the warning a
    slow or timed-out scoring prints."""

    @abstractmethod
    def step(self, responses: list[str], metadata: Sequence[Mapping[str, object]]) -> EnvironmentReturn:
        """Score `responses`; metadata[i] belongs to responses[i]. In a multi-turn episode, responses[i] is the
        model's latest turn and metadata[i] the row updated by the environment's earlier `next_metadata`; the
        episode's reward is the sum of its turns' rewards."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop worker processes."""

    @classmethod
    def answer_problem(cls, answer: str) -> str | None:
        """Why a data row's expected answer can never be matched (the pre-flight names the row), or None.
        Runs in the driver before anything starts; the default accepts every answer."""
        return None
