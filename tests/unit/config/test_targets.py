"""Every `_target_` in conf/ imports and its constructor binds the arguments rlpost passes."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from rlpost.config.load import group_options, groups, load_master_config
from rlpost.runtime.build import resolve
from tests.unit.config.companions import COMPANIONS


def targets_of_all_options() -> dict[str, tuple[str, Any, list[Any], dict[str, Any]]]:
    """key -> (target, config object, extra positional args, extra kwargs) as rlpost builds them."""
    found: dict[str, tuple[str, Any, list[Any], dict[str, Any]]] = {}
    for g in groups():
        for o in group_options(g):
            _, cfg = load_master_config([f"{g}={o}", *COMPANIONS.get((g, o), [])])
            p = cfg.policy
            found[f"policy:{p._target_}"] = (p._target_, p, [], {})
            gen = p.generation
            if gen is not None:  # only algo=grpo has an engine
                found[f"generation:{gen._target_}"] = (gen._target_, gen, ["<cluster>"], {"model_path": "m"})
            found[f"loss:{cfg.loss_fn._target_}"] = (cfg.loss_fn._target_, cfg.loss_fn, [], {})
            for e in getattr(cfg, "env", {}).values():
                found[f"env:{e._target_}"] = (e._target_, e, [], {})
    return found


ALL = targets_of_all_options()


def test_every_kind_is_covered() -> None:
    kinds = {k.split(":")[0] for k in ALL}
    assert kinds == {"policy", "generation", "loss", "env"}
    assert len([k for k in ALL if k.startswith("policy:")]) == 3


@pytest.mark.parametrize("key", sorted(ALL))
def test_target_imports_and_binds(key: str) -> None:
    target, cfg, args, kwargs = ALL[key]
    obj = resolve(target)
    assert inspect.isclass(obj), target
    inspect.signature(obj).bind(cfg, *args, **kwargs)


def test_loss_targets_build_for_real() -> None:
    from rlpost.runtime.build import build

    for key, (_, cfg, _, _) in ALL.items():
        if key.startswith("loss:"):
            loss = build(cfg)
            assert callable(loss) and loss.loss_type.value in ("token_level", "sequence_level")
