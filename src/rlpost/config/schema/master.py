"""MasterConfig: the whole composed config, with the cross-field rules in __post_init__."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpost.config.errors import ConfigError, require
from rlpost.config.schema.checkpoint import CheckpointingConfig
from rlpost.config.schema.cluster import ClusterConfig
from rlpost.config.schema.data import DataConfig
from rlpost.config.schema.distillation import DistillationConfig
from rlpost.config.schema.env import EnvConfig, SyntheticEnvConfig
from rlpost.config.schema.eval import EvalConfig
from rlpost.config.schema.generation import GenerationConfig
from rlpost.config.schema.grpo import GRPOConfig
from rlpost.config.schema.logger import GRPOLoggerConfig
from rlpost.config.schema.loss import ClippedPGLossConfig, DistillationLossConfig, LossConfig
from rlpost.config.schema.model import ModelConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.config.schema.ppo import CriticConfig, PPOConfig


@dataclass
class MasterConfig:
    """Top-level keys as NeMo RL's MasterConfig, plus `model` (which local checkpoint to load)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The trained policy, its backend and its rollout engine."""
    loss_fn: LossConfig = field(default_factory=ClippedPGLossConfig)
    """The loss (`loss=token_level|sequence_level|nll`)."""
    env: dict[str, EnvConfig] = field(default_factory=lambda: {"synthetic": SyntheticEnvConfig()})
    """Environments by name; data rows name theirs with data.env_name."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The GRPO algorithm."""
    logger: GRPOLoggerConfig = field(default_factory=GRPOLoggerConfig)
    """Metrics sinks."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Workers and Ray."""
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """Checkpoints and resume."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The local checkpoint (or tiny model spec) behind policy.model_name."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """`rlpost eval`: which weights and prompts, how many samples."""
    ppo: PPOConfig | None = None
    """PPO (`algo=ppo`): GAE advantages from a critic instead of group baselines; None = GRPO."""
    critic: CriticConfig | None = None
    """PPO's value model (`algo=ppo`)."""
    distillation: DistillationConfig | None = None
    """A teacher scoring the policy's tokens (`algo=distillation`, or `distillation=teacher` with GRPO's
    loss_fn.distillation_kl_coef); None = no teacher."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def generation(self) -> GenerationConfig:
        """The rollout engine's config, policy.generation (GRPO always has one)."""
        gen = self.policy.generation
        if gen is None:
            raise ConfigError("policy.generation", None, "algo=grpo needs a rollout engine",
                              "choose it with generation=vllm|hf")
        return gen

    def validate(self) -> None:
        """Every per-block range check, then the rules that span blocks."""
        self.model.check("model")
        self.policy.check("policy")
        self.loss_fn.check("loss_fn")
        for name, env in self.env.items():
            env.check(f"env.{name}")
        self.data.check("data")
        self.grpo.check("grpo")
        self.logger.check("logger")
        self.cluster.check("cluster")
        self.checkpointing.check("checkpointing")
        self.eval.check("eval")
        if self.ppo is not None:
            self.ppo.check("ppo")
        if self.critic is not None:
            self.critic.check("critic")
        if self.distillation is not None:
            self.distillation.check("distillation")
        self._cross_checks()
        self._ppo_checks()
        self._teacher_checks()

    def _cross_checks(self) -> None:
        p, g, gen = self.policy, self.grpo, self.generation
        if self.ppo is None and not isinstance(self.loss_fn, DistillationLossConfig):
            require(g.num_generations_per_prompt >= 2, "grpo.num_generations_per_prompt", g.num_generations_per_prompt,
                    "must be >= 2: the group baseline needs at least two samples per prompt")
        require(
            not p.reward_model_cfg.enabled,
            "policy.reward_model_cfg.enabled",
            True,
            "algo=grpo trains a causal LM; a reward model is trained with algo=rm",
        )
        require(
            self.data.env_name in self.env,
            "data.env_name",
            self.data.env_name,
            f"must name a configured environment: {sorted(self.env)}",
        )
        require(
            self.data.max_input_seq_length <= p.max_total_sequence_length,
            "data.max_input_seq_length",
            self.data.max_input_seq_length,
            f"must be <= policy.max_total_sequence_length ({p.max_total_sequence_length})",
        )
        require(
            gen.max_new_tokens <= p.max_total_sequence_length,
            "policy.generation.max_new_tokens",
            gen.max_new_tokens,
            f"must be <= policy.max_total_sequence_length ({p.max_total_sequence_length})",
        )
        if self.checkpointing.enabled and (self.checkpointing.metric_name or "").startswith("val:"):
            require(
                g.val_period > 0,
                "checkpointing.metric_name",
                self.checkpointing.metric_name,
                "a 'val:' metric needs validation during training (grpo.val_period > 0; val_at_start alone "
                "logs it before the first step only)",
                "use checkpointing.metric_name=train:reward or null",
            )

    def _ppo_checks(self) -> None:
        """PPO needs its critic, on a backend that builds value models, and the synchronous, unoverlapped step."""
        require(not self.policy.value_head, "policy.value_head", True,
                "the policy is a causal LM; the value head is set on the critic's workers by algo=ppo")
        if self.ppo is None:
            require(self.critic is None, "critic", "set", "only algo=ppo trains a critic", "use algo=ppo")
            return
        require(self.critic is not None, "critic", None, "algo=ppo needs a critic (the value model)",
                "keep algo=ppo's critic block, e.g. critic.lr=1e-4")
        self._side_group_checks("critic", "the critic's values are the whole batch's")
        require(self.ppo.kl_in_reward == 0.0 or self.loss_fn_kl() == 0.0, "ppo.kl_in_reward", self.ppo.kl_in_reward,
                "the KL is either in the reward or in the loss, not both",
                "set loss_fn.reference_policy_kl_penalty=0")

    def loss_fn_kl(self) -> float:
        """The loss's KL coefficient (0 for a loss without one)."""
        return float(self.loss_fn.reference_policy_kl_penalty) if isinstance(self.loss_fn, ClippedPGLossConfig) else 0.0

    def _teacher_checks(self) -> None:
        """A teacher is there exactly when the loss reads it, on a backend that serves it, with synchronous steps."""
        coef = self.loss_fn.distillation_kl_coef if isinstance(self.loss_fn, ClippedPGLossConfig) else 0.0
        reads = isinstance(self.loss_fn, DistillationLossConfig) or coef > 0
        if self.distillation is None:
            require(not reads, "loss_fn.distillation_kl_coef" if coef > 0 else "loss_fn._target_",
                    coef if coef > 0 else self.loss_fn._target_, "the KL to a teacher needs a teacher",
                    "add distillation=teacher distillation.teacher.model_path=DIR")
            return
        require(reads, "distillation", "set", "no loss reads the teacher",
                "use algo=distillation, or loss_fn.distillation_kl_coef > 0 with GRPO's loss")
        self._side_group_checks("distillation teacher", "the teacher scores the whole batch before it trains")

    def _side_group_checks(self, group: str, why: str) -> None:
        """A critic or a teacher: built by the policy's backend, on whole-vocabulary logits (tensor parallel size 1),
        with synchronous, unoverlapped steps."""
        p = self.policy
        require(p.serves_value_model, "policy._target_", p._target_, f"this backend builds no {group}",
                "use policy=dtensor, dtensor_v2 or megatron")
        require(p.parallel_sizes()["tp"] == 1, p.tp_key(), p.parallel_sizes()["tp"],
                f"the {group} needs whole-vocabulary logits and heads: tensor parallel size 1")
        require(not self.grpo.async_grpo.enabled, "grpo.async_grpo.enabled", True,
                f"a {group} runs with synchronous steps: {why}")
        require(self.grpo.overlap_generation_and_training is not True, "grpo.overlap_generation_and_training", True,
                f"a {group} needs generation and training apart: {why}")
