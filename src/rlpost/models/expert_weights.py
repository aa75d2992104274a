"""Mixture-of-experts weights between a checkpoint's layout and transformers' in-memory one.

A Qwen3-MoE or Mixtral checkpoint (the hub's, an HF export, what vLLM loads) holds one matrix per expert:
`layers.L.mlp.experts.E.gate_proj.weight` (Mixtral: `block_sparse_moe.experts.E.w1.weight`, with w3 the up and w2 the
down projection). transformers keeps each layer's experts fused: `mlp.experts.gate_up_proj` [experts, 2 x inter,
hidden] (gate rows first) and `mlp.experts.down_proj` [experts, hidden, inter]; Mixtral's router moves from
`block_sparse_moe.gate` to `mlp.gate`.

- `ExpertAssembler` loads: it takes checkpoint tensors one at a time and hands back each fused tensor once its last
  expert has arrived (one fused tensor in memory at a time beside the pieces).
- `to_checkpoint_layout` exports: the fused tensors split back into the checkpoint's names, as views (no copies).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch


@dataclass(frozen=True)
class ExpertLayout:
    """How one family names its experts in a checkpoint."""

    block: str
    """The MoE block's module name in the checkpoint (transformers names it `mlp`)."""
    gate: str
    """Each expert's gate projection."""
    up: str
    """Each expert's up projection."""
    down: str
    """Each expert's down projection."""

    @cached_property
    def checkpoint_key(self) -> re.Pattern[str]:
        """A checkpoint key of an expert's matrix (groups layer, e, part) or of the router (group router)."""
        parts = "|".join(re.escape(p) for p in (self.gate, self.up, self.down))
        return re.compile(rf"^(?P<layer>.*\.layers\.\d+)\.{re.escape(self.block)}\."
                          rf"(?:experts\.(?P<e>\d+)\.(?P<part>{parts})\.weight|(?P<router>gate\.weight))$")


LAYOUTS: dict[str, ExpertLayout] = {
    "qwen3_moe": ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ExpertLayout("block_sparse_moe", "w1", "w3", "w2"),
}
"""model_type -> its checkpoint layout (rlpost.config.model_families.MOE_MODEL_TYPES)."""

_FUSED = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.mlp\.(?P<rest>experts\.(?:gate_up_proj|down_proj)|gate\.weight)$")


def layout_of(config: Any) -> ExpertLayout | None:
    """The family's checkpoint layout, or None for a model without fused experts."""
    return LAYOUTS.get(str(getattr(config, "model_type", "")))


def num_experts(config: Any) -> int:
    """Experts per MoE layer, under either family's key."""
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


def to_checkpoint_layout(config: Any, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` (in-memory names) under the checkpoint's names; a dense model's dict comes back as it is."""
    layout = layout_of(config)
    if layout is None:
        return dict(full)
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        base = f"{m['layer']}.{layout.block}"
        if m["rest"] == "gate.weight":
            out[f"{base}.gate.weight"] = t
        elif m["rest"] == "experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}.experts.{e}.{layout.gate}.weight"] = t[e, :inter]
                out[f"{base}.experts.{e}.{layout.up}.weight"] = t[e, inter:]
        else:
            for e in range(t.shape[0]):
                out[f"{base}.experts.{e}.{layout.down}.weight"] = t[e]
    return out


@dataclass
class _Pending:
    full: torch.Tensor
    missing: int


@dataclass
class ExpertAssembler:
    """Checkpoint tensors in, in-memory tensors out (see the module docstring)."""

    layout: ExpertLayout
    experts: int
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def target(self, key: str) -> str:
        """The in-memory name `key` goes into (a fused tensor's, for an expert's matrix)."""
        return self._target(self.layout.checkpoint_key.match(key), key)

    def _target(self, m: re.Match[str] | None, key: str) -> str:
        if m is None:
            return key
        if m["router"]:
            return f"{m['layer']}.mlp.gate.weight"
        fused = "down_proj" if m["part"] == self.layout.down else "gate_up_proj"
        return f"{m['layer']}.mlp.experts.{fused}"

    def add(self, key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(in-memory name, tensor) when `key` completes one (at once for anything but an expert's matrix)."""
        m = self.layout.checkpoint_key.match(key)
        name = self._target(m, key)
        if m is None or m["router"]:
            return name, tensor
        e, part = int(m["e"]), m["part"]
        rows = tensor.shape[0]
        if name not in self._pending:
            height = rows if part == self.layout.down else 2 * rows
            self._pending[name] = _Pending(tensor.new_empty((self.experts, height, tensor.shape[1])),
                                           self.experts * (1 if part == self.layout.down else 2))
        pending = self._pending[name]
        offset = rows if part == self.layout.up else 0
        pending.full[e, offset:offset + rows].copy_(tensor)
        pending.missing -= 1
        if pending.missing:
            return None
        del self._pending[name]
        return name, pending.full

    def incomplete(self) -> list[str]:
        """The fused tensors some expert never arrived for."""
        return sorted(self._pending)
