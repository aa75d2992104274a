"""Arithmetic levels for real models: correct answers, deterministic rows, and math-verify scores them."""

from __future__ import annotations

import re

import pytest

from rlpost.config.load import load_master_config
from rlpost.data.datasets import load_rows
from rlpost.data.synthetic_tasks import make_rows
from rlpost.environments.math_environment import math_verify_reward

PATTERN = re.compile(r"^What is (\d+) ([+*-]) (\d+)\? Put the final answer in \\boxed\{\}\.$")


@pytest.mark.parametrize("task, lo, hi, ops", [("arith_add1", 0, 9, "+"), ("arith_add2", 10, 99, "+"),
                                                ("arith_mixed", 0, 99, "+-*")])
def test_levels_ask_what_they_say_and_answer_right(task: str, lo: int, hi: int, ops: str) -> None:
    rows = make_rows(task, 200, seed=3)
    assert rows == make_rows(task, 200, seed=3) and rows != make_rows(task, 200, seed=4)
    seen_ops = set()
    for r in rows:
        m = PATTERN.match(r["problem"])
        assert m, r["problem"]
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        seen_ops.add(op)
        assert lo <= a <= hi and (b <= 9 if op == "*" else lo <= b <= hi)
        assert int(r["expected_answer"]) == (a + b if op == "+" else a - b if op == "-" else a * b)
    assert seen_ops == set(ops)


def test_math_verify_scores_boxed_answers() -> None:
    assert math_verify_reward("3 + 4 = 7, so the answer is \\boxed{7}.", "7") == 1.0
    assert math_verify_reward("\\boxed{8}", "7") == 0.0


def test_the_arith_data_option_feeds_the_math_env() -> None:
    _, cfg = load_master_config(["data=arith", "env=math", "data.synthetic.task=arith_add2"])
    rows = load_rows(cfg.data, "train")
    assert len(rows) == 4096 and all(r["env_name"] == "math" for r in rows)
    assert PATTERN.match(rows[0]["problem"])
