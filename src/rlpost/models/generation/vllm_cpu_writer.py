"""CpuWeightWriter: load HF-named weights into a running vLLM CPU model without vLLM's reload machinery.

On CPU, vLLM packs every linear layer's weight into a oneDNN (or sgl / zentorch) kernel handle and drops
the parameter (`dispatch_cpu_unquantized_gemm`), so a refit must rebuild those handles. vLLM's generic
`reload_weights` does it by restoring each layer on the meta device, materialising it, buffering the
weight loaders' calls, replaying them, processing the layer and copying it back: several copies and a
good deal of Python per layer, which is most of a small model's refit.

This writer does the least that is correct for an unquantized model on one engine rank (TP = PP = 1):

- a plain parameter (norms, biases, the embedding, an untied head) is copied in place;
- a linear layer's new weight, fused from its HF parts in the model's `packed_modules_mapping` order
  (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and checked against the layer's `output_sizes`, is handed to
  vLLM's own `dispatch_cpu_unquantized_gemm`, which builds the kernel handle exactly as at start-up (the
  parts are read in place when they lie back to back, as in a shared-memory refit bucket: no concatenation);
- the output head (its own weight, or the embedding's when tied) gets its kernel handle rebuilt after the copy.

`plan()` returns None when a bucket can't be written this way (a name it can't place, a fused layer split
across buckets, a quantized layer, TP > 1); the caller then uses `reload_weights`. The kernels and their
inputs are vLLM's, so the two paths give the same engine (a test compares their generations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Fused:
    """One linear layer's new weight (and bias) assembled from its HF parts."""

    module: Any
    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    bias_parts: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class WritePlan:
    """What one bucket writes: in-place copies, and linear layers whose kernels are rebuilt."""

    copies: list[tuple[torch.Tensor, torch.Tensor]]
    """(engine parameter, incoming tensor): copied in place (incoming rows may be fewer: padded vocab)."""
    linears: list[_Fused]
    """Linear layers whose fused weight is rebuilt and re-dispatched."""
    heads: list[Any]
    """Output heads (they keep their weight) whose kernel handle is rebuilt after the copies."""


def _is_cpu_linear(module: Any) -> bool:
    """A layer vLLM dispatched to a CPU GEMM kernel: unquantized (UnquantizedLinearMethod/EmbeddingMethod)."""
    qm = getattr(module, "quant_method", None)
    return hasattr(module, "cpu_linear") and type(qm).__name__ in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def _output_heads(model: torch.nn.Module) -> list[Any]:
    """The modules whose kernel handle computes logits: every ParallelLMHead, and `model.lm_head` whatever its type."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    heads: list[Any] = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, torch.nn.Module) and all(lm_head is not h for h in heads):
        heads.append(lm_head)
    return heads


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along rows: a view when they lie back to back in one buffer (a refit bucket in shared
    memory, in export order: q, k, v), else a concatenated copy."""
    first = parts[0]
    if len(parts) == 1:
        return first
    base, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for p in parts:
        if (p.dtype != first.dtype or not p.is_contiguous() or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != base or p.data_ptr() != end):
            return torch.cat(parts)
        end += p.numel() * p.element_size()
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    return torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(), first.storage_offset(), shape,
                                                  torch.empty(shape, device="meta").stride())


class CpuWeightWriter:
    """Writes HF-named tensors into one vLLM CPU model in place (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        packed = getattr(model, "packed_modules_mapping", None) or {}
        # HF leaf module name -> (fused vLLM leaf name, shard index)
        self._shards = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
        self._modules = dict(model.named_modules())
        self._heads = [m for m in _output_heads(model) if _is_cpu_linear(m) and m.weight.numel()]

    @staticmethod
    def supported() -> bool:
        """One engine rank on a CPU platform (fused layers then hold whole, unsharded weights), not zentorch
        (its handle may keep a reference to the weight it was built from, here a reused transfer buffer)."""
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
        from vllm.platforms import current_platform

        return (current_platform.is_cpu() and not current_platform.is_zen_cpu()
                and get_tensor_model_parallel_world_size() == 1 and get_pp_group().world_size == 1)

    def plan(self, named: list[tuple[str, torch.Tensor]]) -> WritePlan | None:
        """How to write `named`, or None if some tensor can't be placed by this writer."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        fused: dict[str, _Fused] = {}
        written: set[int] = set()
        for name, t in named:
            mod_name, _, leaf = name.rpartition(".")
            parent, _, sub = mod_name.rpartition(".")
            target, shard = (mod_name, None)
            if sub in self._shards:
                fused_leaf, shard = self._shards[sub]
                target = f"{parent}.{fused_leaf}" if parent else fused_leaf
            module = self._modules.get(target)
            if module is None or leaf not in ("weight", "bias"):
                return None
            param = getattr(module, leaf, None)
            if not isinstance(param, torch.Tensor):
                return None
            if _is_cpu_linear(module) and leaf == "weight" and param.numel() == 0:
                # packed into a kernel handle at start-up: rebuild it from the (fused) new weight
                entry = fused.setdefault(target, _Fused(module))
                entry.parts[shard if shard is not None else 0] = t
                continue
            if shard is not None:  # a fused bias (qkv): its slice of the engine's bias
                if leaf != "bias":
                    return None
                fused.setdefault(target, _Fused(module)).bias_parts[shard] = t
                continue
            if param.data_ptr() in written:  # a tied head: the embedding already wrote this storage
                continue
            if param.dim() != t.dim() or param.shape[1:] != t.shape[1:] or (t.dim() and t.shape[0] > param.shape[0]):
                return None
            written.add(param.data_ptr())
            copies.append((param, t))
        for entry in fused.values():
            if not self._complete(entry):
                return None
        # The output head's kernel handle holds its own packed copy of the weight: rebuild it when that weight
        # was written (a tied head shares the embedding's storage). An embedding's handle is only ever used
        # when the embedding is the head, so the embedding's own is left alone (half a tied refit's packing).
        heads = [h for h in self._heads if h.weight.data_ptr() in written]
        return WritePlan(copies, list(fused.values()), heads)

    @staticmethod
    def _complete(entry: _Fused) -> bool:
        """Every part of the fused layer present, with the shapes the layer was built with."""
        m = entry.module
        sizes = list(getattr(m, "output_sizes", None) or [m.output_size])
        if entry.parts and sorted(entry.parts) != list(range(len(sizes))):
            return False
        for i, part in entry.parts.items():
            if tuple(part.shape) != (sizes[i], m.input_size):
                return False
        if entry.bias_parts:
            if sorted(entry.bias_parts) != list(range(len(sizes))) or getattr(m, "bias", None) is None:
                return False
            if any(tuple(b.shape) != (sizes[i],) for i, b in entry.bias_parts.items()):
                return False
        return True

    @torch.no_grad()
    def write(self, plan: WritePlan) -> None:
        """Carry out `plan`: copies, then kernel rebuilds (they read the copied weights)."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for param, t in plan.copies:
            if t.dim():
                param.data[: t.shape[0]].copy_(t)  # a padded vocabulary keeps its extra rows
            else:
                param.data.copy_(t)
        for entry in plan.linears:
            m = entry.module
            if entry.bias_parts:
                m.bias.data.copy_(torch.cat([entry.bias_parts[i] for i in sorted(entry.bias_parts)]))
            if not entry.parts:
                continue
            src = _joined([entry.parts[i] for i in sorted(entry.parts)]).to(self.dtype).contiguous()
            m.weight = torch.nn.Parameter(src, requires_grad=False)
            dispatch_cpu_unquantized_gemm(m, remove_weight=True)
            if m.weight.numel() and m.weight.data_ptr() == src.data_ptr():
                # the torch fallback keeps the weight itself: it must not alias a reused transfer buffer
                m.weight = torch.nn.Parameter(src.clone(), requires_grad=False)
        for m in plan.heads:
            dispatch_cpu_unquantized_gemm(m, remove_weight=False)
