"""The master configs of SFT, DPO and reward-model training (NeMo RL's sft.py / dpo.py / rm.py MasterConfigs):
policy, loss, data, loop, logger, cluster, checkpointing, model; no engine, no environments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlpost.config.errors import ConfigError, require
from rlpost.config.schema.checkpoint import CheckpointingConfig
from rlpost.config.schema.cluster import ClusterConfig
from rlpost.config.schema.data import DatasetConfig
from rlpost.config.schema.logger import GRPOLoggerConfig
from rlpost.config.schema.loss import DPOLossConfig, LossConfig, NLLLossConfig, PreferenceLossConfig
from rlpost.config.schema.megatron import check_expert_parallel
from rlpost.config.schema.metric_names import supervised_metrics
from rlpost.config.schema.model import ModelConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.config.schema.supervised import (
    DPOConfig,
    PreferenceDataConfig,
    RMConfig,
    SFTConfig,
    SFTDataConfig,
    SupervisedDataConfig,
    SupervisedLoopConfig,
)


@dataclass
class SupervisedMasterConfig:
    """What SFT, DPO and RM training share; a subclass adds its loop block (sft / dpo / rm)."""

    algo: ClassVar[str] = ""
    """The algo option (and the name of the loop block)."""
    loss_class: ClassVar[type[LossConfig]] = LossConfig
    """The loss config this algorithm trains with."""
    data_class: ClassVar[type[DatasetConfig]] = DatasetConfig
    """The data config this algorithm reads."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The trained model and its backend."""
    loss_fn: LossConfig = field(default_factory=LossConfig)
    """The algorithm's loss."""
    data: DatasetConfig = field(default_factory=DatasetConfig)
    """Training and validation rows."""
    logger: GRPOLoggerConfig = field(default_factory=GRPOLoggerConfig)
    """Metrics sinks."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Workers and Ray."""
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """Checkpoints and resume."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The local checkpoint (or tiny model spec) behind policy.model_name."""

    @property
    def loop(self) -> SupervisedLoopConfig:
        loop = getattr(self, self.algo)
        assert isinstance(loop, SupervisedLoopConfig)
        return loop

    @property
    def rows(self) -> SupervisedDataConfig:
        """The data block, typed (validate() checked its class)."""
        assert isinstance(self.data, SupervisedDataConfig)
        return self.data

    @property
    def pairs(self) -> bool:
        """Rows are (chosen, rejected) pairs trained side by side."""
        return self.algo in ("dpo", "rm")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        a = self.algo
        self.model.check("model")
        self.policy.check("policy")
        if not isinstance(self.loss_fn, self.loss_class):
            raise ConfigError("loss_fn._target_", self.loss_fn._target_, f"algo={a} trains with {self.loss_class.__name__}",
                              f"leave the loss to algo={a}")
        self.loss_fn.check("loss_fn")
        if not isinstance(self.data, self.data_class):
            raise ConfigError("data", type(self.data).__name__, f"algo={a} reads {self.data_class.__name__} rows",
                              "use data=sft_synthetic|sft_jsonl" if a == "sft"
                              else "use data=preference_synthetic|preference_jsonl")
        self.data.check("data")
        self.loop.check(a)
        d = self.rows
        if d.dataset_name != "synthetic" and not d.val_data_paths and (self.loop.val_period or self.loop.val_at_start):
            raise ConfigError("data.val_data_paths", [], f"{a}.val_period={self.loop.val_period} validates, but there "
                              "are no validation rows", "set data.val_data_paths=[...], or leave validation to the "
                              f"defaults (off without validation rows): drop {a}.val_period / {a}.val_at_start / a "
                              "'val:' checkpointing.metric_name from the command")
        self.logger.check("logger")
        require(self.logger.num_val_samples_to_print == 0, "logger.num_val_samples_to_print",
                self.logger.num_val_samples_to_print, f"algo={a} generates no samples to print (GRPO only)")
        self.cluster.check("cluster")
        self.checkpointing.check("checkpointing")
        rm = self.policy.reward_model_cfg.enabled
        require(rm == (a == "rm"), "policy.reward_model_cfg.enabled", rm,
                "algo=rm trains a reward model (true); the other algorithms train causal LMs (false)")
        if rm:
            require(self.policy.serves_reward_model, "policy._target_", self.policy._target_,
                    "this backend trains causal LMs only; a reward model (sequence classifier) needs a DTensor "
                    "worker", "use policy=dtensor or policy=dtensor_v2")
        if self.pairs:
            self._check_pairs()
        self._check_batches()
        if rm:
            require(self._model_parallel() == 1, self.policy.tp_key(), self.policy.parallel_sizes()["tp"],
                    "a reward model trains without model parallelism here (the TP plans cover causal-LM heads)")
        ck = self.checkpointing
        if ck.enabled and (ck.metric_name or "").startswith("val:"):
            require(self.loop.val_period > 0, "checkpointing.metric_name", ck.metric_name,
                    f"a 'val:' metric needs validation during training ({a}.val_period > 0)",
                    "use checkpointing.metric_name=train:loss or null")
        ck.check_metric("checkpointing", supervised_metrics(self.loss_fn._target_, self.loop.val_period > 0))

    def _check_pairs(self) -> None:
        """A pair's two rows must share a micro-batch: even batch sizes, no packing or dynamic batching."""
        p, a = self.policy, self.algo
        for key in ("sequence_packing", "dynamic_batching"):
            require(not getattr(p, key).enabled, f"policy.{key}.enabled", True,
                    f"algo={a} keeps each (chosen, rejected) pair in one micro-batch; {key.replace('_', ' ')} "
                    "would split pairs")
        require(p.train_micro_batch_size % 2 == 0, "policy.train_micro_batch_size", p.train_micro_batch_size,
                f"algo={a} counts rows, two per pair: must be even")

    @property
    def dp(self) -> int:
        """Data-parallel ranks: every worker trains (world / (TP x PP x CP))."""
        return max(self.cluster.num_nodes * self.cluster.gpus_per_node // self._model_parallel(), 1)

    def _model_parallel(self) -> int:
        sizes = self.policy.parallel_sizes()
        return sizes["tp"] * sizes["pp"] * sizes["cp"]

    def _check_batches(self) -> None:
        """Each data-parallel rank gets whole rows (whole pairs for DPO / RM) of every batch."""
        world, mp = self.cluster.num_nodes * self.cluster.gpus_per_node, self._model_parallel()
        require(world % mp == 0, "cluster.gpus_per_node", self.cluster.gpus_per_node,
                f"{world} workers do not split into model-parallel groups of {mp} (TP x PP x CP)")
        check_expert_parallel(self.policy.parallel_sizes(), self.dp, world)
        unit = self.dp * (2 if self.pairs else 1)
        for key, value in (("policy.train_global_batch_size", self.policy.train_global_batch_size),
                           (f"{self.algo}.val_global_batch_size", self.loop.val_global_batch_size)):
            require(value % unit == 0, key, value,
                    f"must be a multiple of {unit} ({self.dp} data-parallel ranks"
                    + (" x 2 rows per pair)" if self.pairs else ")"))


@dataclass
class SFTMasterConfig(SupervisedMasterConfig):
    """`algo=sft`."""

    algo: ClassVar[str] = "sft"
    """The algo option."""
    loss_class: ClassVar[type[LossConfig]] = NLLLossConfig
    """Its loss."""
    data_class: ClassVar[type[DatasetConfig]] = SFTDataConfig
    """Its rows."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The SFT loop."""


@dataclass
class DPOMasterConfig(SupervisedMasterConfig):
    """`algo=dpo`."""

    algo: ClassVar[str] = "dpo"
    """The algo option."""
    loss_class: ClassVar[type[LossConfig]] = DPOLossConfig
    """Its loss."""
    data_class: ClassVar[type[DatasetConfig]] = PreferenceDataConfig
    """Its rows."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """The DPO loop."""


@dataclass
class RMMasterConfig(SupervisedMasterConfig):
    """`algo=rm`."""

    algo: ClassVar[str] = "rm"
    """The algo option."""
    loss_class: ClassVar[type[LossConfig]] = PreferenceLossConfig
    """Its loss."""
    data_class: ClassVar[type[DatasetConfig]] = PreferenceDataConfig
    """Its rows."""
    rm: RMConfig = field(default_factory=RMConfig)
    """The reward-model loop."""

