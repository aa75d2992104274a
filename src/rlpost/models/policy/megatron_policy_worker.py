"""`policy=megatron`: one rank of a Megatron-Core policy (one Ray actor per rank).

`Policy` drives it exactly like the DTensor workers (same constructor, method names and return shapes). Ranks are
laid out tp-fastest, then cp, dp, pp: megatron's default order, so `parallel_state` groups match `RayWorkerGroup`'s
sharding. The model is the HF checkpoint at `policy.model_name` (with `policy.hf_config_overrides`) converted in
memory into a megatron GPTModel (`rlpost.models.megatron`).

- get_logprobs: megatron's forward-only schedule over micro-batches of `logprob_batch_size` (rows padded to a
  multiple when PP > 1), logits / `generation.temperature`, vocab-parallel log-softmax; [B, S] fp32, position 0 = 0.
- get_reference_policy_logprobs: a CPU copy of this rank's shard of the INITIAL weights (the HF checkpoint, taken
  before any checkpoint is loaded: NeMo RL's reference is the pretrained model) is swapped in for the pass; with
  LoRA (`megatron_cfg.peft`, rlpost.models.megatron.lora) the adapters are switched off instead, and only the
  modules trained in full (peft.modules_to_save) have a copy.
- train: per global batch, Gs / Gt (valid sequences, valid tokens[1:]) are summed over the DP group; the loss
  function gets TP-sharded logits / temperature and returns a loss normalised by Gs / Gt; `train_step` runs
  megatron's forward-backward schedule with per-token loss and no averaging (gradients are plain sums over
  micro-batches and DP ranks), clips and steps. The OptimizerParamScheduler (it also owns the weight decay, via
  start/end_weight_decay) is stepped ONCE per train() call, like NeMo RL's Megatron worker (`step(increment=gbs)`
  with gbs-scaled counts) and the DTensor worker: warm-up / decay iterations count GRPO steps. loss / grad_norm
  are means over global batches, lr is the rate after the scheduler step.
- train_part / finish_parts (synchronous GRPO overlapped with generation, `rlpost.models.policy.train_parts`): each
  part runs the same schedule with both normalisers 1 and the gradient finalisation held back; finish_parts scales
  DDP's gradient buffers by the global counts, reduces them over DP and steps once (overlap_grad_reduce off).
- Clipping: `megatron_cfg.optimizer.clip_grad` when > 0, else `policy.max_grad_norm` (None: none); on CPU rlpost
  clips the fp32 grads itself with megatron's rule (megatron's clip asserts CUDA tensor types).
- Export: TP all-gather + PP broadcast to full HF-named tensors (tied lm_head included) by DP
  replica 0; global rank 0 keeps them. Checkpoints: see `megatron_checkpoint` (DCP, same-layout restore, hf/).
- Memory phases (GPU; no-ops on CPU, rlpost.models.megatron.offload): offload_before_refit (and
  prepare_for_lp_inference with offload_optimizer_for_logprob) moves the optimizer (its state and its fp32 main
  params) to pinned host memory, prepare_for_training / train bring it back. offload_after_refit, which runs while
  a colocated engine generates, moves everything else too: DDP's parameter and gradient buffers and the parameters
  outside them; the next call that needs the model brings them back first. empty_unused_memory_level 1 / 2: empty
  the cache after each global batch / also after each logprob pass. With sequence_parallel the sequence is
  right-padded to a multiple of TP.
- Precision and optimizer: megatron_cfg.optimizer.bf16 / fp16 / params_dtype left null follow policy.precision;
  use_distributed_optimizer left null is on with CUDA and DP > 1 (MegatronOptimizerConfig.resolved).

Device (env RLPOST_DEVICE): 'cpu' = gloo, the local layer spec, fp32 and the CPU compatibility layer, switched on
around every call in the calling thread (Ray runs actor calls on a thread pool; the layer's function mode is per
thread), so megatron calls must not run concurrently on one worker (`Policy` never does). 'cuda' = nccl, the
Transformer Engine spec when importable, precision and (distributed) optimizer as configured.

Not supported, with an error naming the key: dynamic batching, sequence packing, context / expert parallelism,
reward models; on CPU also the GPU-only options (bf16/fp16 training, the distributed / precision-aware /
offloaded optimizer, megatron FSDP, sequence parallelism, activation checkpointing). Ray reports a failed actor
constructor only as "actor died" (its first line has no message), so such an error found in __init__ is kept and
re-raised by every later call, which reaches the driver in full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from rlpost.config.errors import ConfigError
from rlpost.config.layout import maps_large_buffers
from rlpost.config.schema.megatron import MegatronPolicyConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.start_gate import StartGate
from rlpost.losses.interface import LossFunction, VocabParallelArgs
from rlpost.models.megatron.offload import HostOffload
from rlpost.models.megatron.output_head import loss_input
from rlpost.models.megatron.train_step import from_last_stage, pad_sequences
from rlpost.models.policy.global_batches import finish_result, train_global_batches
from rlpost.models.policy.interfaces import WorkerTrainResult
from rlpost.models.policy.train_parts import Parts, PartsLoss, TrainPartsMixin
from rlpost.models.policy.weight_export import WeightExportMixin
from rlpost.runtime import host_malloc
from rlpost.runtime.gc_heap import import_frozen

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import MegatronOptimizer

    from rlpost.models.megatron.train_step import MegatronTrainState

_P = ParamSpec("_P")
_R = TypeVar("_R")

def _megatron_call(fn: Callable[Concatenate[MegatronPolicyWorker, _P], _R]
                   ) -> Callable[Concatenate[MegatronPolicyWorker, _P], _R]:
    """Re-raise a deferred init error; bring an offloaded model back to the GPU; on CPU run the call with the CPU
    compatibility layer on in this thread."""

    @functools.wraps(fn)
    def wrapper(self: MegatronPolicyWorker, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self._init_error is not None:
            raise self._init_error
        if self.device.type != "cpu":
            self._host.onload_model(self.model)
            return fn(self, *args, **kwargs)
        from rlpost.models.megatron.cpu_compat import cpu_compat

        with cpu_compat():
            return fn(self, *args, **kwargs)

    return wrapper


class MegatronPolicyWorker(TrainPartsMixin, WeightExportMixin):
    """One rank of a Megatron-Core policy. Constructed inside a Ray actor with RANK/WORLD_SIZE/MASTER_* set."""

    def __init__(
        self,
        cfg: MegatronPolicyConfig,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        start_after: StartGate | None = None,
    ) -> None:
        """`start_after`: nothing is allocated before it is ready (rlpost.distributed.start_gate)."""
        self.cfg = cfg
        self._start_after = start_after
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.device = torch.device(os.environ.get("RLPOST_DEVICE", "cpu"))
        self._init_error: BaseException | None = None
        self._export: list[tuple[str, torch.Tensor]] = []
        self._host = HostOffload(self.device)
        self._init_parts()
        try:
            cfg.check("policy")  # validation ran these; repeated for a config built in code
            cfg.check_device("policy", self.device.type, init_optimizer)
        except (ConfigError, NotImplementedError) as exc:
            self._init_error = exc  # re-raised by every call (see the module docstring)
            return
        self._setup(weights_path, optimizer_path, init_optimizer, init_reference_model)

    @_megatron_call
    def _setup(
        self, weights_path: str | None, optimizer_path: str | None, init_optimizer: bool, init_ref: bool
    ) -> None:
        # megatron-core's import (a large heap) with the collector paused, then frozen (rlpost.runtime.gc_heap)
        import_frozen("megatron.core.models.gpt.gpt_model", "megatron.core.optimizer", "megatron.core.distributed")
        if maps_large_buffers(self.cfg.max_total_sequence_length):  # freed activations leave the process
            host_malloc.map_large_buffers()
        from megatron.core import parallel_state as ps

        from rlpost.models.megatron.cpu_compat import seed_model_parallel_rng
        from rlpost.models.megatron.model import build_gpt_model, freeze_moe_routers, load_hf_checkpoint
        from rlpost.models.megatron.train_step import setup_training
        from rlpost.models.policy import megatron_checkpoint

        if self._start_after is not None:  # colocated engines start, and sleep, before this rank touches the device
            self._start_after.wait()
        m = self.cfg.megatron_cfg
        assert m is not None
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        else:
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=m.tensor_model_parallel_size,
            pipeline_model_parallel_size=m.pipeline_model_parallel_size,
            context_parallel_size=m.context_parallel_size,
            expert_model_parallel_size=m.expert_model_parallel_size,
        )
        seed_model_parallel_rng(1234)
        self.dp_size = ps.get_data_parallel_world_size()
        # optimizer flags left null follow the precision, the device and DP (checkpoints read the resolved values)
        m = dataclasses.replace(m, optimizer=m.optimizer.resolved(self.cfg.precision, self.device.type, self.dp_size))
        self.cfg = dataclasses.replace(self.cfg, megatron_cfg=m)
        self.temperature = float(self.cfg.generation.temperature) if self.cfg.generation is not None else 1.0
        hf_config, hf_state = load_hf_checkpoint(self.cfg.model_name)
        for key, value in self.cfg.hf_config_overrides.items():
            setattr(hf_config, key, value)
        self.hf_config = hf_config
        # LoRA's hooks need megatron's own linears (the local spec): TE's fused layer-norm linear hides their input
        model = build_gpt_model(hf_config, m, self.cfg.precision, hf_state_dict=hf_state,
                                use_te=False if m.peft.enabled else None)
        del hf_state
        if m.freeze_moe_router:
            freeze_moe_routers(model)
        self.model: Any = model
        if self.cfg.value_head:  # PPO's critic: one value per position in place of the vocabulary's logits
            from rlpost.models.megatron.scoring import attach_value_head

            attach_value_head(self.gpt, hf_config.hidden_size, hf_config.initializer_range)
        self.lora = m.peft.enabled
        if self.lora:  # adapters on the linears, everything else frozen (rlpost.models.megatron.lora)
            from rlpost.models.megatron.lora import inject

            inject(self.gpt, m.peft, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
        self.reference: dict[str, torch.Tensor] | None = None
        self._has_reference = init_ref
        if init_ref:  # with LoRA the reference is the base: the adapters switched off, the saved modules' base copy
            from rlpost.models.megatron.lora import is_saved_param

            tied = bool(self.gpt.share_embeddings_and_output_weights)
            self.reference = {k: v.detach().to("cpu", copy=True) for k, v in self.local_state().items()
                              if not self.lora or is_saved_param(k, m.peft, tied)} or None
        self.train_state: MegatronTrainState | None = None
        if init_optimizer:
            max_norm = self.cfg.max_grad_norm
            clip = m.optimizer.clip_grad if m.optimizer.clip_grad > 0 else float(max_norm or 0.0)
            run_cfg = dataclasses.replace(m, optimizer=dataclasses.replace(m.optimizer, clip_grad=clip))
            self.train_state = setup_training(model, run_cfg, m.train_iters)
            self.model = self.train_state.model
        if weights_path:
            megatron_checkpoint.load(self, weights_path, optimizer_path)
        self._host.attach(self.model, self._optimizer)  # what the memory phases move, listed while on the GPU

    # ---- small helpers -----------------------------------------------------------------
    def ping(self) -> int:
        if self._init_error is not None:
            raise self._init_error
        return self.rank

    @property
    def gpt(self) -> GPTModel:
        """The GPTModel inside the DDP / Float16Module wrappers."""
        from rlpost.models.megatron.export import unwrap_model

        return unwrap_model(self.model)

    @property
    def _optimizer(self) -> MegatronOptimizer | None:
        return self.train_state.optimizer if self.train_state is not None else None

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's shard: megatron names -> tensors aliasing the parameters (no TE _extra_state)."""
        return {
            k: v for k, v in self.gpt.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
        }

    def _vp_kwargs(self) -> VocabParallelArgs:
        from megatron.core import parallel_state as ps

        from rlpost.models.megatron.model import resolve_tp_group

        group = resolve_tp_group(None)
        if group is None:
            return {}
        return {"vocab_parallel_group": group, "vocab_parallel_rank": ps.get_tensor_model_parallel_rank()}

    def _seq_multiple(self) -> int:
        m = self.cfg.megatron_cfg
        assert m is not None
        return m.tensor_model_parallel_size if m.sequence_parallel else 1

    def _empty_cache(self, level: int) -> None:
        m = self.cfg.megatron_cfg
        if self.device.type == "cuda" and m is not None and m.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    # ---- logprobs ----------------------------------------------------------------------
    def _scoring_ids(self, data: BatchedDataDict) -> tuple[torch.Tensor, int]:
        """input_ids padded for a forward-only pass (sequence parallelism's length multiple; equal micro-batches
        under pipeline parallelism, the extra rows to drop afterwards) and the micro-batch size."""
        from megatron.core import parallel_state as ps

        ids, rows = data["input_ids"], int(data["input_ids"].shape[0])
        ids = pad_sequences(BatchedDataDict(input_ids=ids), self._seq_multiple())["input_ids"]
        mbs = min(self.cfg.logprob_batch_size, rows)
        pad_rows = (-rows) % mbs if ps.get_pipeline_model_parallel_world_size() > 1 else 0
        if pad_rows:
            ids = torch.cat([ids, ids[:1].expand(pad_rows, -1)])
        return ids, mbs

    def _logprobs(self, data: BatchedDataDict) -> torch.Tensor:
        from rlpost.models.megatron.model import forward_logprobs

        rows, seq = int(data["input_ids"].shape[0]), int(data["input_ids"].shape[1])
        if rows == 0:
            return torch.zeros(0, seq)
        ids, mbs = self._scoring_ids(data)
        lp = forward_logprobs(
            self.model, ids, None, self.temperature, micro_batch_size=mbs, chunk_size=self.cfg.logprob_chunk_size
        )
        self._empty_cache(2)
        return lp[:rows, :seq].float().cpu()

    @_megatron_call
    @torch.no_grad()
    def get_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """A value model's (policy.value_head: PPO's critic) values [B, S], aligned like logprobs."""
        from rlpost.models.megatron.scoring import forward_values

        rows, seq = int(data["input_ids"].shape[0]), int(data["input_ids"].shape[1])
        ids, mbs = self._scoring_ids(data)
        return BatchedDataDict(values=forward_values(self.model, ids, mbs)[:rows, :seq].cpu())

    @_megatron_call
    @torch.no_grad()
    def get_topk_logits(self, data: BatchedDataDict, k: int | None) -> BatchedDataDict:
        """A distillation teacher's top-k indices and logprobs [B, S, k] per position, aligned like logprobs."""
        from rlpost.models.megatron.scoring import forward_topk

        rows, seq = int(data["input_ids"].shape[0]), int(data["input_ids"].shape[1])
        ids, mbs = self._scoring_ids(data)
        idx, lp = forward_topk(self.model, ids, k, self.temperature, mbs)
        return BatchedDataDict(teacher_topk_indices=idx[:rows, :seq].cpu(), teacher_topk_logprobs=lp[:rows, :seq].cpu())

    @_megatron_call
    @torch.no_grad()
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        return BatchedDataDict(logprobs=self._logprobs(data))

    @_megatron_call
    @torch.no_grad()
    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        if not self._has_reference:
            raise RuntimeError("the policy was built without a reference model (init_reference_model=False)")
        from rlpost.models.megatron.lora import adapters_off

        with adapters_off(self.gpt) if self.lora else contextlib.nullcontext():  # LoRA: the base is the reference
            current = self._swap_weights(self.reference) if self.reference is not None else None
            try:
                lp = self._logprobs(data)
            finally:
                if current is not None:
                    self._swap_weights(current)
        return BatchedDataDict(reference_logprobs=lp)

    @torch.no_grad()
    def _swap_weights(self, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy `new` into the model; returns what was there (a storage shared by two names once)."""
        old: dict[str, torch.Tensor] = {}
        seen = set()
        for k, v in self.local_state().items():
            if k not in new:
                continue
            if v.data_ptr() in seen:
                continue
            seen.add(v.data_ptr())
            old[k] = v.detach().to("cpu", copy=True)
            v.copy_(new[k].to(v.device))
        return old

    # ---- training ----------------------------------------------------------------------
    # One global batch trained in parts (rlpost.models.policy.train_parts): megatron's schedule runs over each
    # part's micro-batches with the gradient finalisation held back, and `step_accumulated` scales, reduces and
    # steps once.
    @_megatron_call
    def _begin_parts(self) -> None:
        from rlpost.models.megatron.train_step import begin_accumulation

        if self.train_state is None:
            raise RuntimeError("the policy was built without an optimizer (init_optimizer=False)")
        self._host.restore_optimizer(self._optimizer)
        begin_accumulation(self.train_state)

    @_megatron_call
    def _accumulate_part(self, parts: Parts, data: BatchedDataDict, loss_fn: LossFunction) -> None:
        from rlpost.models.megatron.train_step import accumulate_part, normalised_loss, with_routing

        assert self.train_state is not None  # _begin_parts checked it
        one = torch.ones((), device=self.device)
        recorded: list[dict[str, float]] = []
        mb_loss = functools.partial(normalised_loss, loss_fn, one, one, self._vp_kwargs(), recorded)
        micro = [mb.to(self.device) for mb in
                 pad_sequences(data, self._seq_multiple()).make_microbatch_iterator(self.cfg.train_micro_batch_size)]
        loss, routing = accumulate_part(self.train_state, micro, mb_loss, temperature=self.temperature,
                                        loss_input=loss_input(loss_fn, self.model),
                                        chunk_size=self.cfg.logprob_chunk_size)
        parts.loss += loss
        parts.metrics += from_last_stage(with_routing(recorded, routing))
        self._empty_cache(1)

    @_megatron_call
    def _step_parts(self, parts: Parts, loss_fn: PartsLoss) -> WorkerTrainResult:
        from megatron.core import parallel_state as ps

        from rlpost.models.megatron.train_step import reduce_sums, step_accumulated

        assert self.train_state is not None  # _begin_parts checked it
        scale, metric_scales = parts.global_scales(loss_fn, ps.get_data_parallel_group())
        _, grad_norm = step_accumulated(self.train_state, scale)
        loss, _ = reduce_sums(float(parts.loss) * scale, {})
        self.train_state.scheduler.step(increment=1)
        return finish_result(parts.result(loss, grad_norm, metric_scales),
                             self.train_state.optimizer.param_groups[0]["lr"], self.model.parameters())

    @_megatron_call
    def train(self, data: BatchedDataDict, loss_fn: LossFunction, gbs: int | None = None,
              eval_mode: bool = False) -> WorkerTrainResult:
        """One optimizer step per global batch of `data` (eval_mode: the loss and metrics only, no update)."""
        from megatron.core import parallel_state as ps

        from rlpost.models.megatron.train_step import NoSchedulerStep, normalised_loss, train_step, with_routing

        if self.train_state is None:
            raise RuntimeError("the policy was built without an optimizer (init_optimizer=False)")
        self._host.restore_optimizer(self._optimizer)
        gbs = gbs or self.cfg.train_global_batch_size
        local_gbs = gbs // self.dp_size
        mbs = self.cfg.train_micro_batch_size
        pp = ps.get_pipeline_model_parallel_world_size()
        if pp > 1 and local_gbs % mbs:
            raise ValueError(f"with pipeline parallelism the local batch {local_gbs} (gbs {gbs} / dp {self.dp_size}) "
                             f"must split into equal micro-batches of policy.train_micro_batch_size={mbs}")
        step_state = dataclasses.replace(self.train_state, scheduler=NoSchedulerStep())
        vp = self._vp_kwargs()

        def step(gb: BatchedDataDict, gs: torch.Tensor, gt: torch.Tensor
                 ) -> tuple[float, float, list[dict[str, float]]]:
            gb = pad_sequences(gb, self._seq_multiple())
            micro = [mb.to(self.device) for mb in gb.make_microbatch_iterator(mbs)]
            recorded: list[dict[str, float]] = []
            mb_loss = functools.partial(normalised_loss, loss_fn, gs, gt, vp, recorded)
            res = train_step(step_state, micro, mb_loss, temperature=self.temperature, forward_only=eval_mode,
                             loss_input=loss_input(loss_fn, self.model), chunk_size=self.cfg.logprob_chunk_size)
            self._empty_cache(1)
            return res.loss, res.grad_norm, from_last_stage(with_routing(recorded, res.router_metrics))

        result = train_global_batches(data, local_gbs, self.device, ps.get_data_parallel_group(), step)
        if not eval_mode:
            self.train_state.scheduler.step(increment=1)
        return finish_result(result, self.train_state.optimizer.param_groups[0]["lr"], self.model.parameters())

    # ---- memory phases (GPU: optimizer, then the model, to / from pinned host memory: rlpost.models.megatron.offload)
    @_megatron_call
    def prepare_for_training(self) -> None:
        self._host.restore_optimizer(self._optimizer)
        self.model.train()

    @_megatron_call
    def prepare_for_lp_inference(self) -> None:
        self.model.eval()
        if self.cfg.offload_optimizer_for_logprob:
            self._host.offload_optimizer(self._optimizer)

    def offload_before_refit(self) -> None:
        """GPU: the optimizer goes to the host before the refit gathers the weights."""
        if self._init_error is not None:
            raise self._init_error
        self._host.offload_optimizer(self._optimizer)

    def offload_after_refit(self) -> None:
        """GPU, while a colocated engine generates: the refit's device buffers are freed, the optimizer and then the
        model (parameters, gradient buffers) go to the host; the next call that needs the model brings it back."""
        if self._init_error is not None:
            raise self._init_error
        self.release_device_buffers()
        self._host.offload_optimizer(self._optimizer)
        if self._parts is None:  # a batch trained in parts keeps its gradients in the buffers
            self._host.offload_model(self.model)

    def gpu_memory_stats(self) -> dict[str, float]:
        """logger.monitor_gpus: this rank's CUDA memory ({} on CPU)."""
        from rlpost.models.policy.memory_phases import cuda_memory_stats

        return cuda_memory_stats(self.device)

    # ---- refit export ----------------------------------------------------------------------
    def gather_full_weights(self, dtype: torch.dtype, every_rank: bool = False, tied_head: bool = True
                            ) -> dict[str, torch.Tensor]:
        """Collective over TP x PP of DP replica 0: rank 0 gets full HF-named CPU tensors (a tied lm_head too
        unless `tied_head` is false); `every_rank`: every replica gathers and every rank keeps them on its device."""
        from rlpost.models.policy.megatron_checkpoint import gather_hf_weights

        return gather_hf_weights(self, dtype, every_rank, tied_head)

    @_megatron_call
    def prepare_weights_for_export(self, dtype: str, every_rank: bool = False
                                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """All ranks: gather the full weights (collective); rank 0 (`every_rank`: each rank, for the engine on its
        device) keeps them cast to `dtype` under HF names.

        Returns the kept {name: (shape, dtype)} (the generation side's StateDictInfo), {} where nothing is kept.
        """
        m = self.cfg.megatron_cfg
        if m is not None and m.peft.enabled and m.peft.refit == "adapter":  # the adapters alone, PEFT's names
            from rlpost.models.policy.megatron_checkpoint import gather_peft_adapters

            self._export = list(gather_peft_adapters(self, getattr(torch, dtype), every_rank).items())
        else:
            # a tied head is not sent apart from the embedding: the engine derives it
            self._export = list(self.gather_full_weights(getattr(torch, dtype), every_rank, tied_head=False).items())
        return {k: (tuple(v.shape), v.dtype) for k, v in self._export}

    def init_refit_collective(self, host: str, port: int, world_size: int) -> bool:
        """Rank 0 joins the refit group with the engine workers (non-colocated refit)."""
        if self._init_error is not None:
            raise self._init_error
        self._join_refit_group(host, port, world_size)
        return True

    @_megatron_call
    def broadcast_weights_collective(self, dtype: str) -> str:
        """All ranks gather what a refit moves (prepare_weights_for_export); rank 0 broadcasts it to the engines.
        Rank 0's fingerprint."""
        self.prepare_weights_for_export(dtype)
        return self._broadcast_export()

    # ---- checkpoints -------------------------------------------------------------------------
    @_megatron_call
    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None, hf_export: bool = True) -> None:
        from rlpost.models.policy import megatron_checkpoint

        self._host.restore_optimizer(self._optimizer)
        megatron_checkpoint.save(self, weights_path, optimizer_path, hf_export=hf_export)

    def shutdown(self) -> bool:
        self.close_export_buffers()
        if self._init_error is None and dist.is_initialized():
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
