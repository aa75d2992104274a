"""EngineActor is the contract between EngineGroup (the driver's side of every engine) and the engine actors: both
actor classes implement every method with the Protocol's parameters, and EngineGroup calls only those methods,
each named as `EngineActor.<method>` (never by a string)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from rlpost.models.generation import engine_group
from rlpost.models.generation.engine_group import EngineActor
from rlpost.models.generation.hf_generation import HFGenerationWorker
from rlpost.models.generation.vllm_worker import VllmEngineWorker
from tests.unit.models.contracts import params, protocol_methods

CONTRACT = protocol_methods(EngineActor)




@pytest.mark.parametrize("actor", [VllmEngineWorker, HFGenerationWorker], ids=lambda c: c.__name__)
def test_every_engine_actor_implements_the_contract(actor: type) -> None:
    assert len(CONTRACT) >= 10
    for name in sorted(CONTRACT):
        impl = getattr(actor, name, None)
        assert callable(impl), f"{actor.__name__} has no {name}"
        assert params(impl) == params(getattr(EngineActor, name)), f"{actor.__name__}.{name} signature"


def test_engine_group_calls_actors_only_through_the_contract() -> None:
    tree = ast.parse(Path(inspect.getfile(engine_group)).read_text())
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "EngineActor":
            named.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote":
            pytest.fail(f"line {node.lineno}: an actor called by attribute, not through EngineActor")
    assert named == CONTRACT - {"shutdown"}  # shutdown: each engine's own, with its grace period
