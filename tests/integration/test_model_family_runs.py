"""Each family `model.tiny.architecture` builds, through `rlpost train` on the DTensor worker at TP=2 with the vLLM
engine: GRPO steps (two; the Qwen3-MoE run learns the default task in 80), so the second refit carries trained weights from both TP ranks (each serves the engine on its
device; the fingerprint gate fails if they differ) and the engine stays on policy (token_mult_prob_error <= 1.001 in
fp32); then the HF export of the last step holds the checkpoint's names and transformers loads it.

What each family brings to the path: gemma2 soft-caps its logits (the worker takes them whole) and its vLLM model has
no head apart from the embedding; gemma3_text normalises each head's q and k (the norm's gradient is summed over the
TP ranks); olmo2 normalises whole projections and phi3 fuses them (both gather their projections under TP); qwen3_moe
and mixtral fuse their experts in memory, split them for vLLM and the export, and vLLM-CPU repacks them after each
refit (rlpost.models.generation.vllm_extension.repack_cpu_experts). The Qwen3 run, with LoRA, is
tests/integration/test_grpo.py::test_qwen3_trains_under_dtensor_tp2_with_lora_and_stays_on_policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cli_runs import metrics, train

pytestmark = pytest.mark.slow


STEPS = {"gemma2": 2, "gemma3_text": 2, "olmo2": 2, "phi3": 2, "qwen3_moe": 80, "mixtral": 2}
"""Two steps each; the Qwen3-MoE run is the default job's 80, and it learns the task."""
LORA = ("olmo2", "phi3", "mixtral")
"""Runs with the LoRA preset (experiment=tiny_lora: adapters split as their layers are, the embeddings trained in
full, the merged weights refit); the others train every weight."""


@pytest.mark.parametrize("family", list(STEPS))
def test_each_family_trains_at_tp2_and_the_engine_stays_on_policy(family: str, cache: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    run, steps = tmp_path / family, STEPS[family]
    train(run, cache, f"model.tiny.architecture={family}", "model.tiny.num_key_value_heads=2",
          "cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2", f"grpo.max_num_steps={steps}",
          "grpo.val_period=0", f"checkpointing.save_period={steps}", "checkpointing.metric_name=null",
          *(["experiment=tiny_lora", "policy.dtensor_cfg.lora_cfg.export_merged=true"] if family in LORA else []))
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert all(m["train/token_mult_prob_error"] <= 1.001 for m in lines), lines
    moe = family in ("qwen3_moe", "mixtral")
    for m in lines:  # the routers' statistics (rlpost.models.dtensor.router_stats), a MoE family's alone
        assert (m.get("train/moe_aux_loss", 0.0) > 0.0 and m.get("train/moe_load_cv", -1.0) >= 0.0) is moe, m
    if steps > 2:
        rewards = [m["train/reward"] for m in lines]
        assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.5, rewards
    exported = run / "checkpoints" / f"step_{steps}" / "policy" / "weights" / "hf"
    assert AutoConfig.from_pretrained(exported).model_type == family
    with safe_open(exported / "model.safetensors", "pt") as f:
        names = set(f.keys())
    experts = [n for n in names if ".experts." in n]
    assert bool(experts) is moe and all(n.endswith(".weight") for n in experts), sorted(names)[:8]
    AutoModelForCausalLM.from_pretrained(exported)
