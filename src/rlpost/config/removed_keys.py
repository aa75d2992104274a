"""Config keys rlpost no longer has, each with what replaces it: a config that sets one exits 2 naming the
replacement instead of a bare "unknown config key"."""

from __future__ import annotations

REMOVED_KEYS: dict[str, str] = {
    "policy.generation.colocated.same_process": (
        "was removed: a colocated engine always runs in a Ray actor of its own beside the policy's worker, on CPU "
        "and GPU alike, and is refit over IPC (docs/backends.md); delete the key"
    ),
    "grpo.prefetch_generation": (
        "was removed: each step generates after its refit; to overlap generation with training use "
        "grpo.async_grpo.enabled=true, or grpo.overlap_generation_and_training with the engine on its own workers "
        "(policy.generation.colocated.enabled=false)"
    ),
}
"""Dotted key as a user writes it -> the rule that replaces it."""


def removed_rule(full_key: str) -> str | None:
    """The replacement rule of a removed key (`generation.…` and `policy.generation.…` both name the engine's
    block), or None when `full_key` was never removed."""
    key = full_key.lstrip("+~")
    if key.startswith("generation."):
        key = "policy." + key
    return REMOVED_KEYS.get(key)
