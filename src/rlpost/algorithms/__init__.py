"""RL algorithms: losses, advantages, the GRPO loop."""
