"""Moving a Megatron policy's GPU memory to the host while a colocated engine generates, and back (GPU only).

What a training rank holds on its GPU, and how each part travels:
- megatron DDP's contiguous buffers (`DistributedDataParallel.buffers`): the gradient buffer (fp32 with
  grad_reduce_in_fp32) and, with the distributed optimizer, the parameter buffer the parameters are views of.
  megatron's own `offload_to_cpu` / `reload_from_cpu` free and restore them: the parameter buffer through a pinned
  host copy, the gradient buffer dropped and zeroed on return (nothing is accumulated across an offload).
- parameters outside a parameter buffer (every parameter without the distributed optimizer; frozen ones with it)
  and the main parameters the optimizer owns besides the model's (the fp32 master weights of the mixed-precision
  optimizer): each storage is copied to pinned host memory and resized to 0 bytes, then resized back and refilled.
  The tensors stay the same objects on the same device, as megatron's buffers do: DDP's gradient hooks hang on each
  parameter's grad accumulator, which a `.data` swap to another device would replace.
- the optimizer's state (Adam's moments): the state dict's tensors are replaced by host copies and back.

NeMo RL's Megatron worker does the same in `offload_after_refit` (`move_model(..., "cpu")`, `move_optimizer`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

HostCopies = list[tuple[torch.UntypedStorage, torch.UntypedStorage]]
"""(device storage emptied to 0 bytes, its contents on the host) per offloaded storage."""


def _buffers(model: torch.nn.Module) -> list[Any]:
    """megatron DDP's _ParamAndGradBuffers ([] for a model without DDP: a scoring-only rank)."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return []
    return list(model.buffers) + list(model.expert_parallel_buffers)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _buffer_storages(model: torch.nn.Module) -> set[int]:
    """Storages of the DDP parameter buffers (the distributed optimizer's), while they are on the device."""
    return {_storage(b.param_data) for b in _buffers(model) if b.param_data is not None and b.param_data.numel()}


def loose_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The model's parameters that no DDP parameter buffer holds (call while the buffers are on the device)."""
    in_buffers = _buffer_storages(model)
    return [p for p in model.parameters() if _storage(p) not in in_buffers]


def optimizer_main_params(optimizer: MegatronOptimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    """The torch optimizers' parameters that own their storage: not the model's parameters and not views of a model
    parameter or a DDP buffer (call while everything is on the device)."""
    from rlpost.models.policy.megatron_checkpoint import torch_optimizers

    owned = {_storage(p) for p in model.parameters()} | _buffer_storages(model)
    return [p for topt in torch_optimizers(optimizer) for g in topt.param_groups for p in g["params"]
            if _storage(p) not in owned]


def offload_storages(tensors: Iterable[torch.Tensor]) -> HostCopies:
    """Each distinct storage of `tensors` copied to the host (pinned where CUDA is) and emptied to 0 bytes; the
    tensors keep their identity, device, dtype and shape. Storages already empty are left alone."""
    saved: HostCopies = []
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        host = torch.UntypedStorage(storage.nbytes(), device="cpu")
        if torch.cuda.is_available():
            host = host.pin_memory()
        host.copy_(storage, non_blocking=True)
        saved.append((storage, host))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies are complete before the device memory is given back
    for storage, _ in saved:
        storage.resize_(0)
    return saved


def onload_storages(saved: HostCopies) -> None:
    """offload_storages undone: each storage grown back to its size and refilled from its host copy."""
    for storage, host in saved:
        storage.resize_(host.nbytes())
        storage.copy_(host, non_blocking=True)


def offload_model(model: torch.nn.Module, loose: list[torch.nn.Parameter]) -> HostCopies:
    """DDP's parameter and gradient buffers and the loose parameters to the host; what `onload_model` takes back."""
    for buffer in _buffers(model):
        buffer.offload_to_cpu(move_params=True, move_grads=True)
    return offload_storages(loose)


def onload_model(model: torch.nn.Module, saved: HostCopies) -> None:
    """offload_model undone: the buffers restored (gradients zeroed) and the loose parameters refilled."""
    for buffer in _buffers(model):
        buffer.reload_from_cpu(move_params=True, move_grads=True)
    onload_storages(saved)


def move_optimizer_state(optimizer: MegatronOptimizer, device: torch.device | str) -> None:
    """The optimizer's state tensors (not the 0-d steps) to `device`."""
    from rlpost.models.policy.megatron_checkpoint import optimizer_state_tensors

    for state, name, value in list(optimizer_state_tensors(optimizer)):
        state[name] = value.to(device, non_blocking=True)


class HostOffload:
    """What one Megatron rank has moved to pinned host memory, and the moves (CUDA only: no-ops on CPU). The
    optimizer goes first (`offload_optimizer`: its state and the main parameters it owns), then the model
    (`offload_model`: DDP's buffers and the loose parameters); each comes back on the next call that needs it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.optimizer_offloaded = False
        self.model_offloaded = False
        self._loose: list[torch.nn.Parameter] = []
        self._main: list[torch.Tensor] = []
        self._model_host: HostCopies = []
        self._main_host: HostCopies = []

    def attach(self, model: torch.nn.Module, optimizer: MegatronOptimizer | None) -> None:
        """List what the moves take, while everything is on the device."""
        if self.device.type == "cuda":
            self._loose = loose_parameters(model)
            self._main = optimizer_main_params(optimizer, model) if optimizer is not None else []

    def offload_optimizer(self, optimizer: MegatronOptimizer | None) -> None:
        if self.device.type == "cuda" and not self.optimizer_offloaded and optimizer is not None:
            move_optimizer_state(optimizer, "cpu")
            self._main_host = offload_storages(self._main)
            self.optimizer_offloaded = True
            torch.cuda.empty_cache()

    def restore_optimizer(self, optimizer: MegatronOptimizer | None) -> None:
        if self.optimizer_offloaded and optimizer is not None:  # offloaded only with an optimizer
            move_optimizer_state(optimizer, self.device)
            onload_storages(self._main_host)
            self._main_host = []
            self.optimizer_offloaded = False

    def offload_model(self, model: torch.nn.Module) -> None:
        if self.device.type == "cuda" and not self.model_offloaded:
            self._model_host = offload_model(model, self._loose)
            self.model_offloaded = True
            torch.cuda.empty_cache()

    def onload_model(self, model: torch.nn.Module) -> None:
        if self.model_offloaded:
            onload_model(model, self._model_host)
            self._model_host = []
            self.model_offloaded = False
