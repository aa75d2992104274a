"""The memory plan's formulas on published cases, worked by hand here, and its verdict, fix and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.config.load import load_master_config
from rlpost.config.memory.estimate import estimate, first_fix
from rlpost.config.memory.shape import ModelShape
from rlpost.config.memory.workers import GIB
from rlpost.memory_plan import check_memory, memory_json

QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152064, "max_position_embeddings": 32768, "tie_word_embeddings": False}
"""Qwen2.5-7B's config.json (the fields the plan reads)."""
QWEN25_1_5B = {**QWEN25_7B, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
               "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}


def config_only(tmp_path: Path, hf: dict) -> Path:
    """A model directory holding only config.json."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    return d


def on_gpus(model: Path, gpus: int, gib: float, *extra: str) -> list[str]:
    return ["model=local", f"model.path={model}", "cluster.device=cuda", f"cluster.gpus_per_node={gpus}",
            f"cluster.gpu_memory_gb={gib}", *extra]


def test_published_parameter_counts() -> None:
    # Qwen2.5-7B: 7.62B; Qwen2.5-1.5B: 1.54B; SmolLM2-135M: 134,515,008 (their model cards, HF's num_parameters())
    assert ModelShape.from_hf(QWEN25_7B).params == 7_615_616_512
    assert ModelShape.from_hf(QWEN25_1_5B).params == 1_543_714_304
    assert ModelShape.from_hf(SMOLLM2_135M).params == 134_515_008
    # a KV-cache token of SmolLM2 in fp32: keys and values, 30 layers x 3 heads x 64 = 46,080 bytes
    assert ModelShape.from_hf(SMOLLM2_135M).kv_bytes_per_token("float32") == 2 * 30 * 192 * 4


def test_a_7b_model_in_bf16_adamw_under_fsdp_over_8_gpus(tmp_path: Path) -> None:
    """Mixed-precision AdamW keeps 16 bytes per parameter (fp32 weights, gradients and two moments), sharded 8 ways;
    activations with checkpointing: each layer's input, one layer recomputed, the final norm's input and output."""
    model = config_only(tmp_path, QWEN25_7B)
    _, cfg = load_master_config(on_gpus(model, 8, 80, "policy.max_total_sequence_length=4096",
                                        "policy.train_micro_batch_size=1", "policy.logprob_batch_size=1",
                                        "policy.dynamic_batching.enabled=false",
                                        "policy.dtensor_cfg.activation_checkpointing=true"))
    assert cfg.policy.precision == "bfloat16"
    est = estimate(cfg)
    assert est is not None
    policy = next(w for w in est.workers if w.group == "policy")
    train = policy.phases["training"].device
    states = train["weights"] + train["gradients"] + train["optimizer state"]
    assert states == pytest.approx(16 * 7_615_616_512 / 8)  # 14.18 GiB a GPU
    h, layers, tokens = 3584, 28, 4096
    one_layer = (5 * h + 3 * 3584 + 3 * 512 + 4 * 18944) * tokens * 2  # bf16
    assert train["activations"] == pytest.approx(layers * h * tokens * 2 + 2 * h * tokens * 2)  # the layers' inputs
    assert train["recomputed layer"] == train["backward working set"] == pytest.approx(one_layer)
    assert train["gathered layers"] == pytest.approx(2 * 2 * policy_layer_params())  # two bf16 layers in flight
    # the output layer: 441 tokens of fp32 logits (256 MiB worth); two in the forward (the logits and logsumexp's
    # temporary), one in the backward (recomputed, made the gradient in place) beside the fp32 weight gradient
    assert policy.phases["forward"].device["output layer chunk"] == pytest.approx(2 * 441 * 152064 * 4)
    assert train["output layer chunk"] == pytest.approx(441 * 152064 * 4)
    assert train["output layer gradient"] == pytest.approx(4 * 152064 * 3584)
    # the colocated engine takes gpu_memory_utilization of the GPU while it generates: 0.6 x 80 GiB
    engine = next(w for w in est.workers if w.group == "engine")
    awake = engine.phases["generation"].device
    assert awake["weights"] == pytest.approx(2 * 7_615_616_512)
    assert awake["weights"] + awake["KV cache and activations"] == pytest.approx(0.6 * 80 * GIB)
    # asleep it holds its weights in host memory; the policy's state is offloaded while the engine generates
    assert engine.phases["training"].host["weights"] == awake["weights"]
    assert "optimizer state" in policy.phases["generation"].host
    assert est.fits is True and est.device_gib == 80


def policy_layer_params() -> int:
    h, i, kv = 3584, 18944, 512
    return h * h * 2 + 2 * h * kv + 3 * h * i + (h + 2 * kv) + 2 * h  # q, o; k, v; MLP; q/k/v biases; two norms


def test_what_does_not_fit_names_the_change_that_does(tmp_path: Path) -> None:
    """Qwen2.5-1.5B trained in full on one 24 GiB GPU: 16 bytes a parameter is 23 GiB before activations; offloading
    the optimizer and gradients to the host (FSDP2's CPU offload) is the first change that fits."""
    model = config_only(tmp_path, QWEN25_1_5B)
    _, cfg = load_master_config(on_gpus(model, 1, 24))
    est = estimate(cfg)
    assert est is not None and est.fits is False and est.peak_gib > 24
    fix = first_fix(cfg)
    assert fix is not None
    override, changed = fix
    assert override == "policy.dtensor_cfg.cpu_offload=true"
    assert changed.fits and changed.peak_gib <= 24
    with pytest.raises(Exception, match=r"cluster\.skip_memory_check.*with policy\.dtensor_cfg\.cpu_offload=true"):
        check_memory(cfg)
    _, skip = load_master_config(on_gpus(model, 1, 24, "cluster.skip_memory_check=true"))
    check_memory(skip)  # told to start anyway
    out = memory_json(cfg)
    assert out["fits"] is False and out["fix"]["override"] == override


def test_lora_keeps_no_reference_copy_and_trains_only_the_adapters(tmp_path: Path) -> None:
    model = config_only(tmp_path, QWEN25_1_5B)
    kl = "loss_fn.reference_policy_kl_penalty=0.01"  # the KL term reads the reference policy
    full = estimate(load_master_config(on_gpus(model, 1, 80, kl))[1])
    lora = estimate(load_master_config(on_gpus(model, 1, 80, kl, "policy.dtensor_cfg.lora_cfg.enabled=true"))[1])
    assert full is not None and lora is not None
    p_full = next(w for w in full.workers if w.group == "policy").phases["training"]
    p_lora = next(w for w in lora.workers if w.group == "policy").phases["training"]
    assert "reference weights" in p_full.host and "reference weights" not in p_lora.host
    assert p_lora.device["optimizer state"] < p_full.device["optimizer state"] / 100


def test_lora_modules_to_save_keep_a_reference_copy_of_themselves_and_train(tmp_path: Path) -> None:
    model = config_only(tmp_path, QWEN25_1_5B)
    lora = ["loss_fn.reference_policy_kl_penalty=0.01", "policy.dtensor_cfg.lora_cfg.enabled=true"]
    plain = estimate(load_master_config(on_gpus(model, 1, 80, *lora))[1])
    saved = estimate(load_master_config(on_gpus(model, 1, 80, *lora,
                                                "policy.dtensor_cfg.lora_cfg.modules_to_save=[embed_tokens]"))[1])
    assert plain is not None and saved is not None
    p_plain = next(w for w in plain.workers if w.group == "policy").phases["training"]
    p_saved = next(w for w in saved.workers if w.group == "policy").phases["training"]
    table = QWEN25_1_5B["vocab_size"] * QWEN25_1_5B["hidden_size"]  # tied: one table for both names
    assert p_saved.host["reference weights"] == 4 * table
    assert p_saved.device["optimizer state"] - p_plain.device["optimizer state"] == 2 * 4 * table


def test_a_cpu_engine_counts_the_refit_bucket_it_copies_out_of_the_shared_buffer(tmp_path: Path) -> None:
    """On CPU the colocated engine maps the shared refit buffer and copies each bucket out of it as it loads it: both
    stay resident (SmolLM2-135M's engine: 0.21 GiB of shared memory and 0.14 GiB more anonymous memory at the
    refit)."""
    model = config_only(tmp_path, SMOLLM2_135M)
    est = estimate(load_master_config(["model=local", f"model.path={model}"])[1])
    assert est is not None
    engine = next(w for w in est.workers if w.group == "engine").phases["generation"].device
    policy = next(w for w in est.workers if w.group == "policy").phases["training"].device
    assert engine["refit load copy"] == engine["refit buffer"] == policy["refit buffer"] == 0.25 * GIB
    assert "refit load copy" not in policy
    # a bucket holds whole layer groups: Qwen2.5-1.5B's embedding, 151,936 x 1,536 fp32 values (its tied head is not
    # sent apart), more than the 0.25 GiB buffer; the engine loads the embedding and the head it derives, a copy each
    (tmp_path / "qwen").mkdir()
    big = estimate(load_master_config(["model=local", f"model.path={config_only(tmp_path / 'qwen', QWEN25_1_5B)}"])[1])
    assert big is not None
    big_engine = next(w for w in big.workers if w.group == "engine").phases["generation"].device
    assert big_engine["refit buffer"] == 151936 * 1536 * 4
    assert big_engine["refit load copy"] == 2 * 151936 * 1536 * 4


def test_plan_json_from_a_directory_holding_only_a_7b_config(tmp_path: Path) -> None:
    model = config_only(tmp_path, QWEN25_7B)
    out = subprocess.run([sys.executable, "-m", "rlpost.cli", "plan", "--json",
                          *on_gpus(model, 8, 80, "policy.max_total_sequence_length=2048",
                                  "policy.train_micro_batch_size=4")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    memory = plan["memory"]
    assert memory["device_gib"] == 80 and isinstance(memory["fits"], bool)
    groups = [(w["group"], w["rank"], w["device"]) for w in memory["workers"]]
    assert [g for g in groups if g[0] == "policy"] == [("policy", r, "cuda") for r in range(8)]
    assert any(g[0] == "engine" for g in groups)
    assert all(w["estimate_gib"] == pytest.approx(sum(w["items"].values()), abs=0.01) for w in memory["workers"])
    assert plan["rows"]["parameters"].startswith("7,615,616,512")


def test_the_optimizer_step_holds_two_temporaries_of_the_largest_tensor(tmp_path: Path) -> None:
    """Single-tensor AdamW (foreach and fused off) makes sqrt(v) and sqrt(v) / bias correction of one parameter at
    a time: two fp32 copies of Qwen2.5-7B's largest, its 152,064 x 3,584 output layer, sharded 8 ways; under LoRA
    nothing of note. Colocated, the engine sleeps through the step."""
    model = config_only(tmp_path, QWEN25_7B)
    mb = "policy.train_micro_batch_size=4"
    _, cfg = load_master_config(on_gpus(model, 8, 80, mb))
    est = estimate(cfg)
    assert est is not None
    policy = next(w for w in est.workers if w.group == "policy")
    step = policy.phases["optimizer step"].device
    assert step["optimizer step temporaries"] == pytest.approx(2 * 4 * 152064 * 3584 / 8)
    assert "activations" not in step and "allocator retention" not in step  # a GPU: nothing kept from the backward
    assert next(w for w in est.workers if w.group == "engine").phases["optimizer step"].device == {
        "runtime": 0.5 * GIB}
    lora = estimate(load_master_config(on_gpus(model, 8, 80, mb, "policy.dtensor_cfg.lora_cfg.enabled=true"))[1])
    assert lora is not None
    lora_step = next(w for w in lora.workers if w.group == "policy").phases["optimizer step"].device
    assert lora_step["optimizer step temporaries"] == 0


def test_cpu_counts_the_allocators_kept_pages_and_the_engines_packed_output_layer(tmp_path: Path) -> None:
    """On CPU glibc keeps what a backward frees: the training phase holds its transient working set twice, less the
    gradients a DTensor worker frees after each step (Megatron keeps them in its buffers); vLLM's CPU matmul keeps a
    oneDNN-packed copy of the output layer beside the embedding's weight (SmolLM2: 49,152 x 576 in fp32), and the
    engine the pages of its sampler's warm-up over 256 sequences."""
    model = config_only(tmp_path, SMOLLM2_135M)
    base = ["model=local", f"model.path={model}"]
    est = estimate(load_master_config(base)[1])
    assert est is not None
    train = next(w for w in est.workers if w.group == "policy").phases["training"].device
    transient = (train["activations"] + train["backward working set"] + train["output layer chunk"]
                 + train["output layer gradient"])
    assert train["allocator retention"] == pytest.approx(max(transient - train["gradients"], 0))
    engine = next(w for w in est.workers if w.group == "engine").phases["generation"].device
    assert engine["packed output layer"] == 4 * 49152 * 576
    assert engine["sampler warm-up"] == 3 * 4 * 256 * 49152  # fp32 logits, probabilities, log-probabilities
    megatron = estimate(load_master_config([*base, "policy=megatron"])[1])
    assert megatron is not None
    m_train = next(w for w in megatron.workers if w.group == "policy").phases["training"].device
    assert m_train["allocator retention"] == pytest.approx(
        m_train["activations"] + m_train["backward working set"] + m_train["output layer chunk"]
        + m_train["output layer gradient"])
    # sequences of 4k tokens map their large buffers on their own (rlpost.runtime.host_malloc): nothing kept
    long = estimate(load_master_config([*base, "policy.max_total_sequence_length=4096"])[1])
    assert long is not None
    assert "allocator retention" not in next(w for w in long.workers if w.group == "policy").phases["training"].device
    gpu = estimate(load_master_config(on_gpus(model, 1, 80))[1])
    assert gpu is not None
    assert "allocator retention" not in next(w for w in gpu.workers if w.group == "policy").phases["training"].device
    assert "packed output layer" not in next(w for w in gpu.workers if w.group == "engine").phases["generation"].device


GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
             "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192, "tie_word_embeddings": True,
             "final_logit_softcapping": 30.0}
"""Gemma-2-2B's config.json (the fields the plan reads)."""


@pytest.mark.parametrize("policy", ["dtensor", "megatron"])
def test_soft_capped_logits_are_counted_whole(tmp_path: Path, policy: str) -> None:
    """Gemma 2's soft-capped logits are made for every token of a micro-batch at once on both backends: the forward
    holds two fp32 [4096, 256000] copies (7.8 GiB), where a model without the cap holds two chunks."""
    sizes = ["policy.max_total_sequence_length=4096", "policy.train_micro_batch_size=1",
             "policy.logprob_batch_size=1", "policy.dynamic_batching.enabled=false"]
    heads = {}
    for name, hf in (("capped", GEMMA2_2B), ("plain", {**GEMMA2_2B, "final_logit_softcapping": None})):
        (tmp_path / name).mkdir()
        model = config_only(tmp_path / name, hf)
        _, cfg = load_master_config([f"policy={policy}", *on_gpus(model, 8, 80, *sizes)])
        est = estimate(cfg)
        assert est is not None
        worker = next(w for w in est.workers if w.group == "policy")
        heads[name] = worker.phases["forward"].device["output layer chunk"]
    assert heads["capped"] == pytest.approx(2 * 4096 * 256000 * 4)
    assert heads["plain"] < heads["capped"] / 8
