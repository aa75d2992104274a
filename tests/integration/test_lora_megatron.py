"""LoRA on the Megatron workers (adapters on the tensor-parallel linears, and the tied embeddings trained in full:
peft.modules_to_save) on real Ray actors and gloo groups: TP=2 trains the same as TP=1, only the adapted linears and
the embeddings move, the reference is the base (the adapters off, the base embeddings swapped in), and a checkpoint
holds the adapters and embeddings alone and resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.integration.exported import exported_weights
from tests.integration.test_megatron_policy import (
    LOSS,
    MEGATRON_SGD,
    Built,
    build,
    close,
    make_batch,
    max_diff,
    policy_cfg,
)

pytestmark = pytest.mark.slow

PEFT = ["policy.megatron_cfg.peft.enabled=true", "policy.megatron_cfg.peft.dim=4", "policy.megatron_cfg.peft.alpha=8",
        "policy.megatron_cfg.peft.modules_to_save=[embed_tokens]"]


def train_steps(b: Built, steps: int, first: int = 0) -> list[float]:
    """Losses of SGD steps `first` .. `first + steps - 1` (each on its own batch)."""
    losses = []
    for s in range(first, first + steps):
        data = make_batch(seed=20 + s)
        data["prev_logprobs"] = b.policy.get_logprobs(data)["logprobs"]
        losses.append(b.policy.train(data, LOSS).loss)
    return losses


def test_adapters_alone_train_tp2_equals_tp1_the_reference_is_the_base_and_a_checkpoint_holds_them(
        ray_local: None, tiny_model_dir: Path, built: list[Built], tmp_path: Path) -> None:
    data = make_batch(seed=3)
    base = load_file(str(tiny_model_dir / "model.safetensors"))

    one = build(built, policy_cfg(tiny_model_dir, 1, *PEFT, *MEGATRON_SGD), 1)
    lp0 = one.policy.get_logprobs(data)["logprobs"]
    losses1 = train_steps(one, 3)
    w1 = exported_weights(one.policy)  # merged: W + alpha/r * B @ A under HF names
    # the base: adapters off, the base embeddings in place
    assert torch.equal(one.policy.get_reference_policy_logprobs(data)["reference_logprobs"], lp0)
    assert (one.policy.get_logprobs(data)["logprobs"] - lp0).abs().max() > 1e-3  # the adapters changed the policy
    moved = sorted(k for k in base if not torch.equal(w1[k], base[k]))
    assert "model.embed_tokens.weight" in moved, moved
    assert {k.split(".")[-2] for k in moved} - {"embed_tokens"} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"}, moved
    close(built, one)

    tp = build(built, policy_cfg(tiny_model_dir, 2, "policy.megatron_cfg.tensor_model_parallel_size=2", *PEFT,
                                 *MEGATRON_SGD), 2)
    losses2 = train_steps(tp, 2)
    assert losses2 == pytest.approx(losses1[:2], abs=1e-5)
    tp.policy.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optim"))
    w_saved = exported_weights(tp.policy)
    losses2 += train_steps(tp, 1, first=2)
    assert losses2 == pytest.approx(losses1, abs=1e-5)
    assert max_diff(w1, exported_weights(tp.policy)) <= 1e-5
    close(built, tp)

    # the checkpoint: the adapters of each TP rank and nothing of the base; the HF export is the merged model
    layout = json.loads((tmp_path / "weights" / "megatron_layout.json").read_text())
    assert layout["lora"] is True
    names = set()
    for shard in (tmp_path / "weights" / "model").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            names |= set(f.keys())
    assert names and all(n.endswith((".lora_A", ".lora_B", ".word_embeddings.weight")) for n in names), sorted(names)
    assert sum(n.endswith(".word_embeddings.weight") for n in names) == 2  # one vocabulary shard per TP rank
    assert {n.split("/")[0] for n in names} == {"tp0-pp0", "tp1-pp0"}
    # weights/adapter: a PEFT directory (q/k/v and gate/up adapters split out of the fused ones, sharing A) that peft
    # merges into the base to exactly the merged model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                       str(tmp_path / "weights" / "adapter")).merge_and_unload().state_dict()
    adapters = load_file(str(tmp_path / "weights" / "adapter" / "adapter_model.safetensors"))
    assert len(adapters) == 2 * 7 * 2 + 2  # 2 layers x 7 HF linears x (A, B), the embeddings and the tied head
    assert not (tmp_path / "weights" / "hf").exists()  # the merged model only with peft.export_merged
    assert max_diff({k: merged[k] for k in w_saved}, w_saved) <= 1e-5
    resumed = build(built, policy_cfg(tiny_model_dir, 2, "policy.megatron_cfg.tensor_model_parallel_size=2", *PEFT,
                                      *MEGATRON_SGD), 2, weights_path=str(tmp_path / "weights"),
                    optimizer_path=str(tmp_path / "optim"))
    assert train_steps(resumed, 1, first=2) == pytest.approx(losses1[2:], abs=1e-6)
    assert max_diff(w1, exported_weights(resumed.policy)) <= 1e-5
