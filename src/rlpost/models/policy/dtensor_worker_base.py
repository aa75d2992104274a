"""Shared body of the DTensor policy workers (one Ray actor per rank).

A subclass only decides how the HF model is loaded and parallelised (`_build_model`). Everything
else — logprobs, the training step with global normalisation, the reference model, checkpoints
and weight export for refit — is here. With LoRA (`dtensor_cfg.lora_cfg`, rlpost.models.dtensor.lora) only the
adapters train, the reference is the base with the adapters off, and refit and export carry merged weights.

Training step (NeMo RL semantics): per global batch, the valid sequences and tokens are summed
over data-parallel ranks (Gs, Gt); each micro-batch loss is already divided by them, so the sum of
micro-batch losses is the global mean. FSDP averages gradients over DP, so each micro-batch loss is
multiplied by the DP size before backward. Logits are divided by the sampling temperature.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from rlpost.config.layout import maps_large_buffers
from rlpost.config.schema.lora import LoRAConfig
from rlpost.config.schema.policy import DTensorPolicyConfig
from rlpost.data.packing import PackedSequences
from rlpost.distributed.batched_data_dict import BatchedDataDict, PackedMicroBatch
from rlpost.distributed.collective_device import all_reduce
from rlpost.distributed.start_gate import StartGate
from rlpost.losses.interface import LossFunction, VocabParallelArgs
from rlpost.models.dtensor import context_parallel, lora
from rlpost.models.dtensor.output_head import head_logits, output_layer
from rlpost.models.expert_weights import to_checkpoint_layout
from rlpost.models.policy import dtensor_checkpoint
from rlpost.models.policy.global_batches import finish_result, train_global_batches
from rlpost.models.policy.interfaces import WorkerTrainResult
from rlpost.models.policy.memory_phases import OffloadState, cuda_memory_stats
from rlpost.models.policy.optim import build_optimizer, build_scheduler
from rlpost.models.policy.train_parts import Parts, PartsLoss, TrainPartsMixin
from rlpost.models.policy.weight_export import WeightExportMixin
from rlpost.models.router_stats import router_stats, routers, row_tokens
from rlpost.ops.chunked_head import HeadLogits
from rlpost.runtime import host_malloc
from rlpost.runtime.gc_heap import import_frozen

if TYPE_CHECKING:
    from rlpost.losses.packed import SequencePackingLossWrapper


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class DTensorWorkerBase(TrainPartsMixin, WeightExportMixin):
    """One rank of a DTensor policy. Constructed inside a Ray actor with RANK/WORLD_SIZE/MASTER_* set."""

    DP_DIM = "dp"
    """Name of the data-parallel mesh dimension."""

    def __init__(
        self,
        cfg: DTensorPolicyConfig,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        start_after: StartGate | None = None,
    ) -> None:
        """`start_after`: nothing is allocated before it is ready (rlpost.distributed.start_gate)."""
        # The heavy imports first, with the collector paused and their objects frozen (rlpost.runtime.gc_heap): the
        # model classes, and torch's compiler stack that the optimizer's first param group imports.
        import_frozen("torch._dynamo", "transformers.models.auto.modeling_auto")
        if maps_large_buffers(cfg.max_total_sequence_length):  # freed activations leave the process
            host_malloc.map_large_buffers()
        if start_after is not None:  # colocated engines start, and sleep, before this rank touches the device
            start_after.wait()
        self.cfg = cfg
        self.device = torch.device(os.environ.get("RLPOST_DEVICE", "cpu"))
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        else:
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if self.device.type == "cuda" else "gloo",
                rank=self.rank,
                world_size=self.world_size,
            )
        tp = cfg.dtensor_cfg.tensor_parallel_size
        cp = cfg.dtensor_cfg.context_parallel_size
        self.dp_size = self.world_size // (tp * cp)
        # ('dp', 'cp', 'tp') with context parallelism (rlpost.models.dtensor.context_parallel), else ('dp', 'tp')
        shape, names = ((self.dp_size, cp, tp), (self.DP_DIM, "cp", "tp")) if cp > 1 else \
            ((self.dp_size, tp), (self.DP_DIM, "tp"))
        self.mesh: DeviceMesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        self.tp_size = tp
        self.cp = context_parallel.ContextParallel(self.mesh["cp"].get_group()) if cp > 1 else None
        self._dp_group: dist.ProcessGroup | None = None
        self.temperature = float(cfg.generation.temperature) if cfg.generation is not None else 1.0
        self.lora: LoRAConfig | None = cfg.dtensor_cfg.lora_cfg if cfg.dtensor_cfg.lora_cfg.enabled else None
        torch.manual_seed(1234)
        self.model = self._build_model()
        self._routers = routers(self.model)  # a mixture of experts' (router_stats); [] for a dense model
        if self.cp is not None:
            context_parallel.enable(self.model, self.cp)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if init_optimizer and cfg.optimizer is not None:
            self.optimizer = build_optimizer(cfg.optimizer, [p for p in self.model.parameters() if p.requires_grad])
            self.scheduler = build_scheduler(cfg.scheduler, self.optimizer)
        # The reference policy is the model as loaded from policy.model_name, also when resuming; with LoRA, the
        # same model with its adapters off and a copy of the modules it trains in full (lora_cfg.modules_to_save).
        self.reference: dict[str, torch.Tensor] | None = None
        self._has_reference = init_reference_model
        if init_reference_model:
            self.reference = {k: _local(v).detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
                              if not self.lora or lora.is_saved_module(k, self.lora)} or None
        if weights_path:
            dtensor_checkpoint.load(self, weights_path, optimizer_path, lora_cfg=self.lora)
        self._export: list[tuple[str, torch.Tensor]] = []
        self._mem = OffloadState(self.device, params_on_cpu_by_fsdp=cfg.dtensor_cfg.cpu_offload)
        self._train_micro_batches = 0
        self._init_parts()

    # ---- subclass hook -----------------------------------------------------------------
    def _build_model(self) -> nn.Module:
        raise NotImplementedError

    # ---- small helpers -----------------------------------------------------------------
    def ping(self) -> int:
        return self.rank

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["tp"].get_group() if self.tp_size > 1 else None

    @property
    def dp_group(self) -> dist.ProcessGroup:
        # Slicing a DeviceMesh builds a sub-mesh object each time, and every global batch asks for it: keep one.
        if self._dp_group is None:
            self._dp_group = self.mesh[self.DP_DIM].get_group()
        return self._dp_group

    def _microbatches(self, data: BatchedDataDict, mbs: int) -> Iterator[BatchedDataDict | PackedMicroBatch]:
        if data.micro_batch_kind == "packing":
            yield from data.make_microbatch_iterator_for_packable_sequences()
        elif data.micro_batch_kind == "dynamic":
            yield from data.make_microbatch_iterator_with_dynamic_shapes()
        else:
            yield from data.make_microbatch_iterator(mbs)

    def _model_inputs(self, mb: BatchedDataDict | PackedMicroBatch
                      ) -> tuple[dict[str, object], BatchedDataDict, PackedSequences | None]:
        """The model's keyword arguments for a micro-batch ([1, T] packed or [B, S]), its rows, the packing."""
        if isinstance(mb, PackedMicroBatch):
            pk = mb.packed
            return ({"input_ids": pk.input_ids.to(self.device), "position_ids": pk.position_ids.to(self.device),
                     "attention_mask": pk.attention_mask(torch.float32).to(self.device), "use_cache": False},
                    mb.data, pk)
        # use_cache=False: a scoring pass has no use for the KV cache HF models otherwise build
        ids = mb["input_ids"].to(self.device)
        inputs: dict[str, object] = {"input_ids": ids} if self.cp is None else dict(self.cp.inputs(ids))
        return {**inputs, "use_cache": False}, mb, None

    def _forward_logits(self, mb: BatchedDataDict | PackedMicroBatch
                        ) -> tuple[torch.Tensor, BatchedDataDict, PackedSequences | None]:
        """Logits / temperature for a micro-batch: ([1, T, V] packed or [B, S, V]), its rows, the packing."""
        inputs, rows, pk = self._model_inputs(mb)
        logits = self.model(**inputs).logits
        if isinstance(logits, DTensor):
            logits = logits.to_local()  # [.., V / TP]: sharded over the vocabulary
        logits = logits.float()
        # nothing downstream writes into the logits, so at temperature 1 they are used as they are (no copy)
        return (logits / self.temperature if self.temperature != 1.0 else logits), rows, pk

    def _forward_chunked(self, mb: BatchedDataDict | PackedMicroBatch
                         ) -> tuple[torch.Tensor | HeadLogits, BatchedDataDict, PackedSequences | None]:
        """`_forward_logits`, except that a causal LM's logits come as HeadLogits, read a chunk of tokens at a time
        (rlpost.models.dtensor.output_head)."""
        head = output_layer(self.model)
        if head is None:
            return self._forward_logits(mb)
        inputs, rows, pk = self._model_inputs(mb)
        tp_group = self.tp_group if self.tp_size > 1 else None
        return (head_logits(self.model, head, inputs, self.temperature, self.cfg.logprob_chunk_size, tp_group),
                rows, pk)

    def _vp_kwargs(self) -> VocabParallelArgs:
        if self.tp_size == 1:
            return {}
        return {"vocab_parallel_group": self.tp_group, "vocab_parallel_rank": self.mesh["tp"].get_local_rank()}

    # ---- logprobs ----------------------------------------------------------------------
    @torch.no_grad()
    def get_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        from rlpost.ops.logprobs import next_token_logprobs

        self._onload()
        self.model.eval()
        full_len = int(data["input_ids"].shape[1])
        outs: list[torch.Tensor] = []
        for mb in self._microbatches(data, self.cfg.logprob_batch_size):
            logits, rows, pk = self._forward_chunked(mb)
            if isinstance(mb, PackedMicroBatch):
                pk = mb.packed
                ids = pk.input_ids.to(self.device)
                lp = next_token_logprobs(logits, ids, chunk_size=self.cfg.logprob_chunk_size, **self._vp_kwargs())
                starts = pk.cu_seqlens_padded[:-1].long()
                lp[0, starts] = 0.0  # a sequence's first token has no in-sequence context
                lp = mb.unpack(lp.cpu())  # [N, seq_len]
            else:
                lp = next_token_logprobs(
                    logits, rows["input_ids"].to(self.device), chunk_size=self.cfg.logprob_chunk_size,
                    **self._vp_kwargs(),
                ).cpu()
            if lp.shape[1] < full_len:
                lp = torch.nn.functional.pad(lp, (0, full_len - lp.shape[1]))
            if not mb.is_padding and not rows.is_padding:
                outs.append(lp)
        return BatchedDataDict(logprobs=torch.cat(outs, dim=0) if outs else torch.zeros(0, full_len))

    @torch.no_grad()
    def get_values(self, data: BatchedDataDict) -> BatchedDataDict:
        """A value model's (policy.value_head) values [B, S], aligned like logprobs: position t holds the head's
        output at t - 1, the value of the state that emits token t (0 at each sequence's first token)."""
        self._onload()
        self.model.eval()
        full_len = int(data["input_ids"].shape[1])
        outs: list[torch.Tensor] = []
        for mb in self._microbatches(data, self.cfg.logprob_batch_size):
            head, rows, pk = self._forward_logits(mb)
            v = torch.nn.functional.pad(head[..., 0], (1, 0))[:, :-1]  # [B, S] or [1, T]: shifted one position
            if isinstance(mb, PackedMicroBatch):
                assert pk is not None
                v[0, pk.cu_seqlens_padded[:-1].long()] = 0.0
                v = mb.unpack(v.cpu())
            v = v.cpu()
            if v.shape[1] < full_len:
                v = torch.nn.functional.pad(v, (0, full_len - v.shape[1]))
            if not mb.is_padding and not rows.is_padding:
                outs.append(v)
        return BatchedDataDict(values=torch.cat(outs, dim=0) if outs else torch.zeros(0, full_len))

    @torch.no_grad()
    def get_topk_logits(self, data: BatchedDataDict, k: int | None) -> BatchedDataDict:
        """A teacher's top-k tokens per position and its full-vocabulary log-softmax at them (k None: the whole
        vocabulary), [B, S, k] each, aligned like logprobs: position t holds the distribution that emits token t
        (position 0: index 0, logprob 0, never read)."""
        self._onload()
        self.model.eval()
        full_len = int(data["input_ids"].shape[1])
        idx_out: list[torch.Tensor] = []
        lp_out: list[torch.Tensor] = []
        for mb in self._microbatches(data, self.cfg.logprob_batch_size):
            if isinstance(mb, PackedMicroBatch):
                raise ValueError("a teacher scores unpacked micro-batches (its block turns packing off)")
            logits, rows, _ = self._forward_chunked(mb)
            if isinstance(logits, HeadLogits):
                indices, values = logits.topk_logprobs(k)  # [B, S, k] each, a chunk of tokens at a time
            else:
                lp = torch.log_softmax(logits, dim=-1)  # [B, S, V]
                indices, values = lp.topk(lp.shape[-1] if k is None else min(k, lp.shape[-1]), dim=-1)
            pad = (0, 0, 1, full_len - values.shape[1])  # one position at the front (the shift), the rest at the end
            if not mb.is_padding and not rows.is_padding:
                idx_out.append(torch.nn.functional.pad(indices[:, :-1], pad).cpu())
                lp_out.append(torch.nn.functional.pad(values[:, :-1].float(), pad).cpu())
        return BatchedDataDict(teacher_topk_indices=torch.cat(idx_out), teacher_topk_logprobs=torch.cat(lp_out))

    @torch.no_grad()
    def get_reference_policy_logprobs(self, data: BatchedDataDict) -> BatchedDataDict:
        if not self._has_reference:
            raise RuntimeError("the policy was built without a reference model (init_reference_model=False)")
        self._onload()
        with contextlib.ExitStack() as base:
            if self.lora is not None:  # LoRA: the base model is the reference
                base.enter_context(lora.adapters_off(self.model))
            current = self._swap_weights(self.reference) if self.reference is not None else None
            try:
                out = self.get_logprobs(data)
            finally:
                if current is not None:
                    self._swap_weights(current)
        return BatchedDataDict(reference_logprobs=out["logprobs"])

    @torch.no_grad()
    def _swap_weights(self, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy `new` (the whole state dict, or some of its tensors) into the model; returns what was there. Tied
        tensors (one storage under two names, e.g. embed_tokens / lm_head) are visited once, or the restore would
        write the swapped-in value back through the second name."""
        old: dict[str, torch.Tensor] = {}
        seen = set()
        for k, v in self.model.state_dict().items():
            if k not in new:
                continue
            local = _local(v)
            if local.data_ptr() in seen:
                continue
            seen.add(local.data_ptr())
            old[k] = local.detach().to("cpu", copy=True)
            local.copy_(new[k].to(local.device))
        return old

    # ---- training ----------------------------------------------------------------------
    def train(self, data: BatchedDataDict, loss_fn: LossFunction, gbs: int | None = None,
              eval_mode: bool = False) -> WorkerTrainResult:
        """One optimizer step per global batch of `data` (eval_mode: the loss and metrics only, under no_grad,
        with no update and no scheduler step: validation)."""
        if self.optimizer is None:
            raise RuntimeError("the policy was built without an optimizer (init_optimizer=False)")
        self._onload(with_optimizer=not eval_mode)
        self.model.train(not eval_mode)
        optimizer = self.optimizer
        local_gbs = (gbs or self.cfg.train_global_batch_size) // self.dp_size

        def step(gb: BatchedDataDict, gs: torch.Tensor, gt: torch.Tensor
                 ) -> tuple[float, float, list[dict[str, float]]]:
            if eval_mode:
                with torch.no_grad():
                    return forward_only(gb, gs, gt)
            optimizer.zero_grad(set_to_none=True)
            gb_loss = torch.zeros((), device=self.device)
            recorded = self._backward_micro_batches(gb, loss_fn, gs, gt, gb_loss)
            grad_norm = self._clip_grad_norm()
            optimizer.step()
            return float(all_reduce(gb_loss, self.dp_group)), grad_norm, recorded

        def forward_only(gb: BatchedDataDict, gs: torch.Tensor, gt: torch.Tensor
                         ) -> tuple[float, float, list[dict[str, float]]]:
            gb_loss = torch.zeros((), device=self.device)
            recorded = []
            for mb in self._microbatches(gb, self.cfg.train_micro_batch_size):
                loss, metrics = self._micro_loss(mb, loss_fn, gs, gt)
                gb_loss += loss
                recorded.append(metrics)
            return float(all_reduce(gb_loss, self.dp_group)), 0.0, recorded

        result = train_global_batches(data, local_gbs, self.device, self.dp_group, step)
        if self.scheduler is not None and not eval_mode:
            self.scheduler.step()
        return finish_result(result, optimizer.param_groups[0]["lr"], self.model.parameters())

    # ---- one global batch trained in parts (synchronous GRPO overlapped: rlpost.models.policy.train_parts) -----
    def _begin_parts(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("the policy was built without an optimizer (init_optimizer=False)")
        self.optimizer.zero_grad(set_to_none=True)

    def _accumulate_part(self, parts: Parts, data: BatchedDataDict, loss_fn: LossFunction) -> None:
        self._onload(with_optimizer=True)
        self.model.train()
        one = torch.ones((), device=self.device)
        parts.metrics += self._backward_micro_batches(data, loss_fn, one, one, parts.loss)

    def _step_parts(self, parts: Parts, loss_fn: PartsLoss) -> WorkerTrainResult:
        assert self.optimizer is not None  # _begin_parts checked it
        scale, metric_scales = parts.global_scales(loss_fn, self.dp_group)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        grad_norm = self._clip_grad_norm()
        self.optimizer.step()
        loss = all_reduce(parts.loss * scale, self.dp_group)
        if self.scheduler is not None:
            self.scheduler.step()
        return finish_result(parts.result(float(loss), grad_norm, metric_scales), self.optimizer.param_groups[0]["lr"],
                             self.model.parameters())

    def _backward_micro_batches(self, data: BatchedDataDict, loss_fn: LossFunction, gs: torch.Tensor, gt: torch.Tensor,
                                loss_sum: torch.Tensor) -> list[dict[str, float]]:
        """Forward and backward over `data`'s training micro-batches, gradients accumulating; each micro-batch's
        loss is added into `loss_sum` (in place); their metrics."""
        recorded = []
        for mb in self._microbatches(data, self.cfg.train_micro_batch_size):
            loss, metrics = self._micro_loss(mb, loss_fn, gs, gt)
            (loss * self.dp_size).backward()
            loss_sum += loss.detach()
            recorded.append(metrics)
            self._maybe_clear_cache()
        return recorded

    def _micro_loss(self, mb: BatchedDataDict | PackedMicroBatch, loss_fn: LossFunction, gs: torch.Tensor,
                    gt: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss (zero for a padding micro-batch) and metrics of one micro-batch, packed or not."""
        chunked = getattr(loss_fn, "chunked_logits", False)
        with router_stats(self._routers, self._valid_tokens(mb)) as moe:
            logits, rows, pk = self._forward_chunked(mb) if chunked else self._forward_logits(mb)
        rows = rows.to(self.device)
        fn: LossFunction | SequencePackingLossWrapper = loss_fn
        if pk is not None:
            from rlpost.losses.packed import SequencePackingLossWrapper

            fn = SequencePackingLossWrapper(loss_fn, pk.cu_seqlens, pk.cu_seqlens_padded)
        loss, metrics = fn(logits, rows, gs, gt, **self._vp_kwargs())  # type: ignore[arg-type]  # HeadLogits if chunked
        if mb.is_padding or rows.is_padding:
            loss = loss * 0.0
        return loss, {**metrics, **moe}

    def _valid_tokens(self, mb: BatchedDataDict | PackedMicroBatch) -> torch.Tensor | None:
        """[B x S] the tokens of a padded micro-batch within their row's length (None when packed: every packed
        token is a row's)."""
        if isinstance(mb, PackedMicroBatch) or not self._routers:
            return None
        return row_tokens(mb["input_ids"], mb["input_lengths"]).to(self.device)

    def _clip_grad_norm(self) -> float:
        """Global L2 grad norm over every parameter (TP-sharded and not), then clip to max_grad_norm.

        Parameters live on different meshes (TP-sharded ones on (dp, tp), others on (dp,)), so the
        norm is taken per mesh and combined; torch's clip_grad_norm_ refuses mixed meshes.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        groups: dict[tuple[tuple[str, ...], tuple[int, ...]] | None, list[torch.Tensor]] = {}
        for g in grads:
            key = (tuple(g.device_mesh.mesh_dim_names or ()), tuple(g.device_mesh.mesh.flatten().tolist())) if isinstance(
                g, DTensor
            ) else None
            groups.setdefault(key, []).append(g)
        sq = torch.zeros((), dtype=torch.float64)
        for gs in groups.values():
            n = torch.nn.utils.get_total_norm(gs, 2.0)
            if isinstance(n, DTensor):
                n = n.full_tensor()
            sq += n.detach().double().cpu() ** 2
        total = float(sq.sqrt())
        max_norm = self.cfg.max_grad_norm
        if max_norm is not None and total > max_norm:
            coef = max_norm / (total + 1e-6)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return total

    # ---- memory phases (GPU; no-ops on CPU, see memory_phases) -------------------------------
    def _onload(self, with_optimizer: bool = False) -> None:
        """Bring what offload_* moved to the CPU back before the model (or the optimizer) is used."""
        self._mem.onload(self.model, self.optimizer, with_optimizer)

    def _maybe_clear_cache(self) -> None:
        """dtensor_cfg.clear_cache_every_n_steps: empty the CUDA cache every N training micro-batches."""
        self._train_micro_batches += 1
        n = self.cfg.dtensor_cfg.clear_cache_every_n_steps
        if n and self.device.type == "cuda" and self._train_micro_batches % n == 0:
            torch.cuda.empty_cache()

    def prepare_for_training(self) -> None:
        self._onload(with_optimizer=True)
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        self._onload()
        self.model.eval()
        if self.cfg.offload_optimizer_for_logprob:
            self._mem.offload_optimizer(self.optimizer)

    def offload_before_refit(self) -> None:
        """Optimizer state to the CPU and gradients dropped before the engine wakes its weights."""
        self._mem.offload_optimizer(self.optimizer)

    def offload_after_refit(self) -> None:
        """The refit's device buffers freed and the model to the CPU too, so the engine has the GPU for generation."""
        self.release_device_buffers()
        self._mem.offload_optimizer(self.optimizer)
        self._mem.offload_model(self.model)

    def gpu_memory_stats(self) -> dict[str, float]:
        """logger.monitor_gpus: this rank's CUDA memory ({} on CPU)."""
        return cuda_memory_stats(self.device)

    # ---- refit export ----------------------------------------------------------------------
    def prepare_weights_for_export(self, dtype: str, every_rank: bool = False
                                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """All ranks: gather full weights (collective); rank 0 (`every_rank`: each rank, for the engine on its
        device) keeps them cast to `dtype` under HF names, a tied head not apart from the embedding (the engine
        derives it). With `lora_cfg.refit=adapter`, the adapters alone, under PEFT's names
        (rlpost.models.generation.vllm_lora)."""
        keep = every_rank or self.rank == 0
        if self.lora is not None and self.lora.refit == "adapter":
            self._onload()
            adapters = lora.adapter_state(self.model)
            torch_dtype = getattr(torch, dtype)
            self._export = [(k, v.to(torch_dtype)) for k, v in adapters.items()] if keep else []
            return {k: (tuple(v.shape), v.dtype) for k, v in self._export}
        full = self._gathered_weights(every_rank)
        if getattr(self.model.config, "tie_word_embeddings", False):  # the engine derives its head from the embedding
            full.pop("lm_head.weight", None)
        full = to_checkpoint_layout(self.model.config, full)  # the engine loads a checkpoint's names
        torch_dtype = getattr(torch, dtype)
        self._export = [(k, v.to(torch_dtype)) for k, v in full.items() if v is not None] if keep else []
        return {k: (tuple(v.shape), v.dtype) for k, v in self._export}

    def init_refit_collective(self, host: str, port: int, world_size: int) -> bool:
        """Rank 0 joins the refit group with the engine workers (non-colocated refit)."""
        self._join_refit_group(host, port, world_size)
        return True

    def broadcast_weights_collective(self, dtype: str) -> str:
        """All ranks gather the full weights; rank 0 broadcasts them to the engines. Rank 0's fingerprint."""
        self.prepare_weights_for_export(dtype)
        return self._broadcast_export()

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None, hf_export: bool = True) -> None:
        self._onload(with_optimizer=True)
        dtensor_checkpoint.save(self, weights_path, optimizer_path, self.cfg.model_name, hf_export=hf_export,
                                lora_cfg=self.lora)

    def _gathered_weights(self, every_rank: bool) -> dict[str, torch.Tensor]:
        """The full fp32 weights under the model's own names (LoRA merged in) on rank 0, or on every rank (each on
        its own device) when `every_rank`."""
        self._onload()
        full = dtensor_checkpoint.full_state_dict(self.model, every_rank)
        return lora.merged(full, lora.scaling(self.lora)) if self.lora else full

    def shutdown(self) -> bool:
        self.close_export_buffers()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
