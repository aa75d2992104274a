"""Rollout-engine configs, placed at `policy.generation` (`generation=vllm|hf`).

GenerationConfig holds what every engine honours; VllmConfig and HFGenerationConfig add their own
knobs. The engine class is the option's `_target_`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlpost.config.errors import ConfigError, require
from rlpost.config.fields import POSITIVE, POSITIVE_OR_NONE, SEED, Block, checked, options, within


@dataclass
class ColocationResources:
    """Resources of a generation cluster that is not colocated with training."""

    gpus_per_node: int | None = None
    """Workers (GPUs, or CPU worker slots) per node given to generation; single-node split."""
    num_nodes: int | None = None
    """Whole nodes given to generation; multi-node split."""


@dataclass
class ColocationConfig:
    """Whether the engine shares the training workers' resources."""

    enabled: bool = True
    """True: engine and policy share bundles (weights handed over in-process/IPC). False: separate resources."""
    resources: ColocationResources = field(default_factory=ColocationResources)
    """Generation resources when not colocated."""


ENGINE_BACKENDS: dict[str, str] = {
    "rlpost.models.generation.vllm_generation.VllmGeneration": "vllm",
    "rlpost.models.generation.hf_generation.HFGeneration": "hf",
}
"""`backend` of each built-in engine class (`_target_`)."""


@dataclass
class GenerationConfig(Block):
    """What every rollout engine honours (NeMo RL GenerationConfig)."""

    _target_: str = "rlpost.models.generation.vllm_generation.VllmGeneration"
    """Engine class, built by rlpost.runtime.build."""
    backend: str = "vllm"
    """Engine name, for logs and `_should_use_async_rollouts`: 'vllm' or 'hf'; must name the engine `_target_` builds."""
    max_new_tokens: int = checked(512, POSITIVE)
    """Most tokens generated per sample."""
    temperature: float = checked(1.0, POSITIVE)
    """Sampling temperature; training and logprob passes divide logits by it too."""
    top_p: float = checked(1.0, within("(0, 1]"))
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int | None = None
    """Top-k sampling (None = off)."""
    model_name: str | None = None
    """Model path: unset (filled from policy.model_name by setup) or policy.model_name itself."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a sample; None = the tokenizer's EOS."""
    stop_strings: list[str] | None = None
    """Strings that end a sample."""
    colocated: ColocationConfig = field(default_factory=ColocationConfig)
    """Colocation with the training workers."""

    def check(self, path: str) -> None:
        super().check(path)
        require(
            self.backend != "megatron",
            f"{path}.backend",
            self.backend,
            "rlpost has no Megatron generation engine (the policy workers do not generate)",
            "use generation=vllm or generation=hf",
        )
        options(*sorted(set(ENGINE_BACKENDS.values())))(f"{path}.backend", self.backend)
        built = ENGINE_BACKENDS.get(self._target_)
        require(
            built is None or built == self.backend,
            f"{path}.backend",
            self.backend,
            f"disagrees with {path}._target_={self._target_}, which builds the {built!r} engine",
            "choose the engine with generation=vllm|hf; backend follows it",
        )
        require(
            self.top_k is None or self.top_k > 0 or self.top_k == -1,
            f"{path}.top_k",
            self.top_k,
            "must be null, -1 or > 0",
        )
        res = self.colocated.resources
        if not self.colocated.enabled:
            require(
                res.gpus_per_node is not None or res.num_nodes is not None,
                f"{path}.colocated.resources.gpus_per_node",
                res.gpus_per_node,
                "a non-colocated engine needs resources: set gpus_per_node (single node) or num_nodes",
            )

    # ---- what each engine schema defines -------------------------------------------------
    def weight_dtype(self) -> str:
        """The dtype the trainer casts weights to for this engine at refit."""
        return "float32"

    def async_rollouts(self) -> bool:
        """Whether the engine runs its async variant inside the synchronous loop."""
        return False

    def model_parallel(self) -> tuple[int, int, str]:
        """(TP x PP of one engine, its TP, the key that sets the TP) for the layout's checks."""
        return 1, 1, "policy.generation._target_"

    def gpu_only_keys(self, path: str) -> list[tuple[str, object, str]]:
        """(key, value, what it does) of options that act on GPUs only; a true value is refused on CPU."""
        return []

    def expert_parallel_size(self) -> int:
        """Experts sharded over this many engine ranks (1 = off)."""
        return 1


@dataclass
class VllmSpecificArgs(Block):
    """vLLM engine arguments (NeMo RL VllmSpecificArgs)."""

    tensor_parallel_size: int = checked(1, POSITIVE)
    """Tensor-parallel size of each engine replica."""
    pipeline_parallel_size: int = checked(1, POSITIVE)
    """Pipeline-parallel size of each engine replica."""
    expert_parallel_size: int = checked(1, POSITIVE)
    """Expert-parallel size of each engine replica: 1, or tensor_parallel_size (vLLM's enable_expert_parallel
    shards the experts over the replica's TP ranks); GPU only, MoE models only."""
    gpu_memory_utilization: float = checked(0.6, within("(0, 1]"))
    """Share of GPU memory vLLM may take (GPU only)."""
    max_model_len: int | None = None
    """Context length; None = policy.max_total_sequence_length."""
    async_engine: bool = False
    """Use vLLM's AsyncLLM engine (per-sample coroutines; still on-policy)."""
    precision: str = checked("float32", options("float32", "bfloat16", "float16"))
    """Engine dtype: 'float32', 'bfloat16' or 'float16'."""
    enforce_eager: bool | None = True
    """Disable CUDA graphs / compilation (required on CPU); None (conf/'s default) = eager on CPU, CUDA graphs on CUDA,
    decided with the run's device (rlpost.config.device_defaults). On the CPU it also runs eagerly what vLLM's sampler
    would compile (TORCHDYNAMO_DISABLE=1 in the engine), keeping that compile off the path to the first step."""
    load_format: str = checked("auto", options("auto", "dummy", "safetensors"))
    """'auto' loads the checkpoint; 'dummy' leaves random weights for the first refit to fill."""
    kv_cache_space_gb: float | None = checked(None, POSITIVE_OR_NONE)
    """CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE). None = sized from the model: room for
    max_num_seqs (256) sequences of max_model_len tokens, at least 1/64 GiB and at most 1 GiB (a small model
    needs a few MiB, and a fixed size would hold RAM it never uses)."""
    seed: int = checked(0, SEED)
    """Engine sampling seed."""

    def check(self, path: str) -> None:
        super().check(path)
        require(
            self.expert_parallel_size in (1, self.tensor_parallel_size),
            f"{path}.expert_parallel_size",
            self.expert_parallel_size,
            f"must be 1 or tensor_parallel_size ({self.tensor_parallel_size}): vLLM's expert parallelism spans the "
            "tensor-parallel ranks of one replica",
        )


VLLM_RLPOST_KWARGS: dict[str, str] = {
    "model": "policy.model_name",
    "tokenizer": "policy.tokenizer.name",
    "trust_remote_code": "policy.trust_remote_code",
    "revision": "policy.model_name (a local directory)",
    "code_revision": "policy.model_name (a local directory)",
    "tokenizer_revision": "policy.tokenizer.name (a local directory)",
    "hf_overrides": "policy.hf_config_overrides",
    "worker_cls": "vLLM's own worker, extended for refit",
    "worker_extension_cls": "its refit extension, rlpost.models.generation.vllm_extension",
    "load_format": "policy.generation.vllm_cfg.load_format",
    "model_loader_extra_config": "weights come from policy.model_name and refit",
    "dtype": "policy.generation.vllm_cfg.precision",
    "seed": "policy.generation.vllm_cfg.seed",
    "tensor_parallel_size": "policy.generation.vllm_cfg.tensor_parallel_size",
    "pipeline_parallel_size": "policy.generation.vllm_cfg.pipeline_parallel_size",
    "enable_expert_parallel": "policy.generation.vllm_cfg.expert_parallel_size",
    "distributed_executor_backend": "from the parallel sizes and the device",
    "enforce_eager": "policy.generation.vllm_cfg.enforce_eager",
    "max_model_len": "policy.generation.vllm_cfg.max_model_len",
    "gpu_memory_utilization": "policy.generation.vllm_cfg.gpu_memory_utilization",
    "kv_cache_memory_bytes": "policy.generation.vllm_cfg.kv_cache_space_gb",
    "enable_sleep_mode": "colocated refit needs it",
    "logprobs_mode": "training needs the processed logprobs",
    "max_logprobs": "one logprob per sampled token",
}
"""vLLM engine arguments that `policy.generation.vllm_kwargs` may not set: where each comes from."""


@dataclass
class VllmConfig(GenerationConfig):
    """`generation=vllm`: vLLM engines in Ray actors."""

    vllm_cfg: VllmSpecificArgs = field(default_factory=VllmSpecificArgs)
    """vLLM engine arguments."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"import_path": "dotted_strings"})
    """Raw keyword arguments passed through to vllm.LLM, except those rlpost sets (VLLM_RLPOST_KWARGS);
    a dotted-name string anywhere in it must pass the _target_ allow-list (vLLM imports such names)."""

    def check(self, path: str) -> None:
        super().check(path)
        self.vllm_cfg.check(f"{path}.vllm_cfg")
        for key in self.vllm_kwargs:
            if key in VLLM_RLPOST_KWARGS:
                where = VLLM_RLPOST_KWARGS[key]
                rule = f"is set by rlpost; use {where} instead" if where.startswith("policy.") else f"is set by rlpost itself ({where})"
                raise ConfigError(f"{path}.vllm_kwargs.{key}", self.vllm_kwargs[key], rule)

    def weight_dtype(self) -> str:
        return self.vllm_cfg.precision

    def async_rollouts(self) -> bool:
        return bool(self.vllm_cfg.async_engine)

    def model_parallel(self) -> tuple[int, int, str]:
        v = self.vllm_cfg
        return v.tensor_parallel_size * v.pipeline_parallel_size, v.tensor_parallel_size, \
            "policy.generation.vllm_cfg.tensor_parallel_size"

    def gpu_only_keys(self, path: str) -> list[tuple[str, object, str]]:
        ep = self.vllm_cfg.expert_parallel_size
        return [(f"{path}.vllm_cfg.expert_parallel_size", ep if ep > 1 else None,
                 "vLLM's expert parallelism shards MoE experts over GPUs")]

    def expert_parallel_size(self) -> int:
        return self.vllm_cfg.expert_parallel_size


@dataclass
class HFGenerationConfig(GenerationConfig):
    """`generation=hf`: transformers `generate`, for debugging and models vLLM can't serve."""

    _target_: str = "rlpost.models.generation.hf_generation.HFGeneration"
    """Engine class."""
    backend: str = "hf"
    """Engine name."""
    generation_batch_size: int = checked(32, POSITIVE)
    """Prompts per `generate` call."""
    precision: str = checked("float32", options("float32", "bfloat16", "float16"))
    """Engine dtype: 'float32', 'bfloat16' or 'float16'."""

    def weight_dtype(self) -> str:
        return self.precision
