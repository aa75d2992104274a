"""register_configs(): every ConfigStore.store() call, and nothing else.

The root schema `rlpost_schema` types the whole config; options of polymorphic groups
(policy, generation, loss, env entries) extend their own schema from `/schema/<group>/<name>`.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlpost.config.schema.cispo import CISPOLossConfig
from rlpost.config.schema.data import DataConfig
from rlpost.config.schema.env import (
    CalculatorEnvConfig,
    GuessGameEnvConfig,
    LookupEnvConfig,
    MathEnvConfig,
    RewardModelEnvConfig,
    SyntheticEnvConfig,
)
from rlpost.config.schema.generation import HFGenerationConfig, VllmConfig
from rlpost.config.schema.loss import (
    ClippedPGLossConfig,
    DistillationLossConfig,
    DPOLossConfig,
    NLLLossConfig,
    PreferenceLossConfig,
)
from rlpost.config.schema.megatron import MegatronPolicyConfig
from rlpost.config.schema.policy import DTensorPolicyConfig, PolicyConfig
from rlpost.config.schema.root import RootConfig
from rlpost.config.schema.supervised import PreferenceDataConfig, SFTDataConfig

_REGISTERED = False


def _policy_schema(cls: type[PolicyConfig]) -> DictConfig:
    """A policy schema without an engine (algo=grpo's generation option merges its engine in later)."""
    node = OmegaConf.structured(cls)
    if cls is PolicyConfig:  # each backend brings its optimizer kwargs (Megatron's hold only the lr)
        node.optimizer.kwargs = {}
    return node


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    cs = ConfigStore.instance()
    root = OmegaConf.structured(RootConfig)
    # Polymorphic blocks start as their base type so any option's subclass can merge in.
    root.policy = _policy_schema(PolicyConfig)
    cs.store(name="rlpost_schema", node=root)
    cs.store(group="schema/policy", name="dtensor", node=_policy_schema(DTensorPolicyConfig))
    cs.store(group="schema/policy", name="megatron", node=_policy_schema(MegatronPolicyConfig))
    cs.store(group="schema/generation", name="vllm", node=VllmConfig)
    cs.store(group="schema/generation", name="hf", node=HFGenerationConfig)
    cs.store(group="schema/loss", name="clipped_pg", node=ClippedPGLossConfig)
    cs.store(group="schema/loss", name="cispo", node=CISPOLossConfig)
    cs.store(group="schema/loss", name="nll", node=NLLLossConfig)
    cs.store(group="schema/loss", name="distillation", node=DistillationLossConfig)
    cs.store(group="schema/loss", name="dpo", node=DPOLossConfig)
    cs.store(group="schema/loss", name="preference", node=PreferenceLossConfig)
    cs.store(group="schema/data", name="prompts", node=DataConfig)
    cs.store(group="schema/data", name="sft", node=SFTDataConfig)
    cs.store(group="schema/data", name="preference", node=PreferenceDataConfig)
    cs.store(group="schema/env", name="synthetic", node=SyntheticEnvConfig)
    cs.store(group="schema/env", name="math", node=MathEnvConfig)
    cs.store(group="schema/env", name="calculator", node=CalculatorEnvConfig)
    cs.store(group="schema/env", name="lookup", node=LookupEnvConfig)
    cs.store(group="schema/env", name="guess_game", node=GuessGameEnvConfig)
    cs.store(group="schema/env", name="reward_model", node=RewardModelEnvConfig)
    _REGISTERED = True
