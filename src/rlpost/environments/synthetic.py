"""Synthetic verifiable tasks for the default run: generated in-process, one-token answers.

- next_letter: "Next letter after c" -> "d" (z wraps to a)
- copy_digit:  "Copy the digit 7"     -> "7"
- add_mod10:   "3 + 4 mod 10 ="       -> "7"
- arith_add1 / arith_add2 / arith_mixed: "What is 3 + 4? Put the final answer in \\boxed{}." -> "7", for real
  models, scored by math-verify (env=math), not by the exact match below

Prompts end with the token the answer depends on most, so even a 2-layer model can learn the
mapping quickly from bandit feedback.

Reward: 1.0 when the response (special tokens removed, whitespace stripped) equals the answer;
`format_reward` (default 0.1) when it is a single symbol of the task's answer alphabet (a letter,
or a digit) but the wrong one; else 0.0. The format credit matters for a random-init policy: a
specific token is 1 of ~384 at first, a letter 26 of 384, so the policy first learns to answer
with a letter, then which letter. Tokens generated after the answer would dilute the signal, so
the default run generates one token (answers are one token long).
"""

from __future__ import annotations

import random
import string
from typing import Any, Dict, List

from rlpost.config.schema.env import SyntheticEnvConfig
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.environments.verifier_pool import VerifierPool


def make_example(task: str, rng: random.Random) -> Dict[str, str]:
    """One {"problem", "expected_answer"} row of `task`."""
    if task == "next_letter":
        i = rng.randrange(26)
        return {"problem": f"Next letter after {string.ascii_lowercase[i]}",
                "expected_answer": string.ascii_lowercase[(i + 1) % 26]}
    if task == "copy_digit":
        d = rng.randrange(10)
        return {"problem": f"Copy the digit {d}", "expected_answer": str(d)}
    if task == "add_mod10":
        a, b = rng.randrange(10), rng.randrange(10)
        return {"problem": f"{a} + {b} mod 10 =", "expected_answer": str((a + b) % 10)}
    if task.startswith("arith_"):
        return _arith(task, rng)
    raise ValueError(f"unknown synthetic task {task!r}")


def _arith(task: str, rng: random.Random) -> Dict[str, str]:
    """Arithmetic levels for real models: the answer is asked for in \\boxed{} and math-verify scores it."""
    if task == "arith_add1":
        a, b, op = rng.randrange(10), rng.randrange(10), "+"
    elif task == "arith_add2":
        a, b, op = rng.randrange(10, 100), rng.randrange(10, 100), "+"
    elif task == "arith_mixed":
        op = rng.choice("+-*")
        a, b = rng.randrange(100), rng.randrange(10) if op == "*" else rng.randrange(100)
    else:
        raise ValueError(f"unknown synthetic task {task!r}")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return {"problem": f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}.", "expected_answer": str(value)}


def make_rows(task: str, n: int, seed: int) -> List[Dict[str, str]]:
    rng = random.Random(seed)
    return [make_example(task, rng) for _ in range(n)]


ALPHABETS = {"next_letter": string.ascii_lowercase, "copy_digit": string.digits, "add_mod10": string.digits}


def exact_match_reward(response: str, answer: str, alphabet: str = "", format_reward: float = 0.0) -> float:
    """1.0 iff the stripped response equals the answer; format_reward for one wrong symbol of `alphabet`."""
    r = response.strip()
    if r == str(answer).strip():
        return 1.0
    return format_reward if len(r) == 1 and r in alphabet else 0.0


class SyntheticEnvironment(EnvironmentInterface):
    """Exact-match verifier of the synthetic tasks (in killable workers with a timeout)."""

    def __init__(self, cfg: SyntheticEnvConfig) -> None:
        self.cfg = cfg
        self.pool = VerifierPool.from_config(exact_match_reward, cfg)

    def step(self, responses: List[str], metadata: List[Dict[str, Any]]) -> EnvironmentReturn:
        alphabet = ALPHABETS.get(self.cfg.task, "")
        res = self.pool.run(
            [(r, m["expected_answer"], alphabet, self.cfg.format_reward) for r, m in zip(responses, metadata, strict=True)]
        )
        return EnvironmentReturn(res.rewards, res.timeouts, res.errors, unfinished=res.unfinished)

    def shutdown(self) -> None:
        self.pool.shutdown()
