"""The multi-turn tool environments: the calculator answers calls and scores final answers, refuses what is not
arithmetic, answers malformed or hanging calls with an error observation (never a crash); the lookup tool's
two turns add up to exactly 1.0 for a perfect episode."""

from __future__ import annotations

import pytest

from rlpost.config.schema.env import CalculatorEnvConfig, GuessGameEnvConfig, LookupEnvConfig
from rlpost.environments.calculator import CalculatorEnvironment, calculate, parse_turn
from rlpost.environments.guess_game import GuessGameEnvironment
from rlpost.environments.lookup import LookupEnvironment


def test_calculate_is_arithmetic_only() -> None:
    assert calculate("37*24") == 888 and calculate(" (1+2)**3 - 4/8 ") == 26.5 and calculate("-7 // 2") == -4
    for bad in ("__import__('os').system('true')", "x + 1", "[1, 2]", "1 +", "True + 1", "'a' * 3"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_parse_turn() -> None:
    assert parse_turn("let me <call>3*7</call>") == ("call", "3*7")
    assert parse_turn("<call>3*7") == ("malformed", "a call must end with </call>")
    assert parse_turn("The answer is \\boxed{21}") == ("answer", "The answer is \\boxed{21}")


def test_calculator_answers_calls_and_scores_answers() -> None:
    env = CalculatorEnvironment(CalculatorEnvConfig(num_workers=2, timeout_s=3.0))
    try:
        meta = [{"expected_answer": "888"}] * 6
        ret = env.step(["<call>37 * 24</call>", "<call>1/0</call>", "<call>37 *</call>", "<call>9**9**9**9</call>",
                        "so \\boxed{888}", "\\boxed{887}"], meta)
    finally:
        env.shutdown()
    assert ret.observations is not None and ret.terminateds is not None and ret.next_stop_strings is not None
    assert ret.observations[0] == "<result>888</result>"
    assert ret.observations[1].startswith("<result>error: ZeroDivisionError")
    assert ret.observations[2].startswith("<result>error: ValueError: does not parse")
    assert ret.observations[3] == "<result>error: timed out</result>"  # killed by the watchdog, not a hang
    assert ret.rewards == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert ret.terminateds == [False, False, False, False, True, True]
    assert ret.next_stop_strings[:4] == [["</call>"]] * 4 and ret.next_stop_strings[4] is None
    assert ret.metrics == {"calculator_calls": 4.0, "calculator_malformed_calls": 2.0} and ret.timeouts == 1


def test_lookup_turns_add_up_to_one_for_a_perfect_episode() -> None:
    env = LookupEnvironment(LookupEnvConfig())
    row = {"key": "7", "table": "0123456489", "expected_answer": "4"}
    try:
        first = env.step(["7", "3", "x"], [row] * 3)
        assert first.observations == [" value 4", " value 3", " value ?"] and first.terminateds == [False] * 3
        assert first.next_metadata == [{"asked": "7"}, {"asked": "3"}, {"asked": ""}]
        second = env.step(["4", "3", "x"], [{**row, **m} for m in first.next_metadata])
    finally:
        env.shutdown()
    assert second.terminateds == [True] * 3
    assert first.rewards[0] + second.rewards[0] == 1.0
    assert first.rewards[1:] == [0.0625, 0.0] and second.rewards[1:] == [0.0625, 0.0]


def test_guess_game_hints_until_found_or_out_of_guesses() -> None:
    env = GuessGameEnvironment(GuessGameEnvConfig(max_guesses=3))
    row = {"expected_answer": "6"}
    try:
        first = env.step(["3", "9", "x"], [row] * 3)
        assert first.observations == [" higher", " lower", " a digit"] and first.terminateds == [False] * 3
        assert first.rewards == [0.0] * 3  # nothing until the episode is over
        meta = [{**row, **m} for m in first.next_metadata or []]
        second = env.step(["6", "7", "x"], meta)
        assert second.terminateds == [True, False, False] and second.rewards[0] == 1.0
        assert second.metrics["guess_game_found"] == 1.0
        third = env.step(["5", "x"], [{**row, **m} for m in (second.next_metadata or [])[1:]])
    finally:
        env.shutdown()
    assert third.terminateds == [True, True]  # out of guesses
    assert third.rewards == [0.0625, 0.0]  # format credit: the share of turns that were digits (3/3, 0/3)
