"""One Megatron-Core training step: DDP wrapper, optimizer and LR scheduler from rlpost's MegatronConfig.

`setup_training` wraps a built GPTModel in megatron's DistributedDataParallel (from MegatronDDPConfig), builds
megatron's optimizer (`get_megatron_optimizer`, from MegatronOptimizerConfig) and `OptimizerParamScheduler`
(from MegatronSchedulerConfig), and wires the hooks the schedules use. `train_step` then runs all micro-batches of
one global batch through `get_forward_backward_func()` (no pipelining, or 1F1B over PP stages) and steps.

Loss semantics ("no averaging", NeMo RL's calculate_per_token_loss + do_not_average_loss): loss_fn returns a loss
that is already normalised by the GLOBAL batch counts, so the gradient of the global batch is the plain SUM of
every micro-batch's and every data-parallel rank's gradient. megatron-core 0.16.1 has no do_not_average_loss; we
get the same effect with what it has: the model config has calculate_per_token_loss=True (so forward_step does not
divide the loss by num_microbatches and DDP does not pre-scale gradients by 1/dp), loss_func returns the
three-tuple (loss, num_tokens, data), and finalize_model_grads is called with num_tokens=None (no division by the
token count). The reported loss / metrics are the sums over micro-batches and DP ranks.

Differences from plain PyTorch: megatron's optimizer applies no weight decay to biases and 1-D (norm) params;
Adam is torch's AdamW (decoupled weight decay). Clipping on CPU: megatron's clip asserts CUDA tensor types, so on CPU
megatron gets clip_grad=0 and this module clips the fp32 grads itself with megatron's rule (see cpu_compat).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from rlpost.distributed.collective_device import all_reduce_floats
from rlpost.models.megatron.cpu_compat import is_cpu_compat_active
from rlpost.models.megatron.export import unwrap_model
from rlpost.models.megatron.model import resolve_tp_group, scale_and_mask_logits, vocab_shard_range
from rlpost.models.megatron.output_head import head_logits, passthrough
from rlpost.models.router_stats import megatron_routing, router_stats, routers, row_tokens
from rlpost.ops.chunked_head import HeadLogits
from rlpost.ops.logprobs import vocab_parallel_logprobs

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from rlpost.config.schema.megatron import MegatronConfig
    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.losses.interface import LossFunction, VocabParallelArgs

LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
"""megatron schedule's loss_func: output -> (loss, token count, metrics to report)."""

MicrobatchLoss = Callable[[Any, Mapping[str, Any]], tuple[torch.Tensor, Mapping[str, float]]]
"""loss_fn(logits_or_logprobs, microbatch) -> (globally normalised scalar loss, metrics of python floats)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GPU_ONLY = {
    "bf16": "the bf16 mixed-precision optimizer",
    "fp16": "the fp16 mixed-precision optimizer",
    "use_distributed_optimizer": "the distributed optimizer",
    "use_precision_aware_optimizer": "the precision-aware optimizer",
    "optimizer_cpu_offload": "optimizer CPU offload (HybridDeviceOptimizer)",
}


@dataclasses.dataclass
class MegatronTrainState:
    """The DDP-wrapped model with its optimizer and scheduler; clip_grad is applied by rlpost when manual_clip."""

    model: DistributedDataParallel
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    clip_grad: float
    manual_clip: bool


@dataclasses.dataclass
class TrainStepResult:
    """Outcome of one step: loss and metrics summed over micro-batches and DP ranks, grad norm before clipping."""

    loss: float
    grad_norm: float
    lr: float
    metrics: dict[str, float]
    num_microbatches: int
    update_successful: bool
    router_metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Per micro-batch, a mixture of experts' routing (rlpost.models.router_stats; empty dicts for a dense model)."""


def _check_cpu_support(megatron_cfg: MegatronConfig) -> None:
    if not is_cpu_compat_active():
        return
    opt = megatron_cfg.optimizer
    for field, what in _GPU_ONLY.items():
        if getattr(opt, field):
            raise ValueError(f"megatron_cfg.optimizer.{field}: {what} is GPU-only in megatron-core 0.16.1")
    if megatron_cfg.distributed_data_parallel_config.use_custom_fsdp:
        raise ValueError("megatron_cfg.distributed_data_parallel_config.use_custom_fsdp is GPU-only")


def wrap_ddp(model: torch.nn.Module, megatron_cfg: MegatronConfig) -> DistributedDataParallel:
    """megatron DistributedDataParallel around the built model, from MegatronDDPConfig."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    c = megatron_cfg.distributed_data_parallel_config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=c.grad_reduce_in_fp32,
        overlap_grad_reduce=c.overlap_grad_reduce,
        overlap_param_gather=c.overlap_param_gather,
        use_distributed_optimizer=bool(megatron_cfg.optimizer.use_distributed_optimizer),
        use_megatron_fsdp=c.use_custom_fsdp,
        data_parallel_sharding_strategy=c.data_parallel_sharding_strategy,
        average_in_collective=False,
    )
    return DistributedDataParallel(config=unwrap_model(model).config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model: DistributedDataParallel, megatron_cfg: MegatronConfig) -> MegatronOptimizer:
    """megatron's optimizer from MegatronOptimizerConfig (clip_grad forced to 0 on CPU; rlpost clips there)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = megatron_cfg.optimizer
    config = OptimizerConfig(
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        bf16=bool(o.bf16),
        fp16=bool(o.fp16),
        params_dtype=_DTYPES[o.params_dtype or "float32"],
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum,
        use_distributed_optimizer=bool(o.use_distributed_optimizer),
        use_precision_aware_optimizer=o.use_precision_aware_optimizer,
        clip_grad=0.0 if is_cpu_compat_active() else o.clip_grad,
        optimizer_cpu_offload=o.optimizer_cpu_offload,
        optimizer_offload_fraction=o.optimizer_offload_fraction,
    )
    return get_megatron_optimizer(config, [ddp_model])


def build_scheduler(
    optimizer: MegatronOptimizer, megatron_cfg: MegatronConfig, train_iters: int | None = None
) -> OptimizerParamScheduler:
    """OptimizerParamScheduler from MegatronSchedulerConfig; decay/wd-increment over train_iters steps.

    train_iters defaults to megatron_cfg.train_iters, then to lr_warmup_iters + 1 (enough for constant styles).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s, o = megatron_cfg.scheduler, megatron_cfg.optimizer
    total = train_iters or megatron_cfg.train_iters or s.lr_warmup_iters + 1
    decay = s.lr_decay_iters or total
    return OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.lr_warmup_iters,
        lr_decay_steps=max(decay, s.lr_warmup_iters + 1),
        lr_decay_style=s.lr_decay_style,
        start_wd=s.start_weight_decay,
        end_wd=s.end_weight_decay,
        wd_incr_steps=total,
        wd_incr_style=s.weight_decay_incr_style,
    )


def _finalize_without_token_scaling(
    model_chunks: list[torch.nn.Module], num_tokens: torch.Tensor | None, **kwargs: object
) -> None:
    """finalize_model_grads with num_tokens=None: grads are summed over DP and never divided by a token count."""
    from megatron.core.distributed import finalize_model_grads

    del num_tokens
    finalize_model_grads(model_chunks, None, **kwargs)


def resolve_for_model(model: torch.nn.Module, megatron_cfg: MegatronConfig) -> MegatronConfig:
    """megatron_cfg with the optimizer fields left None made concrete (`MegatronOptimizerConfig.resolved`) for this
    model: its parameters' dtype as the precision, their device, and the data-parallel size of parallel_state."""
    from megatron.core import parallel_state as ps

    first = next(unwrap_model(model).parameters())
    precision = {v: k for k, v in _DTYPES.items()}[first.dtype]
    optimizer = megatron_cfg.optimizer.resolved(precision, first.device.type, ps.get_data_parallel_world_size())
    return dataclasses.replace(megatron_cfg, optimizer=optimizer)


def setup_training(model: torch.nn.Module, megatron_cfg: MegatronConfig, train_iters: int | None = None
                   ) -> MegatronTrainState:
    """Wrap the built model in DDP, build optimizer + scheduler and install the schedule hooks on its config
    (optimizer fields left None follow the model: `resolve_for_model`)."""
    megatron_cfg = resolve_for_model(model, megatron_cfg)
    _check_cpu_support(megatron_cfg)
    ddp = wrap_ddp(model, megatron_cfg)
    optimizer = build_optimizer(ddp, megatron_cfg)
    scheduler = build_scheduler(optimizer, megatron_cfg, train_iters)
    config = unwrap_model(ddp).config
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = _finalize_without_token_scaling
    config.grad_scale_func = optimizer.scale_loss
    clip = float(megatron_cfg.optimizer.clip_grad)
    return MegatronTrainState(ddp, optimizer, scheduler, clip_grad=clip, manual_clip=is_cpu_compat_active())


def _step_with_manual_clip(optimizer: MegatronOptimizer, clip_grad: float) -> tuple[bool, float]:
    """megatron's ChainedOptimizer.step with rlpost's fp32 clip (CPU): coefficient max / (norm + 1e-6) if < 1."""
    if optimizer.prepare_grads():
        return False, float("nan")
    grad_norm = float(optimizer.get_grad_norm())
    if clip_grad > 0.0:
        coeff = clip_grad / (grad_norm + 1.0e-6)
        if coeff < 1.0:
            chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]  # experts: an optimizer of their own
            grads = [p.grad for o in chained for p in o.get_parameters() if p.grad is not None]
            torch._foreach_mul_(grads, coeff)
    return bool(optimizer.step_with_ready_grads()), grad_norm


def reduce_sums(loss: float, metrics: dict[str, float]) -> tuple[float, dict[str, float]]:
    """Sum loss and metrics over DP ranks (last stage; in fp64 on the DP group's device), then share them with every
    pipeline stage."""
    from megatron.core import parallel_state as ps

    keys = sorted(metrics)
    is_last = ps.is_pipeline_last_stage()
    if is_last and ps.get_data_parallel_world_size() > 1:
        summed = all_reduce_floats([loss] + [metrics[k] for k in keys], ps.get_data_parallel_group())
        loss, metrics = summed[0], dict(zip(keys, summed[1:], strict=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        box = [(loss, metrics)]
        dist.broadcast_object_list(
            box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        loss, metrics = box[0]
    return loss, metrics


def _forward_backward(
    state: MegatronTrainState,
    microbatches: Sequence[Mapping[str, Any]],
    loss_fn: MicrobatchLoss,
    temperature: float,
    loss_input: Literal["logits", "logprobs", "head"],
    chunk_size: int | None,
    forward_only: bool,
) -> tuple[float, dict[str, float], list[dict[str, float]]]:
    """megatron's forward(-backward) schedule over the micro-batches: this rank's summed loss and metrics (last
    stage; zero elsewhere), and each micro-batch's routing statistics (a mixture of experts'; this stage's layers).
    Gradients go into DDP's buffers, finalised as the model config says."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlpost.models.megatron import context_parallel as cp

    ddp = state.model
    group = resolve_tp_group(None)
    start, end, vocab = vocab_shard_range(ddp, group)
    device = next(unwrap_model(ddp).parameters()).device
    metric_sums: dict[str, float] = {}
    moe_routers = routers(unwrap_model(ddp))
    routing: list[dict[str, float]] = []

    def forward_step(data_iterator: Iterator[Mapping[str, Any]], mdl: torch.nn.Module) -> tuple[torch.Tensor, LossFunc]:
        mb = next(data_iterator)
        ids = mb["input_ids"].to(device)
        with router_stats(moe_routers, _valid_tokens(mb, moe_routers, device), megatron_routing) as moe:
            output = mdl(cp.split(ids), None, None)
        routing.append(moe)

        def loss_func(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            x: torch.Tensor | HeadLogits
            out = cp.gather(out, ids.shape[1])  # whole sequences under context parallelism
            if loss_input == "head":  # `out` is the final hidden states (output_head.passthrough)
                x = head_logits(ddp, out, temperature, chunk_size, start, vocab, group)
            else:
                logits = scale_and_mask_logits(out, temperature, start, vocab)
                x = logits if loss_input == "logits" else vocab_parallel_logprobs(logits, ids, start, end, group,
                                                                                  chunk_size)
            loss, metrics = loss_fn(x, mb)
            for k, v in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
            return loss, torch.zeros((), dtype=torch.int, device=out.device), {"loss": loss.detach()}

        return output, loss_func

    first = microbatches[0]["input_ids"]
    with passthrough(ddp, active=loss_input == "head"):
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[ddp],
            num_microbatches=len(microbatches),
            seq_length=int(first.shape[1]),
            micro_batch_size=int(first.shape[0]),
            forward_only=forward_only,
        )
    return (float(sum(float(r["loss"]) for r in results)) if results else 0.0), metric_sums, routing


def _valid_tokens(mb: Mapping[str, Any], moe_routers: list[torch.nn.Module], device: torch.device
                  ) -> torch.Tensor | None:
    """[S x B] the micro-batch's tokens within their row's length, in the sequence-major order megatron's routers
    see them (None for a dense model)."""
    if not moe_routers or "input_lengths" not in mb:
        return None
    return row_tokens(mb["input_ids"], mb["input_lengths"], sequence_major=True).to(device)


def _optimizer_step(state: MegatronTrainState) -> tuple[bool, float]:
    """Clip (rlpost's fp32 clip on CPU, megatron's own elsewhere) and step; (success, grad norm before clipping)."""
    if state.manual_clip:
        success, grad_norm = _step_with_manual_clip(state.optimizer, state.clip_grad)
    else:
        success, norm, _ = state.optimizer.step()
        grad_norm = float(norm) if norm is not None else float(state.optimizer.get_grad_norm())
    return bool(success), grad_norm


def train_step(
    state: MegatronTrainState,
    microbatches: Sequence[Mapping[str, Any]],
    loss_fn: MicrobatchLoss,
    *,
    temperature: float = 1.0,
    loss_input: Literal["logits", "logprobs", "head"] = "logits",
    chunk_size: int | None = None,
    forward_only: bool = False,
) -> TrainStepResult:
    """Forward/backward every micro-batch of one global batch, then one optimizer and scheduler step
    (forward_only: the losses and metrics only, under no_grad, with no step: validation).

    Each micro-batch maps "input_ids" ([mbs, S], right-padded; with PP every micro-batch must share [mbs, S]) to
    whatever loss_fn reads. loss_fn gets, per micro-batch on the last stage, either this TP rank's logits
    [mbs, S, V_local] (loss_input="logits"; divided by the temperature, padded vocab columns at the dtype minimum;
    rank r holds the vocab slice [r * V_local, (r + 1) * V_local)) or the next-token logprobs [mbs, S]
    (loss_input="logprobs"; fp32, position 0 = 0) or HeadLogits (loss_input="head": the output layer read
    `chunk_size` tokens at a time, rlpost.models.megatron.output_head), and must return a loss already normalised by
    the global batch.
    """
    ddp, optimizer = state.model, state.optimizer
    run = functools.partial(_forward_backward, state, microbatches, loss_fn, temperature, loss_input, chunk_size,
                            forward_only)
    if forward_only:
        ddp.eval()
        with torch.no_grad():
            loss, metric_sums, routing = run()
        ddp.train()
        loss, metrics = reduce_sums(loss, metric_sums)
        return TrainStepResult(loss, 0.0, float(optimizer.param_groups[0]["lr"]), metrics, len(microbatches), True,
                               routing)
    ddp.train()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss, metric_sums, routing = run()
    lr = float(optimizer.param_groups[0]["lr"])
    success, grad_norm = _optimizer_step(state)
    if success:
        state.scheduler.step(increment=1)
    loss, metrics = reduce_sums(loss, metric_sums)
    return TrainStepResult(loss, grad_norm, lr, metrics, len(microbatches), success and not math.isnan(grad_norm),
                           routing)


# ---- one global batch in parts (rlpost.models.policy.train_parts) ---------------------------------------------


def begin_accumulation(state: MegatronTrainState) -> None:
    """Zero the gradient buffers before the first part (each part sets train mode itself)."""
    state.model.zero_grad_buffer()
    state.optimizer.zero_grad()


def accumulate_part(
    state: MegatronTrainState,
    microbatches: Sequence[Mapping[str, Any]],
    loss_fn: MicrobatchLoss,
    *,
    temperature: float = 1.0,
    loss_input: Literal["logits", "logprobs", "head"] = "logits",
    chunk_size: int | None = None,
) -> tuple[float, list[dict[str, float]]]:
    """Forward/backward over one part's micro-batches into DDP's gradient buffers, left unfinalised (no
    data-parallel reduce, no optimizer step: `step_accumulated` does both once for every part); this rank's summed
    loss and each micro-batch's routing statistics. Without overlap_grad_reduce (checked by the config layer) DDP
    starts no communication inside a part."""
    config = unwrap_model(state.model).config
    finalize, config.finalize_model_grads_func = config.finalize_model_grads_func, None
    try:
        state.model.train()
        loss, _, routing = _forward_backward(state, microbatches, loss_fn, temperature, loss_input, chunk_size, False)
    finally:
        config.finalize_model_grads_func = finalize
    return loss, routing


def step_accumulated(state: MegatronTrainState, scale: float) -> tuple[bool, float]:
    """After the last part: the accumulated gradients times `scale` (the global normaliser the parts ran without),
    finalised (data-parallel reduce, tied embeddings across pipeline stages) and stepped once, as `train_step`
    would on the whole batch; (success, grad norm before clipping). The caller steps the scheduler."""
    state.model.scale_gradients(scale)
    _finalize_without_token_scaling([state.model], None)
    return _optimizer_step(state)


def normalised_loss(
    loss_fn: LossFunction, gs: torch.Tensor, gt: torch.Tensor, vp: VocabParallelArgs, recorded: list[dict[str, float]],
    logits: torch.Tensor, mb: BatchedDataDict,
) -> tuple[torch.Tensor, dict[str, float]]:
    """train_step's per-micro-batch loss: loss_fn with the global counts; its metrics are kept per micro-batch."""
    loss, metrics = loss_fn(logits, mb, gs, gt, **vp)
    recorded.append(metrics)
    return loss, {}


class NoSchedulerStep:
    """Stands in for the scheduler inside train_step: the worker steps the real one once per train() call."""

    def step(self, increment: int) -> None:
        del increment


def pad_sequences(data: BatchedDataDict, multiple: int) -> BatchedDataDict:
    """Right-pad every [B, S, ...] tensor to a multiple of S (sequence parallelism); zeros are masked out."""
    from rlpost.distributed.batched_data_dict import BatchedDataDict

    seq = int(data["input_ids"].shape[1])
    extra = (-seq) % multiple
    if extra == 0:
        return data
    out = {
        k: torch.nn.functional.pad(v.transpose(1, -1), (0, extra)).transpose(1, -1)
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq else v
        for k, v in data.items()
    }
    return BatchedDataDict(out)


def with_routing(recorded: list[dict[str, float]], routing: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each micro-batch's loss metrics with its routing statistics (a mixture of experts'), when this rank has
    both for every micro-batch (the last pipeline stage of a model whose layers it holds)."""
    if len(recorded) == len(routing):
        for metrics, moe in zip(recorded, routing, strict=True):
            metrics.update(moe)
    return recorded


def from_last_stage(recorded: list[dict[str, float]]) -> list[dict[str, float]]:
    """The micro-batches' metrics, which only the last pipeline stage recorded, on every stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return recorded
    box = [recorded]
    dist.broadcast_object_list(
        box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return box[0]
