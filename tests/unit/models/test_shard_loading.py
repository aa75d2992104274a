"""A rank's model built on the meta device and loaded tensor by tensor (rlpost.models.dtensor.shard_loading), on one
process: the same state and outputs as `from_pretrained` (with peft's adapters and HF's new heads), and a clear error
when the checkpoint does not fit the model."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from rlpost.config.load import load_master_config
from rlpost.config.schema.lora import LoRAConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.models.dtensor import lora
from rlpost.models.dtensor.shard_loading import build_sharded
from rlpost.models.policy.hf_loading import load_hf_causal_lm

SEED = 1234
"""The seed the DTensor workers set before building their model."""


def policy_cfg(model_dir: Path, **fields: object) -> PolicyConfig:
    _, cfg = load_master_config(["cluster.gpus_per_node=1"])
    return dataclasses.replace(cfg.policy, model_name=str(model_dir), **fields)  # type: ignore[arg-type]


def identity(model: nn.Module) -> nn.Module:
    return model


def loaded_whole(cfg: PolicyConfig, lora_cfg: LoRAConfig | None) -> nn.Module:
    torch.manual_seed(SEED)
    model = load_hf_causal_lm(cfg, torch.float32)
    return lora.inject(model, lora_cfg) if lora_cfg is not None else model


def built_sharded(cfg: PolicyConfig, lora_cfg: LoRAConfig | None,
                  parallelize: Callable[[nn.Module], nn.Module] = identity) -> nn.Module:
    torch.manual_seed(SEED)
    return build_sharded(cfg, lora_cfg, torch.device("cpu"), parallelize)


@pytest.fixture(scope="module")
def untied_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied Llama with MLP biases, saved as HF saves it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model("llama", hidden_size=96, num_hidden_layers=2, num_attention_heads=3,
                              num_key_value_heads=1, intermediate_size=160, vocab_size=320, tie_word_embeddings=False,
                              mlp_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 500.0,
                                                              "factor": 2.0})
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(hf).save_pretrained(out)
    return out


CASES = {
    "qwen2 tied": ("tiny", {}, None),
    "qwen2 tied lora": ("tiny", {}, LoRAConfig(enabled=True, dim=4, alpha=8)),
    "llama untied lora on attention": ("llama", {}, LoRAConfig(enabled=True, dim=2, match_all_linear=False,
                                                               target_modules=["q_proj", "v_proj"])),
    "qwen2 value head": ("tiny", {"value_head": True}, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_meta_build_equals_loading_the_model_whole(case: str, tiny_model_dir: Path,
                                                       untied_llama_dir: Path) -> None:
    which, fields, lora_cfg = CASES[case]
    cfg = policy_cfg(tiny_model_dir if which == "tiny" else untied_llama_dir, **fields)
    whole, sharded = loaded_whole(cfg, lora_cfg), built_sharded(cfg, lora_cfg)
    a, b = whole.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for name, buf in whole.named_buffers():  # the rotary frequencies, which no checkpoint holds
        assert torch.equal(buf, sharded.get_buffer(name)), name
    if hasattr(whole, "lm_head"):
        def is_tied(m: Any) -> bool:
            return bool(m.lm_head.weight is m.get_input_embeddings().weight)

        assert is_tied(sharded) == is_tied(whole)
    assert [n for n, p in whole.named_parameters() if p.requires_grad] == \
        [n for n, p in sharded.named_parameters() if p.requires_grad]
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(whole(input_ids=ids).logits, sharded(input_ids=ids).logits)


def test_no_parameter_or_buffer_is_left_on_the_meta_device(tiny_model_dir: Path) -> None:
    model = built_sharded(policy_cfg(tiny_model_dir), LoRAConfig(enabled=True, dim=4))
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


def rewrite(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("edit", "named"), [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing 1 ['model.layers.1.mlp.up_proj.weight']"),
    (lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)),
     "unexpected 1 ['model.layers.0.mlp.extra.weight']"),
    (lambda t: t.__setitem__("model.norm.weight", torch.ones(65)), "model.norm.weight: shape (65,)"),
])
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_naming_the_key(
        tiny_model_dir: Path, tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None], named: str) -> None:
    cfg = policy_cfg(rewrite(tiny_model_dir, tmp_path / "edited", edit))
    with pytest.raises(ValueError, match="policy.model_name=|checkpoint tensor") as err:
        built_sharded(cfg, None)
    assert named in str(err.value)


@pytest.mark.gpu
def test_the_meta_build_on_a_gpu_equals_loading_the_model_whole(tiny_model_dir: Path) -> None:
    cfg, lora_cfg = policy_cfg(tiny_model_dir), LoRAConfig(enabled=True, dim=4)
    whole = loaded_whole(cfg, lora_cfg).cuda()
    torch.manual_seed(SEED)
    sharded = build_sharded(cfg, lora_cfg, torch.device("cuda", 0), identity)
    assert all(t.is_cuda for t in [*sharded.parameters(), *sharded.buffers()])
    a, b = whole.state_dict(), sharded.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        assert torch.equal(whole(input_ids=ids).logits, sharded(input_ids=ids).logits)
