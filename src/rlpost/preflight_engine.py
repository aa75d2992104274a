"""The pre-flight's check of the rollout engine's pass-through arguments (`policy.generation.vllm_kwargs`): each
must be an argument vLLM's engine takes, judged against its EngineArgs before Ray starts. vLLM is imported only when
the block is set. `rlpost.checks.CHECKS` runs it."""

from __future__ import annotations

import dataclasses

from rlpost.config.errors import ConfigError, did_you_mean
from rlpost.config.schema.generation import VllmConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.supervised_master import SupervisedMasterConfig

KEY = "policy.generation.vllm_kwargs"


def engine_arguments(async_engine: bool) -> list[str]:
    """The keyword arguments vLLM's engine takes (its AsyncEngineArgs for the async engine)."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    return [f.name for f in dataclasses.fields(AsyncEngineArgs if async_engine else EngineArgs) if f.init]


def check_engine_kwargs(master: MasterConfig | SupervisedMasterConfig) -> None:
    """Every key of policy.generation.vllm_kwargs names an argument of vLLM's engine."""
    gen = getattr(master.policy, "generation", None)
    if not isinstance(gen, VllmConfig) or not gen.vllm_kwargs:
        return
    try:
        names = engine_arguments(bool(gen.vllm_cfg.async_engine))
    except ImportError:  # no vLLM on this host (a launch's login node): the engine judges them where it runs
        return
    for key, value in gen.vllm_kwargs.items():
        if key not in names:
            raise ConfigError(f"{KEY}.{key}", value, "is not an argument of vLLM's engine (vllm.EngineArgs)",
                              did_you_mean(key, names))
