"""GRPO algorithm config (`algo=grpo`, placed at `grpo`) and the resumable save state."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlpost.config.errors import positive, require


@dataclass
class AsyncGRPOConfig:
    """Fully asynchronous GRPO (trajectory collector + replay buffer)."""

    enabled: bool = False
    """Turn async GRPO on (not implemented yet in rlpost: must stay false)."""
    max_trajectory_age_steps: int = 1
    """How many policy versions old a trajectory may be (async GRPO only: only the default is accepted)."""
    in_flight_weight_updates: bool = False
    """Swap weights mid-generation (async GRPO only: only the default is accepted)."""
    recompute_kv_cache_after_weight_updates: bool = False
    """Recompute the KV cache after an in-flight update (async GRPO only: only the default is accepted)."""


@dataclass
class RewardShapingConfig:
    """DAPO overlong reward shaping: r += min(-(len - (max_len - buffer)) / buffer * penalty, 0)."""

    enabled: bool = False
    """Turn shaping on."""
    overlong_buffer_length: int = 128
    """Length of the soft-penalty zone before max_response_length."""
    overlong_buffer_penalty: float = 1.0
    """Penalty at max_response_length."""
    max_response_length: int = 512
    """Response length at which the full penalty applies."""


@dataclass
class RewardScalingConfig:
    """Clamp rewards to [source_min, source_max] and map them affinely onto [target_min, target_max]."""

    enabled: bool = False
    """Turn scaling on."""
    source_min: float = 0.0
    """Lower bound of the raw reward."""
    source_max: float = 1.0
    """Upper bound of the raw reward."""
    target_min: float = 0.0
    """Lower bound of the scaled reward."""
    target_max: float = 1.0
    """Upper bound of the scaled reward."""


@dataclass
class GRPOConfig:
    """Group Relative Policy Optimization (NeMo RL GRPOConfig, v0.4 names and defaults)."""

    num_prompts_per_step: int = 32
    """Prompts sampled per step (dataloader batch size)."""
    num_generations_per_prompt: int = 16
    """Group size G: completions per prompt."""
    max_num_epochs: int = 1
    """Stop after this many passes over the training data."""
    max_num_steps: int = 1000000
    """Stop after this many GRPO steps."""
    max_rollout_turns: int = 1
    """Model turns per episode: 1 = single-turn; more lets the environment answer each turn (a tool result, a
    game's next state) until it ends the episode, this many turns pass, or policy.max_total_sequence_length is
    reached (rlpost.algorithms.multi_turn)."""
    normalize_rewards: bool = True
    """Divide advantages by the group std (where std > 0). False = Dr.GRPO."""
    use_leave_one_out_baseline: bool = True
    """Leave-one-out baseline (RLOO) instead of the plain group mean."""
    val_period: int = 10
    """Validate every this many steps and at the run's last step (max_num_steps, the last epoch, or the
    checkpoint_must_save_by stop), so the final checkpoint always has a validation score; 0 = never."""
    val_batch_size: int = 256
    """Prompts per validation batch."""
    val_at_start: bool = False
    """Validate before the first step."""
    max_val_samples: int = 256
    """Most validation prompts per validation."""
    seed: int = 42
    """Seed of python, numpy, torch and the dataloader."""
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)
    """Asynchronous GRPO."""
    overlong_filtering: bool = False
    """Zero the sample_mask of truncated samples (they still count in the baseline)."""
    use_dynamic_sampling: bool = False
    """DAPO dynamic sampling: keep only groups whose rewards vary."""
    dynamic_sampling_max_gen_batches: int = 10
    """Raise after this many generation batches without enough varied groups."""
    batch_multiplier: float = 1.0
    """Dataloader batch = num_prompts_per_step * batch_multiplier under dynamic sampling."""
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    """DAPO overlong shaping."""
    reward_scaling: RewardScalingConfig = field(default_factory=RewardScalingConfig)
    """Reward clamp + affine map."""
    token_mult_prob_error_warn_threshold: float = 1.05
    """Warn when train/token_mult_prob_error exceeds this (trainer and engine disagree)."""
    token_mult_prob_error_abort_threshold: float = 2.0
    """Abort the run when train/token_mult_prob_error exceeds this."""

    def check(self, path: str) -> None:
        for name in (
            "num_prompts_per_step",
            "num_generations_per_prompt",
            "max_num_epochs",
            "max_num_steps",
            "max_rollout_turns",
            "val_batch_size",
            "max_val_samples",
            "dynamic_sampling_max_gen_batches",
        ):
            positive(f"{path}.{name}", getattr(self, name))
        require(
            self.num_generations_per_prompt >= 2,
            f"{path}.num_generations_per_prompt",
            self.num_generations_per_prompt,
            "must be >= 2: the group baseline needs at least two samples per prompt",
        )
        require(self.val_period >= 0, f"{path}.val_period", self.val_period, "must be >= 0")
        require(self.batch_multiplier >= 1.0, f"{path}.batch_multiplier", self.batch_multiplier, "must be >= 1")
        require(
            not self.async_grpo.enabled,
            f"{path}.async_grpo.enabled",
            True,
            "asynchronous GRPO is not implemented in rlpost yet",
            "async rollouts inside the synchronous loop: policy.generation.vllm_cfg.async_engine=true",
        )
        defaults = AsyncGRPOConfig()
        for name in ("max_trajectory_age_steps", "in_flight_weight_updates", "recompute_kv_cache_after_weight_updates"):
            require(
                getattr(self.async_grpo, name) == getattr(defaults, name),
                f"{path}.async_grpo.{name}",
                getattr(self.async_grpo, name),
                "is an option of asynchronous GRPO, which rlpost does not implement (async_grpo.enabled is refused); "
                "it would have no effect",
                f"leave it at {getattr(defaults, name)}",
            )
        rs = self.reward_scaling
        require(rs.source_min < rs.source_max, f"{path}.reward_scaling.source_min", rs.source_min, "must be < source_max")
        sh = self.reward_shaping
        if sh.enabled:
            positive(f"{path}.reward_shaping.overlong_buffer_length", sh.overlong_buffer_length)
            require(
                sh.overlong_buffer_length < sh.max_response_length,
                f"{path}.reward_shaping.overlong_buffer_length",
                sh.overlong_buffer_length,
                f"must be < max_response_length ({sh.max_response_length})",
            )
        require(
            1.0 <= self.token_mult_prob_error_warn_threshold <= self.token_mult_prob_error_abort_threshold,
            f"{path}.token_mult_prob_error_warn_threshold",
            self.token_mult_prob_error_warn_threshold,
            "must satisfy 1 <= warn <= abort threshold",
        )


@dataclass
class GRPOSaveState:
    """What a checkpoint records of the loop's progress (training_info.json)."""

    consumed_samples: int = 0
    """Prompts consumed so far."""
    current_step: int = 0
    """Step within the current epoch."""
    current_epoch: int = 0
    """Epoch index."""
    total_steps: int = 0
    """GRPO steps done in all."""
    total_valid_tokens: int = 0
    """Valid training tokens seen in all."""
    val_reward: float = -99999999.0
    """Last validation accuracy."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Checkpoint metric values (e.g. 'val:accuracy') written at save time."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GRPOSaveState:
        """Tolerates missing and extra keys (extra keys go to `extra`)."""
        known = {k for k in cls.__dataclass_fields__ if k != "extra"}
        return cls(**{k: v for k, v in d.items() if k in known}, extra={k: v for k, v in d.items() if k not in known})


def _default_grpo_save_state() -> GRPOSaveState:
    return GRPOSaveState()


