"""LoRA on the DTensor workers (peft adapters under TP) on real Ray actors and gloo process groups: TP=2 trains the
same adapters and embeddings (lora_cfg.modules_to_save) as TP=1, only they move, and the reference is the base. Checkpoints: tests/unit/models/
test_lora_checkpoint.py; through the CLI: the split run of test_grpo.py and test_eval.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.exported import exported_weights
from tests.integration.test_dtensor_policy import SGD, Built, make_batch, max_diff, policy_cfg, train_steps

pytestmark = pytest.mark.slow


LORA = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=4",
        "policy.dtensor_cfg.lora_cfg.alpha=8", "policy.dtensor_cfg.lora_cfg.modules_to_save=[embed_tokens]"]


def test_adapters_alone_train_tp2_equals_tp1_and_the_reference_is_the_base(
        ray_local: None, tiny_model_dir: Path, built: list[Built]) -> None:
    data = make_batch(seed=3)
    base = load_file(str(tiny_model_dir / "model.safetensors"))

    one = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", *LORA, optimizer=SGD), 1)
    built.append(one)
    lp0 = one.policy.get_logprobs(data)["logprobs"]
    losses1 = train_steps(one.policy, 3)
    w1 = exported_weights(one.policy)
    ref1 = one.policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    lp1 = one.policy.get_logprobs(data)["logprobs"]
    one.close()
    built.remove(one)

    # the reference is the base model: the adapters off and the base embeddings give the starting logprobs (B
    # starts at zero)
    assert torch.equal(ref1, lp0)
    assert (lp1 - lp0).abs().max() > 1e-3  # and the adapters did change the policy
    # only adapted layers and the (tied) embeddings moved; norms are the base's, bit for bit
    moved = sorted(k for k in base if not torch.equal(w1[k], base[k]))
    assert "model.embed_tokens.weight" in moved, moved
    adapted = [k for k in moved if k != "model.embed_tokens.weight"]
    assert adapted and all(k.endswith("_proj.weight") for k in adapted), moved
    assert {k.split(".")[-2] for k in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}

    tp = Built(policy_cfg(tiny_model_dir, "policy.dtensor_cfg.tensor_parallel_size=2", *LORA, optimizer=SGD), 2)
    built.append(tp)
    losses2 = train_steps(tp.policy, 3)
    assert losses2 == pytest.approx(losses1, abs=1e-5)
    assert max_diff(w1, exported_weights(tp.policy)) <= 1e-5
    assert torch.allclose(tp.policy.get_reference_policy_logprobs(data)["reference_logprobs"], ref1, atol=1e-5)
