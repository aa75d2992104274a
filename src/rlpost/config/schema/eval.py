"""`rlpost eval` settings: which weights, which prompts, how many samples (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import require
from rlpost.config.fields import POSITIVE_OR_NONE, Block, Rule, checked, options

MAX_SAMPLES = 1024
"""The most samples per prompt `rlpost eval` draws (pass@1024 is as far as anyone reports)."""


@dataclass
class EvalConfig(Block):
    """Evaluate a model directory or a checkpoint with the generation engine (`rlpost eval`)."""

    checkpoint: str | None = None
    """A run's checkpoint (…/checkpoints/step_N): its policy/weights/hf is evaluated instead of model.path."""
    split: str = checked("val", options("val", "train"))
    """Prompts to evaluate: the data option's 'val' or 'train' rows."""
    num_samples: int = checked(1, Rule(lambda v: 1 <= v <= MAX_SAMPLES, f"must be in [1, {MAX_SAMPLES}]"))
    """Samples per prompt (at most 1024); pass@k uses k = num_samples."""
    greedy: bool = False
    """Greedy decoding (one sample per prompt) instead of sampling at policy.generation.temperature."""
    max_prompts: int | None = checked(None, POSITIVE_OR_NONE)
    """Evaluate only the first this many prompts; None = all."""
    output: str | None = None
    """Where the JSON report goes; None = outputs/eval/<date>/<time>/eval.json."""

    def check(self, path: str) -> None:
        super().check(path)
        if self.checkpoint:
            name = self.checkpoint.rstrip("/").rsplit("/", 1)[-1]
            require(not name.startswith("corrupt_"), f"{path}.checkpoint", self.checkpoint,
                    "was moved aside as corrupt when the run resumed (it failed its manifest check)",
                    f"evaluate {name.removeprefix('corrupt_').split('.')[0]} of another run, or an earlier step")
        require(not (self.greedy and self.num_samples > 1), f"{path}.num_samples", self.num_samples,
                "greedy decoding gives one answer per prompt; use eval.num_samples=1 or eval.greedy=false")
