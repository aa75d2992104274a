"""The linear layers LoRA adapts, and the trainable and total parameter counts, from a model's config.json alone
(no torch): what `rlpost plan` shows and what the pre-flight checks module names against.

Known layouts: every family rlpost.config.model_counts counts. Another model type is counted by the workers, and
its module names are checked there.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlpost.config.errors import ConfigError
from rlpost.config.layout import model_dir_key, read_hf_config
from rlpost.config.model_counts import base_parameters, experts, is_moe, linear_shapes, tied_head
from rlpost.config.schema.lora import LoRAConfig

if TYPE_CHECKING:
    from rlpost.config.schema.master import MasterConfig
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.config.schema.supervised_master import SupervisedMasterConfig

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The Llama family's linear layers (another family's come from rlpost.config.model_counts.linear_shapes)."""
MEGATRON_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The Megatron-Core names of the same layers: q/k/v and gate/up are fused, each fused layer one adapter."""
MEGATRON_HF_NAMES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                     "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
"""The HF layers each Megatron-Core linear fuses."""


def adapter_config(key: str, lora: LoRAConfig, base_model: str) -> dict[str, object]:
    """The PEFT adapter_config.json of the LoRA block at `key` (HF layer names whatever the backend)."""
    return lora.adapter_config(base_model, MEGATRON_HF_NAMES if is_megatron(key) else None)


def megatron_shapes(hf: Mapping[str, Any]) -> dict[str, tuple[int, int]] | None:
    """`linear_shapes` under Megatron-Core's fused layers (MEGATRON_LINEARS); None for an unknown layout."""
    s = linear_shapes(hf)
    if s is None:
        return None

    def fused(*names: str) -> tuple[int, int]:
        present = [s[n] for n in names if n in s]
        return present[0][0], sum(o for _, o in present)

    attention = {"linear_qkv": fused("q_proj", "k_proj", "v_proj", "qkv_proj"), "linear_proj": s["o_proj"]}
    if is_moe(hf):  # the experts' linears stay frozen, as on the DTensor worker
        return attention
    return {**attention, "linear_fc1": fused("gate_proj", "up_proj", "gate_up_proj"), "linear_fc2": s["down_proj"]}


def layer_shapes(hf: Mapping[str, Any], megatron: bool) -> dict[str, tuple[int, int]] | None:
    """The adaptable layers of the backend's model by name (HF's, or Megatron-Core's fused ones)."""
    return megatron_shapes(hf) if megatron else linear_shapes(hf)


def adapted_modules(lora: LoRAConfig, names: tuple[str, ...] = DECODER_LINEARS) -> list[str]:
    """The decoder linear layers `lora` adapts, out of `names`."""
    chosen = names if lora.match_all_linear else tuple(n for n in names if n in lora.target_modules)
    return [n for n in chosen if n not in lora.exclude_modules]


def unknown_modules(lora: LoRAConfig, names: tuple[str, ...] = DECODER_LINEARS) -> list[str]:
    """Names in target_modules or exclude_modules that are no linear layer of the model."""
    return sorted({*lora.target_modules, *lora.exclude_modules} - set(names))


def parameter_counts(hf: Mapping[str, Any], lora: LoRAConfig, megatron: bool = False) -> tuple[int, int] | None:
    """(trainable, total) parameters of the model with `lora` applied (all of them trainable without LoRA); None
    for an unknown layout. Total counts the adapters too; a tied output head is counted once. `megatron`: the
    adapters sit on Megatron-Core's fused layers (one A for q/k/v, one for gate/up)."""
    adapted = layer_shapes(hf, megatron)
    counted = base_parameters(hf)
    if adapted is None or counted is None:
        return None
    base, layers = counted[0], int(hf["num_hidden_layers"])
    if not lora.enabled:
        return base, base
    adapters = layers * sum(lora.dim * (adapted[n][0] + adapted[n][1]) for n in adapted_modules(lora, tuple(adapted)))
    return adapters + saved_parameters(hf, lora), base + adapters


def saved_tables(lora: LoRAConfig, tied: bool) -> int:
    """The [vocabulary, hidden] tables `lora` trains in full (modules_to_save): a tied head and its embeddings once."""
    tables = len(set(lora.modules_to_save) & {"embed_tokens", "lm_head"})
    return min(tables, 1) if tied else tables


def saved_parameters(hf: Mapping[str, Any], lora: LoRAConfig) -> int:
    """The parameters of the modules `lora` trains in full (modules_to_save)."""
    return saved_tables(lora, tied_head(hf)) * int(hf["vocab_size"]) * int(hf["hidden_size"])


def tiny_hf_config(t: TinyModelConfig) -> dict[str, Any]:
    """The config.json fields that count the tiny model `t` before it is built (its vocabulary padded to a multiple
    of 64)."""
    return {"model_type": t.architecture, "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
            "intermediate_size": t.intermediate_size, "vocab_size": -(-t.vocab_size // 64) * 64,
            "tie_word_embeddings": t.tie_word_embeddings, "max_position_embeddings": t.max_position_embeddings,
            **t.family_fields()}


def describe(hf: Mapping[str, Any] | None, lora: LoRAConfig, megatron: bool = False,
             frozen_routers: bool = False) -> str:
    """`rlpost plan`'s parameters row; `frozen_routers`: a mixture of experts' routers are not trained (Megatron's
    freeze_moe_router)."""
    counts = parameter_counts(hf, lora, megatron) if hf is not None else None
    if hf is None or counts is None:
        what = f"a {hf.get('model_type')} model" if hf is not None else "a model not built yet"
        return f"counted by the workers ({what})" + (f"; LoRA r={lora.dim} alpha={lora.alpha}" if lora.enabled else "")
    trainable, total = counts
    names = tuple(layer_shapes(hf, megatron) or ())
    n_experts, per_tok, sparse = experts(hf)
    routers = sparse * n_experts * int(hf["hidden_size"]) if frozen_routers else 0
    if lora.enabled:
        row = (f"{trainable:,} trained of {total:,} ({100 * trainable / total:.2f}%): LoRA r={lora.dim} "
               f"alpha={lora.alpha} on {', '.join(adapted_modules(lora, names))}"
               + (f", {' and '.join(lora.modules_to_save)} trained in full" if lora.modules_to_save else "")
               + "; the base weights are frozen")
    elif routers:
        row = f"{total - routers:,} trained of {total:,}: the routers frozen (policy.megatron_cfg.freeze_moe_router)"
    else:
        row = f"{total:,}, all trained"
    base = base_parameters(hf)
    if n_experts and base is not None:
        active = total - (base[0] - base[1])  # the experts a token does not run
        row += (f"; {active:,} per token ({per_tok} of {n_experts} experts in each of {sparse} layers"
                + ("; LoRA adapts the attention alone)" if lora.enabled else ")"))
    return row


def model_shape(master: MasterConfig | SupervisedMasterConfig) -> dict[str, Any] | None:
    """The model's config.json, or for a tiny model not built yet the fields it will have; None if unknown."""
    hf = read_hf_config(str(master.policy.model_name), model_dir_key(master))
    t = master.model.tiny
    if hf is None and t is not None and master.policy.model_name == master.model.path:
        hf = tiny_hf_config(t)
    return hf


def is_megatron(key: str) -> bool:
    """Whether a LoRA block's key (`PolicyConfig.lora_settings`) is the Megatron worker's."""
    return ".megatron_cfg." in key


def check_lora_modules(master: MasterConfig | SupervisedMasterConfig) -> None:
    """LoRA's target_modules and exclude_modules must name linear layers of the model, and leave one adapted (a
    layout lora_params does not know is checked by the workers, when peft adds the adapters)."""
    key, lora = master.policy.lora_settings("policy")
    if not lora.enabled:
        return
    hf = model_shape(master)
    shapes = layer_shapes(hf, is_megatron(key)) if hf is not None else None
    if hf is None or shapes is None:
        return
    names = tuple(shapes)
    unknown = unknown_modules(lora, names)
    if unknown:
        which = "target_modules" if set(unknown) & set(lora.target_modules) else "exclude_modules"
        close = difflib.get_close_matches(unknown[0], names, n=1)
        raise ConfigError(f"{key}.{which}", getattr(lora, which),
                          f"names no linear layer of this {hf.get('model_type')} model: {', '.join(unknown)}; "
                          f"its linear layers are {', '.join(names)}", f"did you mean {close[0]!r}?" if close else None)
    if not adapted_modules(lora, names):
        raise ConfigError(f"{key}.exclude_modules", lora.exclude_modules, "leaves no linear layer to adapt")
