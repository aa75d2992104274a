"""rlpost.models.dtensor.output_head on a real HF causal LM: the model run without its output layer's matmul gives
HeadLogits whose logprobs, token-accuracy readout and gradients (the tied embedding's among them) equal the model's own
logits', chunked or not, and the layer's forward is the model's own again afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from rlpost.config.layout import LOGITS_CHUNK_BYTES, chunk_tokens
from rlpost.losses.clipped_pg import NLLLoss
from rlpost.models.dtensor.output_head import head_logits, output_layer
from rlpost.ops.logprobs import next_token_logprobs


def _model(model_dir: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_head_logits_equal_the_models_own(tiny_model_dir: Path, chunk: int | None) -> None:
    model = _model(tiny_model_dir)
    head = output_layer(model)
    assert head is not None and model.config.tie_word_embeddings
    ids = torch.randint(3, 300, (3, 11), generator=torch.Generator().manual_seed(1))
    temperature = 0.8

    logits = model(input_ids=ids, use_cache=False).logits.float() / temperature
    want = next_token_logprobs(logits, ids)
    (want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum().backward()
    want_grads = _grads(model)

    lazy = head_logits(model, head, {"input_ids": ids, "use_cache": False}, temperature, chunk, None)
    assert lazy.shape == logits.shape and lazy.chunk_size == chunk_tokens(chunk, logits.shape[-1])
    got = next_token_logprobs(lazy, ids)
    (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum().backward()
    got_grads = _grads(model)

    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    assert "forward" not in vars(head)  # the layer's own forward again
    torch.testing.assert_close(model(input_ids=ids).logits.float() / temperature, logits.detach())


def test_nll_loss_and_token_accuracy_read_head_logits_like_logits(tiny_model_dir: Path) -> None:
    from rlpost.distributed.batched_data_dict import BatchedDataDict

    model = _model(tiny_model_dir)
    head = output_layer(model)
    assert head is not None
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(2))
    data = BatchedDataDict(input_ids=ids, token_mask=torch.ones(2, 9), sample_mask=torch.ones(2))
    gvs, gvt = torch.tensor(2.0), torch.tensor(16.0)
    loss_fn = NLLLoss()
    assert loss_fn.chunked_logits
    with torch.no_grad():
        whole = loss_fn(model(input_ids=ids).logits.float(), data, gvs, gvt)
        lazy = loss_fn(head_logits(model, head, {"input_ids": ids}, 1.0, 4, None), data, gvs, gvt)
    assert lazy[0].item() == pytest.approx(whole[0].item(), abs=1e-6)
    assert lazy[1] == pytest.approx(whole[1], abs=1e-6)


def test_only_a_plain_bias_free_output_layer_is_read_in_chunks() -> None:
    class LM(nn.Module):
        def __init__(self, head: nn.Module) -> None:
            super().__init__()
            self.head = head

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    assert output_layer(LM(nn.Linear(4, 8, bias=False))) is not None
    assert output_layer(LM(nn.Linear(4, 8))) is None  # a bias: not what HeadLogits computes
    assert output_layer(LM(nn.Sequential(nn.Linear(4, 8, bias=False)))) is None
    assert output_layer(nn.Linear(4, 8)) is None  # no output embeddings (a value or reward model)


def test_the_default_chunk_bounds_a_chunks_logits() -> None:
    assert chunk_tokens(64, 49152) == 64
    assert chunk_tokens(None, 49152) * 49152 * 4 <= LOGITS_CHUNK_BYTES < (chunk_tokens(None, 49152) + 1) * 49152 * 4
    assert chunk_tokens(None, 384) >= 4096  # the tiny model: a whole micro-batch in one chunk


@pytest.mark.parametrize("k", [5, None])
def test_a_teachers_top_k_read_in_chunks_equals_the_whole_log_softmax(tiny_model_dir: Path, k: int | None) -> None:
    model = _model(tiny_model_dir)
    head = output_layer(model)
    assert head is not None
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        want = lp.topk(lp.shape[-1] if k is None else k, dim=-1)
        idx, vals = head_logits(model, head, {"input_ids": ids}, 1.0, 4, None).topk_logprobs(k)
    torch.testing.assert_close(vals, want.values, rtol=1e-6, atol=1e-6)
    assert torch.equal(idx, want.indices)


@pytest.mark.parametrize("overrides, shown", [
    (["policy.logprob_chunk_size=512", "policy.dtensor_cfg.activation_checkpointing=true"],
     "chunks of up to 512 tokens (policy.logprob_chunk_size), never the whole tokens x vocabulary logits; "
     "activation checkpointing on"),
    (["algo=sft", "model.tiny.vocab_size=49152"], f"chunks of up to {LOGITS_CHUNK_BYTES // (4 * 49152):,} tokens"),
    (["policy=megatron", "cluster.gpus_per_node=2", "policy.megatron_cfg.tensor_model_parallel_size=2",
      "policy.megatron_cfg.sequence_parallel=true"], "the whole logits (sequence parallelism)"),
    (["algo=dpo", "policy=megatron", "policy.megatron_cfg.activation_checkpointing=true"],
     "activation checkpointing on"),
    (["cluster.gpus_per_node=2", "policy.dtensor_cfg.context_parallel_size=2"],
     "each sequence split over 2 context-parallel ranks"),
])
def test_the_plan_says_how_long_sequences_are_bounded(overrides: list[str], shown: str) -> None:
    from rlpost.config.load import load_master_config
    from rlpost.plan import plan_rows

    _, master = load_master_config(overrides)
    assert shown in dict(plan_rows(master))["long sequences"]
