"""A PEFT adapter directory (adapter_config.json + adapter_model.safetensors): what `PeftModel.from_pretrained` and
vLLM's LoRA loader read. Written by the checkpoints (weights/adapter/) and by an engine serving the policy's adapter."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlpost.config.schema.lora import ADAPTER_CONFIG

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of every saved adapter tensor name (`base_model.model.<HF layer>.lora_A.weight`)."""


def write_adapter(named: Mapping[str, torch.Tensor], adapter_config: Mapping[str, Any], out_dir: Path) -> Path:
    """`named` (PEFT names) and `adapter_config` as a PEFT adapter directory, replacing what was there."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{ADAPTER_WEIGHTS}.tmp"
    save_file({k: v.detach().cpu().contiguous() for k, v in named.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / ADAPTER_WEIGHTS)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(dict(adapter_config), indent=2))
    return out_dir
