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


KIND_KEYS = {"policy": "policy._target_", "generation": "policy.generation._target_", "loss": "loss_fn._target_",
             "env": "env.x._target_"}


@pytest.mark.parametrize("key", sorted(ALL))
def test_every_shipped_target_is_of_its_kind(key: str) -> None:
    from rlpost.runtime.build import check_target_kind

    check_target_kind(KIND_KEYS[key.split(":")[0]], ALL[key][0], trust_shipped=False)


def test_the_shipped_kinds_are_the_shipped_targets() -> None:
    """The pre-flight's table of shipped classes (taken as proven without importing them) is exactly what conf/
    ships, each under its kind, which the test above proves by importing."""
    from rlpost.runtime.build import SHIPPED_KINDS

    kind_of = {"policy": "policy._target_", "generation": "policy.generation._target_", "loss": "loss_fn._target_",
               "env": "env.*._target_"}
    assert SHIPPED_KINDS == {target: kind_of[key.split(":")[0]] for key, (target, *_) in ALL.items()}


def test_the_pre_flight_imports_no_worker_module() -> None:
    """The default job's checks leave the policy worker's module (FSDP2, DTensor, torch.compile) to the workers."""
    import subprocess
    import sys

    code = ("import sys; from rlpost.config.load import load_master_config; from rlpost.checks import run_checks; "
            "run_checks(load_master_config([])[1]); "
            "print(sorted(m for m in sys.modules if m.startswith(('rlpost.models.policy.dtensor', "
            "'torch.distributed.fsdp', 'vllm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(("key", "target", "rule"), [
    ("policy._target_", "rlpost.cli.main", "is a function, not a class; policy._target_ names a policy worker class"),
    ("policy._target_", "rlpost.config.errors.ConfigError", "is not a policy worker class: it has no get_logprobs"),
    ("policy.generation._target_", "rlpost.models.policy.dtensor_policy_worker.DTensorPolicyWorker",
     "is not a rollout engine class"),
    ("policy.generation._target_", "rlpost.models.generation.interfaces.GenerationInterface", "is abstract"),
    ("loss_fn._target_", "rlpost.data.dataloader.PromptLoader", "it has no __call__"),
    ("env.math._target_", "rlpost.losses.clipped_pg.NLLLoss", "is not a reward environment class"),
])
def test_a_target_of_the_wrong_kind_is_refused(key: str, target: str, rule: str) -> None:
    from rlpost.config.errors import ConfigError
    from rlpost.runtime.build import check_target_kind

    with pytest.raises(ConfigError) as e:
        check_target_kind(key, target)
    assert e.value.key == key and rule in e.value.rule, e.value.rule
