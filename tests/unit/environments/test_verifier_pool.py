"""Reward computations run in killable workers: a hang gets reward 0 and is counted, the batch goes on."""

from __future__ import annotations

from rlpost.config.schema.env import MathEnvConfig, SyntheticEnvConfig
from rlpost.data.synthetic_tasks import make_rows
from rlpost.environments.math_environment import MathEnvironment
from rlpost.environments.synthetic import SyntheticEnvironment, exact_match_reward
from rlpost.environments.verifier_pool import VerifierPool
from tests.unit.environments.hang_fns import maybe_hang


def test_hanging_verifier_is_timed_out_and_the_batch_goes_on() -> None:
    pool = VerifierPool(maybe_hang, num_workers=1, timeout_s=2.0)
    try:
        rewards, timeouts, errors = pool.map([("a", "a"), ("hang", "x"), ("b", "b"), ("boom", "x"), ("c", "d")])
        assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0]
        assert timeouts == 1 and errors == 1
        # the replaced worker keeps serving
        assert pool.map([("z", "z")]) == ([1.0], 0, 0)
    finally:
        pool.shutdown()


def test_synthetic_rewards_and_format_credit() -> None:
    assert exact_match_reward(" 7 ", "7", "0123456789", 0.1) == 1.0
    assert exact_match_reward("3", "7", "0123456789", 0.1) == 0.1
    assert exact_match_reward("x", "7", "0123456789", 0.1) == 0.0
    assert exact_match_reward("77", "7", "0123456789", 0.1) == 0.0
    env = SyntheticEnvironment(SyntheticEnvConfig(task="copy_digit", format_reward=0.1, timeout_s=5.0))
    try:
        rows = make_rows("copy_digit", 3, seed=0)
        answers = [r["expected_answer"] for r in rows]
        wrong = str((int(answers[1]) + 1) % 10)
        ret = env.step([answers[0], wrong, "no"], rows)
        assert ret.rewards == [1.0, 0.1, 0.0] and ret.timeouts == 0
    finally:
        env.shutdown()


def test_synthetic_rows_are_deterministic_and_verifiable() -> None:
    a, b = make_rows("next_letter", 20, seed=3), make_rows("next_letter", 20, seed=3)
    assert a == b
    for r in a:
        letter = r["problem"].split()[-1]
        assert r["expected_answer"] == chr((ord(letter) - 97 + 1) % 26 + 97)
    for r in make_rows("add_mod10", 10, seed=1):
        x, _, y, *_ = r["problem"].split()
        assert r["expected_answer"] == str((int(x) + int(y)) % 10)


def test_math_environment_uses_math_verify() -> None:
    env = MathEnvironment(MathEnvConfig(timeout_s=20.0))
    try:
        ret = env.step(["so the answer is \\boxed{\\frac{1}{2}}", "it is 3"], [{"expected_answer": "0.5"},
                                                                             {"expected_answer": "4"}])
        assert ret.rewards == [1.0, 0.0]
    finally:
        env.shutdown()
