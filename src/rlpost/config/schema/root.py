"""RootConfig: what Hydra composes (every algorithm's block optional), and `narrow`, which turns it into the
chosen algorithm's typed master config: GRPO's MasterConfig, or SFT / DPO / RM's SupervisedMasterConfig.

`algo=grpo|sft|dpo|rm` (conf/algo/) fills exactly one of grpo / sft / dpo / rm, and chooses the groups that
algorithm reads: GRPO brings the engine (policy.generation), the environments (env), its loss and prompt data;
the others bring their loss and data only. A key of a block the chosen algorithm does not read cannot be set:
Hydra has no such key to override, and a block filled by other means is refused here, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpost.config.errors import ConfigError
from rlpost.config.schema.checkpoint import CheckpointingConfig
from rlpost.config.schema.cluster import ClusterConfig
from rlpost.config.schema.data import DataConfig, DatasetConfig
from rlpost.config.schema.distillation import DistillationConfig
from rlpost.config.schema.env import EnvConfig
from rlpost.config.schema.eval import EvalConfig
from rlpost.config.schema.grpo import GRPOConfig
from rlpost.config.schema.logger import GRPOLoggerConfig
from rlpost.config.schema.loss import LossConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.model import ModelConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.config.schema.ppo import CriticConfig, PPOConfig
from rlpost.config.schema.supervised import DPOConfig, RMConfig, SFTConfig
from rlpost.config.schema.supervised_master import MASTER_CONFIGS, SupervisedMasterConfig

ALGORITHMS = ("grpo", "sft", "dpo", "rm")
"""The `algo` options, each the name of the block it fills."""


@dataclass
class RootConfig:
    """The composed config, before `narrow` picks the algorithm's master config (no checks of its own)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The trained policy and its backend (and, for GRPO, its rollout engine)."""
    loss_fn: LossConfig = field(default_factory=LossConfig)
    """The loss (chosen by the algo option; `loss=...` swaps GRPO's)."""
    env: dict[str, EnvConfig] = field(default_factory=dict)
    """GRPO's environments by name."""
    data: DatasetConfig = field(default_factory=DatasetConfig)
    """Prompts (GRPO) or training rows (SFT, DPO, RM)."""
    grpo: GRPOConfig | None = None
    """GRPO (`algo=grpo`)."""
    sft: SFTConfig | None = None
    """Supervised fine-tuning (`algo=sft`)."""
    dpo: DPOConfig | None = None
    """Direct preference optimisation (`algo=dpo`)."""
    rm: RMConfig | None = None
    """Reward-model training (`algo=rm`)."""
    ppo: PPOConfig | None = None
    """PPO's additions to GRPO's blocks (`algo=ppo`)."""
    critic: CriticConfig | None = None
    """PPO's value model (`algo=ppo`)."""
    distillation: DistillationConfig | None = None
    """A distillation teacher (`algo=distillation`, or `distillation=teacher` with GRPO)."""
    logger: GRPOLoggerConfig = field(default_factory=GRPOLoggerConfig)
    """Metrics sinks."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Workers and Ray."""
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """Checkpoints and resume."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The local checkpoint (or tiny model spec) behind policy.model_name."""
    eval: EvalConfig | None = None
    """`rlpost eval` (GRPO's engine and environments score a model)."""


def narrow(root: RootConfig) -> MasterConfig | SupervisedMasterConfig:
    """The chosen algorithm's validated master config (ConfigError if no or several algorithm blocks are set)."""
    chosen = [name for name in ALGORITHMS if getattr(root, name) is not None]
    if len(chosen) != 1:
        raise ConfigError("algo", chosen or None, "exactly one algorithm block must be set",
                          f"choose it with algo={'|'.join(ALGORITHMS)}")
    algo = chosen[0]
    if algo == "grpo":
        assert root.grpo is not None
        if not isinstance(root.data, DataConfig):
            raise ConfigError("data", type(root.data).__name__, "algo=grpo reads prompts with answers",
                              "use a GRPO data option, e.g. data=synthetic|arith|math_jsonl")
        if root.policy.generation is None:
            raise ConfigError("policy.generation", None, "algo=grpo needs a rollout engine",
                              "choose it with generation=vllm|hf")
        return MasterConfig(policy=root.policy, loss_fn=root.loss_fn, env=root.env, data=root.data, grpo=root.grpo,
                            logger=root.logger, cluster=root.cluster, checkpointing=root.checkpointing,
                            model=root.model, eval=root.eval or EvalConfig(), ppo=root.ppo, critic=root.critic,
                            distillation=root.distillation)
    for key, present in (("policy.generation", root.policy.generation is not None), ("env", bool(root.env)),
                         ("eval", root.eval is not None), ("ppo", root.ppo is not None),
                         ("critic", root.critic is not None), ("distillation", root.distillation is not None)):
        if present:
            raise ConfigError(key, "set", f"algo={algo} does not generate: only algo=grpo reads this block")
    return MASTER_CONFIGS[algo](policy=root.policy, loss_fn=root.loss_fn, data=root.data,
                                logger=root.logger, cluster=root.cluster, checkpointing=root.checkpointing,
                                model=root.model, **{algo: getattr(root, algo)})
