"""Safe loading of a local HF causal LM: no remote code unless the config turns it on, safetensors only."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlpost.config.schema.policy import PolicyConfig


def load_hf_causal_lm(cfg: PolicyConfig, dtype: torch.dtype) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained` on a local directory, fp32 master weights, SDPA attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(cfg.model_name)
    if not path.is_dir():
        raise FileNotFoundError(f"policy.model_name={cfg.model_name!r}: not a local model directory")
    hf_cfg = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, **cfg.hf_config_overrides)
    return AutoModelForCausalLM.from_pretrained(
        path,
        config=hf_cfg,
        dtype=dtype,
        trust_remote_code=cfg.trust_remote_code,
        use_safetensors=True,
        attn_implementation="sdpa",
    )
