"""The policy's LoRA adapter served by vLLM (`lora_cfg.refit=adapter`): only the adapters move at a refit.

The engine starts with `enable_lora` and one adapter slot. A refit streams the adapter tensors (PEFT names,
`base_model.model.<layer>.lora_A.weight`) through the same transports as full weights; the engine worker keeps
them, and once the last one arrived writes them as a PEFT directory on its node (in /dev/shm: memory, not disk)
and vLLM loads it in place of the previous version (`load_inplace`, one adapter id for the run). Every request
then names that adapter. The refit fingerprint is computed on the tensors as the engine received them, as for
full weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlpost.models.peft_adapter import PEFT_PREFIX

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts."""

ADAPTER_NAME = "rlpost-policy"
ADAPTER_ID = 1


def engine_rank(dim: int) -> int:
    """vLLM's `max_lora_rank` for adapters of rank `dim`: the smallest it accepts that is >= dim."""
    for r in VLLM_LORA_RANKS:
        if r >= dim:
            return r
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {dim}")


def engine_lora_kwargs(adapter_config: Mapping[str, Any]) -> dict[str, Any]:
    """The vLLM engine arguments that serve one adapter of this PEFT config."""
    return {"enable_lora": True, "max_lora_rank": engine_rank(int(adapter_config["r"])), "max_loras": 1,
            "max_cpu_loras": 1}


def is_adapter_refit(names: Iterable[str]) -> bool:
    """Whether a refit's tensor names are a PEFT adapter's (else they are the model's weights)."""
    names = list(names)
    return bool(names) and all(n.startswith(PEFT_PREFIX) and (".lora_A." in n or ".lora_B." in n) for n in names)


STAGE_PREFIX = "rlpost-lora-"


def _stage_root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else Path(
        tempfile.gettempdir())


def stage_dir(replica: int) -> Path:
    """Where this process writes the adapter it serves: node-local memory where the node has /dev/shm."""
    return _stage_root() / f"{STAGE_PREFIX}{os.getpid()}-{replica}"


def sweep_orphans(root: Path | None = None) -> list[str]:
    """Remove adapter directories whose engine process is gone (killed before it could remove its own); their
    names."""
    removed = []
    for path in (root or _stage_root()).glob(f"{STAGE_PREFIX}*"):
        pid = path.name[len(STAGE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def remove_stage(out_dir: Path) -> None:
    shutil.rmtree(out_dir, ignore_errors=True)
