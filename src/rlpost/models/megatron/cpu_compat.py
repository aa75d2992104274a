"""The one CPU compatibility layer for megatron-core 0.16.1: run it on CPU, over gloo, in fp32.

megatron-core assumes CUDA: it calls `torch.cuda.current_device()` (RoPE `get_emb`, the DDP grad buffers, the
global memory buffer of DotProductAttention, the schedules), allocates with `device="cuda"` (FP32Optimizer,
grad-norm buffers, token counters) and calls `.cuda()`. On a CPU-only torch each of these raises
"Torch not compiled with CUDA enabled". This module makes them land on the CPU, and nothing else:

1. `torch.cuda.current_device` is replaced by a function returning ``"cpu"`` (so `x.to(current_device())` and
   `torch.empty(..., device=current_device())` are CPU calls);
2. a `torch.overrides.TorchFunctionMode` rewrites ``device="cuda"`` / ``"cuda:N"`` / an int ordinal given to any
   torch function to ``"cpu"``, turns `Tensor.cuda()` into a no-op and `Tensor.to("cuda")` into `.to("cpu")`, and
   drops `pin_memory=True` (RoPE's context-parallel slice pins its index tensor);
3. `seed_model_parallel_rng` uses megatron's public
   `initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)` instead of
   `model_parallel_cuda_manual_seed` (which needs `torch.cuda.get_rng_state`); the tracker's `fork()` is then a
   no-op, so dropout must be 0 (the converted configs set it to 0);
4. `recompute_context()` puts the mode back for a layer that activation checkpointing recomputes: the backward
   that recomputes it is a torch call, run by the mode's handler with the mode off.

It is active only when turned on explicitly (`enable_cpu_compat()` / `cpu_compat()`), by a worker that has no
CUDA device; `enable_cpu_compat()` refuses (returns False, changes nothing) when CUDA is available, so it is never
active on a GPU. Enabling is reference-counted and idempotent; the last `disable_cpu_compat()` restores
`torch.cuda.current_device` and pops the mode. The function mode is per thread (torch keeps the mode stack in
thread-local state, which autograd propagates to its backward threads): enable it in the thread that drives
megatron. Under the mode every torch call goes through one Python function, a small per-op cost on CPU.

What works on CPU with this layer (fp32, gloo; tested): GPTModel with the local layer spec (megatron's own
DotProductAttention, RMSNorm, SwiGLU, RoPE incl. llama3 scaling), TP, PP (forward-only and 1F1B training schedules
over p2p; the converted config turns `batch_p2p_sync` off, as it calls torch.cuda.synchronize), DP with Megatron
DDP, `get_megatron_optimizer` in fp32 (Adam/SGD, non-distributed), OptimizerParamScheduler, and the forward pass of
a bf16 model (Float16Module).

GPU-only in megatron-core 0.16.1 (what each does on CPU even with this layer):
- bf16/fp16 mixed-precision optimizer (`Float16OptimizerWithFloat16Params`):
  ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, torch.cuda.HalfTensor, or
  torch.cuda.BFloat16Tensor`` (a tensor-type-string check);
- distributed optimizer (`use_distributed_optimizer=True`): the same type-string check;
- megatron's gradient clipping (`OptimizerConfig.clip_grad > 0`):
  ``AssertionError`` at ``assert param.grad.type() == 'torch.cuda.FloatTensor'`` in `clip_grad_by_total_norm_fp32`.
  rlpost's train step therefore hands megatron `clip_grad=0` on CPU and clips the fp32 grads itself by the same
  rule (coefficient max_norm / (norm + 1e-6) when < 1), so `clip_grad` still works on CPU;
- Transformer Engine specs, fused kernels (`bias_activation_fusion`, `masked_softmax_fusion`,
  `apply_rope_fusion`, `gradient_accumulation_fusion`, `persist_layer_norm`) and sequence parallelism with the
  local spec (megatron's torch-norm wrapper asserts ``sequence parallel not supported by torch LayerNorm``);
- `model_parallel_cuda_manual_seed`: ``AssertionError: Torch not compiled with CUDA enabled``
  (use `seed_model_parallel_rng`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "cpu_compat",
    "cpu_compat_needed",
    "disable_cpu_compat",
    "enable_cpu_compat",
    "is_cpu_compat_active",
    "seed_model_parallel_rng",
]


def _is_cuda_device(device: object) -> bool:
    """True for "cuda", "cuda:N", torch.device("cuda", ...) and a bare int ordinal (= a CUDA device in torch)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to the CPU in every torch call made while the mode is on the stack."""

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # page-locked host memory for CUDA copies: there is no pinned allocator
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _State:
    """Process-wide bookkeeping of the layer (reference count, the saved originals, the pushed mode)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved_current_device: Callable[[], int] | None = None
        self.mode: _CudaToCpuMode | None = None


_STATE = _State()


def _cpu_current_device() -> str:
    """Stand-in for torch.cuda.current_device while the layer is active."""
    return "cpu"


def cpu_compat_needed() -> bool:
    """True when this process has no usable CUDA device (the only case where the layer may be enabled)."""
    return not torch.cuda.is_available()


def is_cpu_compat_active() -> bool:
    """Whether the layer is currently enabled in this process."""
    return _STATE.depth > 0


def enable_cpu_compat() -> bool:
    """Turn the layer on (nestable). Returns False and does nothing when CUDA is available."""
    if not cpu_compat_needed():
        return False
    with _STATE.lock:
        if _STATE.depth == 0:
            _STATE.saved_current_device = torch.cuda.current_device
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
            mode = _CudaToCpuMode()
            mode.__enter__()
            _STATE.mode = mode
        _STATE.depth += 1
    return True


def disable_cpu_compat() -> None:
    """Undo one `enable_cpu_compat()`; the last one restores torch.cuda.current_device and pops the mode."""
    with _STATE.lock:
        if _STATE.depth == 0:
            return
        _STATE.depth -= 1
        if _STATE.depth > 0:
            return
        mode, _STATE.mode = _STATE.mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        if _STATE.saved_current_device is not None:
            torch.cuda.current_device = _STATE.saved_current_device
            _STATE.saved_current_device = None


def recompute_context() -> contextlib.AbstractContextManager[object]:
    """The mode again, while the layer is on (else nothing): the context a recomputed forward runs in."""
    return _CudaToCpuMode() if is_cpu_compat_active() else contextlib.nullcontext()


@contextlib.contextmanager
def cpu_compat() -> Iterator[bool]:
    """Context manager form of enable/disable; yields whether the layer is active (False on a GPU machine)."""
    enabled = enable_cpu_compat()
    try:
        yield enabled
    finally:
        if enabled:
            disable_cpu_compat()


def seed_model_parallel_rng(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (call after initialize_model_parallel).

    On a GPU this is megatron's `model_parallel_cuda_manual_seed(seed)`. With the CPU layer active it seeds torch
    and installs the inference RNG tracker (`fork()` is a no-op: no TP-distinct dropout streams, dropout must be 0).
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if is_cpu_compat_active():
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
