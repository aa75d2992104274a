"""Safe loading of a local HF causal LM: no remote code unless the config turns it on, safetensors only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlpost.config.model_families import attention_implementation
from rlpost.config.schema.policy import PolicyConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")
"""The tokenizer files an HF export copies from the model directory."""

NEW_HEADS = ("score",)
"""Modules a reward or value model adds on top of a causal LM's body: initialised by HF when the checkpoint lacks
them."""


def hf_model_class_and_config(cfg: PolicyConfig) -> tuple[Any, Any]:
    """The transformers auto class and the model config `cfg` asks for: a causal LM, or with
    policy.reward_model_cfg.enabled a one-label sequence classifier on the same body (HF pools the score at each row's
    last non-pad token), or with `value_head` a one-label token classifier (PPO's critic: a value at every
    position); policy.hf_config_overrides applied."""
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
    return auto, hf_cfg


def has_new_head(cfg: PolicyConfig) -> bool:
    """Whether the model carries a head (NEW_HEADS) that a causal LM's checkpoint lacks."""
    return bool(cfg.reward_model_cfg.enabled or cfg.value_head)


def load_hf_causal_lm(cfg: PolicyConfig, dtype: torch.dtype) -> nn.Module:
    """`from_pretrained` on a local directory, fp32 master weights, `attention_implementation`'s attention, of the model
    `hf_model_class_and_config` names (a new `score` head, initialised by HF, when the directory holds a causal
    LM)."""
    auto, hf_cfg = hf_model_class_and_config(cfg)
    model = auto.from_pretrained(
        Path(cfg.model_name),
        config=hf_cfg,
        dtype=dtype,
        trust_remote_code=cfg.trust_remote_code,
        use_safetensors=True,
        attn_implementation=attention_implementation(hf_cfg),
    )
    if has_new_head(cfg):
        model.config.architectures = [type(model).__name__]  # the export loads as what it is
    return model


def build_hf_model_on_meta(cfg: PolicyConfig, dtype: torch.dtype) -> nn.Module:
    """The model `load_hf_causal_lm` loads, with its parameters on the meta device (no memory, no weights read) and
    its buffers computed on the CPU (rotary frequencies and other non-persistent buffers, which no checkpoint
    holds); tied weights tied."""
    from accelerate import init_empty_weights

    auto, hf_cfg = hf_model_class_and_config(cfg)
    with init_empty_weights(include_buffers=False):
        model = auto.from_config(
            hf_cfg, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
            attn_implementation=attention_implementation(hf_cfg),
        )
    model.tie_weights()  # init_empty_weights registers each parameter anew, which unties them
    if has_new_head(cfg):
        model.config.architectures = [type(model).__name__]
    return model
