"""A mixture-of-experts layer's weights between a checkpoint's per-expert matrices and transformers' fused tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlpost.models.expert_weights import LAYOUTS, ExpertAssembler, to_checkpoint_layout

E, H, INTER = 3, 4, 5


def _fused(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.layers.2.mlp.experts.gate_up_proj": torch.randn(E, 2 * INTER, H, generator=g),
            "model.layers.2.mlp.experts.down_proj": torch.randn(E, H, INTER, generator=g),
            "model.layers.2.mlp.gate.weight": torch.randn(E, H, generator=g),
            "model.layers.2.self_attn.q_proj.weight": torch.randn(H, H, generator=g)}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_fused_experts_split_into_the_checkpoint_names_and_back(family: str) -> None:
    fused = _fused(1)
    ckpt = to_checkpoint_layout(SimpleNamespace(model_type=family), fused)
    lo = LAYOUTS[family]
    block = "model.layers.2." + lo.block
    assert len(ckpt) == 3 * E + 2
    assert torch.equal(ckpt[f"{block}.experts.1.{lo.gate}.weight"], fused["model.layers.2.mlp.experts.gate_up_proj"][1, :INTER])
    assert torch.equal(ckpt[f"{block}.experts.1.{lo.up}.weight"], fused["model.layers.2.mlp.experts.gate_up_proj"][1, INTER:])
    assert torch.equal(ckpt[f"{block}.experts.2.{lo.down}.weight"], fused["model.layers.2.mlp.experts.down_proj"][2])
    assert torch.equal(ckpt[f"{block}.gate.weight"], fused["model.layers.2.mlp.gate.weight"])
    assembler, back = ExpertAssembler(lo, E), {}
    for name, t in reversed(list(ckpt.items())):  # any order: a fused tensor comes out with its last expert
        done = assembler.add(name, t.clone())
        if done is not None:
            back[done[0]] = done[1]
    assert not assembler.incomplete()
    assert back.keys() == fused.keys() and all(torch.equal(back[k], fused[k]) for k in fused)


def test_a_missing_expert_leaves_its_tensor_incomplete() -> None:
    ckpt = to_checkpoint_layout(SimpleNamespace(model_type="qwen3_moe"), _fused(2))
    assembler = ExpertAssembler(LAYOUTS["qwen3_moe"], E)
    for name, t in ckpt.items():
        if name != "model.layers.2.mlp.experts.1.up_proj.weight":
            assembler.add(name, t)
    assert assembler.incomplete() == ["model.layers.2.mlp.experts.gate_up_proj"]


def test_a_dense_model_keeps_its_names() -> None:
    fused = _fused(3)
    assert to_checkpoint_layout(SimpleNamespace(model_type="qwen2"), fused) == fused
