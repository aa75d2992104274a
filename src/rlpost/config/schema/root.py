"""RootConfig: what Hydra composes (every algorithm's block optional), and `narrow`, which turns it into the
chosen algorithm's typed master config: MasterConfig for a rollout algorithm, SFT / DPO / RM's
SupervisedMasterConfig.

`algo=<name>` (conf/algo/) sets `algo` and fills that algorithm's blocks (rlpost.config.algorithms), and
chooses the groups it reads: a rollout algorithm brings the engine (policy.generation), the environments (env),
its loss and prompt data; the others bring their loss and data only. A key of a block the chosen algorithm does not
read cannot be set: Hydra has no such key to override, and a block filled by other means is refused here, naming
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpost.config.algorithms import ADDONS, algorithm, all_blocks, readers
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
from rlpost.config.schema.supervised_master import SupervisedMasterConfig


@dataclass
class RootConfig:
    """The composed config, before `narrow` picks the algorithm's master config (no checks of its own)."""

    algo: str = "grpo"
    """The algorithm (rlpost.config.algorithms), set by the `algo=` option."""
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
    """The chosen algorithm's validated master config (ConfigError naming a block it does not read, or lacks)."""
    algo = algorithm(root.algo)
    reads = set(algo.blocks) | (set(ADDONS) if algo.rollout else set())
    for name in all_blocks():
        if name not in reads and getattr(root, name) is not None:
            raise ConfigError(name, "set", f"algo={algo.name} does not read this block",
                              f"it belongs to algo={readers(name)[0]}")
    for name in algo.blocks:
        if getattr(root, name) is None:
            raise ConfigError(name, None, f"algo={algo.name} needs this block", f"keep algo={algo.name}'s defaults")
    root.policy.resolve_batching(algo.token_batches)
    if algo.rollout:
        if not isinstance(root.data, DataConfig):
            raise ConfigError("data", type(root.data).__name__, f"algo={algo.name} reads prompts with answers",
                              "use a GRPO data option, e.g. data=synthetic|arith|math_jsonl")
        if root.policy.generation is None:
            raise ConfigError("policy.generation", None, f"algo={algo.name} needs a rollout engine",
                              "choose it with generation=vllm|hf")
        blocks = {name: getattr(root, name) for name in reads}  # the grpo block and the algorithm's (checked above)
        return MasterConfig(algo=algo.name, policy=root.policy, loss_fn=root.loss_fn, env=root.env, data=root.data,
                            logger=root.logger, cluster=root.cluster, checkpointing=root.checkpointing,
                            model=root.model, eval=root.eval or EvalConfig(), **blocks)
    for key, present in (("policy.generation", root.policy.generation is not None), ("env", bool(root.env)),
                         ("eval", root.eval is not None)):
        if present:
            raise ConfigError(key, "set", f"algo={algo.name} does not generate: only rollout algorithms read this "
                              "block", f"it belongs to algo={readers(key)[0]}")
    assert algo.master is not None and issubclass(algo.master, SupervisedMasterConfig)
    return algo.master(policy=root.policy, loss_fn=root.loss_fn, data=root.data, logger=root.logger,
                       cluster=root.cluster, checkpointing=root.checkpointing, model=root.model,
                       **{name: getattr(root, name) for name in algo.blocks})
