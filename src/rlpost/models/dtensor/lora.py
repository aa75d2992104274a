"""LoRA on the DTensor workers with the `peft` library: adapters injected into the HF model before it is
parallelised, so they compose with TP and FSDP2.

- Injection: `peft.inject_adapter_in_model` keeps the model's class (the TP plans are per class) and freezes every
  base weight; the optimizer gets the adapters only, and FSDP2 reduces only gradients that exist.
- TP: an adapted layer `X` becomes `X.base_layer` (sharded as `X` was) plus `X.lora_A` / `X.lora_B`. B is split
  where the base weight's output is split (column-parallel), A where its input is (row-parallel: A's output is
  all-reduced before B), and the other factor is replicated; the adapter's output then has the base output's layout.
- `lora_cfg.modules_to_save` (embed_tokens, lm_head) train in full beside the adapters; a tied head trains with
  the embeddings it shares. The reference policy is the base: the adapters switched off (`adapters_off`), and the
  worker's copy of those modules' base values swapped in; no other weight is copied.
- Refit and HF export move merged weights, W + alpha / r * B @ A, under the base model's names (`merged`); the
  PEFT export holds the adapters under PEFT's names (`peft_adapter_tensors`).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from rlpost.config.schema.lora import LoRAConfig
from rlpost.models.peft_adapter import ADAPTER_WEIGHTS

ADAPTER = "default"
"""peft's name for the one adapter."""


MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""What LoRA adapts in a mixture-of-experts model: the attention's linears. peft would otherwise wrap each layer's
fused expert tensors and its router whole; under LoRA they stay frozen."""


def peft_config(cfg: LoRAConfig, saved: bool = False, moe: bool = False) -> Any:  # -> peft.LoraConfig
    """The peft LoraConfig of `cfg` (dim -> r, alpha -> lora_alpha; match_all_linear -> "all-linear"; for a `moe`
    model, the attention's linears among them). `saved`: with modules_to_save, as a PEFT adapter directory describes
    them (the injection trains them in place instead)."""
    from peft import LoraConfig

    targets: str | list[str] = "all-linear" if cfg.match_all_linear else list(cfg.target_modules)
    if moe:
        targets = [t for t in MOE_TARGETS if targets == "all-linear" or t in targets]
    return LoraConfig(
        r=cfg.dim,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        exclude_modules=list(cfg.exclude_modules) or None,
        bias="none",
        modules_to_save=list(cfg.modules_to_save) or None if saved else None,
        ensure_weight_tying=saved and bool(cfg.modules_to_save),
    )


def inject(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Add adapters to `model` in place (base weights frozen); ValueError naming the key when none matched."""
    from peft import inject_adapter_in_model

    from rlpost.models.router_stats import routers

    try:
        inject_adapter_in_model(peft_config(cfg, moe=bool(routers(model))), model)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ValueError(f"policy.dtensor_cfg.lora_cfg: {first}") from None
    for name, p in model.named_parameters(remove_duplicate=False):  # a tied head under its own name too
        if is_saved_module(name, cfg):
            p.requires_grad_(True)
    return model


def adapted_layers(model: nn.Module) -> list[str]:
    """Names of the layers that carry an adapter."""
    from peft.tuners.lora import LoraLayer

    return [name for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def lora_tp_plan(plan: Mapping[str, ParallelStyle], layers: list[str]) -> dict[str, ParallelStyle]:
    """`plan` for the model with adapters: an adapted layer's style moves to its base_layer, and its adapter gets
    the same split (B for a column-parallel base, A for a row-parallel one), its layouts included (a gathered
    projection's B gathers too: see rlpost.models.dtensor.parallelize.gathered_attention_tp_plan)."""
    out: dict[str, ParallelStyle] = {}
    for key, style in plan.items():
        if not any(fnmatch.fnmatchcase(name, key) for name in layers):
            out[key] = style
            continue
        out[f"{key}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            out[f"{key}.lora_B.{ADAPTER}"] = copy.deepcopy(style)
        elif isinstance(style, RowwiseParallel):
            out[f"{key}.lora_A.{ADAPTER}"] = copy.deepcopy(style)
        else:
            raise ValueError(f"{key}: LoRA does not know how to split an adapter for {type(style).__name__}")
    return out


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter disabled inside the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def is_adapter(name: str) -> bool:
    """Whether a state-dict key is an adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def is_saved_module(name: str, cfg: LoRAConfig) -> bool:
    """Whether a state-dict key belongs to a module that trains in full (`lora_cfg.modules_to_save`)."""
    module = name.rpartition(".")[0]
    return module.rpartition(".")[2] in cfg.modules_to_save


def is_trained(name: str, cfg: LoRAConfig) -> bool:
    """Whether a state-dict key trains under LoRA: an adapter's, or a module's in modules_to_save."""
    return is_adapter(name) or is_saved_module(name, cfg)


def scaling(cfg: LoRAConfig) -> float:
    """alpha / r: the scale of every adapter's update (peft's, with one rank and alpha for all layers)."""
    return cfg.alpha / cfg.dim


def merged(full: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own names) from a full state dict with adapters: W + scale * B @ A for each
    adapted layer, computed in fp32."""
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        if is_adapter(key):
            continue
        layer, sep, leaf = key.rpartition(".base_layer.")
        if not sep:
            out[key] = value
            continue
        name = f"{layer}.{leaf}"
        if leaf == "weight":
            a = full[f"{layer}.lora_A.{ADAPTER}.weight"].float()
            b = full[f"{layer}.lora_B.{ADAPTER}.weight"].float()
            value = (value.float() + scale * (b @ a)).to(value.dtype)
        out[name] = value
    return out


def peft_adapter_tensors(full: Mapping[str, torch.Tensor], cfg: LoRAConfig | None = None,
                         tied: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The adapters, and with `cfg` the modules it trains in full, under PEFT's saved names
    (`base_model.model.<layer>.lora_A.weight`, `base_model.model.model.embed_tokens.weight`), as
    `PeftModel.from_pretrained` loads them. `tied` (alias -> name, e.g. lm_head.weight -> model.embed_tokens.weight):
    a trained tied weight goes under both names, as PEFT ties a saved module's copies (ensure_weight_tying) and
    loads each under its own name."""
    def trained(k: str) -> bool:
        return is_trained(k, cfg) if cfg is not None else is_adapter(k)

    out = {k: v for k, v in full.items() if trained(k)}
    for alias, name in (tied or {}).items():
        if name in full and (trained(alias) or trained(name)):
            out[name], out[alias] = full[name], full[name].clone()  # safetensors stores no shared storage
    return {f"base_model.model.{k.replace(f'.{ADAPTER}.', '.')}": v.detach().contiguous() for k, v in out.items()}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective over all ranks: the adapters' full tensors under PEFT's names (`peft_adapter_tensors`), fp32 on the
    CPU, on every rank; the base weights are not gathered."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p
        key = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        out[key] = full.detach().float().cpu()
    return peft_adapter_tensors(out)


def write_peft_dir(cfg: LoRAConfig, full: Mapping[str, torch.Tensor], base_model: str, out_dir: Path,
                   tied: Mapping[str, str] | None = None) -> None:
    """A PEFT adapter directory: adapter_config.json (base_model_name_or_path = `base_model`) and
    adapter_model.safetensors (`tied`: as in `peft_adapter_tensors`)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    conf = peft_config(cfg, saved=True, moe=any(".experts." in n for n in full))
    conf.base_model_name_or_path = str(base_model)
    conf.task_type = "CAUSAL_LM"
    save_file(peft_adapter_tensors(full, cfg, tied), str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    conf.save_pretrained(str(out_dir))


def merge_peft_dir(adapter_dir: Path, out_dir: Path) -> Path:
    """The base model named by a PEFT adapter directory with the adapter merged in, written to `out_dir` as an HF
    directory with the base's tokenizer files (what `rlpost eval` serves for a LoRA checkpoint)."""
    import shutil

    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rlpost.models.policy.hf_loading import TOKENIZER_FILES

    base_dir = Path(PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the console is rlpost's
    try:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, use_safetensors=True)
        model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, out_dir / name)
    return out_dir
