"""LoRA adapters (`policy.dtensor_cfg.lora_cfg`, `policy.megatron_cfg.peft`): NeMo RL's key names.

Only the adapters train (and the modules named in `modules_to_save`, in full): the base weights are frozen, outside
the optimizer and the gradient reduction, the KL or DPO reference is the base with the adapters switched off (and
the saved modules' base values in place), and checkpoints hold the adapters, the saved modules and their optimizer
state alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlpost.config.errors import require
from rlpost.config.fields import POSITIVE, check_fields, checked, within

REFIT_MODES = ("merged", "adapter")
"""`refit`: the adapters merged into the engine's weights, or served as a vLLM LoRA adapter."""

MAX_SERVED_RANK = 512
"""The largest adapter rank vLLM serves (its max_lora_rank choices end there)."""

SAVEABLE_MODULES = ("embed_tokens", "lm_head")
"""What `modules_to_save` may name, by the HF model's names: the input embeddings and the output head (one weight
when the model ties them)."""

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a directory a PEFT adapter directory."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the model's linear layers (W + alpha/dim * B @ A)."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model."""
    target_modules: list[str] = field(default_factory=list)
    """Linear layers to adapt, by the last part of their name (`q_proj`, `down_proj`, ...); with match_all_linear
    false this must name at least one."""
    exclude_modules: list[str] = field(default_factory=list)
    """Linear layers never adapted, by the last part of their name (applies to match_all_linear too)."""
    match_all_linear: bool = True
    """Adapt every linear layer of the decoder (not the output head); target_modules adds nothing then."""
    dim: int = checked(8, POSITIVE)
    """The adapters' rank r."""
    alpha: int = checked(32, POSITIVE)
    """Scale numerator: the update is alpha / dim * B @ A."""
    dropout: float = checked(0.0, within("[0, 1)"))
    """Dropout on the adapter's input during training (0: none)."""
    refit: str = "merged"
    """How the rollout engine gets each new policy version. merged: W + alpha/dim * B @ A written into the engine's
    weights by the weight refit (every weight moves; generation runs the plain model). adapter: only the adapters
    move, served by vLLM's LoRA support (enable_lora, max_lora_rank = the next rank vLLM offers >= dim; the adapter
    is replaced in place each version); the vLLM engine only."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (PEFT's modules_to_save): `embed_tokens`, `lm_head`. A model
    whose weights carry little yet (the default job's randomly initialised tiny model) learns only with them: its
    frozen embeddings and head cap every logit near 1. With tied embeddings either name trains the one shared
    weight. The reference policy keeps their base values; lora_cfg.refit=merged only (vLLM serves adapters alone)."""
    export_merged: bool = False
    """Checkpoints also write the merged model (W + alpha/dim * B @ A) as an HF directory, `weights/hf`, beside the
    PEFT adapter directory `weights/adapter` (with checkpointing.save_consolidated)."""

    def adapter_config(self, base_model: str, hf_names: Mapping[str, Sequence[str]] | None = None
                       ) -> dict[str, object]:
        """The adapter_config.json of these adapters on `base_model`, in PEFT's keys (what vLLM reads to serve
        them). `hf_names`: the HF layers each configured module name stands for (Megatron's fused layers)."""
        def hf(names: Sequence[str]) -> list[str]:
            return [h for n in names for h in (hf_names.get(n, (n,)) if hf_names else (n,))]

        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
                "r": self.dim, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "bias": "none",
                "target_modules": "all-linear" if self.match_all_linear else hf(self.target_modules),
                "exclude_modules": hf(self.exclude_modules) or None, "fan_in_fan_out": False,
                "use_rslora": False, "use_dora": False, "modules_to_save": list(self.modules_to_save) or None}

    def check(self, path: str) -> None:
        if not self.enabled:
            return
        check_fields(self, path)
        require(self.match_all_linear or bool(self.target_modules), f"{path}.target_modules", self.target_modules,
                "must name at least one linear layer when match_all_linear is false")
        require(self.refit in REFIT_MODES, f"{path}.refit", self.refit, f"must be one of {', '.join(REFIT_MODES)}")
        require(self.refit != "adapter" or self.dim <= MAX_SERVED_RANK, f"{path}.dim", self.dim,
                f"vLLM serves adapters of rank <= {MAX_SERVED_RANK} (lora_cfg.refit=adapter)")
        unknown = sorted(set(self.modules_to_save) - set(SAVEABLE_MODULES))
        require(not unknown, f"{path}.modules_to_save", self.modules_to_save,
                f"names {unknown}; the modules that can train in full are {', '.join(SAVEABLE_MODULES)}")
        require(not self.modules_to_save or self.refit == "merged", f"{path}.modules_to_save", self.modules_to_save,
                "needs lora_cfg.refit=merged: vLLM serves the adapters alone, not modules trained in full")
        overlap = sorted(set(self.target_modules) & set(self.exclude_modules))
        require(not overlap, f"{path}.exclude_modules", self.exclude_modules,
                f"excludes {overlap}, which target_modules names")
