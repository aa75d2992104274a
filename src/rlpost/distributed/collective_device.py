"""The device a tensor must live on for a collective over a process group, decided by the group's backend.

torch.distributed dispatches a collective on the device of its tensor: an NCCL group refuses a CPU tensor ("No
backend type associated with device type cpu"), a gloo group works on CPU tensors. A tensor the worker builds
itself for a collective (counts, loss sums, metrics) is therefore created on `collective_device(group)`, never on
the CPU by default nor on the worker's device by assumption.

- `collective_device(group)`: NCCL -> the current CUDA device; gloo (and any backend that serves the CPU) -> CPU;
  a group with a backend per device ("cpu:gloo,cuda:nccl") -> the current CUDA device when CUDA is available,
  else CPU. `group=None` is the default group, as in torch.distributed.
- `all_reduce(tensor, group, op)`: the tensor reduced over the group, returned on the tensor's own device (copied
  to the group's device and back only when they differ).
- `all_reduce_floats(values, group, op)`: python floats reduced over the group in fp64 (metric sums).

The backend is read from torch.distributed itself (`dist.get_backend`); the mapping from a backend name to a
device type is the pure function `device_type_for_backend`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

_CPU_FIRST = ("cpu", "cuda")
"""Preference for a single backend that serves several device types (gloo, mpi): CPU tensors first."""
_PER_DEVICE_FIRST = ("cuda", "cpu")
"""Preference for a group with a backend per device type ("cpu:gloo,cuda:nccl"): the accelerator's backend first."""


def device_type_for_backend(backend: str, cuda_available: bool) -> str:
    """The device type ('cpu' or 'cuda') of a collective's tensors for a torch.distributed backend name.

    `backend` is what `dist.get_backend` returns: one name ("nccl", "gloo") or one backend per device type
    ("cpu:gloo,cuda:nccl"). A single backend is asked for the device types it serves (torch's
    `Backend.backend_capability`; CPU when it serves the CPU); a per-device group uses CUDA when it has a CUDA
    backend and CUDA is available, else the CPU.
    """
    name = str(backend).lower()
    if ":" in name:
        served = [pair.split(":", 1)[0].strip() for pair in name.split(",") if pair.strip()]
        order = _PER_DEVICE_FIRST if cuda_available else ("cpu",)
    else:
        served = list(dist.Backend.backend_capability.get(name, ()))
        order = _CPU_FIRST
    for device_type in order:
        if device_type in served:
            return device_type
    raise ValueError(f"process-group backend {backend!r} serves none of the device types {list(order)}")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must live on for a collective over `group` (None: the default group)."""
    device_type = device_type_for_backend(str(dist.get_backend(group)), torch.cuda.is_available())
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
               op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """`tensor` reduced over `group`, on the tensor's own device. In place when the tensor already lives on the
    group's device; otherwise a copy travels there and the result comes back (the input is left as it was)."""
    device = collective_device(group)
    if tensor.device == device:
        dist.all_reduce(tensor, op=op, group=group)
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op, group=group)
    return moved.to(tensor.device)


def all_reduce_floats(values: Sequence[float], group: dist.ProcessGroup | None = None,
                      op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
    """python floats reduced over `group` element-wise, in fp64 on the group's device."""
    t = torch.tensor(list(values), dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=op, group=group)
    return [float(v) for v in t.tolist()]
