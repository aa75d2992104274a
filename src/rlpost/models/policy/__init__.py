"""Policy configs at NeMo RL's path (`nemo_rl.models.policy`), as typed dataclasses."""

from rlpost.config.schema.megatron import (
    MegatronConfig,
    MegatronDDPConfig,
    MegatronOptimizerConfig,
    MegatronSchedulerConfig,
)
from rlpost.config.schema.policy import (
    DTensorConfig,
    DynamicBatchingConfig,
    PolicyConfig,
    PytorchOptimizerConfig,
    RewardModelConfig,
    SchedulerMilestones,
    SequencePackingConfig,
    SinglePytorchSchedulerConfig,
    TokenizerConfig,
)

__all__ = [
    "DTensorConfig",
    "DynamicBatchingConfig",
    "MegatronConfig",
    "MegatronDDPConfig",
    "MegatronOptimizerConfig",
    "MegatronSchedulerConfig",
    "PolicyConfig",
    "PytorchOptimizerConfig",
    "RewardModelConfig",
    "SchedulerMilestones",
    "SequencePackingConfig",
    "SinglePytorchSchedulerConfig",
    "TokenizerConfig",
]
