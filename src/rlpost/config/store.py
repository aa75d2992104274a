"""register_configs(): every ConfigStore.store() call, and nothing else.

The root schema `rlpost_schema` types the whole config; options of polymorphic groups
(generation, loss, env entries) extend their own schema from `/schema/<group>/<name>`.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from rlpost.config.schema.env import MathEnvConfig, SyntheticEnvConfig
from rlpost.config.schema.generation import GenerationConfig, HFGenerationConfig, VllmConfig
from rlpost.config.schema.loss import ClippedPGLossConfig, LossConfig, NLLLossConfig
from rlpost.config.schema.master import MasterConfig

_REGISTERED = False


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    cs = ConfigStore.instance()
    root = OmegaConf.structured(MasterConfig)
    # Polymorphic blocks start as their base type so any option's subclass can merge in.
    root.env = {}
    root.policy.generation = OmegaConf.structured(GenerationConfig)
    root.loss_fn = OmegaConf.structured(LossConfig)
    cs.store(name="rlpost_schema", node=root)
    cs.store(group="schema/generation", name="vllm", node=VllmConfig)
    cs.store(group="schema/generation", name="hf", node=HFGenerationConfig)
    cs.store(group="schema/loss", name="clipped_pg", node=ClippedPGLossConfig)
    cs.store(group="schema/loss", name="nll", node=NLLLossConfig)
    cs.store(group="schema/env", name="synthetic", node=SyntheticEnvConfig)
    cs.store(group="schema/env", name="math", node=MathEnvConfig)
    _REGISTERED = True
