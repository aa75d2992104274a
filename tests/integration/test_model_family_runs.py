"""Each family `model.tiny.architecture` builds, through `rlpost train` on the DTensor worker at TP=2 with the vLLM
engine: two GRPO steps, so the second refit carries trained weights from both TP ranks (each serves the engine on its
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


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "olmo2", "phi3", "qwen3_moe", "mixtral"])
def test_each_family_trains_at_tp2_and_the_engine_stays_on_policy(family: str, cache: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    run = tmp_path / family
    train(run, cache, f"model.tiny.architecture={family}", "model.tiny.num_key_value_heads=2",
          "cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2", "grpo.max_num_steps=2",
          "grpo.val_period=0", "checkpointing.save_period=2", "checkpointing.metric_name=null")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["train/token_mult_prob_error"] <= 1.001 for m in lines), lines
    exported = run / "checkpoints" / "step_2" / "policy" / "weights" / "hf"
    assert AutoConfig.from_pretrained(exported).model_type == family
    with safe_open(exported / "model.safetensors", "pt") as f:
        names = set(f.keys())
    experts = [n for n in names if ".experts." in n]
    if family in ("qwen3_moe", "mixtral"):
        assert experts and all(n.endswith(".weight") for n in experts), sorted(names)[:8]
    else:
        assert not experts
    AutoModelForCausalLM.from_pretrained(exported)
