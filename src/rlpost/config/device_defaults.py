"""The defaults that follow the run's device: precision 'auto' and vLLM's enforce_eager None.

conf/ sets `policy.precision: auto` (bfloat16 on CUDA, float32 on CPU) and `vllm_cfg.enforce_eager: null` (eager on
CPU, CUDA graphs on CUDA). `to_master_config` turns both into concrete values once, on the composed config before it
is typed and checked, so every consumer (the policy workers, vLLM's and the HF engine's precision, which interpolate
`policy.precision`, Megatron's pipeline dtype, the plan, the checkpoint's metadata) reads a dtype and a bool. A value
the user gives wins.

Torch-free: `cluster.device=auto` is decided by whether this process can see an NVIDIA GPU (its device nodes, and a
CUDA_VISIBLE_DEVICES that does not hide them all). torch's `cuda.is_available()` says the same wherever a GPU can be
used; where a GPU is visible but torch cannot use it, the run's device checks refuse the bf16 default with exit 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, flag_override

AUTO = "auto"
"""The precision value that follows the device."""
DEVICE_PRECISION = {"cuda": "bfloat16", "cpu": "float32"}
"""The precision `auto` becomes on each device."""
_HIDDEN = ("", "-1", "none", "void", "nodevfiles")
"""CUDA_VISIBLE_DEVICES values that hide every GPU."""


def gpu_visible(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> bool:
    """Whether this process can see an NVIDIA GPU: a /dev/nvidia<N> device node, and CUDA_VISIBLE_DEVICES (when set)
    naming at least one device."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip().lower() in _HIDDEN:
        return False
    try:
        return any(re.fullmatch(r"nvidia\d+", p.name) for p in dev.iterdir())
    except OSError:
        return False


def auto_device() -> str:
    """'cuda' or 'cpu': what `cluster.device=auto` means in this process."""
    return "cuda" if gpu_visible() else "cpu"


def run_device(cluster_device: str) -> str:
    """The concrete device of a run whose config says `cluster.device=<cluster_device>`."""
    return auto_device() if cluster_device == AUTO else cluster_device


def resolve_device_defaults(node: DictConfig, device: str | None = None) -> None:
    """Replace `policy.precision: auto` and `policy.generation.vllm_cfg.enforce_eager: null` in the composed config
    `node` with the values for `device` (default: the device `cluster.device` names). Interpolations of
    `policy.precision` then read the concrete dtype. Idempotent; a value the user set is kept."""
    precision = OmegaConf.select(node, "policy.precision", default=None)
    eager_key = "policy.generation.vllm_cfg.enforce_eager"
    has_eager = OmegaConf.select(node, "policy.generation.vllm_cfg", default=None) is not None
    eager = OmegaConf.select(node, eager_key, default=None) if has_eager else False
    if precision != AUTO and eager is not None:
        return
    if device is None:
        device = run_device(str(OmegaConf.select(node, "cluster.device", default=AUTO)))
    with flag_override(node, "readonly", False):
        if precision == AUTO:
            node.policy.precision = DEVICE_PRECISION.get(device, "float32")
        if eager is None:
            node.policy.generation.vllm_cfg.enforce_eager = device != "cuda"
