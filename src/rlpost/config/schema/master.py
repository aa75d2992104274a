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
from rlpost.config.schema.metric_names import grpo_metrics
from rlpost.config.schema.model import ModelConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.config.schema.ppo import CriticConfig, PPOConfig


@dataclass
class MasterConfig:
    """Top-level keys as NeMo RL's MasterConfig, plus `model` (which local checkpoint to load) and `algo`."""

    algo: str = "grpo"
    """The rollout algorithm (`algo=grpo|ppo|distillation|...`: rlpost.config.algorithms), which reads the
    grpo block and its own."""
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
        from rlpost.config.algorithms import all_blocks, check_rollout

        for name in all_blocks():  # the chosen algorithm's blocks and add-ons (narrow refused every other)
            block = getattr(self, name, None)
            if block is not None and name != "grpo":
                block.check(name)
        self._cross_checks()
        self._async_checks()
        require(not self.policy.value_head, "policy.value_head", True,
                "the policy is a causal LM; the value head is set on a critic's workers by algo=ppo")
        check_rollout(self)
        self.checkpointing.check_metric("checkpointing", grpo_metrics(
            self.loss_fn._target_, self.grpo.val_period > 0, self.grpo.use_dynamic_sampling))

    def _async_checks(self) -> None:
        """Async GRPO trains on trajectories of older weights while the engine keeps generating: it needs its own
        engine slots and importance-sampling correction."""
        if not self.grpo.async_grpo.enabled:
            return
        require(not self.generation.colocated.enabled, "grpo.async_grpo.enabled", True,
                "async GRPO needs the engine on its own workers",
                "policy.generation.colocated.enabled=false with colocated.resources for the engine "
                "(e.g. cluster.gpus_per_node=2 policy.generation.colocated.resources.gpus_per_node=1)")
        loss = self.loss_fn
        correction = getattr(loss, "use_importance_sampling_correction", None)
        require(isinstance(loss, ClippedPGLossConfig) and bool(correction),
                "loss_fn.use_importance_sampling_correction", correction,
                "async GRPO trains on trajectories of older weights: importance-sampling correction must be on",
                "loss_fn.use_importance_sampling_correction=true")
        require(not self.grpo.use_dynamic_sampling, "grpo.use_dynamic_sampling", True,
                "is not supported with async GRPO (as in NeMo RL)")
        require(not self.grpo.async_grpo.in_flight_weight_updates or self.generation.async_rollouts(),
                "grpo.async_grpo.in_flight_weight_updates", True,
                "needs vLLM's async engine (it freezes requests in flight while the weights change)",
                "generation=vllm policy.generation.vllm_cfg.async_engine=true")

    def _cross_checks(self) -> None:
        p, g, gen = self.policy, self.grpo, self.generation
        require(isinstance(self.loss_fn, ClippedPGLossConfig | DistillationLossConfig), "loss_fn._target_",
                self.loss_fn._target_, f"algo={self.algo} trains on its rollouts with a policy-gradient or "
                "distillation loss; this one trains on rows (algo=sft|dpo|rm)",
                "loss=token_level|sequence_level|gspo|cispo, or loss=distillation with algo=distillation")
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
        require(gen.model_name in (None, p.model_name), "policy.generation.model_name", gen.model_name,
                f"must be unset or policy.model_name ({p.model_name}): the engine serves the policy's weights, "
                "refitted from the trainer each step")
        scorer = self.env.get(self.data.env_name)
        if self.data.dataset_name == "synthetic" and isinstance(scorer, SyntheticEnvConfig):
            require(scorer.task == self.data.synthetic.task, f"env.{self.data.env_name}.task", scorer.task,
                    f"must be the task the prompts are generated for (data.synthetic.task={self.data.synthetic.task}):"
                    " the verifier would score one task's answers against another's",
                    f"leave env.{self.data.env_name}.task unset (it follows data.synthetic.task)")
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
