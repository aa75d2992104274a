"""Megatron-Core backend config (`policy=megatron`): names and defaults as NeMo RL's MegatronConfig, and the
policy schema of the backend (`MegatronPolicyConfig`) with the checks of what the worker can run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from rlpost.config.errors import ConfigError, require, safe_env_vars
from rlpost.config.fields import NON_NEGATIVE, POSITIVE, Block, checked, options
from rlpost.config.model_counts import is_moe, num_experts
from rlpost.config.model_families import ARCHITECTURES
from rlpost.config.schema.lora import LoRAConfig
from rlpost.config.schema.policy import PolicyConfig, PytorchOptimizerConfig


@dataclass
class MegatronOptimizerConfig(Block):
    """Megatron-Core optimizer (`megatron.core.optimizer.OptimizerConfig`)."""

    optimizer: str = checked("adam", options("adam", "sgd"))
    """'adam' or 'sgd'."""
    lr: float = checked(5.0e-6, POSITIVE)
    """Peak learning rate."""
    min_lr: float = 5.0e-7
    """Learning rate floor of the decay schedule."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    bf16: bool | None = None
    """bf16 mixed-precision optimizer with fp32 main params (GPU only); None: on when policy.precision is bfloat16."""
    fp16: bool | None = None
    """fp16 mixed-precision optimizer with loss scaling (GPU only); None: on when policy.precision is float16."""
    params_dtype: str | None = checked(None, options("float32", "bfloat16", "float16", allow_none=True))
    """dtype of the model parameters as built; None: policy.precision."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1.0e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum (optimizer='sgd')."""
    use_distributed_optimizer: bool | None = None
    """Shard optimizer state over data-parallel ranks (ZeRO-1; GPU only); None: on with CUDA and more than one
    data-parallel rank."""
    use_precision_aware_optimizer: bool = False
    """Keep optimizer states in lower precision (GPU only)."""
    clip_grad: float = checked(0.0, NON_NEGATIVE)
    """Global grad-norm clip; 0 disables (clipping is GPU only in megatron-core 0.16)."""
    optimizer_cpu_offload: bool = False
    """Offload the optimizer to CPU (HybridDeviceOptimizer; GPU only)."""
    optimizer_offload_fraction: float = 0.0
    """Share of the optimizer offloaded when optimizer_cpu_offload is on."""

    def check(self, path: str) -> None:
        super().check(path)
        require(self.min_lr <= self.lr, f"{path}.min_lr", self.min_lr, "must be <= lr")
        require(not (self.bf16 and self.fp16), f"{path}.bf16", self.bf16, "bf16 and fp16 are exclusive")

    def resolved(self, precision: str, device: str, data_parallel_size: int) -> MegatronOptimizerConfig:
        """This config with every field left None made concrete for the run: bf16 / fp16 follow `precision`
        (bfloat16 / float16), params_dtype is `precision`, and the distributed optimizer is on with CUDA and more
        than one data-parallel rank (megatron-core runs it on GPUs only). A value the user set is kept."""
        return replace(
            self,
            bf16=precision == "bfloat16" if self.bf16 is None else self.bf16,
            fp16=precision == "float16" if self.fp16 is None else self.fp16,
            params_dtype=precision if self.params_dtype is None else self.params_dtype,
            use_distributed_optimizer=(device == "cuda" and data_parallel_size > 1
                                       if self.use_distributed_optimizer is None else self.use_distributed_optimizer),
        )


@dataclass
class MegatronSchedulerConfig(Block):
    """Megatron-Core OptimizerParamScheduler."""

    start_weight_decay: float = 0.01
    """Weight decay at the first step."""
    end_weight_decay: float = 0.01
    """Weight decay at the last step."""
    weight_decay_incr_style: str = checked("constant", options("constant", "linear", "cosine"))
    """'constant', 'linear' or 'cosine'."""
    lr_decay_style: str = checked("constant", options("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    """'constant', 'linear', 'cosine' or 'inverse-square-root'."""
    lr_decay_iters: int | None = None
    """Steps over which lr decays; None = the training steps."""
    lr_warmup_iters: int = checked(0, NON_NEGATIVE)
    """Linear warm-up steps."""
    lr_warmup_init: float = 0.0
    """Learning rate at the first warm-up step."""


@dataclass
class MegatronDDPConfig(Block):
    """Megatron-Core DistributedDataParallel wrapper."""

    grad_reduce_in_fp32: bool = True
    """Reduce gradients in fp32."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient all-reduce with backward."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with forward (distributed optimizer)."""
    use_custom_fsdp: bool = False
    """Megatron's own FSDP (GPU only)."""
    data_parallel_sharding_strategy: str = checked("no_shard",
                                                   options("no_shard", "optim", "optim_grads", "optim_grads_params"))
    """'no_shard', 'optim', 'optim_grads' or 'optim_grads_params'."""


@dataclass
class MegatronConfig(Block):
    """Parallelism and memory knobs of the Megatron-Core worker."""

    env_vars: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for each worker process."""
    empty_unused_memory_level: int = checked(0, options(0, 1, 2))
    """0: never, 1: after each step, 2: also after each micro-batch, empty the allocator cache."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (rlpost.models.megatron.model.checkpoint_layers)."""
    converter_type: str = checked("auto", options("auto", *ARCHITECTURES.values()))
    """HF architecture to convert from ('auto': config.json's; rlpost.config.model_families lists the others)."""
    tensor_model_parallel_size: int = checked(1, POSITIVE)
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int = checked(1, POSITIVE)
    """Pipeline-parallel size."""
    num_layers_in_first_pipeline_stage: int | None = None
    """Layers on the first stage (uneven pipelines)."""
    num_layers_in_last_pipeline_stage: int | None = None
    """Layers on the last stage (uneven pipelines)."""
    context_parallel_size: int = checked(1, POSITIVE)
    """Ranks that split each sequence (rlpost.models.megatron.context_parallel: megatron's load-balanced chunks, keys
    and values gathered per layer); 1: off. Dense models on one pipeline stage, without sequence parallelism."""
    pipeline_dtype: str = checked("float32", options("float32", "bfloat16", "float16"))
    """dtype of the tensors passed between pipeline stages."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations over the TP group (requires TP > 1)."""
    freeze_moe_router: bool = True
    """Do not train MoE routers (their parameters get requires_grad=False; a dense model has none)."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size inside experts (null: tensor_model_parallel_size, megatron's default and the only one the
    worker takes: each expert is split over the tensor-parallel group as a dense MLP is)."""
    expert_model_parallel_size: int = checked(1, POSITIVE)
    """Expert-parallel size (a mixture of experts): each rank of an expert-parallel group holds
    num_experts / this of each layer's experts; it must divide the data-parallel size and the experts."""
    defer_fp32_logits: bool = False
    """Cast logits to fp32 lazily: not implemented (logits reach the chunked logprob pass in fp32), must stay false."""
    apply_rope_fusion: bool = False
    """Fused RoPE kernel (GPU only)."""
    optimizer: MegatronOptimizerConfig = field(default_factory=MegatronOptimizerConfig)
    """Megatron optimizer."""
    scheduler: MegatronSchedulerConfig = field(default_factory=MegatronSchedulerConfig)
    """Megatron LR / weight-decay scheduler."""
    distributed_data_parallel_config: MegatronDDPConfig = field(default_factory=MegatronDDPConfig)
    """Megatron DDP wrapper."""
    train_iters: int | None = None
    """Total optimizer steps; injected by GRPO setup, leave unset."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Raw TransformerConfig overrides passed through to megatron-core."""
    peft: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters on the decoder's tensor-parallel linears (NeMo RL's MegatronPeftConfig keys; target_modules
    names linear_qkv, linear_proj, linear_fc1, linear_fc2; rlpost.models.megatron.lora)."""

    def check(self, path: str) -> None:
        super().check(path)
        safe_env_vars(f"{path}.env_vars", self.env_vars)
        self.peft.check(f"{path}.peft")
        if self.peft.enabled:
            key = f"{path}.peft.enabled"
            require(not self.sequence_parallel, key, True,
                    "LoRA adapters on Megatron need the whole sequence at the column-parallel layers (sequence_parallel)",
                    f"set {path}.sequence_parallel=false")
        require(self.expert_tensor_parallel_size in (None, self.tensor_model_parallel_size),
                f"{path}.expert_tensor_parallel_size", self.expert_tensor_parallel_size,
                f"must be null or tensor_model_parallel_size ({self.tensor_model_parallel_size}): the worker splits "
                "each expert over the tensor-parallel group")
        require(
            not self.sequence_parallel or self.tensor_model_parallel_size > 1,
            f"{path}.sequence_parallel",
            self.sequence_parallel,
            "sequence parallelism needs tensor_model_parallel_size > 1",
        )
        require(
            not self.defer_fp32_logits,
            f"{path}.defer_fp32_logits",
            self.defer_fp32_logits,
            "lazy fp32 logits are not implemented by rlpost's Megatron worker: its logits reach the logprob pass in "
            "fp32 (policy.logprob_chunk_size works without it)",
            "leave it false",
        )
        self.optimizer.check(f"{path}.optimizer")
        self.scheduler.check(f"{path}.scheduler")
        self.distributed_data_parallel_config.check(f"{path}.distributed_data_parallel_config")


MEGATRON_WORKER = "rlpost.models.policy.megatron_policy_worker.MegatronPolicyWorker"

GPU_ONLY_OPTIMIZER = {
    "bf16": "the bf16 mixed-precision optimizer",
    "fp16": "the fp16 mixed-precision optimizer",
    "use_distributed_optimizer": "the distributed optimizer",
    "use_precision_aware_optimizer": "the precision-aware optimizer",
    "optimizer_cpu_offload": "optimizer CPU offload",
}


@dataclass
class MegatronPolicyConfig(PolicyConfig):
    """The Megatron-Core worker (`policy=megatron`)."""

    _target_: str = MEGATRON_WORKER
    """Worker class of the training backend, built by rlpost.runtime.build."""
    optimizer: PytorchOptimizerConfig = field(default_factory=lambda: PytorchOptimizerConfig(kwargs={"lr": 5.0e-6}))
    """Only `kwargs.lr` (the lr path both backends share); megatron_cfg.optimizer.lr follows it."""
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)
    """Megatron backend knobs."""

    pads_vocab: ClassVar[bool] = True
    """Megatron pads the vocabulary itself (make_vocab_size_divisible_by)."""
    has_device_checks: ClassVar[bool] = True
    """GPU-only megatron-core features are refused on CPU; the mixed-precision flags must match the precision."""
    serves_value_model: ClassVar[bool] = True
    """The Megatron worker puts a value head in place of the output layer (PPO's critic) and scores a teacher's
    top-k (rlpost.models.megatron.scoring)."""

    def check(self, path: str) -> None:
        super().check(path)
        self._check_optimizer(path)  # first: a wrong lr would otherwise surface as min_lr > lr
        m = self.megatron_cfg
        m.check(f"{path}.megatron_cfg")
        unsupported = [  # (key, value, is it on, what)
            (f"{path}.dynamic_batching.enabled", self.dynamic_batching.enabled, self.dynamic_batching.enabled,
             "dynamic batching"),
            (f"{path}.sequence_packing.enabled", self.sequence_packing.enabled, self.sequence_packing.enabled,
             "sequence packing"),
        ]
        for key, value, on, what in unsupported:
            require(not on, key, value, f"{what} is not implemented by the Megatron policy worker", "turn it off")
        if m.context_parallel_size > 1:
            beside_cp: list[tuple[str, object, bool]] = [
                ("pipeline_model_parallel_size", m.pipeline_model_parallel_size, m.pipeline_model_parallel_size > 1),
                ("sequence_parallel", m.sequence_parallel, m.sequence_parallel),
            ]
            for name, setting, on in beside_cp:
                require(not on, f"{path}.megatron_cfg.{name}", setting, f"is not supported with {path}.megatron_cfg."
                        f"context_parallel_size={m.context_parallel_size} (context parallelism splits sequences on one "
                        "pipeline stage, without sequence parallelism)", f"set {path}.megatron_cfg.context_parallel_size=1")
        require(not self.scheduler, f"{path}.scheduler", self.scheduler,
                "the Megatron worker schedules the lr with megatron_cfg.scheduler; torch schedulers are not used",
                "leave policy.scheduler empty with policy=megatron")

    def _check_optimizer(self, path: str) -> None:
        """policy.optimizer.kwargs.lr is the lr path both backends share; the preset interpolates it into
        megatron_cfg.optimizer.lr. Everything else about Megatron's optimizer lives in megatron_cfg.optimizer."""
        opt, mo = self.optimizer, self.megatron_cfg.optimizer
        require(set(opt.kwargs) == {"lr"}, f"{path}.optimizer.kwargs", sorted(opt.kwargs),
                "with policy=megatron only policy.optimizer.kwargs.lr is read",
                "set the other optimizer options under policy.megatron_cfg.optimizer")
        require(opt.name == PytorchOptimizerConfig.name, f"{path}.optimizer.name", opt.name,
                "with policy=megatron the optimizer is megatron-core's",
                "choose it with policy.megatron_cfg.optimizer.optimizer=adam|sgd")
        require(mo.lr == opt.kwargs["lr"], f"{path}.megatron_cfg.optimizer.lr", mo.lr,
                f"disagrees with {path}.optimizer.kwargs.lr={opt.kwargs['lr']}, which policy=megatron takes it from",
                f"set {path}.optimizer.kwargs.lr (the path both backends share)")

    def parallel_sizes(self) -> dict[str, int]:
        m = self.megatron_cfg
        return {"tp": m.tensor_model_parallel_size, "pp": m.pipeline_model_parallel_size, "cp": m.context_parallel_size,
                "ep": m.expert_model_parallel_size}

    def lora_settings(self, path: str) -> tuple[str, LoRAConfig]:
        return f"{path}.megatron_cfg.peft", self.megatron_cfg.peft

    def worker_env(self) -> dict[str, str]:
        return dict(self.megatron_cfg.env_vars)

    def tp_key(self) -> str:
        return "policy.megatron_cfg.tensor_model_parallel_size"

    def check_device(self, path: str, device: str, init_optimizer: bool = True) -> None:
        m = self.megatron_cfg
        if device == "cpu":
            gpu_only: list[tuple[str, object, str]] = [
                (f"{path}.megatron_cfg.optimizer.{name}", getattr(m.optimizer, name), what)
                for name, what in GPU_ONLY_OPTIMIZER.items()
            ]
            gpu_only += [
                (f"{path}.megatron_cfg.distributed_data_parallel_config.use_custom_fsdp",
                 m.distributed_data_parallel_config.use_custom_fsdp, "megatron FSDP"),
                (f"{path}.megatron_cfg.sequence_parallel", m.sequence_parallel,
                 "sequence parallelism (the local layer spec's torch norms reject it)"),
                (f"{path}.precision", self.precision if init_optimizer and self.precision != "float32" else None,
                 "training in bf16/fp16 (megatron's mixed-precision optimizer)"),
            ]
            for key, value, what in gpu_only:
                if value:
                    raise ConfigError(key, value, f"{what} is GPU-only in megatron-core 0.16.1",
                                      "turn it off (or use float32) when RLPOST_DEVICE=cpu")
        if not init_optimizer:
            return
        for name, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
            flag = getattr(m.optimizer, name)
            if flag is None:  # follows policy.precision (MegatronOptimizerConfig.resolved)
                continue
            require(flag == (self.precision == dtype), f"{path}.megatron_cfg.optimizer.{name}", flag,
                    f"must be {not flag} with {path}.precision={self.precision}",
                    "bf16/fp16 params train with megatron's mixed-precision optimizer; leave it null to follow "
                    f"{path}.precision")


def check_expert_parallel(sizes: dict[str, int], dp: int, workers: int) -> None:
    """Megatron's expert-parallel groups lie inside the data-parallel (x CP) ranks: EP must divide DP x CP."""
    ep = sizes.get("ep", 1)
    if (dp * sizes["cp"]) % ep:
        raise ConfigError("policy.megatron_cfg.expert_model_parallel_size", ep,
                          f"must divide the data-parallel size x CP ({dp} x {sizes['cp']} of the {workers} training "
                          "workers): each expert-parallel group is drawn from the data-parallel ranks")


def check_megatron_experts(hf: Mapping[str, Any], path: str, tp: int, sequence_parallel: bool, ep: int = 1,
                           cp: int = 1) -> None:
    """ConfigError at the Megatron block `path` when megatron-core cannot lay out or train the model's experts: a
    mixture of experts above TP=1 trains only with sequence parallelism (a GPU's Transformer Engine norms), and
    expert parallelism needs experts that split evenly over it. rlpost's context parallelism is for dense models."""
    if cp > 1 and is_moe(hf):
        raise ConfigError(f"{path}.context_parallel_size", cp, f"context parallelism on Megatron is for dense models; "
                          f"this model ({hf.get('model_type')}) is a mixture of experts",
                          f"set {path}.context_parallel_size=1")
    if ep > 1:
        n = num_experts(hf) if is_moe(hf) else 0
        if not n or n % ep:
            what = f"its {n} experts do not split evenly" if n else f"the model ({hf.get('model_type')}) has no experts"
            raise ConfigError(f"{path}.expert_model_parallel_size", ep, f"{what} over {ep} expert-parallel ranks")
    if is_moe(hf) and tp > 1 and not sequence_parallel:
        raise ConfigError(f"{path}.sequence_parallel", sequence_parallel,
                          f"megatron-core trains a mixture of experts at tensor_model_parallel_size={tp} only with "
                          "sequence parallelism", f"set {path}.sequence_parallel=true on a GPU, or "
                          f"{path}.tensor_model_parallel_size=1")
