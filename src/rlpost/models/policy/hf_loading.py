"""Safe loading of a local HF causal LM: no remote code unless the config turns it on, safetensors only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlpost.config.schema.policy import PolicyConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")
"""The tokenizer files an HF export copies from the model directory."""


def load_hf_causal_lm(cfg: PolicyConfig, dtype: torch.dtype) -> nn.Module:
    """`from_pretrained` on a local directory, fp32 master weights, SDPA attention: a causal LM, or with
    policy.reward_model_cfg.enabled a one-label sequence classifier on the same body (a new `score` head when
    the directory holds a causal LM; HF pools the score at each row's last non-pad token), or with `value_head` a
    one-label token classifier (PPO's critic: a value at every position)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    path = Path(cfg.model_name)
    if not path.is_dir():
        raise FileNotFoundError(f"policy.model_name={cfg.model_name!r}: not a local model directory")
    hf_cfg = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, **cfg.hf_config_overrides)
    auto: Any = AutoModelForCausalLM
    if cfg.reward_model_cfg.enabled:
        auto = AutoModelForSequenceClassification
        hf_cfg.num_labels = 1
        if hf_cfg.pad_token_id is None:  # the loader pads with EOS when a tokenizer has no pad token
            hf_cfg.pad_token_id = hf_cfg.eos_token_id
    elif cfg.value_head:
        auto = AutoModelForTokenClassification
        hf_cfg.num_labels = 1
        hf_cfg.classifier_dropout = 0.0  # a value estimate, not a regularised classifier
    model = auto.from_pretrained(
        path,
        config=hf_cfg,
        dtype=dtype,
        trust_remote_code=cfg.trust_remote_code,
        use_safetensors=True,
        attn_implementation="sdpa",
    )
    if cfg.reward_model_cfg.enabled or cfg.value_head:
        model.config.architectures = [type(model).__name__]  # the export loads as what it is
    return model
