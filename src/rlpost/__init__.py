"""rlpost: reinforcement-learning post-training of language models (GRPO), Hydra-driven."""

__version__ = "0.1.0"
