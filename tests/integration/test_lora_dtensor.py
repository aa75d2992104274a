"""LoRA on the DTensor workers (peft adapters under TP and FSDP2) on real Ray actors and gloo process groups."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.integration.test_dtensor_policy import LOSS, SGD, Built, make_batch, max_diff, policy_cfg, train_steps

pytestmark = pytest.mark.slow

@pytest.fixture
def made() -> Iterator[list[Built]]:
    out: list[Built] = []
    yield out
    for b in out:
        b.close()


LORA = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=4",
        "policy.dtensor_cfg.lora_cfg.alpha=8"]


def test_adapters_alone_train_tp2_equals_tp1_and_the_reference_is_the_base(
        ray_local: None, tiny_model_dir: Path, made: list[Built]) -> None:
    data = make_batch(seed=3)
    base = load_file(str(tiny_model_dir / "model.safetensors"))

    one = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", *LORA, optimizer=SGD), 1)
    made.append(one)
    lp0 = one.policy.get_logprobs(data)["logprobs"]
    losses1 = train_steps(one.policy, 3)
    w1 = one.policy.full_weights()
    ref1 = one.policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    lp1 = one.policy.get_logprobs(data)["logprobs"]
    one.close()
    made.remove(one)

    # the reference is the base model: the adapters off gives the starting logprobs (B starts at zero)
    assert torch.equal(ref1, lp0)
    assert (lp1 - lp0).abs().max() > 1e-3  # and the adapters did change the policy
    # only adapted layers moved; embeddings and norms are the base's, bit for bit
    moved = sorted(k for k in base if not torch.equal(w1[k], base[k]))
    assert moved and all(k.endswith("_proj.weight") for k in moved), moved
    assert {k.split(".")[-2] for k in moved} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"}

    tp = Built(policy_cfg(tiny_model_dir, "policy.dtensor_cfg.tensor_parallel_size=2", *LORA, optimizer=SGD), 2)
    made.append(tp)
    losses2 = train_steps(tp.policy, 3)
    assert losses2 == pytest.approx(losses1, abs=1e-5)
    assert max_diff(w1, tp.policy.full_weights()) <= 1e-5
    assert torch.allclose(tp.policy.get_reference_policy_logprobs(data)["reference_logprobs"], ref1, atol=1e-5)


def test_checkpoint_holds_adapters_resumes_exactly_and_exports_a_peft_dir(
        ray_local: None, tiny_model_dir: Path, made: list[Built], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = policy_cfg(tiny_model_dir, *LORA, "policy.dtensor_cfg.lora_cfg.export_merged=true")  # AdamW, DP=2
    a = Built(cfg, 2)
    made.append(a)
    train_steps(a.policy, 2)
    a.policy.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optim"))
    data = make_batch(seed=11)
    lp_saved = a.policy.get_logprobs(data)["logprobs"]
    data["prev_logprobs"] = lp_saved
    a.policy.train(data, LOSS)
    w_next = a.policy.full_weights()
    a.close()
    made.remove(a)

    # model/ holds the adapters only; the optimizer state is theirs alone
    saved: set[str] = set()
    for f in (tmp_path / "weights" / "model").glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            saved |= set(sf.keys())
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:4]
    assert len(saved) == 2 * 7 * 2  # A and B of 7 layers, 2 decoder layers
    optim_bytes = sum(f.stat().st_size for f in (tmp_path / "optim" / "optim").glob("*.safetensors"))
    base_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert optim_bytes < base_bytes / 2

    # the PEFT directory loads with peft on the base, and the merged HF directory with transformers: both score as
    # the policy did
    adapter = tmp_path / "weights" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    valid = torch.arange(data["input_ids"].shape[1])[None, 1:] < data["input_lengths"][:, None]
    for model in (PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(adapter)),
                  AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "hf")):
        with torch.no_grad():
            ref = torch.log_softmax(model(input_ids=data["input_ids"]).logits.float(), -1)[:, :-1]
        ref = ref.gather(-1, data["input_ids"][:, 1:, None])[..., 0]
        assert torch.allclose(lp_saved[:, 1:][valid], ref[valid], atol=1e-5)

    # resume (another layout: one rank) trains the next step exactly as the uninterrupted run did
    b = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", *LORA), 1,
              weights_path=str(tmp_path / "weights"), optimizer_path=str(tmp_path / "optim"))
    made.append(b)
    assert torch.allclose(b.policy.get_logprobs(data)["logprobs"], lp_saved, atol=1e-6)
    b.policy.train(data, LOSS)
    assert max_diff(w_next, b.policy.full_weights()) <= 1e-6


def test_a_full_checkpoint_is_refused_by_a_lora_run(ray_local: None, tiny_model_dir: Path, made: list[Built],
                                                    tmp_path: Path) -> None:
    from rlpost.distributed.worker_groups import WorkerGroupError

    a = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1"), 1)
    made.append(a)
    a.policy.save_checkpoint(str(tmp_path / "weights"), None, hf_export=False)
    a.close()
    made.remove(a)
    b = Built(policy_cfg(tiny_model_dir, "cluster.gpus_per_node=1", *LORA), 1, weights_path=str(tmp_path / "weights"))
    made.append(b)
    with pytest.raises(WorkerGroupError, match="holds a full model, and this run trains LoRA adapters"):
        b.policy.state_fingerprints()


def test_grpo_with_lora_refits_merged_weights_and_eval_serves_the_adapter_checkpoint(tmp_path: Path) -> None:
    """The default job with LoRA through the CLI: the engine generates with the merged weights (its logprobs equal
    the trainer's), the checkpoint holds a PEFT adapter, and `rlpost eval` on it scores what validation scored."""
    import os
    import subprocess

    from tests.integration.test_eval import RLPOST

    env = {**os.environ, "RLPOST_CACHE_DIR": str(tmp_path / "cache"), "RAY_AUTH_MODE": "disabled"}
    val = ["grpo.max_val_samples=16", "grpo.val_batch_size=16"]
    train = subprocess.run([RLPOST, "train", f"hydra.run.dir={tmp_path / 'run'}", *LORA, "grpo.max_num_steps=2",
                            "grpo.val_period=2", *val], env=env, capture_output=True, text=True, timeout=600,
                           cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3 for r in rows), rows
    step = tmp_path / "run" / "checkpoints" / "step_2"
    weights = step / "policy" / "weights"
    assert (weights / "adapter" / "adapter_model.safetensors").is_file() and not (weights / "hf").exists()
    out = subprocess.run([RLPOST, "eval", *val, "eval.max_prompts=16", f"eval.checkpoint={step}",
                          f"eval.output={tmp_path / 'eval.json'}"], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Loading" not in out.stdout + out.stderr  # the merge's progress bars go to the log
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["accuracy"] == rows[-1]["validation/accuracy"]
