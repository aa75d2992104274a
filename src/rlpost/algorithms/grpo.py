"""GRPO at NeMo RL's path (`nemo_rl.algorithms.grpo`).

Public names: GRPOConfig, GRPOSaveState, GRPOLoggerConfig, MasterConfig (typed dataclasses),
and the loop's functions. The loop reads top to bottom; each phase lives in its own module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlpost.config.schema.grpo import GRPOConfig, GRPOSaveState, _default_grpo_save_state
from rlpost.config.schema.logger import GRPOLoggerConfig
from rlpost.config.schema.master import MasterConfig

if TYPE_CHECKING:
    from rlpost.config.schema.generation import GenerationConfig

__all__ = [
    "GRPOConfig",
    "GRPOSaveState",
    "GRPOLoggerConfig",
    "MasterConfig",
    "_default_grpo_save_state",
    "_should_use_async_rollouts",
]


def _should_use_async_rollouts(master_config: MasterConfig) -> bool:
    """Async rollouts (vLLM's async engine inside the synchronous, on-policy loop) iff the engine is
    vLLM and `vllm_cfg.async_engine` is on."""
    gen: GenerationConfig = master_config.policy.generation
    vllm_cfg = getattr(gen, "vllm_cfg", None)
    return gen.backend == "vllm" and vllm_cfg is not None and bool(vllm_cfg.async_engine)
