"""GPU memory phases of the DTensor workers: what moves off the device around refit and logprob passes.

- `offload_before_refit` / `offload_optimizer_for_logprob`: the optimizer state (Adam's moments; not the 0-d
  step counters, which live on the CPU already) goes to the CPU and the gradients are dropped.
- `offload_after_refit` (colocated): the model's parameters and buffers go to the CPU too, so the engine has
  the GPU for generation; the next call that needs the model brings it back (`OffloadState.onload`).

On CPU there is nothing to move: every method is a no-op. With `dtensor_cfg.cpu_offload` FSDP2 keeps the
parameters on the CPU itself, so only the buffers move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every non-scalar optimizer state tensor (plain or DTensor) to `device`, in place in the state dict."""
    for state in optimizer.state.values():
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != torch.device(device):
                state[name] = value.to(device, non_blocking=True)


def move_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Move the module's buffers (FSDP2 does not move them with its sharded parameters)."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.device != torch.device(device):
                module.register_buffer(name, buf.to(device), persistent=name not in module._non_persistent_buffers_set)


@dataclass
class OffloadState:
    """Where the model and the optimizer state of one worker are, and how to bring them back."""

    device: torch.device
    """The worker's compute device."""
    params_on_cpu_by_fsdp: bool = False
    """dtensor_cfg.cpu_offload: FSDP2 keeps the parameters on the CPU; only buffers move."""
    model_offloaded: bool = False
    """The model was moved to the CPU (offload_after_refit)."""
    optimizer_offloaded: bool = False
    """The optimizer state was moved to the CPU."""

    @property
    def active(self) -> bool:
        return self.device.type == "cuda"

    def offload_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        if not self.active or optimizer is None or self.optimizer_offloaded:
            return
        optimizer.zero_grad(set_to_none=True)
        move_optimizer_state(optimizer, "cpu")
        self.optimizer_offloaded = True
        torch.cuda.empty_cache()

    def offload_model(self, model: nn.Module) -> None:
        if not self.active or self.model_offloaded:
            return
        if not self.params_on_cpu_by_fsdp:
            model.to("cpu")
        move_buffers(model, "cpu")
        self.model_offloaded = True
        torch.cuda.empty_cache()

    def onload(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, with_optimizer: bool) -> None:
        """The model (and, when asked, the optimizer state) back on the device."""
        if self.model_offloaded:
            if not self.params_on_cpu_by_fsdp:
                model.to(self.device)
            move_buffers(model, self.device)
            self.model_offloaded = False
        if with_optimizer and self.optimizer_offloaded and optimizer is not None:
            if not self.params_on_cpu_by_fsdp:
                move_optimizer_state(optimizer, self.device)
            self.optimizer_offloaded = False


def cuda_memory_stats(device: torch.device) -> dict[str, float]:
    """`logger.monitor_gpus`: this process's CUDA memory in GiB (and utilisation when NVML is installed)."""
    if device.type != "cuda":
        return {}
    gib = float(2**30)
    free, total = torch.cuda.mem_get_info(device)
    out: dict[str, float] = {
        "memory_allocated_gb": torch.cuda.memory_allocated(device) / gib,
        "memory_reserved_gb": torch.cuda.memory_reserved(device) / gib,
        "max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / gib,
        "device_used_gb": (total - free) / gib,
        "device_total_gb": total / gib,
    }
    try:
        out["utilization_pct"] = float(torch.cuda.utilization(device))
    except Exception:  # noqa: BLE001 - needs the optional NVML bindings
        pass
    torch.cuda.reset_peak_memory_stats(device)
    return out
