"""Reward computations run in killable workers: a hang gets reward 0 and is counted, the batch goes on."""

from __future__ import annotations

import threading

from rlpost.config.schema.env import MathEnvConfig, SyntheticEnvConfig
from rlpost.data.synthetic_tasks import make_rows
from rlpost.environments.math_environment import MathEnvironment
from rlpost.environments.synthetic import SyntheticEnvironment, exact_match_reward
from rlpost.environments.verifier_pool import VerifierPool
from tests.unit.environments.hang_fns import maybe_die, maybe_hang


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


def test_samples_queued_behind_a_dead_worker_are_still_scored() -> None:
    """One worker gets several samples at once; when it dies on one, only that one is charged."""
    pool = VerifierPool(maybe_die, num_workers=1, timeout_s=30.0)
    try:
        rewards, timeouts, errors = pool.map([("a", "a"), ("die", "x"), ("b", "b"), ("c", "c"), ("d", "x")])
        assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0] and timeouts == 0 and errors == 1
    finally:
        pool.shutdown()


def test_a_lone_worker_scores_a_batch_in_a_few_messages() -> None:
    """256 quick rewards come back in a message or two, not one message each (each costs the driver a wake-up)."""
    pool = VerifierPool(exact_match_reward, num_workers=1, timeout_s=5.0)
    try:
        args = [(str(i % 7), str(i % 5), "0123456789", 0.1) for i in range(256)]
        res = pool.run(args)
        assert res.rewards == [exact_match_reward(*a) for a in args] and res.errors == 0 and res.timeouts == 0
        assert 1 <= res.messages <= 3
    finally:
        pool.shutdown()


def test_large_samples_behind_a_hung_call_neither_block_nor_get_lost() -> None:
    """Samples bigger than a pipe's buffer wait in the driver, not in a hung worker's full pipe (a blocked send
    would outlive every timeout); after the kill they run on the replacement."""
    big = "x" * 200_000  # six of them are more than a socket pair buffers
    pool = VerifierPool(maybe_hang, num_workers=1, timeout_s=1.5)
    out: list[tuple[list[float], int, int]] = []
    scoring = threading.Thread(target=lambda: out.append(pool.map([("hang", "x"), *[(big, big)] * 6])), daemon=True)
    try:
        scoring.start()
        scoring.join(timeout=60)
        assert not scoring.is_alive(), "the driver blocked sending into the hung worker's pipe"
        rewards, timeouts, errors = out[0]
        assert rewards == [0.0] + [1.0] * 6 and timeouts == 1 and errors == 0
    finally:
        pool.shutdown()  # kills the worker: a send blocked on it fails and the thread ends


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
