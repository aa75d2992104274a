"""LoRA checkpoints of a DTensor worker (one rank, in-process): the adapters (and the embeddings of
lora_cfg.modules_to_save) and their optimizer state alone, a resume that continues bit for bit, a PEFT directory and
a merged HF directory that score as the policy does, and a full-model checkpoint refused by a LoRA run (and the
reverse)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlpost.runtime.checkpointing import CheckpointError
from tests.unit.models.test_pickle_free_checkpoint import _assert_same, _snapshot

LORA = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=4",
        "policy.dtensor_cfg.lora_cfg.alpha=8", "policy.dtensor_cfg.lora_cfg.export_merged=true"]


def _step(worker: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in worker.model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g) * 0.1
    worker.optimizer.step()
    worker.scheduler.step()
    worker.optimizer.zero_grad(set_to_none=True)


def _logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[:, :-1]
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("saved_modules", [[], ["embed_tokens"]], ids=["adapters", "adapters-and-embeddings"])
def test_adapters_alone_are_saved_resumed_exactly_and_exported(one_rank: Any, tiny_model_dir: Path,
                                                               tmp_path: Path, saved_modules: list[str]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlpost.models.dtensor.lora import merge_peft_dir

    cfg = [*LORA, f"policy.dtensor_cfg.lora_cfg.modules_to_save=[{','.join(saved_modules)}]"]
    w = one_rank(cfg)
    trainable = [n for n, p in w.model.named_parameters() if p.requires_grad]
    adapters = [n for n in trainable if ".lora_A." in n or ".lora_B." in n]
    assert adapters and sorted(set(trainable) - set(adapters)) == [f"model.{m}.weight" for m in saved_modules]
    assert sum(len(g["params"]) for g in w.optimizer.param_groups) == len(trainable)  # the base is not optimised
    _step(w, 0)
    _step(w, 1)
    w.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optim"))
    at_save = _snapshot(w)
    _step(w, 2)
    after_next = _snapshot(w)

    saved: set[str] = set()
    for f in (tmp_path / "weights" / "model").glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            saved |= set(sf.keys())
    assert saved == set(trainable)
    base_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    optim_bytes = sum(f.stat().st_size for f in (tmp_path / "optim" / "optim").glob("*.safetensors"))
    trained_bytes = sum(p.numel() * 4 for p in w.model.parameters() if p.requires_grad)
    assert optim_bytes < 2 * trained_bytes + 64 * 1024 < base_bytes * 2  # Adam's two states of what trains alone

    # resume: the same weights and optimizer state, and the next step lands where the uninterrupted one did
    r = one_rank(cfg, weights_path=str(tmp_path / "weights"), optimizer_path=str(tmp_path / "optim"))
    _assert_same(_snapshot(r), at_save)
    _step(r, 2)
    _assert_same(_snapshot(r), after_next)

    # PEFT's loader on the base, and transformers on the merged export, score as the policy did at the save
    ids = torch.randint(3, 380, (4, 12), generator=torch.Generator().manual_seed(3))
    saved_policy = one_rank(cfg, weights_path=str(tmp_path / "weights"))
    expected = _logprobs(saved_policy.model, ids)
    adapter = tmp_path / "weights" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(adapter))
    assert (_logprobs(peft_model, ids) - expected).abs().max() <= 1e-5
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "hf")
    assert (_logprobs(merged, ids) - expected).abs().max() <= 1e-5
    served = AutoModelForCausalLM.from_pretrained(merge_peft_dir(adapter, tmp_path / "served"))  # what eval serves
    assert (_logprobs(served, ids) - expected).abs().max() <= 1e-5
    if saved_modules:  # the embeddings did train, and under PEFT's name
        base = load_file(str(tiny_model_dir / "model.safetensors"))["model.embed_tokens.weight"]
        assert not torch.equal(saved_policy.model.get_input_embeddings().weight.detach(), base)
        with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as sf:
            assert "base_model.model.model.embed_tokens.weight" in set(sf.keys())


def test_a_checkpoint_of_the_other_kind_is_refused(one_rank: Any, tmp_path: Path) -> None:
    full, lora = tmp_path / "full", tmp_path / "lora"
    one_rank().save_checkpoint(str(full), None, hf_export=False)
    one_rank(LORA).save_checkpoint(str(lora), None, hf_export=False)
    with pytest.raises(CheckpointError, match="holds a full model, and this run trains LoRA adapters"):
        one_rank(LORA, weights_path=str(full))
    with pytest.raises(CheckpointError, match="holds LoRA adapters, and this run trains a full model"):
        one_rank(weights_path=str(lora))
