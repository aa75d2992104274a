"""LoRA pieces without workers: parameter counts from config.json against real models, the merged weights against
peft's own merge, the TP plan for adapters, adapters off, and the config rules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from rlpost.config.errors import ConfigError
from rlpost.config.lora_params import adapted_modules, parameter_counts, tiny_hf_config
from rlpost.config.schema.lora import LoRAConfig
from rlpost.models.dtensor import lora
from rlpost.models.dtensor.parallelize import qwen2_llama_tp_plan

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2 tied": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 384, "tie_word_embeddings": True},
    "llama gqa untied": {"model_type": "llama", "hidden_size": 96, "num_hidden_layers": 3, "num_attention_heads": 3,
                         "num_key_value_heads": 1, "intermediate_size": 160, "vocab_size": 320,
                         "tie_word_embeddings": False, "mlp_bias": True},
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 48, "intermediate_size": 96, "vocab_size": 256,
              "tie_word_embeddings": True},
}
SETTINGS = {
    "all": LoRAConfig(enabled=True, dim=4),
    "attention only": LoRAConfig(enabled=True, dim=2, match_all_linear=False, target_modules=["q_proj", "v_proj"]),
    "all but the mlp": LoRAConfig(enabled=True, dim=3, exclude_modules=["gate_proj", "up_proj", "down_proj"]),
}


def build(hf: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in hf.items() if k != "model_type"}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(hf["model_type"], **fields))


def counts(model: torch.nn.Module) -> tuple[int, int]:
    params = list(model.parameters())  # a tied head is one parameter
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_counts_from_config_json_equal_the_models(shape: str, setting: str) -> None:
    hf, cfg = SHAPES[shape], SETTINGS[setting]
    model = build(hf)
    assert parameter_counts(hf, LoRAConfig()) == counts(model)
    assert parameter_counts(hf, cfg) == counts(lora.inject(model, cfg))


def test_a_tiny_model_not_built_yet_is_counted_as_built(tiny_model_dir: Any) -> None:
    import json

    from rlpost.config.schema.model import TinyModelConfig

    guessed = tiny_hf_config(TinyModelConfig())
    built = json.loads((tiny_model_dir / "config.json").read_text())
    assert parameter_counts(guessed, SETTINGS["all"]) == parameter_counts(built, SETTINGS["all"])


def test_merged_weights_equal_peft_merge_and_the_adapters_off_are_the_base() -> None:
    from peft import LoraConfig, get_peft_model

    hf = SHAPES["llama gqa untied"]
    cfg = LoRAConfig(enabled=True, dim=4, alpha=12, exclude_modules=["k_proj"])
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    base = build(hf)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    model = lora.inject(build(hf), cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    from peft.tuners.lora import LoraLayer

    scale = lora.scaling(cfg)
    assert {m.scaling[lora.ADAPTER] for m in model.modules() if isinstance(m, LoraLayer)} == {scale} == {3.0}
    ours = lora.merged(model.state_dict(), scale)

    reference = get_peft_model(build(hf), LoraConfig(r=4, lora_alpha=12, target_modules="all-linear",
                                                     exclude_modules=["k_proj"]))
    reference.base_model.model.load_state_dict(model.state_dict())
    theirs = reference.merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-6
    with torch.no_grad():
        assert (model(input_ids=ids).logits - base_logits).abs().max() > 1e-3
        with lora.adapters_off(model):
            assert torch.equal(model(input_ids=ids).logits, base_logits)
        assert (model(input_ids=ids).logits - base_logits).abs().max() > 1e-3  # back on after the block


def test_the_tp_plan_splits_b_under_column_and_a_under_row_parallel_layers() -> None:
    model = lora.inject(build(SHAPES["qwen2 tied"]), SETTINGS["attention only"])
    plan = lora.lora_tp_plan(qwen2_llama_tp_plan(), lora.adapted_layers(model))
    assert isinstance(plan["model.layers.*.self_attn.q_proj.base_layer"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.q_proj.lora_B.default"], ColwiseParallel)
    assert "model.layers.*.self_attn.q_proj.lora_A.default" not in plan  # replicated
    assert isinstance(plan["model.layers.*.self_attn.k_proj"], ColwiseParallel)  # not adapted: unchanged
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)
    model = lora.inject(build(SHAPES["qwen2 tied"]), SETTINGS["all"])
    plan = lora.lora_tp_plan(qwen2_llama_tp_plan(), lora.adapted_layers(model))
    assert isinstance(plan["model.layers.*.mlp.down_proj.lora_A.default"], RowwiseParallel)
    assert "model.layers.*.mlp.down_proj.lora_B.default" not in plan
    from rlpost.models.dtensor.parallelize import gathered_attention_tp_plan

    gathered = lora.lora_tp_plan(gathered_attention_tp_plan(), lora.adapted_layers(model))  # OLMo 2's layout
    assert gathered["model.layers.*.self_attn.q_proj.lora_B.default"].output_layouts == (Replicate(),)
    assert gathered["model.layers.*.self_attn.o_proj.lora_A.default"].input_layouts == (Replicate(),)


@pytest.mark.parametrize(("cfg", "key", "rule"), [
    (LoRAConfig(enabled=True, dim=0), "lora_cfg.dim", "must be > 0"),
    (LoRAConfig(enabled=True, alpha=-1), "lora_cfg.alpha", "must be > 0"),
    (LoRAConfig(enabled=True, dropout=1.0), "lora_cfg.dropout", "[0, 1)"),
    (LoRAConfig(enabled=True, match_all_linear=False), "lora_cfg.target_modules", "at least one"),
    (LoRAConfig(enabled=True, target_modules=["q_proj"], exclude_modules=["q_proj"]), "lora_cfg.exclude_modules",
     "which target_modules names"),
])
def test_config_rules(cfg: LoRAConfig, key: str, rule: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg.check("lora_cfg")
    assert err.value.key == key and rule in err.value.rule


def test_adapted_modules_follow_targets_and_exclusions() -> None:
    assert adapted_modules(SETTINGS["attention only"]) == ["q_proj", "v_proj"]
    assert adapted_modules(SETTINGS["all but the mlp"]) == ["q_proj", "k_proj", "v_proj", "o_proj"]
