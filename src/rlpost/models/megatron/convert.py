"""HF <-> Megatron-Core conversion for the Qwen2, Qwen3, Llama, Mistral, Phi-3, OLMo 2, Gemma 2 and Gemma 3 families
(dense, SwiGLU, RMSNorm, RoPE, GQA; Qwen3's per-head q/k RMSNorm; Phi-3's fused projections; OLMo 2's post-norms and
whole-projection q/k norms in rlpost.models.megatron.olmo2; Gemma's GeGLU, sandwich norms, scaled embedding, soft-caps
and sliding windows in rlpost.models.megatron.gemma) and the Qwen3-MoE and Mixtral mixtures of experts (their
attention as Qwen3's and Mistral's; the experts and router in rlpost.models.megatron.moe).

Config: `transformer_config_from_hf` maps the HF config to a megatron `TransformerConfig` (RMSNorm eps, GQA via
`num_query_groups`, `kv_channels` = head_dim, SwiGLU = `gated_linear_unit` + silu, Qwen2's q/k/v bias via
`add_qkv_bias`, Qwen3's q/k norms via `qk_layernorm`, no dropout, `calculate_per_token_loss=True` so the schedules never average a loss), and
`gpt_model_args_from_hf` gives the GPTModel arguments (padded vocab, RoPE base `rope_theta`, llama3 RoPE scaling,
tied embeddings = `share_embeddings_and_output_weights`). On CPU every fusion is off, weights are initialised on
the CPU and `batch_p2p_sync` is off (it calls torch.cuda.synchronize after the pipeline p2p ops); on a GPU the
bias-activation / bias-dropout fusions are on and `apply_rope_fusion` follows the config.

Weights, per layer (HF name -> megatron local-spec name, TP split):
  input_layernorm.weight            -> input_layernorm.weight                    replicated
  self_attn.{q,k,v}_proj.{weight,bias} -> self_attention.linear_qkv.{weight,bias}  dim 0, fused (below)
  self_attn.{q,k}_norm.weight       -> self_attention.{q,k}_layernorm.weight     replicated (Qwen3)
  self_attn.o_proj.weight           -> self_attention.linear_proj.weight         dim 1
  post_attention_layernorm.weight   -> pre_mlp_layernorm.weight                  replicated
  mlp.{gate,up}_proj.weight         -> mlp.linear_fc1.weight                     dim 0, fused (below)
  mlp.down_proj.weight              -> mlp.linear_fc2.weight                     dim 1
A mixture of experts' MLP (router and experts) maps as rlpost.models.megatron.moe describes; OLMo 2's norms as
rlpost.models.megatron.olmo2 describes (its q/k norm weights split over TP with the heads); Gemma's four norms a
layer as rlpost.models.megatron.gemma describes (its MLP is Llama's; Gemma 3's q/k norms are Qwen3's).
Phi-3 fuses q, k and v in `self_attn.qkv_proj` (rows [q; k; v]) and gate and up in `mlp.gate_up_proj` (rows
[gate; up]): they are split into the same q, k, v and gate, up, and joined again on the way back.
plus model.embed_tokens.weight -> embedding.word_embeddings.weight (dim 0), model.norm.weight ->
decoder.final_layernorm.weight, lm_head.weight -> output_layer.weight (dim 0; absent when tied on a single stage).
The Transformer Engine spec fuses the two norms into the next linear (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`); `to_model_keys` / `from_model_keys` translate between the two namings.

Fused layouts:
- linear_qkv interleaves per query group g (ng = num_key_value_heads groups of nh/ng query heads):
  rows [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]; the bias follows the same layout.
  A TP rank holds the contiguous 1/tp slice of these rows (whole groups when ng >= tp; when ng < tp megatron
  all-gathers the fused output and picks its heads, so the contiguous slice is still the right shard).
- linear_fc1 of TP rank r is [gate rows of shard r; up rows of shard r] (megatron's GLU chunks the local
  output in two), i.e. NOT a slice of the global [gate; up].

Vocab padding: megatron shards the vocabulary evenly over TP, so the embedding and output layer get
`padded_vocab_size(V, tp, divisor)` rows: V rounded up to a multiple of divisor * tp (megatron-LM's
make_vocab_size_divisible_by, default 128; set megatron_cfg.extra["make_vocab_size_divisible_by"] to change it).
Padded rows are zero; rlpost's logit code masks padded columns out of every softmax; export drops them.

Layer indices: megatron numbers the layers of a pipeline stage from 0; a stage holding global layers
[start, end) maps HF layer g to local index g - start.

`rlpost.models.megatron.export.export_hf_weights` gathers a built (possibly TP/PP-sharded, DDP-wrapped) model back
to full HF tensors; see its docstring for the collectives. No conversion cache is kept on disk: conversion is an in-memory re-layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rlpost.config.model_families import ARCHITECTURES
from rlpost.models.megatron import gemma as gemma_layers
from rlpost.models.megatron import moe as moe_layers
from rlpost.models.megatron import olmo2

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import PretrainedConfig

    from rlpost.config.schema.megatron import MegatronConfig

LLAMA_LIKE_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                    "Olmo2ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", *gemma_layers.ARCHITECTURES)
"""Architectures whose attention_bias / mlp_bias flags would add biases megatron's layers here do not carry."""
FUSED_PROJECTION_ARCHS = ("Phi3ForCausalLM",)
"""Architectures whose checkpoint fuses q/k/v (qkv_proj) and gate/up (gate_up_proj)."""
DEFAULT_VOCAB_DIVISOR = 128
VOCAB_DIVISOR_KEY = "make_vocab_size_divisible_by"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Megatron's llama3 RoPE scaling hard-codes these (RotaryEmbedding._apply_scaling).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# local-spec name -> Transformer Engine spec name of the norms that TE fuses into the next linear.
_TE_NORM_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclasses.dataclass(frozen=True)
class HFModelDims:
    """The architecture facts of a supported HF causal LM that the conversion needs."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    qkv_bias: bool
    qk_norm: bool
    fused_projections: bool
    tied_embeddings: bool
    initializer_range: float
    moe: moe_layers.MoEDims | None = None
    """The experts of a mixture of experts (rlpost.models.megatron.moe); None for a dense MLP."""
    post_norms: bool = False
    """OLMo 2's layer: norms after attention and the MLP, q/k norms over the whole projection (models.megatron.olmo2)."""
    gemma: gemma_layers.GemmaDims | None = None
    """Gemma 2 or 3's layer (rlpost.models.megatron.gemma); None for another family."""


def _rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """transformers 5 keeps RoPE settings in `rope_parameters`; 4.x used rope_theta + rope_scaling."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    out = dict(getattr(hf_config, "rope_scaling", None) or {})
    out.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return out


def hf_model_dims(hf_config: PretrainedConfig, converter_type: str = "auto") -> HFModelDims:
    """Read and validate the dims of a config of a converted family (ARCHITECTURES); raise NotImplementedError for an
    unsupported variant."""
    if converter_type == "auto":
        archs = list(getattr(hf_config, "architectures", None) or [])
        arch = archs[0] if archs else ARCHITECTURES.get(getattr(hf_config, "model_type", ""), "")
    else:
        arch = converter_type
    if arch not in ARCHITECTURES.values():
        raise NotImplementedError(
            f"no Megatron converter for {arch or hf_config!r}; supported: {list(ARCHITECTURES.values())}"
        )
    gemma = gemma_layers.gemma_dims(hf_config, arch)
    if gemma is None and getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={hf_config.hidden_act!r}: only SwiGLU (silu) is converted")
    if arch in LLAMA_LIKE_ARCHS and (
        getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)
    ):
        raise NotImplementedError(
            f"{arch} attention_bias / mlp_bias (projection / MLP biases) have no megatron equivalent here"
        )
    if getattr(hf_config, "use_sliding_window", False) or (
        arch in ("MistralForCausalLM", "MixtralForCausalLM") and getattr(hf_config, "sliding_window", None) is not None
    ):
        raise NotImplementedError(f"{arch} sliding-window attention is not converted (sliding_window must be unset)")
    rope = _rope_parameters(hf_config) if gemma is None else {"rope_theta": gemma.rope[0][0]}  # Gemma: per layer
    if float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise NotImplementedError(f"{arch} partial_rotary_factor != 1 (RoPE on part of each head) is not converted")
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    scaling: float | None = None
    if rope_type == "llama3":
        for key, value in _LLAMA3_FIXED.items():
            if float(rope.get(key, value)) != value:
                raise NotImplementedError(f"llama3 RoPE with {key}={rope.get(key)}: megatron fixes it to {value}")
        scaling = float(rope["factor"])
    elif rope_type != "default":
        raise NotImplementedError(f"rope_type={rope_type!r} is not converted (only 'default' and 'llama3')")
    heads = int(hf_config.num_attention_heads)
    return HFModelDims(
        architecture=arch,
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
        ffn_hidden_size=int(hf_config.intermediate_size),
        vocab_size=int(hf_config.vocab_size),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling_factor=scaling,
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or bool(gemma and gemma.qk_norm),
        fused_projections=arch in FUSED_PROJECTION_ARCHS,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        initializer_range=float(getattr(hf_config, "initializer_range", 0.02)),
        moe=moe_layers.moe_dims(hf_config, arch),
        post_norms=arch == olmo2.ARCHITECTURE,
        gemma=gemma,
    )


def padded_vocab_size(vocab_size: int, tp_size: int, divisor: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """vocab_size rounded up to a multiple of divisor * tp_size (megatron's even vocab split over TP)."""
    multiple = divisor * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def vocab_divisor(megatron_cfg: MegatronConfig | None) -> int:
    """The vocab padding divisor: megatron_cfg.extra['make_vocab_size_divisible_by'] or 128."""
    if megatron_cfg is None:
        return DEFAULT_VOCAB_DIVISOR
    return int(megatron_cfg.extra.get(VOCAB_DIVISOR_KEY, DEFAULT_VOCAB_DIVISOR))


def pipeline_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Global layers [start, end) of an even pipeline split (uneven splits: pass layer_range explicitly)."""
    if num_layers % pp_size:
        raise ValueError(f"{num_layers} layers do not split evenly over {pp_size} stages; pass layer_range")
    per = num_layers // pp_size
    return pp_rank * per, (pp_rank + 1) * per


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else _DTYPES[dtype]


def transformer_config_from_hf(
    hf_config: PretrainedConfig, megatron_cfg: MegatronConfig, params_dtype: torch.dtype | str
) -> TransformerConfig:
    """megatron TransformerConfig of the HF model under megatron_cfg's parallelism (see the module docstring).

    megatron_cfg.extra entries override TransformerConfig fields (except make_vocab_size_divisible_by, which
    is the vocab padding divisor); an unknown key raises ValueError.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    d = hf_model_dims(hf_config, megatron_cfg.converter_type)
    dtype = _torch_dtype(params_dtype)
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=d.num_layers,
        hidden_size=d.hidden_size,
        num_attention_heads=d.num_heads,
        num_query_groups=d.num_kv_heads,
        kv_channels=d.head_dim,
        ffn_hidden_size=d.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=d.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=d.qkv_bias,
        qk_layernorm=d.qk_norm,  # OLMo 2's q/k norms come from its spec: megatron would sum their TP-split grads
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=d.initializer_range,
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=_torch_dtype(megatron_cfg.pipeline_dtype),
        tensor_model_parallel_size=megatron_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=megatron_cfg.pipeline_model_parallel_size,
        context_parallel_size=megatron_cfg.context_parallel_size,
        expert_model_parallel_size=megatron_cfg.expert_model_parallel_size,
        sequence_parallel=megatron_cfg.sequence_parallel,
        num_layers_in_first_pipeline_stage=megatron_cfg.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=megatron_cfg.num_layers_in_last_pipeline_stage,
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=on_gpu and megatron_cfg.apply_rope_fusion,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # The post-batch_isend_irecv torch.cuda.synchronize() guards CUDA streams; gloo requests are waited on.
        batch_p2p_sync=on_gpu,
    )
    if d.moe is not None:
        kwargs.update(moe_layers.transformer_kwargs(d.moe))
    if d.gemma is not None:  # GeGLU; megatron fuses only its own gelu and swiglu
        kwargs.update(activation_func=functools.partial(F.gelu, approximate="tanh"), bias_activation_fusion=False)
    extra = {k: v for k, v in megatron_cfg.extra.items() if k != VOCAB_DIVISOR_KEY}
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"megatron_cfg.extra has keys that are not TransformerConfig fields: {unknown}")
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


def gpt_model_args_from_hf(hf_config: PretrainedConfig, megatron_cfg: MegatronConfig) -> dict[str, Any]:
    """GPTModel constructor arguments (besides config / spec / pre- and post-process) for the HF model."""
    d = hf_model_dims(hf_config, megatron_cfg.converter_type)
    return dict(
        vocab_size=padded_vocab_size(
            d.vocab_size, megatron_cfg.tensor_model_parallel_size, vocab_divisor(megatron_cfg)
        ),
        max_sequence_length=d.max_position_embeddings,
        position_embedding_type="rope" if d.gemma is None else "none",  # Gemma: RoPE per layer in its attention
        rotary_base=d.rope_theta,
        rope_scaling=d.rope_scaling_factor is not None,
        rope_scaling_factor=d.rope_scaling_factor or 8.0,
        share_embeddings_and_output_weights=d.tied_embeddings,
        parallel_output=True,
    )


# ----------------------------------------------------------------------------------------------- tensor layout


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: HFModelDims) -> torch.Tensor:
    """[nh*hd, ...], [ng*hd, ...], [ng*hd, ...] -> megatron's per-group interleaved [(nh + 2 ng) * hd, ...]."""
    ng, rest = d.num_kv_heads, q.shape[1:]
    fused = torch.cat([q.reshape(ng, -1, *rest), k.reshape(ng, -1, *rest), v.reshape(ng, -1, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, d: HFModelDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of _fuse_qkv."""
    ng, hd, rest = d.num_kv_heads, d.head_dim, fused.shape[1:]
    grouped = fused.reshape(ng, -1, *rest)
    q, k, v = torch.split(grouped, [d.num_heads // ng * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _qkv_rows(d: HFModelDims) -> list[int]:
    """The q, k and v rows of a fused [q; k; v] projection (Phi-3's qkv_proj)."""
    return [d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def tp_split_dim(name: str) -> int | None:
    """Dimension along which megatron shards a (local-spec) parameter over TP; None = replicated."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "layernorm.projection_weight")):
        return 0
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def _shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP shard `rank` of the full megatron tensor `name` (fc1: [gate_r; up_r]), in storage of its own (not a view
    that would keep the full tensor alive)."""
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return full
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


def merge_tp_shard(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Full megatron tensor `name` from its TP shards in rank order (inverse of the per-rank split)."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=dim)


def to_model_keys(state_dict: Mapping[str, torch.Tensor], model_keys: set[str]) -> dict[str, torch.Tensor]:
    """Rename local-spec norm keys to the TE spec's fused names when the model uses them."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        for local, te in _TE_NORM_ALIASES.items():
            if name.endswith(local):
                alias = name[: -len(local)] + te
                if name not in model_keys and alias in model_keys:
                    name = alias
                break
        out[name] = t
    return out


def from_model_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local-spec names for a model state dict (TE fused-norm names renamed back, `_extra_state` dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name.endswith("_extra_state") or not isinstance(t, torch.Tensor):
            continue
        for local, te in _TE_NORM_ALIASES.items():
            if name.endswith(te):
                name = name[: -len(te)] + local
                break
        out[name] = t
    return out


# ------------------------------------------------------------------------------------------------ HF -> Megatron


def _layer_hf_to_megatron(hf: Mapping[str, torch.Tensor], g: int, d: HFModelDims, ep: tuple[int, int] = (0, 1)
                          ) -> dict[str, torch.Tensor]:
    """Full (TP-unsplit) megatron tensors of HF layer g, under names relative to decoder.layers.<i>; of a mixture of
    experts, expert-parallel rank ep[0] of ep[1]'s experts."""
    h = f"model.layers.{g}."
    if d.fused_projections:
        q, k, v = torch.split(hf[h + "self_attn.qkv_proj.weight"], _qkv_rows(d), dim=0)
    else:
        q, k, v = (hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv")
    out = {
        "self_attention.linear_qkv.weight": _fuse_qkv(q, k, v, d),
        "self_attention.linear_proj.weight": hf[h + "self_attn.o_proj.weight"],
    }
    if d.post_norms:
        out.update(olmo2.hf_to_megatron(hf, h))
    elif d.gemma is not None:
        out.update(gemma_layers.hf_to_megatron(hf, h))
    else:
        out["input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out["pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
    if d.moe is not None:
        out.update(moe_layers.hf_to_megatron(hf, h, d.moe, *ep))
    else:
        out["mlp.linear_fc1.weight"] = (hf[h + "mlp.gate_up_proj.weight"] if d.fused_projections else
                                        torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]]))
        out["mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    if d.qkv_bias:
        out["self_attention.linear_qkv.bias"] = _fuse_qkv(
            hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"], d
        )
    if d.qk_norm:
        out["self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
        out["self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
    return out


def hf_to_megatron_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: PretrainedConfig,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    *,
    layer_range: tuple[int, int] | None = None,
    divisor: int = DEFAULT_VOCAB_DIVISOR,
    converter_type: str = "auto",
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The local-spec megatron state dict of TP rank tp_rank on pipeline stage pp_rank (and, of a mixture of
    experts, the experts of expert-parallel rank ep_rank).

    The stage holds global layers layer_range (default: the even split) under local indices; stage 0 gets the
    embedding, the last stage the final norm and (unless tied on a single stage) output_layer.weight, which for a
    tied model is the embedding. Vocab rows are zero-padded to padded_vocab_size(V, tp_size, divisor).
    Tensors may share storage with hf_state_dict. Each unit (the embedding, a layer, the final norm and head) is
    converted and cut to this rank's shard before the next is read, so with a lazily read checkpoint
    (rlpost.models.megatron.model.LazyCheckpoint) the rank holds its shard and one unit's full tensors.
    """
    d = hf_model_dims(hf_config, converter_type)
    start, end = layer_range or pipeline_layer_range(d.num_layers, pp_rank, pp_size)
    vocab = padded_vocab_size(d.vocab_size, tp_size, divisor)
    out: dict[str, torch.Tensor] = {}

    def put(name: str, full: torch.Tensor) -> None:
        out[name] = _shard(name, full, tp_rank, tp_size)

    if pp_rank == 0:
        put("embedding.word_embeddings.weight", _pad_rows(hf_state_dict["model.embed_tokens.weight"], vocab))
    for g in range(start, end):
        for name, t in _layer_hf_to_megatron(hf_state_dict, g, d, (ep_rank, ep_size)).items():
            put(f"decoder.layers.{g - start}.{name}", t)
    if pp_rank == pp_size - 1:
        put("decoder.final_layernorm.weight", hf_state_dict["model.norm.weight"])
        if not (d.tied_embeddings and pp_rank == 0):
            head = "model.embed_tokens.weight" if d.tied_embeddings else "lm_head.weight"
            if head not in hf_state_dict:
                raise KeyError(f"{head} missing from the HF state dict (tie_word_embeddings={d.tied_embeddings})")
            put("output_layer.weight", _pad_rows(hf_state_dict[head], vocab))
    return out


# ------------------------------------------------------------------------------------------------ Megatron -> HF


def _layer_megatron_to_hf(m: Mapping[str, torch.Tensor], g: int, d: HFModelDims) -> dict[str, torch.Tensor]:
    """HF tensors of global layer g from full megatron tensors named relative to decoder.layers.<i>."""
    h = f"model.layers.{g}."
    q, k, v = split_qkv(m["self_attention.linear_qkv.weight"], d)
    if d.post_norms:
        out = olmo2.megatron_to_hf(m, h)
    elif d.gemma is not None:
        out = gemma_layers.megatron_to_hf(m, h)
    else:
        out = {h + "input_layernorm.weight": m["input_layernorm.weight"],
               h + "post_attention_layernorm.weight": m["pre_mlp_layernorm.weight"]}
    if d.fused_projections:
        out[h + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v], dim=0)
    else:
        out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                    h + "self_attn.v_proj.weight": v})
    if d.qkv_bias:
        qb, kb, vb = split_qkv(m["self_attention.linear_qkv.bias"], d)
        out.update({h + "self_attn.q_proj.bias": qb, h + "self_attn.k_proj.bias": kb, h + "self_attn.v_proj.bias": vb})
    if d.qk_norm:
        out[h + "self_attn.q_norm.weight"] = m["self_attention.q_layernorm.weight"]
        out[h + "self_attn.k_norm.weight"] = m["self_attention.k_layernorm.weight"]
    out[h + "self_attn.o_proj.weight"] = m["self_attention.linear_proj.weight"]
    if d.moe is not None:
        return {**out, **moe_layers.megatron_to_hf(m, h, d.moe)}
    if d.fused_projections:
        out[h + "mlp.gate_up_proj.weight"] = m["mlp.linear_fc1.weight"]
    else:
        gate, up = m["mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update({h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up})
    out[h + "mlp.down_proj.weight"] = m["mlp.linear_fc2.weight"]
    return out


def full_megatron_to_hf(
    full: Mapping[str, torch.Tensor], d: HFModelDims, layer_offset: int = 0, include_tied_lm_head: bool = True
) -> dict[str, torch.Tensor]:
    """HF tensors for whatever part of a stage `full` holds (TP-merged local-spec tensors, local layer indices).

    For a tied model lm_head.weight is emitted from the embedding (include_tied_lm_head) and a last-stage
    output_layer copy is ignored.
    """
    out: dict[str, torch.Tensor] = {}
    if "embedding.word_embeddings.weight" in full:
        emb = full["embedding.word_embeddings.weight"][: d.vocab_size]
        out["model.embed_tokens.weight"] = emb
        if d.tied_embeddings and include_tied_lm_head:
            out["lm_head.weight"] = emb
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in full.items():
        if name.startswith("decoder.layers."):
            idx, rest = name[len("decoder.layers.") :].split(".", 1)
            layers.setdefault(int(idx), {})[rest] = t
    for local in sorted(layers):
        out.update(_layer_megatron_to_hf(layers[local], local + layer_offset, d))
    if "decoder.final_layernorm.weight" in full:
        out["model.norm.weight"] = full["decoder.final_layernorm.weight"]
    if "output_layer.weight" in full and not d.tied_embeddings:
        out["lm_head.weight"] = full["output_layer.weight"][: d.vocab_size]
    return out


def megatron_to_hf_state_dict(
    tp_shards: Sequence[Mapping[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    hf_config: PretrainedConfig,
    *,
    layer_offset: int = 0,
    include_tied_lm_head: bool = True,
    converter_type: str = "auto",
) -> dict[str, torch.Tensor]:
    """HF state dict of one pipeline stage from its megatron state dicts (one per TP rank, in rank order).

    Accepts local-spec or TE-spec names (`_extra_state` entries are ignored). layer_offset is the stage's first
    global layer. Vocab padding is removed. For a whole model, union the results of all stages.
    """
    shards = [tp_shards] if isinstance(tp_shards, Mapping) else list(tp_shards)
    local = [from_model_keys(s) for s in shards]
    merged = {name: merge_tp_shard(name, [s[name] for s in local]) for name in local[0]}
    return full_megatron_to_hf(merged, hf_model_dims(hf_config, converter_type), layer_offset, include_tied_lm_head)
