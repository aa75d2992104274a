"""The adapter a LoRA adapter refit hands vLLM: its rank, its names and its directory, read back by vLLM's and
peft's own loaders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlpost.config.schema.lora import LoRAConfig
from rlpost.models.generation import vllm_lora
from rlpost.models.peft_adapter import ADAPTER_WEIGHTS, write_adapter


def test_the_engine_rank_is_the_next_one_vllm_offers() -> None:
    assert [vllm_lora.engine_rank(d) for d in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="up to 512"):
        vllm_lora.engine_rank(513)


def test_an_adapter_refit_is_told_apart_by_its_names() -> None:
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert vllm_lora.is_adapter_refit([a, a.replace("lora_A", "lora_B")])
    assert not vllm_lora.is_adapter_refit(["model.layers.0.self_attn.q_proj.weight", a])
    assert not vllm_lora.is_adapter_refit([])


def test_the_written_adapter_loads_in_vllm_and_peft(tmp_path: Path) -> None:
    from peft import LoraConfig
    from safetensors.torch import load_file
    from vllm.lora.peft_helper import PEFTHelper

    cfg = LoRAConfig(enabled=True, dim=4, alpha=16, match_all_linear=False, target_modules=["q_proj", "v_proj"])
    named = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 4)}
    out = write_adapter(named, cfg.adapter_config("/models/base"), tmp_path / "adapter")
    helper = PEFTHelper.from_local_dir(str(out), None)
    assert (helper.r, helper.lora_alpha, helper.vllm_lora_scaling_factor) == (4, 16, 4.0)
    peft_cfg = LoraConfig.from_pretrained(str(out))
    assert (peft_cfg.r, peft_cfg.lora_alpha, set(peft_cfg.target_modules)) == (4, 16, {"q_proj", "v_proj"})
    loaded = load_file(str(out / ADAPTER_WEIGHTS))
    assert all(torch.equal(loaded[k], v) for k, v in named.items()) and set(loaded) == set(named)
    assert vllm_lora.engine_lora_kwargs(cfg.adapter_config("/m")) == {
        "enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1}


def test_adapter_directories_of_dead_engines_are_swept(tmp_path: Path) -> None:
    import os

    dead = tmp_path / f"{vllm_lora.STAGE_PREFIX}999999999-0"
    alive = tmp_path / f"{vllm_lora.STAGE_PREFIX}{os.getpid()}-0"
    for d in (dead, alive):
        d.mkdir()
        (d / ADAPTER_WEIGHTS).write_bytes(b"x")
    assert vllm_lora.sweep_orphans(tmp_path) == [dead.name]
    assert not dead.exists() and alive.exists()
