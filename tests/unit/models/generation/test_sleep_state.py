"""The engines' sleep/wake state machine (rlpost.models.generation.sleep_state)."""

from __future__ import annotations

import pytest

from rlpost.models.generation.sleep_state import EngineAsleep, SleepState


def test_an_engine_starts_awake_and_sleeps_whole() -> None:
    s = SleepState()
    assert s.awake and s.name == "awake"
    s.require_awake("vLLM replica 0")
    s.slept()
    assert not s.awake and s.asleep and s.name == "asleep"


def test_a_refit_wakes_the_weights_then_the_kv_cache() -> None:
    s = SleepState()
    s.slept()
    assert s.to_wake(["weights"]) == ["weights"]
    s.woke(["weights"])
    assert s.name == "weights awake, KV cache asleep" and not s.awake and not s.asleep
    assert s.to_wake(None) == ["kv_cache"]  # what is awake already is not woken twice
    s.woke(s.to_wake(["kv_cache"]))
    assert s.awake and s.to_wake(None) == []


def test_generation_on_a_sleeping_engine_names_the_engine_and_its_state() -> None:
    s = SleepState()
    s.slept()
    s.woke(["kv_cache"])
    with pytest.raises(EngineAsleep, match="^vLLM replica 3 is KV cache awake, weights asleep: generation was asked"):
        s.require_awake("vLLM replica 3")


def test_only_known_parts_can_be_woken() -> None:
    with pytest.raises(ValueError, match=r"cannot wake \['activations'\]"):
        SleepState().to_wake(["activations"])
