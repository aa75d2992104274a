"""Gemma 2 and Gemma 3 on Megatron-Core: the parts of their layer megatron-core's does not have, as submodules of the
local layer spec and hooks on the GPTModel.

A Gemma decoder layer differs from Llama's in:

- **Norms** `(1 + w) * x / rms(x)` (`norms.GemmaRMSNorm`), the final norm too (the block spec's `layer_norm`), and
  Gemma 3's per-head q/k norms.
- **Sandwich norms**: besides the norms before attention and the MLP, a norm of each one's output before the
  residual add (`norms.post_norm_linear` on `linear_proj` and `linear_fc2`, as OLMo 2's layer has).
- **GeGLU**: the gate goes through tanh-approximated GELU (`gelu_pytorch_tanh`).
- **Attention** (`GemmaCoreAttention`, in place of megatron's core attention): scores scaled by
  `query_pre_attn_scalar ** -0.5` and soft-capped (Gemma 2: `cap * tanh(s / cap)`), and layers that attend to the
  last `sliding_window` positions only (`layer_types`), with a RoPE base of their own (Gemma 3's local layers). The
  core attention applies RoPE itself, per layer: the GPTModel is built without megatron's position embedding.
- **The embedding** is scaled by sqrt(hidden) in its own dtype, and (Gemma 2) the logits are soft-capped: hooks on
  the embedding and the output layer (`adapt_model`). The output layer of a soft-capped model is not read in chunks
  (`output_head.reads_in_chunks`), as on the DTensor backend.

Attention is computed whole per micro-batch ([heads, S, S] scores): with soft-capping in explicit ops, without it in
torch's scaled_dot_product_attention. Context parallelism is refused (the pre-flight exits 2).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlpost.models.megatron.norms import GemmaRMSNorm, sandwich_spec

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")
"""transformers' names of the tanh-approximated GELU (what megatron gets as `F.gelu(approximate="tanh")`)."""


@dataclasses.dataclass(frozen=True)
class GemmaDims:
    """What a Gemma layer needs beyond a Llama layer's dims, per global layer where it varies."""

    query_pre_attn_scalar: float
    attn_softcap: float | None
    final_softcap: float | None
    sliding_window: int | None
    sliding: tuple[bool, ...]
    """Per layer: whether it attends to the last `sliding_window` positions only."""
    rope: tuple[tuple[float, float], ...]
    """Per layer: (RoPE base, linear scaling factor)."""
    qk_norm: bool
    """Gemma 3's per-head q/k norms (converted as Qwen3's)."""


def _rope_of(params: dict[str, Any], arch: str) -> tuple[float, float]:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear"):
        raise NotImplementedError(f"{arch} rope_type={kind!r} is not converted (only 'default' and 'linear')")
    if float(params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise NotImplementedError(f"{arch} partial_rotary_factor != 1 (RoPE on part of each head) is not converted")
    return float(params.get("rope_theta", 10000.0)), float(params.get("factor", 1.0)) if kind == "linear" else 1.0


def gemma_dims(hf_config: Any, arch: str) -> GemmaDims | None:
    """The Gemma facts of a Gemma 2 or 3 config; None for another family. NotImplementedError for a variant the
    layer here does not compute."""
    if arch not in ARCHITECTURES:
        return None
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise NotImplementedError(f"{arch} hidden_activation={act!r}: only tanh-approximated GELU is converted")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise NotImplementedError(f"{arch} use_bidirectional_attention: only causal attention is converted")
    if getattr(hf_config, "attention_bias", False):
        raise NotImplementedError(f"{arch} attention_bias has no megatron equivalent here")
    layers = int(hf_config.num_hidden_layers)
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * layers)
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    nested = all(isinstance(params.get(t), dict) for t in set(types))
    rope = tuple(_rope_of(params[t] if nested else params, arch) for t in types)
    window = getattr(hf_config, "sliding_window", None)
    return GemmaDims(
        query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
        attn_softcap=getattr(hf_config, "attn_logit_softcapping", None),
        final_softcap=getattr(hf_config, "final_logit_softcapping", None),
        sliding_window=int(window) if window else None,
        sliding=tuple(t == "sliding_attention" and bool(window) for t in types),
        rope=rope,
        qk_norm=arch == "Gemma3ForCausalLM",
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [b, heads, s, d] with cos / sin [s, d] (the two halves of each head rotated, as transformers does)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class GemmaCoreAttention(nn.Module):
    """Core attention of one Gemma layer, built and called as megatron's DotProductAttention is: query
    [s, b, heads, d], key / value [s, b, groups, d] (this rank's heads; no RoPE applied yet) -> [s, b, heads x d].
    Causal by position (rows are right-padded); no parameters."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, *, gemma: GemmaDims) -> None:
        super().__init__()
        del attn_mask_type, attention_type, attention_dropout, softmax_scale, cp_comm_type, pg_collection
        if config.context_parallel_size > 1:
            raise ValueError("Gemma's attention on Megatron takes no context parallelism")
        layer = layer_number - 1  # megatron numbers the layers from 1, over every pipeline stage
        self.scale = gemma.query_pre_attn_scalar ** -0.5
        self.softcap = gemma.attn_softcap
        self.window = gemma.sliding_window if gemma.sliding[layer] else None
        base, factor = gemma.rope[layer]
        d = config.kv_channels
        # transformers' inverse frequencies, in fp32 whatever the model's dtype (not a buffer: Float16Module would cast it)
        self.inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)) / factor

    def _cos_sin(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=like.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(like.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(like.dtype), emb.sin().to(like.dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        del attention_mask, attn_mask_type  # causal by position, built below
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("Gemma's attention on Megatron takes no attention bias and no packed sequences")
        s = query.shape[0]
        cos, sin = self._cos_sin(s, query)
        groups = query.shape[2] // key.shape[2]
        q = _rotate(query.permute(1, 2, 0, 3), cos, sin)  # [b, heads, s, d]
        k = _rotate(key.permute(1, 2, 0, 3), cos, sin).repeat_interleave(groups, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(groups, dim=1)
        pos = torch.arange(s, device=query.device)
        allowed = pos[None, :] <= pos[:, None]  # [queries, keys]
        if self.window is not None:
            allowed &= pos[:, None] - pos[None, :] < self.window
        if self.softcap is None:
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
            scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
        return out.permute(2, 0, 1, 3).reshape(s, out.shape[0], -1)


def gemma_spec(spec: ModuleSpec, gemma: GemmaDims) -> ModuleSpec:
    """A copy of the local GPT layer spec (built with q/k norms) with Gemma's norms and attention (module docstring)."""
    head_norm = GemmaRMSNorm if gemma.qk_norm else None
    spec = sandwich_spec(spec, GemmaRMSNorm, GemmaRMSNorm, head_norm, head_norm)
    spec.submodules.self_attention.submodules.core_attention = functools.partial(GemmaCoreAttention, gemma=gemma)
    return spec


def block_spec(layer: ModuleSpec, config: Any) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder: `layer` for each of its layers and Gemma's final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=GemmaRMSNorm)


def _scale_embedding(normalizer: float, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * torch.tensor(normalizer, dtype=out.dtype)


def _softcap_logits(cap: float, module: nn.Module, args: Any,
                    out: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
    logits, bias = out
    return torch.tanh(logits / cap) * cap, bias


def adapt_model(gpt: Any, gemma: GemmaDims, hidden_size: int) -> None:
    """Scale the first stage's embedding by sqrt(hidden) and soft-cap the last stage's logits (Gemma 2), and record
    the cap as `gpt.final_logit_softcapping` (None: none)."""
    if gpt.pre_process:
        gpt.embedding.register_forward_hook(functools.partial(_scale_embedding, hidden_size ** 0.5))
    if gpt.post_process and gemma.final_softcap:
        gpt.output_layer.register_forward_hook(functools.partial(_softcap_logits, float(gemma.final_softcap)))
    gpt.final_logit_softcapping = gemma.final_softcap


NORMS = {"input_layernorm.weight": "input_layernorm.weight",
         "self_attention.linear_proj.post_norm.weight": "post_attention_layernorm.weight",
         "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
         "mlp.linear_fc2.post_norm.weight": "post_feedforward_layernorm.weight"}
"""A layer's norms before and after attention and the MLP: megatron name -> HF name under the layer's prefix
(replicated over TP; Gemma 3's q/k norms are converted as Qwen3's)."""


def hf_to_megatron(hf: Any, h: str) -> dict[str, torch.Tensor]:
    """The norms of HF layer prefix `h` under their megatron names."""
    return {name: hf[h + hf_name] for name, hf_name in NORMS.items()}


def megatron_to_hf(m: Any, h: str) -> dict[str, torch.Tensor]:
    """Inverse of hf_to_megatron."""
    return {h + hf_name: m[name] for name, hf_name in NORMS.items()}
