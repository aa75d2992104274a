"""PPO's rules across blocks and its plan rows (its blocks: rlpost.config.schema.ppo; its code:
rlpost.algorithms.ppo)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlpost.config.errors import require
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.side_group import side_group_rules, where

if TYPE_CHECKING:
    from rlpost.config.memory.workers import Worker


def ppo_rules(master: MasterConfig) -> None:
    """PPO's critic, on a backend that builds value models, with the synchronous, unoverlapped step; the KL either in
    the reward or in the loss."""
    critic, p = master.critic, master.ppo
    assert critic is not None and p is not None  # algo=ppo's blocks (rlpost.config.algorithms)
    side_group_rules(master, "critic", "the critic's values are the whole batch's")
    kl = master.loss_fn.reference_policy_kl_penalty if isinstance(master.loss_fn, ClippedPGLossConfig) else 0.0
    require(p.kl_in_reward == 0.0 or kl == 0.0, "ppo.kl_in_reward", p.kl_in_reward,
            "the KL is either in the reward or in the loss, not both", "set loss_fn.reference_policy_kl_penalty=0")


def plan_rows(master: MasterConfig, train_world: int) -> list[tuple[str, str]]:
    """Where the critic runs and how the advantages are made."""
    p, c = master.ppo, master.critic
    assert p is not None and c is not None
    body = c.model_name or "the policy's model"
    kl = f", minus {p.kl_in_reward} x KL to the reference per token" if p.kl_in_reward else ""
    warm = f"; the policy trains from step {p.critic_warmup_steps + 1}" if p.critic_warmup_steps else ""
    return [
        ("critic", f"{body} with a value head, lr {c.lr}, {where(c.colocated, c.num_workers, train_world)}; "
                   f"value clip {p.value_clip}{warm}"),
        ("advantages", f"GAE (gamma {p.gamma}, lambda {p.lam}) on the reward at the last response token{kl}"
                       + ("; whitened over the step's batch" if p.whiten_advantages else "")),
    ]


def memory(master: MasterConfig, device: str, train_world: int) -> list[Worker]:
    """The critic's workers for the memory plan: the policy's block on its model, trained in full."""
    from rlpost.config.lora_params import model_shape
    from rlpost.config.memory.shape import ModelShape, read_shape
    from rlpost.config.memory.workers import policy_worker

    c = master.critic
    assert c is not None
    hf = model_shape(master)
    shape = read_shape(c.model_name, "critic.model_name") if c.model_name else (
        ModelShape.from_hf(hf) if hf is not None else None)
    if shape is None:
        return []
    worker = policy_worker(master.policy, shape, device, c.num_workers or train_world, group="critic", lora=False)
    worker.shares_device_with = "policy" if c.colocated else None
    return [worker]


def preflight(master: MasterConfig) -> None:
    """The critic's own model directory, when it names one, holds a model (config.json)."""
    from pathlib import Path

    from rlpost.config.errors import ConfigError

    c = master.critic
    assert c is not None
    if c.model_name is None:
        return
    d = Path(c.model_name).expanduser()
    if not d.is_dir():
        raise ConfigError("critic.model_name", c.model_name, "no such directory" if not d.exists() else
                          "is not a directory", "name a local HF model directory, or leave it null for the policy's")
    if not (d / "config.json").is_file():
        raise ConfigError("critic.model_name", c.model_name, "holds no config.json: not an HF model directory")
    theirs, ours = _vocabulary(d), _vocabulary(Path(str(master.policy.tokenizer.name)).expanduser())
    if theirs is not None and ours is not None and theirs != ours:
        raise ConfigError("critic.model_name", c.model_name,
                          f"has another tokenizer ({len(theirs)} tokens, the policy's {len(ours)}, "
                          f"{len(set(theirs.items()) ^ set(ours.items()))} differing): the critic scores the "
                          "policy's tokens", "a critic of the policy's family (the same tokenizer)")


def _vocabulary(model_dir: object) -> dict[str, int] | None:
    """The token -> id map of a directory's tokenizer.json (None when it has none or it is unreadable)."""
    import json
    from pathlib import Path

    try:
        vocab = json.loads((Path(str(model_dir)) / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return vocab if isinstance(vocab, dict) else None
