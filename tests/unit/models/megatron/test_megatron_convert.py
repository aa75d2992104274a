"""HF <-> Megatron weight and config conversion (no process group, no megatron parallel state)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlpost.config.schema.megatron import MegatronConfig
from rlpost.models.megatron.convert import (
    gpt_model_args_from_hf,
    hf_model_dims,
    hf_to_megatron_state_dict,
    megatron_to_hf_state_dict,
    padded_vocab_size,
    pipeline_layer_range,
    transformer_config_from_hf,
)
from rlpost.models.megatron.model import check_right_padded, load_hf_checkpoint, scale_and_mask_logits
from tests.unit.models.megatron import megatron_test_helpers as h


@pytest.fixture(scope="module")
def hf_models() -> dict[str, Any]:
    return {name: h.make_hf_model(name) for name in h.MODEL_CONFIGS}


@pytest.mark.parametrize("name", list(h.MODEL_CONFIGS))
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_exact(name: str, tp: int, pp: int, hf_models: dict[str, Any]) -> None:
    config = hf_models[name].config
    ref = h.checkpoint_state(hf_models[name])
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [hf_to_megatron_state_dict(ref, config, r, tp, stage, pp) for r in range(tp)]
        start, _ = pipeline_layer_range(config.num_hidden_layers, stage, pp)
        part = megatron_to_hf_state_dict(shards, config, layer_offset=start)
        assert not set(part) & set(back)
        back.update(part)
    assert set(back) == set(ref), sorted(set(back) ^ set(ref))
    for k, v in ref.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def _labelled_layer(
    nh: int, ng: int, hd: int, hidden: int, ffn: int
) -> tuple[SimpleNamespace, dict[str, torch.Tensor]]:
    """A one-layer Qwen2-like config whose q/k/v/gate/up rows carry their own labels."""
    cfg = SimpleNamespace(
        model_type="qwen2",
        num_hidden_layers=1,
        hidden_size=hidden,
        num_attention_heads=nh,
        num_key_value_heads=ng,
        head_dim=hd,
        intermediate_size=ffn,
        vocab_size=8,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_theta": 1e4, "rope_type": "default"},
    )

    def rows(base: int, n: int) -> torch.Tensor:
        return (base + torch.arange(n, dtype=torch.float32))[:, None].repeat(1, hidden)

    p = "model.layers.0."
    sd = {
        "model.embed_tokens.weight": torch.randn(8, hidden),
        "model.norm.weight": torch.ones(hidden),
        p + "input_layernorm.weight": torch.ones(hidden),
        p + "post_attention_layernorm.weight": torch.ones(hidden),
        p + "self_attn.q_proj.weight": rows(100, nh * hd),
        p + "self_attn.k_proj.weight": rows(200, ng * hd),
        p + "self_attn.v_proj.weight": rows(300, ng * hd),
        p + "self_attn.q_proj.bias": rows(100, nh * hd)[:, 0],
        p + "self_attn.k_proj.bias": rows(200, ng * hd)[:, 0],
        p + "self_attn.v_proj.bias": rows(300, ng * hd)[:, 0],
        p + "self_attn.o_proj.weight": torch.randn(hidden, nh * hd),
        p + "mlp.gate_proj.weight": rows(500, ffn),
        p + "mlp.up_proj.weight": rows(600, ffn),
        p + "mlp.down_proj.weight": torch.randn(hidden, ffn),
    }
    return cfg, sd


def test_qkv_is_interleaved_per_query_group_and_fc1_per_rank() -> None:
    cfg, sd = _labelled_layer(nh=4, ng=2, hd=1, hidden=2, ffn=4)
    full = hf_to_megatron_state_dict(sd, cfg)
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    assert qkv == [100, 101, 200, 300, 102, 103, 201, 301]
    assert full["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == qkv
    assert full["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [500, 501, 502, 503, 600, 601, 602, 603]
    shards = [hf_to_megatron_state_dict(sd, cfg, r, 2) for r in range(2)]
    assert shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [100, 101, 200, 300]
    assert shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == [102, 103, 201, 301]
    assert shards[0]["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [500, 501, 600, 601]
    assert shards[1]["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [502, 503, 602, 603]
    assert shards[1]["decoder.layers.0.self_attention.linear_proj.weight"].shape == (2, 2)


def test_vocab_padding(hf_models: dict[str, Any]) -> None:
    assert padded_vocab_size(128, 1) == 128
    assert padded_vocab_size(128, 2) == 256
    assert padded_vocab_size(100, 1) == 128
    assert padded_vocab_size(151936, 1) == 151936
    assert padded_vocab_size(151936, 8) == 152576  # megatron-LM pads to a multiple of 128 * tp
    assert padded_vocab_size(100, 2, divisor=1) == 100
    model = hf_models["qwen2_tied"]
    shards = [hf_to_megatron_state_dict(model.state_dict(), model.config, r, 2) for r in range(2)]
    emb = [s["embedding.word_embeddings.weight"] for s in shards]
    assert emb[0].shape == emb[1].shape == (128, 64)
    assert torch.equal(emb[0], model.state_dict()["model.embed_tokens.weight"])
    assert not emb[1].any()  # the second TP rank holds only padding rows
    assert "output_layer.weight" not in shards[0]  # tied, single stage: the head reuses the embedding
    last = hf_to_megatron_state_dict(model.state_dict(), model.config, 0, 1, pp_rank=1, pp_size=2)
    assert torch.equal(last["output_layer.weight"], model.state_dict()["model.embed_tokens.weight"])
    assert set(last) >= {"decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.weight"}
    assert "decoder.layers.1.input_layernorm.weight" not in last


def test_transformer_config_from_hf() -> None:
    cfg = MegatronConfig(tensor_model_parallel_size=2, extra={"make_vocab_size_divisible_by": 64})
    qwen = transformer_config_from_hf(h.qwen2_config(True), cfg, "float32")
    assert (qwen.num_attention_heads, qwen.num_query_groups, qwen.kv_channels) == (2, 1, 32)
    assert qwen.add_qkv_bias and not qwen.add_bias_linear and qwen.gated_linear_unit
    assert qwen.normalization == "RMSNorm" and qwen.layernorm_epsilon == 1e-6
    assert qwen.calculate_per_token_loss and qwen.hidden_dropout == 0.0 and qwen.attention_dropout == 0.0
    assert qwen.params_dtype == torch.float32 and qwen.tensor_model_parallel_size == 2
    if not torch.cuda.is_available():
        assert qwen.use_cpu_initialization and not qwen.batch_p2p_sync
        assert not (qwen.bias_activation_fusion or qwen.apply_rope_fusion or qwen.masked_softmax_fusion)
    args = gpt_model_args_from_hf(h.qwen2_config(True), cfg)
    assert args["vocab_size"] == 128 and args["rotary_base"] == 5000.0
    assert args["share_embeddings_and_output_weights"] and not args["rope_scaling"]
    llama = transformer_config_from_hf(h.llama_config(), MegatronConfig(extra={"init_method_std": 0.5}), "float32")
    assert not llama.add_qkv_bias and llama.num_query_groups == 2 and llama.kv_channels == 16
    assert llama.init_method_std == 0.5
    largs = gpt_model_args_from_hf(h.llama_config(), MegatronConfig())
    assert largs["rope_scaling"] and largs["rope_scaling_factor"] == 8.0 and largs["rotary_base"] == 500000.0
    assert not largs["share_embeddings_and_output_weights"] and largs["vocab_size"] == 128
    with pytest.raises(ValueError, match="not TransformerConfig fields"):
        transformer_config_from_hf(h.llama_config(), MegatronConfig(extra={"no_such_field": 1}), "float32")


def test_unsupported_variants_are_rejected() -> None:
    llama = h.llama_config()
    llama.attention_bias = True
    with pytest.raises(NotImplementedError, match="attention_bias"):
        hf_model_dims(llama)
    qwen = h.qwen2_config(True)
    qwen.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(NotImplementedError, match="yarn"):
        hf_model_dims(qwen)
    with pytest.raises(NotImplementedError, match="no Megatron converter"):
        hf_model_dims(SimpleNamespace(model_type="gpt2", architectures=None))
    with pytest.raises(ValueError, match="evenly"):
        pipeline_layer_range(3, 0, 2)


def test_load_hf_checkpoint(tmp_path: Any, hf_models: dict[str, Any]) -> None:
    path = h.save_hf_model("qwen2_tied", str(tmp_path))
    config, state = load_hf_checkpoint(path)
    assert config.architectures == ["Qwen2ForCausalLM"] and config.tie_word_embeddings
    ref = hf_models["qwen2_tied"].state_dict()
    assert set(state) == set(ref) - {"lm_head.weight"}  # a tied checkpoint does not store the head
    for k, v in state.items():
        assert torch.equal(v, ref[k]), k
    assert hf_model_dims(config).architecture == "Qwen2ForCausalLM"


def test_logit_masking_and_padding_check() -> None:
    logits = torch.zeros(1, 2, 4)
    out = scale_and_mask_logits(logits + 1.0, 0.5, vocab_start=4, vocab_size=6)  # slice [4, 8), 2 real ids
    assert out[0, 0, :2].tolist() == [2.0, 2.0]
    assert torch.all(out[..., 2:] == torch.finfo(torch.float32).min)
    assert torch.equal(scale_and_mask_logits(logits, 1.0, 0, 4), logits)
    assert torch.all(scale_and_mask_logits(logits, 1.0, 8, 6) == torch.finfo(torch.float32).min)
    check_right_padded(torch.tensor([[1, 1, 0], [1, 0, 0]]))
    with pytest.raises(ValueError, match="right-padded"):
        check_right_padded(torch.tensor([[0, 1, 1]]))
