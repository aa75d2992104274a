"""Policy configs (`policy=dtensor|dtensor_v2|megatron`): names and defaults as NeMo RL's
`nemo_rl.models.policy`. The worker backend is the option's `_target_`; exactly one of
`dtensor_cfg` / `megatron_cfg` is set, matching it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlpost.config.errors import ConfigError, one_of, positive, require, safe_env_vars
from rlpost.config.schema.generation import GenerationConfig, VllmConfig
from rlpost.config.schema.megatron import MegatronConfig

PRECISIONS = ("float32", "bfloat16", "float16")
PACKING_ALGORITHMS = (
    "concatenative",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "modified_first_fit_decreasing",
)


@dataclass
class TokenizerConfig:
    """Tokenizer of the policy."""

    name: str = "${policy.model_name}"
    """Local path of the tokenizer (default: the model's)."""
    chat_template: str | None = "default"
    """None: plain passthrough; 'default': the tokenizer's own; a *.jinja path; or a literal template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra arguments bound into apply_chat_template (e.g. enable_thinking)."""


@dataclass
class PytorchOptimizerConfig:
    """A torch optimizer by import path (DTensor workers)."""

    name: str = "torch.optim.AdamW"
    """Import path of the optimizer class; must pass the _target_ allow-list."""
    kwargs: dict[str, Any] = field(
        default_factory=lambda: {
            "lr": 5.0e-6,
            "weight_decay": 0.01,
            "betas": [0.9, 0.999],
            "eps": 1.0e-8,
            "foreach": False,
            "fused": False,
        }
    )
    """Constructor keyword arguments (lr, weight_decay, betas, eps, ...)."""


@dataclass
class SinglePytorchSchedulerConfig:
    """One torch LR scheduler by import path; an entry of `policy.scheduler`."""

    name: str = "torch.optim.lr_scheduler.ConstantLR"
    """Import path of the scheduler class."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments."""


@dataclass
class SchedulerMilestones:
    """The milestones entry of `policy.scheduler`: several schedulers are chained with SequentialLR."""

    milestones: list[int] = field(default_factory=list)
    """Steps at which the next scheduler takes over."""


def parse_scheduler(path: str, entries: list[dict[str, Any]]) -> list[Any]:
    """Turn the YAML list of `policy.scheduler` into typed entries and check its shape."""
    out: list[Any] = []
    for i, e in enumerate(entries):
        key = f"{path}[{i}]"
        require(isinstance(e, dict), key, e, "each scheduler entry is a mapping")
        if "milestones" in e:
            require(set(e) == {"milestones"}, key, e, "a milestones entry has only 'milestones'")
            out.append(SchedulerMilestones(milestones=[int(m) for m in e["milestones"]]))
        else:
            extra = set(e) - {"name", "kwargs"}
            require(not extra, key, e, f"unknown keys {sorted(extra)}; a scheduler entry has 'name' and 'kwargs'")
            require("name" in e, key, e, "a scheduler entry needs 'name' (import path)")
            out.append(SinglePytorchSchedulerConfig(name=e["name"], kwargs=dict(e.get("kwargs") or {})))
    scheds = [e for e in out if isinstance(e, SinglePytorchSchedulerConfig)]
    miles = [e for e in out if isinstance(e, SchedulerMilestones)]
    require(len(miles) <= 1, path, entries, "at most one milestones entry")
    if len(scheds) > 1:
        require(len(miles) == 1, path, entries, "several schedulers need one milestones entry (SequentialLR)")
        require(
            len(miles[0].milestones) == len(scheds) - 1,
            path,
            entries,
            f"{len(scheds)} schedulers need {len(scheds) - 1} milestones",
        )
    return out


@dataclass
class DTensorConfig:
    """FSDP2 + DTensor tensor-parallel worker knobs."""

    env_vars: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for each worker process."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy for params, grads and optimizer state (GPU only)."""
    sequence_parallel: bool = False
    """Shard norm activations over the TP group (requires tensor_parallel_size > 1)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward."""
    tensor_parallel_size: int = 1
    """Tensor-parallel size."""
    context_parallel_size: int = 1
    """Context-parallel size (not with sequence packing)."""
    custom_parallel_plan: str | None = None
    """Import path of a TP plan (dict or callable) replacing the built-in per-architecture plan."""
    clear_cache_every_n_steps: int | None = None
    """Empty the CUDA allocator cache every N training micro-batches (GPU only); None = never."""

    def check(self, path: str) -> None:
        safe_env_vars(f"{path}.env_vars", self.env_vars)
        positive(f"{path}.clear_cache_every_n_steps", self.clear_cache_every_n_steps, allow_none=True)
        positive(f"{path}.tensor_parallel_size", self.tensor_parallel_size)
        positive(f"{path}.context_parallel_size", self.context_parallel_size)
        require(
            not self.sequence_parallel or self.tensor_parallel_size > 1,
            f"{path}.sequence_parallel",
            self.sequence_parallel,
            "sequence parallelism needs tensor_parallel_size > 1",
        )
        require(
            not self.sequence_parallel,
            f"{path}.sequence_parallel",
            self.sequence_parallel,
            "sequence parallelism is not implemented for the DTensor workers yet",
        )
        require(
            self.context_parallel_size == 1,
            f"{path}.context_parallel_size",
            self.context_parallel_size,
            "context parallelism is not implemented for the DTensor workers yet",
        )


@dataclass
class SequencePackingConfig:
    """Pack several sequences into one micro-batch row (no attention across boundaries)."""

    enabled: bool = False
    """Turn packing on."""
    train_mb_tokens: int = 2048
    """Token budget of one packed training micro-batch."""
    logprob_mb_tokens: int = 2048
    """Token budget of one packed logprob micro-batch."""
    algorithm: str = "modified_first_fit_decreasing"
    """Bin-packing algorithm."""
    sequence_length_round: int = 64
    """Pad each packed row to a multiple of this."""

    def check(self, path: str) -> None:
        if self.enabled:
            positive(f"{path}.train_mb_tokens", self.train_mb_tokens)
            positive(f"{path}.logprob_mb_tokens", self.logprob_mb_tokens)
            one_of(f"{path}.algorithm", self.algorithm, PACKING_ALGORITHMS)
            positive(f"{path}.sequence_length_round", self.sequence_length_round)


@dataclass
class DynamicBatchingConfig:
    """Sort by length and bucket micro-batches to a token budget."""

    enabled: bool = False
    """Turn dynamic batching on."""
    train_mb_tokens: int = 2048
    """Token budget of one training micro-batch."""
    logprob_mb_tokens: int = 2048
    """Token budget of one logprob micro-batch."""
    sequence_length_round: int = 64
    """Each micro-batch is trimmed to its longest sequence rounded up to this."""

    def check(self, path: str) -> None:
        if self.enabled:
            positive(f"{path}.train_mb_tokens", self.train_mb_tokens)
            positive(f"{path}.logprob_mb_tokens", self.logprob_mb_tokens)
            positive(f"{path}.sequence_length_round", self.sequence_length_round)


@dataclass
class RewardModelConfig:
    """Use the policy worker as a reward model instead of a causal LM."""

    enabled: bool = False
    """Turn the reward-model mode on (not implemented by rlpost's policy workers: must stay false)."""
    reward_model_type: str = "bradley_terry"
    """Only 'bradley_terry' (sequence classification, one label)."""

    def check(self, path: str) -> None:
        one_of(f"{path}.reward_model_type", self.reward_model_type, ("bradley_terry",))
        require(
            not self.enabled,
            f"{path}.enabled",
            self.enabled,
            "reward-model training is not implemented by rlpost's policy workers (they train causal LMs)",
            "rewards come from the environments (env=...)",
        )


@dataclass
class PolicyConfig:
    """The trained policy: model, batch sizes, backend, optimizer and its rollout engine."""

    _target_: str = "rlpost.models.policy.dtensor_policy_worker.DTensorPolicyWorker"
    """Worker class of the training backend, built by rlpost.runtime.build."""
    model_name: str = "${model.path}"
    """Local HF checkpoint directory (default: the `model` group's)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer."""
    train_global_batch_size: int = 32
    """Samples per optimizer step, over all data-parallel ranks."""
    train_micro_batch_size: int = 4
    """Samples per forward/backward micro-batch on one data-parallel rank."""
    logprob_batch_size: int = 4
    """Samples per micro-batch of the logprob (previous / reference) passes."""
    logprob_chunk_size: int | None = None
    """Compute logprobs in chunks of this many positions (bounds fp32 logit memory)."""
    generation: GenerationConfig = field(default_factory=VllmConfig)
    """Rollout engine (`generation=vllm|hf`)."""
    generation_batch_size: int = 32
    """Prompts per `generate` call of the HF engine (generation=hf fills policy.generation.generation_batch_size
    from it); vLLM schedules whole batches itself, so with generation=vllm only the default is accepted."""
    precision: str = "float32"
    """Compute dtype: 'float32', 'bfloat16' or 'float16' (master weights stay fp32)."""
    reward_model_cfg: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward-model mode."""
    dtensor_cfg: DTensorConfig | None = None
    """DTensor backend knobs (set by policy=dtensor and policy=dtensor_v2)."""
    megatron_cfg: MegatronConfig | None = None
    """Megatron backend knobs (set by policy=megatron)."""
    hf_config_overrides: dict[str, Any] = field(default_factory=dict)
    """Applied to the HF AutoConfig (and mirrored into vLLM's hf_overrides)."""
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    """Dynamic batching (exclusive with sequence packing)."""
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    """Sequence packing (exclusive with dynamic batching)."""
    make_sequence_length_divisible_by: int = 1
    """Pad sequence length to a multiple of this (TP / SP requirement)."""
    max_total_sequence_length: int = 512
    """Prompt + response cap; also vLLM's max_model_len by default."""
    max_grad_norm: float | None = 1.0
    """Gradient-norm clip (DTensor); None = no clipping."""
    refit_buffer_size_gb: float | None = None
    """Size of the refit transfer buffer; None = automatic."""
    optimizer: PytorchOptimizerConfig | None = field(default_factory=PytorchOptimizerConfig)
    """Torch optimizer (DTensor backends; Megatron uses megatron_cfg.optimizer)."""
    scheduler: list[dict[str, Any]] = field(default_factory=list)
    """Torch LR schedulers: a list of {name, kwargs} plus one {milestones} entry; empty = constant lr."""
    trust_remote_code: bool = False
    """Allow HF checkpoints to run their own Python code. Off: loading never executes model code."""
    offload_optimizer_for_logprob: bool = False
    """Move the optimizer state to the CPU during logprob passes (GPU only)."""

    def check(self, path: str) -> None:
        require(bool(self.model_name), f"{path}.model_name", self.model_name, "must name a local model directory")
        positive(f"{path}.train_global_batch_size", self.train_global_batch_size)
        positive(f"{path}.train_micro_batch_size", self.train_micro_batch_size)
        positive(f"{path}.logprob_batch_size", self.logprob_batch_size)
        positive(f"{path}.logprob_chunk_size", self.logprob_chunk_size, allow_none=True)
        positive(f"{path}.generation_batch_size", self.generation_batch_size)
        positive(f"{path}.make_sequence_length_divisible_by", self.make_sequence_length_divisible_by)
        positive(f"{path}.max_total_sequence_length", self.max_total_sequence_length)
        positive(f"{path}.max_grad_norm", self.max_grad_norm, allow_none=True)
        one_of(f"{path}.precision", self.precision, PRECISIONS)
        require(
            self.train_micro_batch_size <= self.train_global_batch_size,
            f"{path}.train_micro_batch_size",
            self.train_micro_batch_size,
            f"must be <= train_global_batch_size ({self.train_global_batch_size})",
        )
        self._check_backend(path)
        self.generation.check(f"{path}.generation")
        self.reward_model_cfg.check(f"{path}.reward_model_cfg")
        self._check_generation_batch_size(path)
        self.dynamic_batching.check(f"{path}.dynamic_batching")
        self.sequence_packing.check(f"{path}.sequence_packing")
        require(
            not (self.dynamic_batching.enabled and self.sequence_packing.enabled),
            f"{path}.sequence_packing.enabled",
            True,
            "sequence packing and dynamic batching are mutually exclusive",
        )
        parse_scheduler(f"{path}.scheduler", self.scheduler)
        if self.optimizer is not None:
            require(
                isinstance(self.optimizer.kwargs.get("lr", 1.0), (int, float)) and self.optimizer.kwargs.get("lr", 1.0) > 0,
                f"{path}.optimizer.kwargs.lr",
                self.optimizer.kwargs.get("lr"),
                "must be a number > 0",
            )

    def _check_generation_batch_size(self, path: str) -> None:
        """The policy-level batch is the HF engine's; no other engine reads it."""
        key = f"{path}.generation_batch_size"
        engine_batch = getattr(self.generation, "generation_batch_size", None)
        if engine_batch is None:
            require(
                self.generation_batch_size == PolicyConfig.generation_batch_size,
                key,
                self.generation_batch_size,
                f"only the HF engine batches prompts; {type(self.generation).__name__} schedules whole batches "
                "itself, so this would have no effect",
                f"leave it at {PolicyConfig.generation_batch_size}, or use generation=hf",
            )
        else:
            require(
                self.generation_batch_size == engine_batch,
                key,
                self.generation_batch_size,
                f"differs from {path}.generation.generation_batch_size ({engine_batch}), which the HF engine uses",
                "set one of them (the engine's defaults to this one)",
            )

    def _check_backend(self, path: str) -> None:
        is_megatron = "megatron" in self._target_.lower()
        if is_megatron:
            require(
                self.megatron_cfg is not None,
                f"{path}.megatron_cfg",
                None,
                "the Megatron worker needs megatron_cfg",
                "choose the backend with policy=megatron",
            )
            require(
                self.dtensor_cfg is None,
                f"{path}.dtensor_cfg",
                "<set>",
                "a Megatron policy takes no dtensor_cfg",
                "choose the backend with policy=..., not by setting both blocks",
            )
            assert self.megatron_cfg is not None
            self.megatron_cfg.check(f"{path}.megatron_cfg")
            if self.dynamic_batching.enabled:
                require(
                    self.megatron_cfg.pipeline_model_parallel_size == 1,
                    f"{path}.dynamic_batching.enabled",
                    True,
                    "dynamic batching requires pipeline_model_parallel_size=1",
                )
            if self.megatron_cfg.context_parallel_size > 1:
                require(
                    self.sequence_packing.enabled,
                    f"{path}.megatron_cfg.context_parallel_size",
                    self.megatron_cfg.context_parallel_size,
                    "Megatron context parallelism requires sequence packing",
                )
        else:
            if self.dtensor_cfg is None:
                raise ConfigError(
                    f"{path}.dtensor_cfg",
                    None,
                    "the DTensor worker needs dtensor_cfg",
                    "choose the backend with policy=dtensor",
                )
            require(
                self.megatron_cfg is None,
                f"{path}.megatron_cfg",
                "<set>",
                "a DTensor policy takes no megatron_cfg",
                "choose the backend with policy=..., not by setting both blocks",
            )
            self.dtensor_cfg.check(f"{path}.dtensor_cfg")
            if self.dtensor_cfg.context_parallel_size > 1:
                require(
                    not self.sequence_packing.enabled,
                    f"{path}.dtensor_cfg.context_parallel_size",
                    self.dtensor_cfg.context_parallel_size,
                    "DTensor context parallelism does not work with sequence packing",
                )

    def parallel_sizes(self) -> dict[str, int]:
        """TP, PP and CP of the configured backend (DP is derived from the world size)."""
        if self.megatron_cfg is not None:
            m = self.megatron_cfg
            return {
                "tp": m.tensor_model_parallel_size,
                "pp": m.pipeline_model_parallel_size,
                "cp": m.context_parallel_size,
            }
        d = self.dtensor_cfg or DTensorConfig()
        return {"tp": d.tensor_parallel_size, "pp": 1, "cp": d.context_parallel_size}
