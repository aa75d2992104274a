"""EnvironmentInterface: turn responses into rewards. A leaf module."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


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


class EnvironmentInterface(ABC):
    """Single-turn scoring of responses against per-sample metadata (e.g. the ground truth)."""

    @abstractmethod
    def step(self, responses: list[str], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Score `responses`; metadata[i] belongs to responses[i]."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop worker processes."""

    @classmethod
    def answer_problem(cls, answer: str) -> str | None:
        """Why a data row's expected answer can never be matched (the pre-flight names the row), or None.
        Runs in the driver before anything starts; the default accepts every answer."""
        return None
