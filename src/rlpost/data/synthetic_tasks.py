"""Synthetic verifiable tasks: rows {problem, expected_answer} generated in-process (data=synthetic, data=arith).

- next_letter: "Next letter after c" -> "d" (z wraps to a)
- copy_digit:  "Copy the digit 7"     -> "7"
- add_mod10:   "3 + 4 mod 10 ="       -> "7"
- arith_add1 / arith_add2 / arith_mixed: "What is 3 + 4? Put the final answer in \\boxed{}." -> "7", for real
  models, scored by math-verify (env=math); the ones above by rlpost.environments.synthetic's exact match.
- lookup: "Key 7" -> table[7], a secret table of the row only the lookup tool knows (multi-turn, env=lookup).
- guess_digit: "Guess my digit:" -> the row's secret digit, found with "higher"/"lower" hints (env=guess_game).
- calc_mul: "What is 37 * 24? You have a calculator: ..." -> "888", two-digit products for real models with
  the calculator tool (multi-turn, env=calculator).

Prompts end with the token the answer depends on most, so even a 2-layer model can learn the
mapping quickly from bandit feedback.
"""

from __future__ import annotations

import random
import string

from rlpost.data.rows import PromptRow


def make_example(task: str, rng: random.Random) -> PromptRow:
    """One {"problem", "expected_answer"} row of `task` (lookup rows also carry their "key" and "table")."""
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
    if task == "lookup":
        key, table = rng.randrange(10), "".join(rng.choice(string.digits) for _ in range(10))
        return {"problem": f"Key {key}", "expected_answer": table[key], "key": str(key), "table": table}
    if task == "guess_digit":
        return {"problem": "Guess my digit:", "expected_answer": str(rng.randrange(10))}
    if task == "calc_mul":
        a, b = rng.randrange(11, 100), rng.randrange(11, 100)
        return {"problem": f"What is {a} * {b}? Use the calculator: write <call>expression</call> and you will get "
                           "<result>value</result>, then give the final answer in \\boxed{}. Example: "
                           "<call>12*34</call><result>408</result> The answer is \\boxed{408}.",
                "expected_answer": str(a * b)}
    raise ValueError(f"unknown synthetic task {task!r}")


def _arith(task: str, rng: random.Random) -> PromptRow:
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


def make_rows(task: str, n: int, seed: int) -> list[PromptRow]:
    rng = random.Random(seed)
    return [make_example(task, rng) for _ in range(n)]


ALPHABETS = {"next_letter": string.ascii_lowercase, "copy_digit": string.digits, "add_mod10": string.digits}
