"""Build a megatron-core GPTModel from an HF Qwen2/Llama checkpoint, and compute next-token logprobs with it.

`build_gpt_model` needs `megatron.core.parallel_state.initialize_model_parallel(...)` to have run (and, on CPU,
`cpu_compat.enable_cpu_compat()` plus `cpu_compat.seed_model_parallel_rng(seed)`). It builds this rank's
stage/shard with the local layer spec (megatron's own modules; always on CPU) or the Transformer Engine spec (on a
GPU when transformer_engine imports), then loads the converted HF weights into it.

`forward_logprobs` runs the model through megatron's forward-only schedule (`get_forward_backward_func()`, which
is the 1F1B pipeline schedule with p2p send/recv between stages when PP > 1), divides the logits by the
temperature, masks the padded vocabulary columns, and computes the next-token logprobs with a vocab-parallel
log-softmax over the TP group (`rlpost.ops.logprobs.vocab_parallel_logprobs`). Every rank gets the result
(the last stage broadcasts it over the PP group).

Padding: rows must be right-padded. megatron-core's GPTModel applies RoPE at positions 0..S-1 whatever the
position_ids (they only feed learned absolute embeddings), and the attention is plain causal, so positions before
the padding are exact and positions in the padding are meaningless; left padding would shift RoPE positions and
is rejected.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlpost.models.megatron.convert import (
    gpt_model_args_from_hf,
    hf_model_dims,
    hf_to_megatron_state_dict,
    to_model_keys,
    transformer_config_from_hf,
    vocab_divisor,
)
from rlpost.models.megatron.export import unwrap_model
from rlpost.models.megatron.moe import allow_moe_without_transformer_engine
from rlpost.ops.logprobs import vocab_parallel_logprobs

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import PretrainedConfig

    from rlpost.config.schema.megatron import MegatronConfig
    from rlpost.models.megatron.gemma import GemmaDims


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a local safetensors checkpoint, each read from its file when it is asked for and not kept: a
    rank converting its shard holds one checkpoint tensor at a time, never the whole model."""

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self._where: dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                self._where.update(dict.fromkeys(f.keys(), file))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._where[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf_checkpoint(model_dir: str | os.PathLike[str]) -> tuple[PretrainedConfig, Mapping[str, torch.Tensor]]:
    """(HF config, state dict) of a local checkpoint: *.safetensors (single or indexed), read lazily tensor by tensor
    (LazyCheckpoint), else pytorch_model.bin (memory-mapped).

    Never runs checkpoint code (trust_remote_code=False).
    """
    from transformers import AutoConfig

    path = os.fspath(model_dir)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True, mmap=True)
        return config, state
    return config, LazyCheckpoint([os.path.join(path, name) for name in files])


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(use_te: bool | None = None, qk_layernorm: bool = False, num_experts: int | None = None,
               context_parallel: bool = False, post_norms: bool = False, gemma: GemmaDims | None = None) -> ModuleSpec:
    """The decoder layer spec: Transformer Engine on a GPU when importable (or use_te=True), else local;
    `qk_layernorm`: per-head RMSNorm on the queries and keys (Qwen3); `num_experts`: a MoE layer of that many
    experts (each its own MLP: no grouped GEMM) in place of the dense MLP; `context_parallel`: rlpost's
    context-parallel core attention (rlpost.models.megatron.context_parallel) on every device; `post_norms`: OLMo 2's
    layer (rlpost.models.megatron.olmo2), `gemma`: Gemma's (rlpost.models.megatron.gemma), each on the local spec on
    every device."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_te is None:
        use_te = torch.cuda.is_available() and _te_available()
    if post_norms:
        from rlpost.models.megatron import olmo2

        spec = olmo2.olmo2_spec(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    elif gemma is not None:
        from rlpost.models.megatron import gemma as gemma_layers

        spec = gemma_layers.gemma_spec(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), gemma)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm)
    else:
        if num_experts:
            allow_moe_without_transformer_engine()
        spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm, normalization="RMSNorm")
    if context_parallel:
        from rlpost.models.megatron import context_parallel as cp

        spec = cp.use_in_spec(spec)
    return spec


def load_hf_weights(
    model: GPTModel, hf_config: PretrainedConfig, hf_state_dict: Mapping[str, torch.Tensor],
    megatron_cfg: MegatronConfig,
) -> None:
    """Convert the HF weights to this rank's TP shard / PP stage and copy them into the (unwrapped) model."""
    from megatron.core import parallel_state as ps

    gpt = unwrap_model(model)
    layers = list(gpt.decoder.layers)
    start = int(layers[0].layer_number) - 1 if layers else 0
    local = hf_to_megatron_state_dict(
        hf_state_dict,
        hf_config,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        layer_range=(start, start + len(layers)),
        divisor=vocab_divisor(megatron_cfg),
        converter_type=megatron_cfg.converter_type,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
    )
    model_keys = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    local = to_model_keys(local, model_keys)
    missing = sorted(model_keys - set(local))
    unexpected = sorted(set(local) - model_keys)
    if missing or unexpected:
        raise RuntimeError(f"HF -> megatron key mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    gpt.load_state_dict(local, strict=False)


def freeze_moe_routers(model: torch.nn.Module) -> int:
    """megatron_cfg.freeze_moe_router: requires_grad=False on every MoE router parameter (megatron names them
    `...mlp.router.<param>`), before DDP and the optimizer are built, so they are never updated. How many."""
    frozen = 0
    for name, param in model.named_parameters():
        if ".router." in f".{name}":
            param.requires_grad_(False)
            frozen += 1
    return frozen


def build_gpt_model(
    hf_model: str | os.PathLike[str] | PretrainedConfig,
    megatron_cfg: MegatronConfig,
    precision: str = "float32",
    pre_process: bool | None = None,
    post_process: bool | None = None,
    *,
    hf_state_dict: Mapping[str, torch.Tensor] | None = None,
    load_weights: bool = True,
    use_te: bool | None = None,
) -> GPTModel:
    """This rank's GPTModel for an HF checkpoint directory, or for an HF config plus hf_state_dict.

    pre_process / post_process default to whether this rank is the first / last pipeline stage. precision sets
    params_dtype; bf16/fp16 wrap the model in megatron's Float16Module (fp32 logits out). The model is on the
    current CUDA device on a GPU, on the CPU otherwise. `model.unpadded_vocab_size` is set to the HF vocab size.
    On CPU a bf16 model runs forward (logprobs); training it needs megatron's mixed-precision optimizer, which is
    GPU-only (see cpu_compat).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module

    if isinstance(hf_model, (str, os.PathLike)):
        hf_config, loaded = load_hf_checkpoint(hf_model)
        hf_state_dict = loaded if hf_state_dict is None else hf_state_dict
    else:
        hf_config = hf_model
    if load_weights and hf_state_dict is None:
        raise ValueError("build_gpt_model needs hf_state_dict when given an HF config and load_weights=True")
    config: TransformerConfig = transformer_config_from_hf(hf_config, megatron_cfg, precision)
    dims = hf_model_dims(hf_config, megatron_cfg.converter_type)
    spec: ModuleSpec | TransformerBlockSubmodules = layer_spec(
        use_te, qk_layernorm=config.qk_layernorm, num_experts=config.num_moe_experts,
        context_parallel=config.context_parallel_size > 1, post_norms=dims.post_norms, gemma=dims.gemma)
    if dims.gemma is not None:
        from rlpost.models.megatron import gemma as gemma_layers

        spec = gemma_layers.block_spec(spec, config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        **gpt_model_args_from_hf(hf_config, megatron_cfg),
    )
    model.unpadded_vocab_size = dims.vocab_size
    if dims.gemma is not None:
        gemma_layers.adapt_model(model, dims.gemma, dims.hidden_size)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if load_weights:
        assert hf_state_dict is not None
        load_hf_weights(model, hf_config, hf_state_dict, megatron_cfg)
    if megatron_cfg.activation_checkpointing:
        checkpoint_layers(model)
    if precision != "float32":
        return Float16Module(config, model)
    return model


def checkpoint_layers(model: GPTModel) -> None:
    """Recompute each decoder layer of this stage in backward: torch's non-reentrant checkpoint around the layer's
    forward, as the DTensor workers do, on every device. megatron-core's own recompute (`recompute_granularity`)
    saves and restores CUDA RNG states, which a CPU does not have; the layers here run without dropout, so the
    recomputed forward is the same either way. The module tree and its parameter names are left as they are."""
    from torch.utils.checkpoint import checkpoint

    from rlpost.models.megatron.cpu_compat import recompute_context

    def contexts() -> tuple[contextlib.AbstractContextManager[object], contextlib.AbstractContextManager[object]]:
        return contextlib.nullcontext(), recompute_context()  # on CPU the recompute needs the compatibility layer

    for layer in model.decoder.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, context_fn=contexts)


def vocab_shard_range(model: torch.nn.Module, tp_group: dist.ProcessGroup | None) -> tuple[int, int, int]:
    """(start, end, unpadded vocab) of this TP rank's slice of the padded vocabulary."""
    gpt = unwrap_model(model)
    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    local = gpt.vocab_size // size
    return rank * local, (rank + 1) * local, int(getattr(gpt, "unpadded_vocab_size", gpt.vocab_size))


def scale_and_mask_logits(logits: torch.Tensor, temperature: float, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """logits / temperature, with the padded vocabulary columns (ids >= vocab_size) set to the dtype's minimum.

    logits: [B, S, V_local], this rank's slice starting at vocab_start. The minimum (not -inf) keeps a slice that
    is all padding finite, so max / logsumexp / gather stay NaN-free; its softmax mass is exactly 0.
    """
    if temperature != 1.0:
        logits = logits / temperature
    valid = vocab_size - vocab_start
    if valid >= logits.shape[-1]:
        return logits
    padded = torch.arange(logits.shape[-1], device=logits.device) >= max(valid, 0)
    return logits.masked_fill(padded, torch.finfo(logits.dtype).min)


def check_right_padded(attention_mask: torch.Tensor | None) -> None:
    """Raise ValueError if any row of the [B, S] mask (1 = token) has a token after padding."""
    if attention_mask is None:
        return
    m = attention_mask.to(torch.int8)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError("megatron forward needs right-padded rows (RoPE positions are always 0..S-1)")


def resolve_tp_group(tp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """tp_group, else megatron's TP group; None when the TP size is 1."""
    from megatron.core import parallel_state as ps

    group = tp_group if tp_group is not None else ps.get_tensor_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def _microbatches(input_ids: torch.Tensor, micro_batch_size: int, pp_size: int) -> list[torch.Tensor]:
    if pp_size > 1 and input_ids.shape[0] % micro_batch_size:
        raise ValueError(
            f"with PP the batch {input_ids.shape[0]} must split evenly into micro-batches of {micro_batch_size}"
        )
    return list(input_ids.split(micro_batch_size))


def forward_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    *,
    micro_batch_size: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Next-token logprobs [B, S] (fp32, position 0 = 0) of right-padded input_ids [B, S], on every rank.

    logprob[b, t] = log softmax(logits[b, t - 1] / temperature)[input_ids[b, t]] over the unpadded vocabulary.
    tp_group defaults to megatron's TP group; PP uses megatron's pipeline groups. micro_batch_size (default: the
    whole batch) splits the batch for the schedule; chunk_size bounds the positions per log-softmax chunk.
    """
    from rlpost.models.megatron.output_head import head_logits, passthrough, reads_in_chunks

    check_right_padded(attention_mask)
    group = resolve_tp_group(tp_group)
    start, end, vocab = vocab_shard_range(model, group)
    chunked = reads_in_chunks(model)

    def collect(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if chunked:  # `out` is the final hidden states: the output layer read a chunk of tokens at a time
            return head_logits(model, out, temperature, chunk_size, start, vocab, group).next_token_logprobs(ids)
        logits = scale_and_mask_logits(out, temperature, start, vocab)
        return vocab_parallel_logprobs(logits, ids, start, end, group, chunk_size).float()

    with passthrough(model, active=chunked):
        return forward_collect(model, input_ids, collect, (), micro_batch_size=micro_batch_size)


def forward_collect(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    collect: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tail: tuple[int, ...],
    *,
    micro_batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`collect(model output, input_ids)` of every micro-batch of right-padded input_ids [B, S] through megatron's
    forward-only schedule, concatenated to [B, S, *tail] of `dtype` on every rank (the last pipeline stage
    broadcasts it over the PP group)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlpost.models.megatron import context_parallel as cp

    device = next(unwrap_model(model).parameters()).device
    batch_size, seq_len = input_ids.shape
    mbs = micro_batch_size or batch_size
    chunks = _microbatches(input_ids.to(device), mbs, ps.get_pipeline_model_parallel_world_size())

    def forward_step(data_iterator: Iterator[torch.Tensor], mdl: torch.nn.Module
                     ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
        ids = next(data_iterator)
        output = mdl(cp.split(ids), None, None)

        def last_stage(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return torch.zeros((), device=out.device), {"out": collect(cp.gather(out, ids.shape[1]), ids).to(dtype)}

        return output, last_stage

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            results = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(chunks),
                model=[model],
                num_microbatches=len(chunks),
                seq_length=seq_len,
                micro_batch_size=mbs,
                forward_only=True,
            )
    finally:
        model.train(was_training)
    out = torch.cat([r["out"] for r in results]) if results else None
    if ps.get_pipeline_model_parallel_world_size() > 1:
        if out is None:
            out = torch.empty(batch_size, seq_len, *tail, dtype=dtype, device=device)
        dist.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    assert out is not None
    return out
