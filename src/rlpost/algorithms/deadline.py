"""`checkpointing.checkpoint_must_save_by`: save and stop before a wall-clock budget runs out.

The budget ('DD:HH:MM:SS') counts from the run's start (setup included, as a batch scheduler counts
it). After each step the loop asks `SaveDeadline.due()`: would one more step as slow as the slowest
so far, plus a save as slow as the last one, pass the budget? Then it saves this step and stops; the
run exits 0 and re-running the command resumes from that checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlpost.config.schema.checkpoint import wall_budget_s


class SaveDeadline:
    """Tracks the slowest step and the last save against a wall-clock budget."""

    def __init__(self, budget: str | None, started_at: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self.budget_s = wall_budget_s(budget) if budget else None
        self.started_at = started_at
        self.clock = clock
        self.slowest_step_s = 0.0
        self.last_save_s = 0.0

    @property
    def enabled(self) -> bool:
        return self.budget_s is not None

    def step_took(self, seconds: float) -> None:
        """Record a step's duration (the slowest one sizes the margin)."""
        self.slowest_step_s = max(self.slowest_step_s, seconds)

    def save_took(self, seconds: float) -> None:
        """Record how long the latest checkpoint took to write."""
        self.last_save_s = seconds

    def elapsed(self) -> float:
        return self.clock() - self.started_at

    def due(self) -> bool:
        """True when another step and a save would not fit in the budget any more."""
        if self.budget_s is None:
            return False
        return self.elapsed() + self.slowest_step_s + self.last_save_s >= self.budget_s

    def message(self, step: int) -> str:
        """The one line printed when the run stops for the deadline."""
        return (
            f"checkpointing.checkpoint_must_save_by={self.budget}: saved step {step} and stopped after "
            f"{self.elapsed():.0f}s (another step needs ~{self.slowest_step_s:.1f}s + {self.last_save_s:.1f}s to "
            "save); re-run the same command to resume"
        )
