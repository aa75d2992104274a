"""Policy configs (`policy=dtensor|dtensor_v2|megatron`): names and defaults as NeMo RL's
`nemo_rl.models.policy`. `policy` is a polymorphic group: `PolicyConfig` holds what every backend
honours, and each backend's schema (`DTensorPolicyConfig` here, `MegatronPolicyConfig` in
schema/megatron.py) adds its block (`dtensor_cfg` / `megatron_cfg`), its parallel sizes, worker
environment and support checks. The worker class is the option's `_target_`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlpost.config.errors import require, safe_env_vars
from rlpost.config.fields import POSITIVE, POSITIVE_OR_NONE, Block, check_fields, checked, options
from rlpost.config.schema.generation import GenerationConfig
from rlpost.config.schema.lora import LoRAConfig

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


def parse_scheduler(path: str, entries: list[dict[str, Any]]
                    ) -> list[SinglePytorchSchedulerConfig | SchedulerMilestones]:
    """Turn the YAML list of `policy.scheduler` into typed entries and check its shape."""
    out: list[SinglePytorchSchedulerConfig | SchedulerMilestones] = []
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
class DTensorConfig(Block):
    """FSDP2 + DTensor tensor-parallel worker knobs."""

    env_vars: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for each worker process."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy for params, grads and optimizer state (GPU only)."""
    sequence_parallel: bool = False
    """Shard norm activations over the TP group (requires tensor_parallel_size > 1)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward."""
    tensor_parallel_size: int = checked(1, POSITIVE)
    """Tensor-parallel size."""
    context_parallel_size: int = checked(1, POSITIVE)
    """Ranks that split each sequence (rlpost.models.dtensor.context_parallel: keys and values gathered per layer);
    policy=dtensor, unpacked micro-batches, a causal LM."""
    custom_parallel_plan: str | None = None
    """Import path of a TP plan (dict or callable) replacing the built-in per-architecture plan."""
    clear_cache_every_n_steps: int | None = checked(None, POSITIVE_OR_NONE)
    """Empty the CUDA allocator cache every N training micro-batches (GPU only); None = never."""
    lora_cfg: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (peft): only they train; the reference is the base with them off."""

    def check(self, path: str) -> None:
        safe_env_vars(f"{path}.env_vars", self.env_vars)
        self.lora_cfg.check(f"{path}.lora_cfg")
        super().check(path)
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


@dataclass
class SequencePackingConfig:
    """Pack several sequences into one micro-batch row (no attention across boundaries)."""

    enabled: bool = False
    """Turn packing on."""
    train_mb_tokens: int = checked(2048, POSITIVE)
    """Token budget of one packed training micro-batch."""
    logprob_mb_tokens: int = checked(2048, POSITIVE)
    """Token budget of one packed logprob micro-batch."""
    algorithm: str = checked("modified_first_fit_decreasing", options(*PACKING_ALGORITHMS))
    """Bin-packing algorithm."""
    sequence_length_round: int = checked(64, POSITIVE)
    """Pad each packed row to a multiple of this."""

    def check(self, path: str) -> None:
        if self.enabled:
            check_fields(self, path)


@dataclass
class DynamicBatchingConfig:
    """Micro-batches cut to a token budget: each data-parallel rank's rows sorted longest first (so the step's peak
    comes at its first micro-batch) and grouped while rows x longest row stays within the budget, each micro-batch
    trimmed to its own longest row. The losses are normalised over the global batch, so the step is the same as
    with fixed micro-batches (tests/unit/losses/test_global_normalization.py)."""

    enabled: bool | None = None
    """True / False; None: on wherever it trains the same steps as fixed micro-batches and the backend has it: the
    DTensor workers under algo=grpo|rloo|distillation|sft without sequence packing (rlpost.config.algorithms:
    `token_batches`). The plan's `batching` row says which."""
    train_mb_tokens: int | None = checked(None, POSITIVE_OR_NONE)
    """Token budget of one training micro-batch; None: max_total_sequence_length x train_micro_batch_size, the most
    a fixed micro-batch holds (NeMo RL's default), so no micro-batch is larger than a fixed one can be."""
    logprob_mb_tokens: int | None = checked(None, POSITIVE_OR_NONE)
    """Token budget of one logprob micro-batch; None: max_total_sequence_length x logprob_batch_size."""
    sequence_length_round: int = checked(64, POSITIVE)
    """Each micro-batch is trimmed to its longest sequence rounded up to this (at most the batch's width)."""

    def tokens(self, training: bool) -> int:
        """The token budget of a training or a logprob micro-batch (set once the config is composed:
        PolicyConfig.resolve_batching)."""
        value = self.train_mb_tokens if training else self.logprob_mb_tokens
        if value is None:
            raise ValueError("the dynamic-batching budgets are set by PolicyConfig.resolve_batching")
        return value

    def check(self, path: str) -> None:
        if self.enabled:
            check_fields(self, path)


@dataclass
class RewardModelConfig(Block):
    """Use the policy worker as a reward model instead of a causal LM."""

    enabled: bool = False
    """The worker builds a sequence-classification model (one score per sequence) instead of a causal LM.
    Set by algo=rm; the DTensor workers serve it, the others refuse it."""
    reward_model_type: str = checked("bradley_terry", options("bradley_terry"))
    """Only 'bradley_terry' (HF AutoModelForSequenceClassification, num_labels=1, trained on preference pairs)."""

@dataclass
class PolicyConfig(Block):
    """The trained policy: model, batch sizes, backend, optimizer and its rollout engine."""

    _target_: str = "rlpost.models.policy.dtensor_policy_worker.DTensorPolicyWorker"
    """Worker class of the training backend, built by rlpost.runtime.build."""
    model_name: str = "${model.path}"
    """Local HF checkpoint directory (default: the `model` group's)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer."""
    train_global_batch_size: int = checked(32, POSITIVE)
    """Samples per optimizer step, over all data-parallel ranks."""
    train_micro_batch_size: int = checked(4, POSITIVE)
    """Samples per forward/backward micro-batch on one data-parallel rank."""
    logprob_batch_size: int = checked(4, POSITIVE)
    """Samples per micro-batch of the logprob (previous / reference) passes."""
    logprob_chunk_size: int | None = checked(None, POSITIVE_OR_NONE)
    """DTensor: tokens per chunk of the output layer, which the loss and the logprob passes read from the final hidden
    states a chunk at a time, so the whole [tokens, vocabulary] logits never exist (rlpost.ops.chunked_head); None =
    as many as 256 MiB of fp32 logits hold (1,365 tokens at a 49k vocabulary). Megatron: positions per chunk of its
    vocab-parallel log-softmax."""
    generation: GenerationConfig | None = None
    """Rollout engine (`generation=vllm|hf`, chosen by algo=grpo); None for the algorithms that do not generate
    (algo=sft|dpo|rm)."""
    generation_batch_size: int = checked(32, POSITIVE)
    """Prompts per `generate` call of the HF engine (generation=hf fills policy.generation.generation_batch_size
    from it); vLLM schedules whole batches itself, so with generation=vllm only the default is accepted."""
    precision: str = "float32"
    """Compute dtype: 'float32', 'bfloat16', 'float16', or 'auto' (conf/'s default: bfloat16 on CUDA, float32 on CPU,
    decided with the run's device by rlpost.config.device_defaults); master weights stay fp32."""
    reward_model_cfg: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward-model mode."""
    value_head: bool = False
    """The worker builds a value model: the body with a one-output head on every token (HF
    AutoModelForTokenClassification, num_labels=1). Set by algo=ppo on the critic's copy of this block
    (rlpost.algorithms.critic); the DTensor and Megatron workers serve it."""
    hf_config_overrides: dict[str, Any] = field(default_factory=dict)
    """Applied to the HF AutoConfig (and mirrored into vLLM's hf_overrides)."""
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    """Dynamic batching (exclusive with sequence packing)."""
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    """Sequence packing (exclusive with dynamic batching)."""
    make_sequence_length_divisible_by: int = checked(1, POSITIVE)
    """Pad sequence length to a multiple of this (TP / SP requirement)."""
    max_total_sequence_length: int = checked(512, POSITIVE)
    """Prompt + response cap; also vLLM's max_model_len by default."""
    max_grad_norm: float | None = checked(1.0, POSITIVE_OR_NONE)
    """Gradient-norm clip (DTensor); None = no clipping."""
    refit_buffer_size_gb: float | None = checked(None, POSITIVE_OR_NONE)
    """Bound on the colocated refit's transfer buffers (GiB; None = 0.25). A model that fits goes in one bucket;
    a larger one in layer-aligned buckets of half of it through two shared-memory slots on one node (rank 0 writes
    the next while the engines load the current), or through the object store across nodes."""
    optimizer: PytorchOptimizerConfig = field(default_factory=PytorchOptimizerConfig)
    """The optimizer and its lr, for every backend (`policy.optimizer.kwargs.lr=...` sweeps either); Megatron
    takes AdamW's lr / weight_decay / betas / eps from here into megatron_cfg.optimizer."""
    scheduler: list[dict[str, Any]] = field(default_factory=list)
    """Torch LR schedulers: a list of {name, kwargs} plus one {milestones} entry; empty = constant lr."""
    trust_remote_code: bool = False
    """Allow HF checkpoints to run their own Python code. Off: loading never executes model code."""
    offload_optimizer_for_logprob: bool = False
    """Move the optimizer state to the CPU during logprob passes (GPU only)."""

    def check(self, path: str) -> None:
        require(
            type(self) is not PolicyConfig,
            f"{path}._target_",
            self._target_,
            "no backend schema: the policy block must come from a backend option",
            "choose one with policy=dtensor|dtensor_v2|megatron",
        )
        require(bool(self.model_name), f"{path}.model_name", self.model_name, "must name a local model directory")
        super().check(path)
        require(self.precision in PRECISIONS, f"{path}.precision", self.precision,
                f"must be one of {list(PRECISIONS)} or 'auto' (bfloat16 on CUDA, float32 on CPU)")
        require(
            self.train_micro_batch_size <= self.train_global_batch_size,
            f"{path}.train_micro_batch_size",
            self.train_micro_batch_size,
            f"must be <= train_global_batch_size ({self.train_global_batch_size})",
        )
        if self.generation is not None:
            self.generation.check(f"{path}.generation")
            key, lora = self.lora_settings(path)
            if lora.enabled and lora.refit == "adapter":
                require(self.generation.backend == "vllm", f"{key}.refit", lora.refit,
                        f"serving the adapter needs the vLLM engine (policy.generation is {self.generation.backend!r})",
                        "use refit=merged with this engine")
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
        for name, value in self.optimizer.kwargs.items():
            for v in value if isinstance(value, (list, tuple)) else [value]:
                require(not isinstance(v, float) or math.isfinite(v), f"{path}.optimizer.kwargs.{name}", value,
                        "must be a finite number")
        require("lr" in self.optimizer.kwargs, f"{path}.optimizer.kwargs.lr", None,
                "must be set: without it the optimizer would train at its class's default")
        lr = self.optimizer.kwargs["lr"]
        require(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0, f"{path}.optimizer.kwargs.lr",
                lr, "must be a finite number > 0")

    def resolve_batching(self, token_batches: bool) -> None:
        """Make `dynamic_batching` concrete (run once on the composed config, before it is checked): `enabled: None`
        becomes on where `token_batches` (the algorithm's losses allow it), the backend batches by tokens and
        sequence packing is off; a budget left None becomes the most tokens a fixed micro-batch holds."""
        d, longest = self.dynamic_batching, self.max_total_sequence_length
        if d.enabled is None:
            d.enabled = token_batches and self.batches_by_tokens and not self.sequence_packing.enabled
        if d.train_mb_tokens is None:
            d.train_mb_tokens = longest * self.train_micro_batch_size
        if d.logprob_mb_tokens is None:
            d.logprob_mb_tokens = longest * self.logprob_batch_size

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

    # ---- what each backend schema defines -----------------------------------------------
    serves_reward_model: ClassVar[bool] = False
    """The backend can build a reward model (policy.reward_model_cfg.enabled, algo=rm)."""
    serves_value_model: ClassVar[bool] = False
    """The backend can build a value model (value_head: PPO's critic) and score a distillation teacher's top-k."""
    pads_vocab: ClassVar[bool] = False
    """The backend pads the vocabulary to a multiple of TP itself (else TP must divide it)."""
    has_device_checks: ClassVar[bool] = False
    """`check_device` checks something (else the pre-flight need not resolve the device, which imports torch)."""
    batches_by_tokens: ClassVar[bool] = False
    """The backend runs dynamic batching (micro-batches of varying rows and lengths)."""

    def parallel_sizes(self) -> dict[str, int]:
        """TP, PP and CP of the backend (DP is derived from the world size)."""
        return {"tp": 1, "pp": 1, "cp": 1}

    def lora_settings(self, path: str) -> tuple[str, LoRAConfig]:
        """The backend's LoRA block and its key."""
        return f"{path}._target_", LoRAConfig()

    def worker_env(self) -> dict[str, str]:
        """Extra environment variables of every worker process."""
        return {}

    def tp_key(self) -> str:
        """The key that sets the tensor-parallel size (for error messages)."""
        return "policy._target_"

    def gpu_only_keys(self, path: str) -> list[tuple[str, object, str]]:
        """(key, value, what it does) of options that act on GPUs only; a true value is refused on CPU."""
        return []

    def check_device(self, path: str, device: str, init_optimizer: bool = True) -> None:
        """Checks that need the run's device ('cpu' or 'cuda'): run by the pre-flight, `rlpost plan` and the
        worker itself."""


@dataclass
class DTensorPolicyConfig(PolicyConfig):
    """The FSDP2 / DTensor workers (`policy=dtensor`, `policy=dtensor_v2`)."""

    dtensor_cfg: DTensorConfig = field(default_factory=DTensorConfig)
    """DTensor backend knobs."""

    serves_reward_model: ClassVar[bool] = True
    """The DTensor workers build HF sequence classifiers for algo=rm."""
    serves_value_model: ClassVar[bool] = True
    """The DTensor workers build HF token classifiers: PPO's critic."""
    batches_by_tokens: ClassVar[bool] = True
    """The DTensor workers take micro-batches of any shape."""

    def check(self, path: str) -> None:
        super().check(path)
        self.dtensor_cfg.check(f"{path}.dtensor_cfg")
        if self.dtensor_cfg.lora_cfg.enabled:
            key = f"{path}.dtensor_cfg.lora_cfg.enabled"
            require(not self.reward_model_cfg.enabled, key, True,
                    "LoRA is not supported for a reward model: its new score head would have to train in full")
            require(self.dtensor_cfg.tensor_parallel_size == 1 or not self._target_.endswith("V2"), key, True,
                    "dtensor_v2 loads a tensor-parallel model already sharded by transformers, before adapters can "
                    "be added", "use policy=dtensor for LoRA with tensor parallelism")
        cp = self.dtensor_cfg.context_parallel_size
        if cp > 1:
            key = f"{path}.dtensor_cfg.context_parallel_size"
            require(not self.sequence_packing.enabled, key, cp,
                    "DTensor context parallelism does not work with sequence packing",
                    f"set {path}.sequence_packing.enabled=false")
            require(not self._target_.endswith("V2"), key, cp, "context parallelism runs on policy=dtensor",
                    "use policy=dtensor")
            require(not self.reward_model_cfg.enabled, key, cp,
                    "a reward model scores each sequence's last token, which context parallelism splits away")

    def parallel_sizes(self) -> dict[str, int]:
        d = self.dtensor_cfg
        return {"tp": d.tensor_parallel_size, "pp": 1, "cp": d.context_parallel_size}

    def lora_settings(self, path: str) -> tuple[str, LoRAConfig]:
        return f"{path}.dtensor_cfg.lora_cfg", self.dtensor_cfg.lora_cfg

    def worker_env(self) -> dict[str, str]:
        return dict(self.dtensor_cfg.env_vars)

    def tp_key(self) -> str:
        return "policy.dtensor_cfg.tensor_parallel_size"

    def gpu_only_keys(self, path: str) -> list[tuple[str, object, str]]:
        d = self.dtensor_cfg
        return [
            (f"{path}.dtensor_cfg.cpu_offload", d.cpu_offload,
             "FSDP2 CPU offload keeps parameters, gradients and optimizer state off the GPU"),
            (f"{path}.dtensor_cfg.clear_cache_every_n_steps", d.clear_cache_every_n_steps,
             "it empties the CUDA allocator cache"),
        ]
