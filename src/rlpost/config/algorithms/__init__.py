"""The algorithms `algo=` chooses, by name: each one's config blocks, rules, plan rows and code.

An algorithm is a unit of three parts: conf/algo/<name>.yaml (which sets `algo: <name>` and fills its blocks), its
config module under rlpost/config/schema/ (its blocks, the rules that span them, its plan rows) and its code module
under rlpost/algorithms/ (`UNIT`: its worker groups beside the policy, advantages and step loop). This registry is
the one place that lists them; the shared machinery (config loading, plan, pre-flight, setup, loop, runner) asks it
and names no algorithm. An add-on (`ADDONS`) is a block any rollout algorithm may take: a distillation teacher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlpost.config.algorithms import distillation, grpo, ppo, rloo
from rlpost.config.errors import ConfigError
from rlpost.config.schema import supervised_master

if TYPE_CHECKING:
    from rlpost.config.memory.workers import Worker


class Run(Protocol):
    """What the registry reads of a rollout run's master config (rlpost.config.schema.master.MasterConfig)."""

    @property
    def algo(self) -> str: ...

Rows = list[tuple[str, str]]
"""(label, value) rows of `rlpost plan`."""


def _no_rules(master: Any) -> None:
    """An algorithm with no rules beyond its blocks' own."""


def _no_rows(master: Any, train_world: int) -> Rows:
    return []


def _no_memory(master: Any, device: str, train_world: int) -> list[Worker]:
    return []


@dataclass(frozen=True)
class Algorithm:
    """One `algo=` option."""

    name: str
    """The option (`algo=<name>`), set as the root key `algo` by conf/algo/<name>.yaml."""
    label: str
    """What the progress bar calls a step."""
    unit: str
    """The module of its code; the module's `UNIT` is what setup and the runner call (rlpost.algorithms.units)."""
    blocks: tuple[str, ...]
    """The root blocks it reads, every one required: its option fills them; any other algorithm's are refused."""
    rollout: bool = True
    """Generates with an engine and scores with environments (the grpo block, generation, env, eval); False: trains
    on rows (SFT, DPO, RM: `master` is its config class)."""
    rules: Callable[[Any], None] = _no_rules
    """master -> None: the rules that span its blocks (ConfigError naming the key)."""
    plan_rows: Callable[[Any, int], Rows] = _no_rows
    """(master, training workers) -> its rows of `rlpost plan`."""
    whole_batch: str | None = None
    """Why its step needs the whole batch before training (no overlapped generation); None: it does not."""
    master: type | None = None
    """The master config class of an algorithm that does not roll out."""
    memory: Callable[[Any, str, int], list[Worker]] = _no_memory
    """(master, device, training workers) -> its worker groups beside the policy and the engine, for the memory plan
    (rlpost.config.memory)."""
    preflight: Callable[[Any], None] = _no_rules
    """master -> None: its checks of local files (the pre-flight's), e.g. a critic's own model directory."""
    token_batches: bool = False
    """Its losses are normalised over the global batch and a row may go to any micro-batch, so micro-batches cut to
    a token budget train the same step: `policy.dynamic_batching.enabled: null` turns on (DTensor). False for DPO and
    RM (a pair shares a micro-batch) and PPO (its critic's micro-batches follow the policy's)."""


@dataclass(frozen=True)
class AddOn:
    """A block any rollout algorithm may take (a teacher): its rules run for every rollout run, set or not."""

    rules: Callable[[Any], None]
    """master -> None: when it must, or must not, be set, and its checks when it is."""
    plan_rows: Callable[[Any, int], Rows]
    """(master, training workers) -> its plan rows when set."""
    whole_batch: str
    """Why a run with it set needs the whole batch before training."""
    preflight: Callable[[Any], None]
    """master -> None: its checks of local files (the pre-flight's), when set."""
    unit: str
    """The module whose `side_group(cfg)` builds its worker group (rlpost.algorithms.units)."""
    memory: Callable[[Any, str, int], list[Worker]] = _no_memory
    """(master, device, training workers) -> its worker group, for the memory plan."""


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("grpo", "GRPO", "rlpost.algorithms.grpo_unit", ("grpo",), rules=grpo.group_rules, token_batches=True),
    Algorithm("ppo", "PPO", "rlpost.algorithms.ppo", ("grpo", "ppo", "critic"), rules=ppo.ppo_rules,
              plan_rows=ppo.plan_rows, memory=ppo.memory, preflight=ppo.preflight, whole_batch="PPO's advantages need the critic's values of the whole batch "
                                                   "(algo=ppo)"),
    Algorithm("distillation", "Distil", "rlpost.algorithms.distillation", ("grpo", "distillation"),
              token_batches=True),
    Algorithm("rloo", "RLOO", "rlpost.algorithms.rloo", ("grpo",), rules=rloo.rloo_rules, plan_rows=rloo.plan_rows,
              token_batches=True),
    Algorithm("sft", "SFT", "rlpost.algorithms.supervised", ("sft",), rollout=False,
              master=supervised_master.SFTMasterConfig, token_batches=True),
    Algorithm("dpo", "DPO", "rlpost.algorithms.supervised", ("dpo",), rollout=False,
              master=supervised_master.DPOMasterConfig),
    Algorithm("rm", "RM", "rlpost.algorithms.supervised", ("rm",), rollout=False,
              master=supervised_master.RMMasterConfig),
)}
"""Every algorithm, by its `algo=` name (the first is the default)."""

ADDONS: dict[str, AddOn] = {
    "distillation": AddOn(distillation.teacher_rules, distillation.plan_rows,
                          "the distillation teacher scores the whole batch before training",
                          distillation.preflight, "rlpost.algorithms.distillation", distillation.memory),
}
"""Blocks any rollout algorithm may take, by name."""

ROLLOUT_BLOCKS = ("env", "eval", "policy.generation")
"""What only rollout algorithms read besides their blocks: the environments, `rlpost eval`'s block, the engine."""


def algorithm(name: str) -> Algorithm:
    """The algorithm called `name` (ConfigError naming `algo` when there is none)."""
    if name not in ALGORITHMS:
        raise ConfigError("algo", name, "is not an algorithm", f"choose algo={'|'.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def all_blocks() -> list[str]:
    """Every root block an algorithm or an add-on reads (each None unless the chosen algorithm reads it)."""
    names = [b for a in ALGORITHMS.values() for b in a.blocks] + list(ADDONS)
    return list(dict.fromkeys(names))


def readers(block: str) -> list[str]:
    """The algorithms that read `block` (a root block, or the first part of a key), in registry order."""
    if block in ADDONS or block in ROLLOUT_BLOCKS or block == "generation":
        return [a.name for a in ALGORITHMS.values() if a.rollout]
    return [a.name for a in ALGORITHMS.values() if block in a.blocks]


def set_addons(master: Run) -> list[AddOn]:
    """The add-ons a rollout run has set."""
    return [addon for name, addon in ADDONS.items() if getattr(master, name) is not None]


def check_rollout(master: Run) -> None:
    """The chosen algorithm's rules, then every add-on's."""
    algorithm(master.algo).rules(master)
    for addon in ADDONS.values():
        addon.rules(master)


def whole_batch_reason(master: Run) -> str | None:
    """Why the run's step needs the whole batch before it trains (its algorithm's, an add-on's), else None."""
    reason = algorithm(master.algo).whole_batch
    return reason or next((addon.whole_batch for addon in set_addons(master)), None)


def rollout_plan_rows(master: Run, train_world: int) -> Rows:
    """The plan rows of the algorithm and its add-ons."""
    rows = algorithm(master.algo).plan_rows(master, train_world)
    return rows + [row for addon in set_addons(master) for row in addon.plan_rows(master, train_world)]


def side_memory(master: Run, device: str, train_world: int) -> list[Worker]:
    """The worker groups of the algorithm and its add-ons beside the policy and the engine, for the memory plan."""
    groups = algorithm(master.algo).memory(master, device, train_world)
    return groups + [w for addon in set_addons(master) for w in addon.memory(master, device, train_world)]


def preflight(master: Run) -> None:
    """The algorithm's and its add-ons' checks of local files."""
    algorithm(master.algo).preflight(master)
    for addon in set_addons(master):
        addon.preflight(master)
