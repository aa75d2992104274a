"""The routers' statistics a mixture-of-experts step logs (rlpost.models.router_stats)."""

from __future__ import annotations

import pytest
import torch

from rlpost.models.router_stats import layer_stats, router_stats, routers


def test_even_routing_gives_k_and_no_spread_and_two_favourites_give_more() -> None:
    e, k = 4, 2
    chosen = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]])  # every expert twice
    aux, cv = layer_stats(torch.zeros(4, e), chosen, e)
    assert aux == pytest.approx(k) and cv == 0.0
    logits = torch.tensor([[9.0, 9.0, -9.0, -9.0]]).expand(6, e)  # every token: experts 0 and 1
    aux, cv = layer_stats(logits, torch.tensor([[0, 1]]).expand(6, k), e)
    assert aux == pytest.approx(e * k * 0.5, rel=1e-4) and cv == pytest.approx(1.0)


def test_a_moe_forward_reports_each_layer_and_leaves_out_padding() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=32,
                               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    found = routers(model)
    assert len(found) == 2
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    valid = torch.tensor([True] * 5 + [True, True, False, False, False])
    seen = []
    handle = found[0].register_forward_hook(lambda m, a, out: seen.append(out[0].shape[0]))
    with torch.no_grad(), router_stats(found, valid) as got:
        model(input_ids=ids)
    handle.remove()
    assert seen == [10] and set(got) == {"moe_aux_loss", "moe_load_cv"}
    with torch.no_grad(), router_stats(found, None) as everything:
        model(input_ids=ids)
    assert got["moe_load_cv"] >= 0.0 and got != everything  # the 3 padding tokens changed the counts
    assert routers(AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32,
                   intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))) == []
