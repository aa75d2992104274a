"""`rlpost eval` settings: which weights, which prompts, how many samples (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import one_of, positive, require


@dataclass
class EvalConfig:
    """Evaluate a model directory or a checkpoint with the generation engine (`rlpost eval`)."""

    checkpoint: str | None = None
    """A run's checkpoint (…/checkpoints/step_N): its policy/weights/hf is evaluated instead of model.path."""
    split: str = "val"
    """Prompts to evaluate: the data option's 'val' or 'train' rows."""
    num_samples: int = 1
    """Samples per prompt; pass@k uses k = num_samples."""
    greedy: bool = False
    """Greedy decoding (one sample per prompt) instead of sampling at policy.generation.temperature."""
    max_prompts: int | None = None
    """Evaluate only the first this many prompts; None = all."""
    output: str | None = None
    """Where the JSON report goes; None = outputs/eval/<date>/<time>/eval.json."""

    def check(self, path: str) -> None:
        one_of(f"{path}.split", self.split, ("val", "train"))
        positive(f"{path}.num_samples", self.num_samples)
        positive(f"{path}.max_prompts", self.max_prompts, allow_none=True)
        require(not (self.greedy and self.num_samples > 1), f"{path}.num_samples", self.num_samples,
                "greedy decoding gives one answer per prompt; use eval.num_samples=1 or eval.greedy=false")
